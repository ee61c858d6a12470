"""Pure segment operations (DESIGN §3): no I/O, metadata in, metadata out."""

from __future__ import annotations

from collections.abc import Sequence

from ._errors import InvalidRequestError, InvalidSegmentError
from ._segment import INT64_MAX, PayloadSegment, _row_nbytes, check_int, validate_segments

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
    out: list[PayloadSegment] = []
    for seg in validate_segments(segments):
        if seg.rows == 0:
            if lo <= seg.pos <= hi:
                out.append(seg)
            continue
        start, stop = max(seg.pos, lo), min(seg.pos + seg.rows, hi)
        if start >= stop:
            continue
        seg = _trim_front(seg, start - seg.pos)
        if stop - start != seg.rows:
            seg = PayloadSegment(
                seg.field, seg.file, seg.offset, seg.pos, stop - start, seg.dtype, list(seg.shape)
            )
        out.append(seg)
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
        New segments, same order, only ``pos`` changed.

    Raises
    ------
    InvalidRequestError
        If ``delta`` is not an integer, or a result would have ``pos < 0`` or
        ``pos + rows`` beyond int64. (Contract: DESIGN §3.)
    InvalidSegmentError
        If any segment is invalid.
    """
    delta = check_int(delta, "delta", minimum=-INT64_MAX)
    out = []
    for i, seg in enumerate(validate_segments(segments)):
        pos = seg.pos + delta
        if pos < 0:
            raise InvalidRequestError(f"segment {i}: shift by {delta} makes pos {pos} < 0")
        if pos + seg.rows > INT64_MAX:
            raise InvalidRequestError(f"segment {i}: shift by {delta} overflows int64")
        out.append(
            PayloadSegment(
                seg.field, seg.file, seg.offset, pos, seg.rows, seg.dtype, list(seg.shape)
            )
        )
    return out


def _validate_side(segments: Sequence[PayloadSegment], side: str) -> list[PayloadSegment]:
    """`validate_segments`, its error message prefixed with ``side`` (index kept)."""
    try:
        return validate_segments(segments)
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
    prefill = _validate_side(prefill, "prefill")
    decode = _validate_side(decode, "decode")
    head = [s for s in prefill if s.field == field]
    if not head:
        if any(s.field == field for s in decode):
            raise InvalidRequestError(
                f"decode carries {field!r} segments but prefill has none to stitch onto"
            )
        return list(decode)
    cut = max(s.pos + s.rows for s in head)
    out = list(head)
    for seg in decode:
        if seg.field != field:
            out.append(seg)
        elif seg.pos + seg.rows <= cut:
            continue
        else:
            out.append(_trim_front(seg, max(0, cut - seg.pos)))
    return out
