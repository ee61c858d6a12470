"""Window read semantics (DESIGN §4), split into an I/O-free plan and an assembly step.

`plan_window` turns segments and a window into the byte extents to fetch; whoever holds the
bytes (the daemon over HTTP, a test reading files) fetches them; `assemble` lays them into the
output array. The semantics live here once, whatever carries the bytes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import InvalidRequestError, InvalidSegmentError
from ._ops import _check_window
from ._segment import PayloadSegment, _row_nbytes, segment_end, validate_segments

__all__ = [
    "Piece",
    "WindowPlan",
    "assemble",
    "direct_view",
    "place",
    "plan_window",
    "prepare_output",
]

_BIG_ENDIAN = sys.byteorder == "big"


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
        Output dtype: ``int32`` for integer fields, ``float32`` for float fields, unless
        the reader asked for another.
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
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if not float(fill).is_integer() or not info.min <= fill <= info.max:
            raise InvalidRequestError(f"fill {fill!r} does not fit the output dtype {dtype}")
        return int(fill)
    return float(fill)


def _output_dtype(field: str, stored: set[str], dtype: Any) -> np.dtype[Any]:
    """The output dtype: int32/float32 by default (DESIGN §4), else ``dtype`` if it holds
    every stored dtype of the field without loss."""
    float_field = any(np.dtype(d).kind == "f" for d in stored)
    if dtype is None:
        return np.dtype(np.float32 if float_field else np.int32)
    try:
        out = np.dtype(dtype)
    except TypeError:
        raise InvalidRequestError(f"dtype {dtype!r} is not a numpy dtype") from None
    if out.kind not in "iuf":
        raise InvalidRequestError(f"dtype must be an integer or float dtype, got {out}")
    narrow = sorted(d for d in stored if not np.can_cast(d, out, "safe"))
    if narrow:
        raise InvalidRequestError(
            f"dtype {out} cannot hold the {', '.join(narrow)} rows of field {field!r}"
        )
    native: np.dtype[Any] = out.newbyteorder("=")
    return native


def plan_window(
    segments: Sequence[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    fill: int | float,
    dtype: Any = None,
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
        Value of entries no row covers; must fit the output dtype.
    dtype : numpy dtype, optional
        Output dtype. Default ``int32`` for integer fields, ``float32`` for float fields
        (DESIGN §4); any integer or float dtype that holds every stored dtype of the field
        without loss (e.g. the stored ``uint8``, or ``int64`` for indexing).

    Returns
    -------
    WindowPlan or None
        ``None`` when no segment has ``field``.

    Raises
    ------
    InvalidRequestError
        ``lo > hi``, ``lo < 0`` (checked first); a ``fill`` or ``dtype`` that does not fit.
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
    out_dtype = _output_dtype(field, {s.dtype for s in mine}, dtype)
    fill = _check_fill(fill, out_dtype)
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
    return WindowPlan(lo, hi, row_shape, out_dtype, fill, tuple(pieces))


def prepare_output(plan: WindowPlan, out: np.ndarray | None = None) -> np.ndarray:
    """Return the array a window is read into, with every entry no piece writes set to fill.

    Parameters
    ----------
    plan : WindowPlan
        The window.
    out : numpy.ndarray, optional
        A caller's array to fill (e.g. a view of a pinned buffer reused every step): dtype
        ``plan.dtype``, shape ``[hi - lo, *dims]`` with each of ``dims`` at least the
        matching ``row_shape`` entry; entries beyond ``row_shape`` are set to fill. Default: a
        new array ``[hi - lo, *row_shape]``.

    Raises
    ------
    InvalidRequestError
        ``out`` has another dtype, too few rows or columns, another rank, or is read-only.
    """
    if out is None:
        out = plan.new_output()
        wider = False
    else:
        if not isinstance(out, np.ndarray):
            raise InvalidRequestError(f"out must be a numpy.ndarray, got {type(out).__name__}")
        want = (plan.hi - plan.lo, *plan.row_shape)
        if out.dtype != plan.dtype:
            raise InvalidRequestError(f"out has dtype {out.dtype}, the read gives {plan.dtype}")
        if (
            out.ndim != len(want)
            or out.shape[0] != want[0]
            or any(o < w for o, w in zip(out.shape[1:], want[1:], strict=True))
        ):
            raise InvalidRequestError(f"out has shape {out.shape}, the window needs {want}")
        if not out.flags.writeable:
            raise InvalidRequestError("out is read-only")
        wider = out.shape != want
    if wider:
        out[...] = plan.fill
        return out
    # every row a piece touches is written whole; only the others start as fill
    covered = np.zeros(plan.hi - plan.lo, dtype=bool)
    for p in plan.pieces:
        covered[p.dst : p.dst + p.rows] = True
    if not covered.all():
        out[~covered] = plan.fill
    return out


def direct_view(plan: WindowPlan, out: np.ndarray, piece: Piece) -> memoryview | None:
    """The bytes of ``out`` a piece's rows can be read straight into, or ``None``.

    Possible when ``out`` is C-contiguous, little-endian, has the piece's dtype and row shape:
    then the stored bytes are the output bytes (a stored-dtype read needs no copy).
    """
    if (
        piece.shape != out.shape[1:]
        or np.dtype(piece.dtype).newbyteorder("<") != out.dtype.newbyteorder("<")
        or not out.flags.c_contiguous
        or (out.dtype.byteorder == ">" or (out.dtype.byteorder == "=" and _BIG_ENDIAN))
    ):
        return None
    row = out.itemsize * math.prod(piece.shape)
    return out.data.cast("B")[piece.dst * row : (piece.dst + piece.rows) * row]


def place(plan: WindowPlan, out: np.ndarray, piece: Piece, data: Any) -> None:
    """Write one piece's rows (its stored bytes ``data``) over its output rows, whole.

    Values go to the leading entries, ``fill`` to the rest of each row; numpy converts the
    dtype in one pass.
    """
    rows = np.frombuffer(data, dtype=np.dtype(piece.dtype).newbyteorder("<"))
    rows = rows.reshape(piece.rows, *piece.shape)
    dst = out[piece.dst : piece.dst + piece.rows]
    if piece.shape == dst.shape[1:]:
        dst[...] = rows
    else:
        dst[...] = plan.fill
        dst[(slice(None), *(slice(0, d) for d in piece.shape))] = rows


def assemble(plan: WindowPlan, data: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Lay the fetched bytes of ``plan`` into the output array.

    Parameters
    ----------
    plan : WindowPlan
        The plan the bytes were fetched for.
    data : bytes-like
        The pieces' bytes concatenated in plan order (``plan.nbytes`` bytes, little-endian).
    out : numpy.ndarray, optional
        See `prepare_output`; a new array by default.

    Returns
    -------
    numpy.ndarray
        ``out``, or a fresh, writeable, C-contiguous ``[hi - lo, *row_shape]`` array of
        ``plan.dtype``. Every entry starts as ``fill``; each piece's rows overwrite their
        output rows whole, values in the leading entries and ``fill`` in the rest.

    Raises
    ------
    InvalidRequestError
        If ``data`` is not exactly ``plan.nbytes`` long, or ``out`` does not fit.
    """
    view = memoryview(data).cast("B")
    if view.nbytes != plan.nbytes:
        raise InvalidRequestError(f"expected {plan.nbytes} bytes for the window, got {view.nbytes}")
    out = prepare_output(plan, out)
    at = 0
    for p in plan.pieces:
        place(plan, out, p, view[at : at + p.nbytes])
        at += p.nbytes
    return out
