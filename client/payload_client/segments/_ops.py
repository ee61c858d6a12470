"""Pure segment operations (docs/contract.md, "Pure segment operations"): no I/O, metadata in, metadata out."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from typing import overload

import numpy as np

from .._errors import InvalidRequestError, InvalidSegmentError
from ._columns import SegmentList
from ._segment import (
    INT64_MAX,
    PayloadSegment,
    _Checked,
    _checked_list,
    _columns_of,
    _row_nbytes,
    check_int,
    check_shift,
    check_window,
)

__all__ = ["clip_segments", "merge_pd_segments", "shift_segments"]

# Each operation validates its list with `_checked_list`: a short list comes back as a list
# and is worked on segment by segment, a long one as columns (numpy for the arithmetic and
# the checks, the results built in one comprehension). Both give the same results.

_MERGE_BULK_MIN = 48
"""Shortest side of a merge checked column by column (a merge on columns costs more)."""


def _cut(seg: PayloadSegment, start: int, stop: int) -> PayloadSegment:
    """Rows ``[start, stop)`` of a valid segment (``pos <= start < stop <= pos + rows``)."""
    if start == seg.pos and stop == seg.pos + seg.rows:
        return seg
    return PayloadSegment(
        seg.field,
        seg.file,
        seg.offset + (start - seg.pos) * _row_nbytes(seg),
        start,
        stop - start,
        seg.dtype,
        _shared(seg.shape),
    )


def _shared(shape: Sequence[int]) -> list[int]:
    """``shape`` itself when it is a list, else a list of it.

    The operations' results share their inputs' shape lists: segments are immutable, and a
    copy of each (100,000 lists) cost more than the rest of an operation.
    """
    return shape if type(shape) is list else list(shape)


def _cut_many(
    cols: _Checked, index: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> list[PayloadSegment]:
    """Rows ``[start[k], stop[k])`` of each segment ``index[k]`` of ``cols`` (int64 [m])."""
    segs = cols.segments
    picked = index.tolist()
    if len(cols.dtypes or ()) == 1 == len(cols.shapes or ()):
        nbytes: int | np.ndarray = _row_nbytes(segs[picked[0]]) if picked else 0
    else:
        nbytes = np.array([_row_nbytes(segs[i]) for i in picked], dtype=np.int64)
    # within each segment's bytes: no overflow (validated)
    offset = cols.offset_a[index] + (start - cols.pos_a[index]) * nbytes
    return [
        PayloadSegment(s.field, s.file, o, p, r, s.dtype, _shared(s.shape))
        for s, o, p, r in zip(
            map(segs.__getitem__, picked),
            offset.tolist(),
            start.tolist(),
            (stop - start).tolist(),
            strict=True,
        )
    ]


@overload
def clip_segments(segments: SegmentList, lo: int, hi: int) -> SegmentList: ...  # type: ignore[overload-overlap]
@overload
def clip_segments(segments: Sequence[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]: ...
def clip_segments(
    segments: Sequence[PayloadSegment], lo: int, hi: int
) -> list[PayloadSegment] | SegmentList:
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
        kept when ``lo <= pos <= hi``. (Contract: docs/contract.md, "Pure segment operations".) A segment kept whole is the
        input object; a trimmed one shares its input's ``shape`` list when that is a list.
        A `SegmentList` for a `SegmentList` (array operations, no object a segment).

    Raises
    ------
    InvalidRequestError
        If ``lo < 0``, ``lo > hi`` or either is not an integer.
    InvalidSegmentError
        If any segment is invalid (docs/contract.md, "The segment model").
    """
    if isinstance(segments, SegmentList):
        return segments.clip(lo, hi)
    lo, hi = check_window(lo, hi)
    cols = _checked_list(segments)
    if isinstance(cols, list):
        out = []
        for seg in cols:
            if seg.rows == 0:
                if lo <= seg.pos <= hi:
                    out.append(seg)
                continue
            start, stop = max(seg.pos, lo), min(seg.pos + seg.rows, hi)
            if start < stop:
                out.append(_cut(seg, start, stop))
        return out
    segs = cols.segments
    pos, end = cols.pos_a, cols.pos_a + cols.rows_a  # no overflow: validated
    # wholly inside (a placeholder: lo <= pos <= hi) is kept as it is
    whole = (pos >= lo) & (end <= hi)
    if whole.all():
        return segs
    part = ~whole & (cols.rows_a > 0) & (np.maximum(pos, lo) < np.minimum(end, hi))
    keep = whole | part
    out = list(compress(segs, keep.tolist()))
    index = np.flatnonzero(part)
    cut = _cut_many(cols, index, np.maximum(pos[index], lo), np.minimum(end[index], hi))
    for j, seg in zip(np.flatnonzero(part[keep]).tolist(), cut, strict=True):
        out[j] = seg
    return out


