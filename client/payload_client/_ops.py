"""Pure segment operations (DESIGN §3): no I/O, metadata in, metadata out."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

import numpy as np

from ._errors import InvalidRequestError, InvalidSegmentError
from ._segment import INT64_MAX, PayloadSegment, _Checked, _checked_columns, _row_nbytes, check_int

__all__ = ["clip_segments", "merge_pd_segments", "shift_segments"]


def _check_window(lo: int, hi: int) -> tuple[int, int]:
    lo = check_int(lo, "lo")
    hi = check_int(hi, "hi")
    if lo > hi:
        raise InvalidRequestError(f"window [lo, hi) needs lo <= hi, got lo={lo} > hi={hi}")
    return lo, hi


def _trim_front(seg: PayloadSegment, k: int) -> PayloadSegment:
    """Drop the first ``k`` rows (``0 <= k <= rows``) of a valid segment."""
    if k == 0:
        return seg
    return PayloadSegment(
        seg.field,
        seg.file,
        seg.offset + k * _row_nbytes(seg),
        seg.pos + k,
        seg.rows - k,
        seg.dtype,
        list(seg.shape),
    )


def clip_segments(segments: Sequence[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    """Keep only the rows at token positions in ``[lo, hi)`` (end exclusive).

    Parameters
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields, in order.
    lo, hi : int
        Window of absolute token positions, ``0 <= lo <= hi``.

    Returns
    -------
    list of PayloadSegment
        In the input order. A segment wholly outside the window is dropped; one that
        straddles an edge is trimmed (a front cut of ``k`` rows adds ``k * row_nbytes`` to
        ``offset`` and ``k`` to ``pos``); positions stay absolute. A zero-row placeholder is
        kept when ``lo <= pos <= hi``. (Contract: DESIGN §3.)

    Raises
    ------
    InvalidRequestError
        If ``lo < 0``, ``lo > hi`` or either is not an integer.
    InvalidSegmentError
        If any segment is invalid (DESIGN §2).
    """
    lo, hi = _check_window(lo, hi)
    cols = _checked_columns(segments)
    segs = cols.segments
    if not segs:
        return []
    pos, end = cols.pos_a, cols.pos_a + cols.rows_a  # no overflow: validated
    # wholly inside (a placeholder: lo <= pos <= hi) is kept as it is
    whole = (pos >= lo) & (end <= hi)
    if whole.all():
        return segs
    part = ~whole & (cols.rows_a > 0) & (np.maximum(pos, lo) < np.minimum(end, hi))
    keep = whole | part
    out = list(compress(segs, keep.tolist()))
    where = np.flatnonzero(part[keep]).tolist(), np.flatnonzero(part).tolist()
    for j, i in zip(*where, strict=True):
        seg = segs[i]
        start, stop = max(seg.pos, lo), min(seg.pos + seg.rows, hi)
        out[j] = PayloadSegment(
            seg.field,
            seg.file,
            seg.offset + (start - seg.pos) * _row_nbytes(seg),
            start,
            stop - start,
            seg.dtype,
            list(seg.shape),
        )
    return out


def shift_segments(segments: Sequence[PayloadSegment], delta: int) -> list[PayloadSegment]:
    """Add ``delta`` to every segment's ``pos`` (packing a sample at offset ``delta``).

    Parameters
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields.
    delta : int
        Token positions to add; may be negative.

    Returns
    -------
    list of PayloadSegment
        New segments, same order, only ``pos`` changed. Each shares its input's ``shape``
        list (a segment is immutable: never mutate its shape).

    Raises
    ------
    InvalidRequestError
        If ``delta`` is not an integer, or a result would have ``pos < 0`` or
        ``pos + rows`` beyond int64. (Contract: DESIGN §3.)
    InvalidSegmentError
        If any segment is invalid.
    """
    delta = check_int(delta, "delta", minimum=-INT64_MAX)
    cols = _checked_columns(segments)
    if not cols.segments:
        return []
    pos = cols.pos_a
    if delta < 0 and int(pos.min()) + delta < 0:
        i = int(np.argmax(pos < -delta))
        raise InvalidRequestError(
            f"segment {i}: shift by {delta} makes pos {cols.pos[i] + delta} < 0"
        )
    if delta > 0:
        end = pos + cols.rows_a  # no overflow: validated
        if int(end.max()) + delta > INT64_MAX:
            i = int(np.argmax(end > INT64_MAX - delta))
            raise InvalidRequestError(f"segment {i}: shift by {delta} overflows int64")
    moved = (pos + delta).tolist()  # in [0, INT64_MAX]: checked above
    # each result shares its input's shape list: copying 100,000 lists cost more than the
    # rest of the shift (the collector runs over every one), and segments are immutable
    return [
        PayloadSegment(f, fi, o, p, r, d, sh)
        for f, fi, o, p, r, d, sh in zip(
            cols.field, cols.file, cols.offset, moved, cols.rows, cols.dtype, cols.shape,
            strict=True,
        )
    ]  # fmt: skip


def _validate_side(segments: Sequence[PayloadSegment], side: str) -> _Checked:
    """`_checked_columns`, its error message prefixed with ``side`` (index kept)."""
    try:
        return _checked_columns(segments)
    except InvalidSegmentError as exc:
        err = InvalidSegmentError(f"{side} {exc}", field=exc.field)
        err.index = exc.index
        raise err from None


def merge_pd_segments(
    prefill: Sequence[PayloadSegment],
    decode: Sequence[PayloadSegment],
    field: str = "routed_experts",
) -> list[PayloadSegment]:
    """Stitch prefill and decode segments under prefill/decode disaggregation.

    Parameters
    ----------
    prefill : sequence of PayloadSegment
        Segments returned by the prefill instance; only those of ``field`` are used.
    decode : sequence of PayloadSegment
        Segments returned by the decode instance.
    field : str, default "routed_experts"
        The field to stitch; other fields keep the decode side's segments.

    Returns
    -------
    list of PayloadSegment
        The prefill segments of ``field`` unchanged, then every decode segment in order,
        where decode segments of ``field`` keep only positions ``>= cut`` (``cut`` is the
        largest ``pos + rows`` of the prefill ones): dropped when they end at or before
        ``cut``, front-trimmed when they start before it. (Contract: DESIGN §3, the P/D
        rule of the router.)

    Raises
    ------
    InvalidRequestError
        If decode has segments of ``field`` and prefill has none.
    InvalidSegmentError
        If any segment on either side is invalid or overflows int64.
    """
    if not isinstance(field, str) or not field:
        raise InvalidRequestError("field must be a non-empty string")
    pre = _validate_side(prefill, "prefill")
    dec = _validate_side(decode, "decode")
    mine = [f == field for f in pre.field]
    if not any(mine):
        if any(f == field for f in dec.field):
            raise InvalidRequestError(
                f"decode carries {field!r} segments but prefill has none to stitch onto"
            )
        return dec.segments
    head = list(compress(pre.segments, mine))
    cut = int((pre.pos_a + pre.rows_a)[np.array(mine, dtype=bool)].max())
    segs = dec.segments
    if not segs:
        return head
    ours = np.array([f == field for f in dec.field], dtype=bool)
    # decode segments of `field` keep positions >= cut: dropped when they end at or
    # before it, front-trimmed when they start before it
    drop = ours & (dec.pos_a + dec.rows_a <= cut)
    trim = ours & ~drop & (dec.pos_a < cut)
    if not trim.any():
        return head + (list(compress(segs, (~drop).tolist())) if drop.any() else segs)
    keep = ~drop
    tail = list(compress(segs, keep.tolist()))
    where = np.flatnonzero(trim[keep]).tolist(), np.flatnonzero(trim).tolist()
    for j, i in zip(*where, strict=True):
        tail[j] = _trim_front(segs[i], cut - dec.pos[i])
    return head + tail
