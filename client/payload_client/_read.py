"""Window read semantics (DESIGN §4), split into an I/O-free plan and an assembly step.

`plan_window` turns segments and a window into the byte extents to fetch; whoever holds the
bytes (the daemon over HTTP, a test reading files) fetches them; `assemble` lays them into the
output array. The semantics live here once, whatever carries the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import InvalidRequestError, InvalidSegmentError
from ._ops import _check_window
from ._segment import PayloadSegment, _row_nbytes, segment_end, validate_segments

__all__ = ["Piece", "WindowPlan", "assemble", "plan_window"]

_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True, slots=True)
class Piece:
    """The rows of one segment that fall inside a window.

    Attributes
    ----------
    file : str
        Data file relative to the payload root.
    offset : int
        Byte offset of the first needed row.
    nbytes : int
        Bytes to read (needed rows times the row size).
    end : int
        Byte offset just past the whole segment: the file must be at least this long.
    dst : int
        Output row the first needed row lands on (``position - lo``).
    rows : int
        Number of needed rows.
    dtype : str
        Stored dtype of one element.
    shape : tuple of int
        Stored shape of one row.
    """

    file: str
    offset: int
    nbytes: int
    end: int
    dst: int
    rows: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """What a window read needs and how it lays out.

    Attributes
    ----------
    lo, hi : int
        Token positions of the window ``[lo, hi)``.
    row_shape : tuple of int
        Shape of one output row.
    dtype : numpy.dtype
        ``int32`` for integer fields, ``float32`` for float fields.
    fill : int or float
        Value of every entry no row covers.
    pieces : tuple of Piece
        In segment order: later pieces overwrite earlier ones, row by row.
    """

    lo: int
    hi: int
    row_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    fill: int | float
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        """Total bytes the pieces need."""
        return sum(p.nbytes for p in self.pieces)

    def new_output(self) -> np.ndarray:
        """Allocate the (uninitialised) output array ``[hi - lo, *row_shape]``.

        Raises
        ------
        InvalidRequestError
            If it cannot be allocated.
        """
        shape = (self.hi - self.lo, *self.row_shape)
        try:
            return np.empty(shape, dtype=self.dtype)
        except (MemoryError, ValueError) as exc:
            raise InvalidRequestError(
                f"the window's output {list(shape)} {self.dtype} cannot be allocated: {exc}"
            ) from None


def _check_fill(fill: Any, dtype: np.dtype[Any]) -> int | float:
    if isinstance(fill, bool) or not isinstance(fill, int | float | np.integer | np.floating):
        raise InvalidRequestError(f"fill must be a number, got {type(fill).__name__}")
    if dtype.kind == "i":
        if not float(fill).is_integer() or not _INT32.min <= fill <= _INT32.max:
            raise InvalidRequestError(f"fill must be an int32 for an integer field, got {fill!r}")
        return int(fill)
    return float(fill)


def plan_window(
    segments: Sequence[PayloadSegment], field: str, lo: int, hi: int, fill: int | float
) -> WindowPlan | None:
    """Plan the read of ``field`` over token positions ``[lo, hi)``.

    Parameters
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields; only those with ``segment.field == field`` count.
    field : str
        Field to read.
    lo, hi : int
        Window of absolute token positions, ``0 <= lo <= hi`` (end exclusive).
    fill : int or float
        Value of entries no row covers; an int32 for integer fields.

    Returns
    -------
    WindowPlan or None
        ``None`` when no segment has ``field``.

    Raises
    ------
    InvalidRequestError
        ``lo > hi``, ``lo < 0``, a bad ``fill``; checked first.
    InvalidSegmentError
        Any invalid segment in the list, of any field (checked before the field filter);
        segments of ``field`` with row shapes of different ranks, or mixing integer and
        float dtypes.

    Notes
    -----
    The row shape is the element-wise maximum of the shapes of the field's segments that
    intersect the window, or of all of them when none does (DESIGN §4).
    """
    lo, hi = _check_window(lo, hi)
    segments = validate_segments(segments)
    mine = [s for s in segments if s.field == field]
    if not mine:
        return None
    ranks = {len(s.shape) for s in mine}
    if len(ranks) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} have row shapes of different ranks {sorted(ranks)}",
            field="shape",
        )
    kinds = {np.dtype(s.dtype).kind for s in mine}
    if "f" in kinds and len(kinds) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} mix integer and float dtypes", field="dtype"
        )
    dtype = np.dtype(np.float32 if "f" in kinds else np.int32)
    fill = _check_fill(fill, dtype)
    hits = [s for s in mine if max(s.pos, lo) < min(s.pos + s.rows, hi)]
    shapes = [s.shape for s in (hits or mine)]
    row_shape = tuple(max(dims) for dims in zip(*shapes, strict=True))
    pieces = []
    for s in hits:
        start, stop = max(s.pos, lo), min(s.pos + s.rows, hi)
        rb = _row_nbytes(s)
        pieces.append(
            Piece(
                file=s.file,
                offset=s.offset + (start - s.pos) * rb,
                nbytes=(stop - start) * rb,
                end=segment_end(s),
                dst=start - lo,
                rows=stop - start,
                dtype=s.dtype,
                shape=tuple(s.shape),
            )
        )
    return WindowPlan(lo, hi, row_shape, dtype, fill, tuple(pieces))


def assemble(plan: WindowPlan, data: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Lay the fetched bytes of ``plan`` into a fresh output array.

    Parameters
    ----------
    plan : WindowPlan
        The plan the bytes were fetched for.
    data : bytes-like
        The pieces' bytes concatenated in plan order (``plan.nbytes`` bytes, little-endian).
    out : numpy.ndarray, optional
        The array from ``plan.new_output()`` to fill; a new one by default.

    Returns
    -------
    numpy.ndarray
        Shape ``[hi - lo, *row_shape]``, dtype ``plan.dtype``; fresh, writeable,
        C-contiguous. Every entry starts as ``fill``; each piece's rows overwrite their
        output rows whole, values in the leading entries and ``fill`` in the rest.

    Raises
    ------
    InvalidRequestError
        If ``data`` is not exactly ``plan.nbytes`` long.
    """
    view = memoryview(data).cast("B")
    if view.nbytes != plan.nbytes:
        raise InvalidRequestError(f"expected {plan.nbytes} bytes for the window, got {view.nbytes}")
    if out is None:
        out = plan.new_output()
    # every row a piece touches is written whole below; only the others start as fill
    covered = np.zeros(plan.hi - plan.lo, dtype=bool)
    for p in plan.pieces:
        covered[p.dst : p.dst + p.rows] = True
    if not covered.all():
        out[~covered] = plan.fill
    at = 0
    for p in plan.pieces:
        rows = np.frombuffer(view[at : at + p.nbytes], dtype=np.dtype(p.dtype).newbyteorder("<"))
        rows = rows.reshape(p.rows, *p.shape)
        at += p.nbytes
        dst = out[p.dst : p.dst + p.rows]
        if p.shape == plan.row_shape:
            dst[...] = rows
        else:
            dst[...] = plan.fill
            dst[(slice(None), *(slice(0, d) for d in p.shape))] = rows
    return out