@overload
def shift_segments(segments: SegmentList, delta: int) -> SegmentList: ...  # type: ignore[overload-overlap]
@overload
def shift_segments(segments: Sequence[PayloadSegment], delta: int) -> list[PayloadSegment]: ...
def shift_segments(
    segments: Sequence[PayloadSegment], delta: int
) -> list[PayloadSegment] | SegmentList:
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
        list when that is a list (a segment is immutable: never mutate its shape). A
        `SegmentList` for a `SegmentList`.

    Raises
    ------
    InvalidRequestError
        If ``delta`` is not an integer, or a result would have ``pos < 0`` or
        ``pos + rows`` beyond int64. (Contract: docs/contract.md, "Pure segment operations".)
    InvalidSegmentError
        If any segment is invalid.
    """
    if isinstance(segments, SegmentList):
        return segments.shift(delta)
    delta = check_int(delta, "delta", minimum=-INT64_MAX)
    cols = _checked_list(segments)
    # each result shares its input's shape list (`_shared`): copying 100,000 lists cost
    # more than the rest of the shift (the collector runs over every one)
    if isinstance(cols, list):
        out = []
        for i, seg in enumerate(cols):
            check_shift(seg.pos, seg.pos + seg.rows, delta, i)
            shape = _shared(seg.shape)
            out.append(
                PayloadSegment(
                    seg.field, seg.file, seg.offset, seg.pos + delta, seg.rows, seg.dtype, shape
                )
            )
        return out
    pos = cols.pos_a
    if delta < 0 and int(pos.min()) + delta < 0:
        i = int(np.argmax(pos < -delta))
        check_shift(cols.pos[i], cols.pos[i] + cols.rows[i], delta, i)
    if delta > 0:
        end = pos + cols.rows_a  # no overflow: validated
        if int(end.max()) + delta > INT64_MAX:
            i = int(np.argmax(end > INT64_MAX - delta))
            check_shift(cols.pos[i], cols.pos[i] + cols.rows[i], delta, i)
    moved = (pos + delta).tolist()  # in [0, INT64_MAX]: checked above
    shapes = cols.shape if cols.lists else list(map(_shared, cols.shape))
    return [
        PayloadSegment(f, fi, o, p, r, d, sh)
        for f, fi, o, p, r, d, sh in zip(
            cols.field, cols.file, cols.offset, moved, cols.rows, cols.dtype, shapes, strict=True
        )
    ]


def _validate_side(
    segments: Sequence[PayloadSegment], side: str
) -> list[PayloadSegment] | _Checked:
    """`_checked_list`, its error message prefixed with ``side`` (index kept)."""
    try:
        return _checked_list(segments, _MERGE_BULK_MIN)
    except InvalidSegmentError as exc:
        err = InvalidSegmentError(f"{side} {exc}", field=exc.field)
        err.index = exc.index
        raise err from None


@overload
def merge_pd_segments(  # type: ignore[overload-overlap]
    prefill: SegmentList, decode: Sequence[PayloadSegment], field: str = ...
) -> SegmentList: ...
@overload
def merge_pd_segments(  # type: ignore[overload-overlap]
    prefill: Sequence[PayloadSegment], decode: SegmentList, field: str = ...
) -> SegmentList: ...
@overload
def merge_pd_segments(
    prefill: Sequence[PayloadSegment], decode: Sequence[PayloadSegment], field: str = ...
) -> list[PayloadSegment]: ...
def merge_pd_segments(
    prefill: Sequence[PayloadSegment],
    decode: Sequence[PayloadSegment],
    field: str = "routed_experts",
) -> list[PayloadSegment] | SegmentList:
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
        ``cut``, front-trimmed when they start before it. (Contract: docs/contract.md, "Pure segment operations", the P/D
        rule of the router.) Segments kept whole are the input objects; a trimmed one
        shares its input's ``shape`` list when that is a list. A `SegmentList` when either
        side is one.

    Raises
    ------
    InvalidRequestError
        If decode has segments of ``field`` and prefill has none.
    InvalidSegmentError
        If any segment on either side is invalid or overflows int64.
    """
    if isinstance(prefill, SegmentList) or isinstance(decode, SegmentList):
        return SegmentList.merge_pd(prefill, decode, field)
    if not isinstance(field, str) or not field:
        raise InvalidRequestError("field must be a non-empty string")
    pre = _validate_side(prefill, "prefill")
    dec = _validate_side(decode, "decode")
    if isinstance(pre, list) and isinstance(dec, list):
        head = [s for s in pre if s.field == field]
        if not head:
            _check_no_field(dec, field)
            return dec
        cut = max(s.pos + s.rows for s in head)
        tail = [s for s in dec if s.field != field or s.pos + s.rows > cut]
        return head + [
            s if s.field != field else _cut(s, max(s.pos, cut), s.pos + s.rows) for s in tail
        ]
    pre = _columns_of(pre) if isinstance(pre, list) else pre
    dec = _columns_of(dec) if isinstance(dec, list) else dec
    mine = [f == field for f in pre.field]
    if not any(mine):
        _check_no_field(dec.segments, field)
        return dec.segments
    head = list(compress(pre.segments, mine))
    cut = int((pre.pos_a + pre.rows_a)[np.array(mine, dtype=bool)].max())
    segs = dec.segments
    if not segs:
        return head
    ours = np.array([f == field for f in dec.field], dtype=bool)
    # decode segments of `field` keep positions >= cut: dropped when they end at or
    # before it, front-trimmed when they start before it
    end = dec.pos_a + dec.rows_a  # no overflow: validated
    drop = ours & (end <= cut)
    trim = ours & ~drop & (dec.pos_a < cut)
    if not trim.any():
        return head + (list(compress(segs, (~drop).tolist())) if drop.any() else segs)
    keep = ~drop
    tail = list(compress(segs, keep.tolist()))
    index = np.flatnonzero(trim)
    trimmed = _cut_many(dec, index, np.full(len(index), cut, dtype=np.int64), end[index])
    for j, seg in zip(np.flatnonzero(trim[keep]).tolist(), trimmed, strict=True):
        tail[j] = seg
    return head + tail


def _check_no_field(decode: list[PayloadSegment], field: str) -> None:
    if any(s.field == field for s in decode):
        raise InvalidRequestError(
            f"decode carries {field!r} segments but prefill has none to stitch onto"
        )
