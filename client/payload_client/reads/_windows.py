"""Windows: what a read asks for, its I/O-free plan, and how fetched bytes lay out (docs/contract.md, "Reading a window").

`Window` is one window a client reads (`CoveredRead`, `ReadResult`: what it gives back).
`plan_window` turns segments and a window into the byte extents to fetch; whoever holds the
bytes (the daemon over HTTP, the data plane, a test reading files) fetches them; `assemble`
(or `place`, piece by piece) lays them into the output array. The semantics live here once,
whatever carries the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import InvalidRequestError
from ..segments._dtypes import check_kinds
from ..segments._segment import (
    SUPPORTED_DTYPES,
    PayloadSegment,
    check_window,
    validate_segments,
)
from ..wire._fields import check_patterns
from ._checks import checked_field, row_shape_of
from ._few import pieces_of_hits
from ._plan import (
    Piece,
    PieceTable,
    table_of_columns,
    table_of_pieces,
)

__all__ = [
    "PAGE",
    "CoveredRead",
    "Piece",
    "ReadResult",
    "Window",
    "WindowLike",
    "WindowPlan",
    "assemble",
    "coverage",
    "node_of",
    "page_matched",
    "place",
    "plan_window",
    "prepare_output",
]

PAGE = 4096
"""Bytes of a memory page; the file offset of a piece modulo it is where its bytes start in
the page cache."""

_ALIASED = 64
"""A destination this few bytes past the source (modulo `PAGE`) makes the kernel's copy slow."""
_MATCHED_OUTPUT = 64 << 10
"""Outputs the client allocates from this size on start at their first piece's page offset."""
_SMALL = 8
"""Segment lists up to this long are planned in plain Python (`_plan_few`), longer ones over
numpy columns: below it, numpy's cost per call is more than Python's per segment."""
_FEW = 16
"""Plans of more pieces than this use array operations where they visit every piece."""
_COLUMNS = ("file", "offset", "nbytes", "end", "dst", "rows", "kind")
"""The array columns of a `PieceTable`."""
_ITEMSIZE = {name: np.dtype(name).itemsize for name in SUPPORTED_DTYPES}
_STORED = {name: np.dtype(name).newbyteorder("<") for name in SUPPORTED_DTYPES}
"""The on-disk (little-endian) dtype of each stored dtype name."""


class Window(NamedTuple):
    """One window to read in `PayloadClient.read_many`.

    Attributes
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields.
    field : str
        Field to read.
    lo, hi : int
        Token positions ``[lo, hi)`` (end exclusive).
    fill : int or float
        Value of entries no row covers.
    out : numpy.ndarray, optional
        Array to read into (see `PayloadClient.read_field`).
    dtype : numpy dtype, optional
        Output dtype (see `PayloadClient.read_field`).
    coverage : bool, default False
        Also say which rows are real: the window's result is then a `CoveredRead`
        ``(array, covered)`` instead of the bare array.
    required : bool, default False
        Raise `InvalidRequestError` when no segment has ``field`` (instead of ``None``).
    """

    segments: Sequence[PayloadSegment]
    field: str
    lo: int
    hi: int
    fill: int | float
    out: np.ndarray | None = None
    dtype: Any = None
    coverage: bool = False
    required: bool = False


WindowLike = Window | tuple[Sequence[PayloadSegment], str, int, int, int | float]
"""A `Window` or a plain ``(segments, field, lo, hi, fill)`` tuple."""


class CoveredRead(NamedTuple):
    """A window read with its coverage (``coverage=True``): unpacks as ``(array, covered)``.

    Attributes
    ----------
    array : numpy.ndarray or None
        What the read returns without coverage: ``[hi - lo, *row_shape]``, or ``None``
        when no segment has the field.
    covered : numpy.ndarray
        ``bool`` ``[hi - lo]``, a fresh array: ``covered[i]`` is ``True`` when some segment
        of the field has a row at token position ``lo + i`` (so ``array[i]`` holds real
        values, padded with fill only beyond that row's own shape), ``False`` when
        ``array[i]`` is all fill. All ``False`` when ``array`` is ``None`` or the window is
        empty; placeholders (segments of no rows) cover nothing.
    """

    array: np.ndarray | None
    covered: np.ndarray


ReadResult = np.ndarray | CoveredRead | None
"""One window's result in `PayloadClient.read_many`: a `CoveredRead` for windows asking
for coverage, else the array or ``None``."""


class WindowPlan:
    """What a window read needs and how it lays out.

    Parameters
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
    parts : tuple of Piece or PieceTable
        The pieces (`payload_client.reads._plan`): disjoint in output rows (each row only by the
        last segment in list order that has it), sorted by ``(file, offset)``; as tuples for
        a few, as columns for many.
    ends : dict
        Every file a segment intersecting the window names (the rows of some may all be
        overwritten by later segments), with the largest segment end in it: the file must
        be at least that long.
    narrow : bool, default False
        Whether some piece's rows are narrower than ``row_shape`` (rows of several widths).

    Attributes
    ----------
    count, nbytes, covered_rows : int
        Pieces; the bytes they need; the output rows they write.
    filled : bool
        Set by `prepare_output` when it has set every entry of the output to fill (pieces
        then write only their values).
    """

    __slots__ = ("_pieces", "_table", "count", "covered_rows", "dtype", "ends", "fill",
                 "filled", "hi", "lo", "narrow", "nbytes", "parts", "row_shape")  # fmt: skip

    def __init__(
        self,
        lo: int,
        hi: int,
        row_shape: tuple[int, ...],
        dtype: np.dtype[Any],
        fill: int | float,
        parts: tuple[Piece, ...] | PieceTable = (),
        ends: Mapping[str, int] | None = None,
        narrow: bool = False,
    ) -> None:
        self.lo, self.hi, self.row_shape, self.dtype, self.fill = lo, hi, row_shape, dtype, fill
        self.parts = parts
        self.narrow, self.filled = narrow, False
        self.ends: Mapping[str, int] = {} if ends is None else ends
        self._pieces: tuple[Piece, ...] | None = None
        self._table: PieceTable | None = None
        if isinstance(parts, PieceTable):
            self._table = parts
            self.count = int(parts.file.size)
            self.nbytes = int(parts.nbytes.sum())
            self.covered_rows = int(parts.rows.sum())
        else:
            self._pieces = parts
            self.count = len(parts)
            if self.count == 1:
                self.nbytes, self.covered_rows = parts[0].nbytes, parts[0].rows
            else:
                self.nbytes = sum(p.nbytes for p in parts)
                self.covered_rows = sum(p.rows for p in parts)

    def __repr__(self) -> str:
        return (
            f"WindowPlan(lo={self.lo}, hi={self.hi}, row_shape={self.row_shape}, "
            f"dtype={self.dtype}, fill={self.fill!r}, pieces={self.count})"
        )

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The pieces as `Piece` tuples (sorted by file and offset, disjoint)."""
        if self._pieces is None:
            assert self._table is not None
            self._pieces = self._table.pieces()
        return self._pieces

    @property
    def table(self) -> PieceTable:
        """The pieces as columns."""
        if self._table is None:
            assert self._pieces is not None
            self._table = table_of_pieces(self._pieces)
        return self._table

    def of_node(self, node: str) -> WindowPlan:
        """The part of this plan in files of ``node`` (`node_of`): its pieces, its ends;
        the same window and output, so that reads of each node's part, into one output,
        make the whole read (the pieces are disjoint in output rows)."""
        ends = {f: e for f, e in self.ends.items() if node_of(f) == node}
        if len(ends) == len(self.ends):
            return self
        parts = self.parts
        if isinstance(parts, PieceTable):
            codes = [i for i, f in enumerate(parts.files) if node_of(f) == node]
            keep = np.isin(parts.file, codes)
            parts = parts._replace(**{c: getattr(parts, c)[keep] for c in _COLUMNS})
        else:
            parts = tuple(p for p in parts if node_of(p.file) == node)
        return WindowPlan(
            self.lo, self.hi, self.row_shape, self.dtype, self.fill, parts, ends, self.narrow
        )

    def covered(self) -> np.ndarray:
        """A fresh ``bool [hi - lo]``: the output rows some piece writes."""
        n = self.hi - self.lo
        parts = self.parts
        if isinstance(parts, PieceTable) and parts.file.size > _FEW:
            edges = np.zeros(n + 1, np.int8)  # pieces are disjoint: +1 at a start, -1 past it
            edges[parts.dst] = 1
            np.subtract.at(edges, parts.dst + parts.rows, 1)
            return np.cumsum(edges[:-1], dtype=np.int8) > 0
        covered = np.zeros(n, dtype=bool)
        for p in self.pieces:
            covered[p.dst : p.dst + p.rows] = True
        return covered

    def new_output(self) -> np.ndarray:
        """Allocate the (uninitialised) output array ``[hi - lo, *row_shape]``.

        From 64 KiB up, its memory starts at the same offset within a page as the first
        piece's bytes in the file (see `page_matched`): a view of a buffer one page larger.

        Raises
        ------
        InvalidRequestError
            If it cannot be allocated.
        """
        shape = (self.hi - self.lo, *self.row_shape)
        nbytes = math.prod(shape) * self.dtype.itemsize
        try:
            if nbytes < _MATCHED_OUTPUT:  # too small for the copy's speed to matter
                return np.empty(shape, dtype=self.dtype)
            raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise InvalidRequestError(
                f"the window's output {list(shape)} {self.dtype} cannot be allocated: {exc}"
            ) from None
        at = 0
        parts = self.parts
        if isinstance(parts, PieceTable):  # match the largest piece
            if parts.nbytes.size:
                j = int(parts.nbytes.argmax())
                at = int(parts.offset[j]) - int(parts.dst[j]) * (nbytes // shape[0])
        elif parts:
            big = max(parts, key=lambda p: p.nbytes)
            at = big.offset - big.dst * (nbytes // shape[0])
        if at % self.dtype.itemsize:  # numpy needs each element aligned to its size
            at = 0
        return page_matched(raw, at, nbytes).view(self.dtype).reshape(shape)


def node_of(file: str) -> str:
    """The node of a segment's ``file``: its first component (docs/contract.md, "Reads across nodes"), the whole path
    when it has one component only."""
    return file.partition("/")[0]


def page_matched(buf: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``buf`` starting at the same offset within a page as file ``offset``.

    Parameters
    ----------
    buf : numpy.ndarray
        ``uint8``, C-contiguous, at least ``nbytes + PAGE`` bytes.
    offset : int
        File offset (bytes) of the data that will be read into the result.
    nbytes : int
        Bytes wanted.

    Returns
    -------
    numpy.ndarray
        A ``uint8`` view ``[nbytes]`` of ``buf`` whose address is ``offset`` modulo `PAGE`.

    Notes
    -----
    The kernel copies page-cache bytes to user memory with ``rep movsb``; on x86 CPUs that copy
    runs up to ten times slower when the destination lies a few bytes (1 to about 32) past the
    source modulo 4096 ("4K aliasing"). Large numpy arrays start 16 bytes into a page, page-cache
    bytes of a file's first row at 0: exactly that case. A destination at the source's page
    offset never hits it (measured in ``docs/validation/benchmarks.md``).
    """
    shift = (offset - buf.ctypes.data) % PAGE
    return buf[shift : shift + nbytes]


def plan_window(
    segments: Sequence[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    fill: int | float,
    dtype: Any = None,
    ragged: bool | None = None,
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
        (docs/contract.md, "Reading a window"); any integer or float dtype that holds every stored dtype of the field
        without loss (e.g. the stored ``uint8``, or ``int64`` for indexing).
    ragged : bool, optional
        The field's row shape rule (`payload_client.protocol.is_ragged` of its spec in the
        daemon's fields table; the clients pass it): ``False``, every row dimension must
        agree over the field's segments; ``True``, every one but the last. ``None`` (no
        table): only the number of dimensions must agree.

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
        segments of ``field`` with row shapes of different ranks, or whose fixed dimensions
        disagree (``ragged``: naming two such segments), or mixing integer and float
        dtypes.

    Notes
    -----
    The row shape is the element-wise maximum of the shapes of the field's segments that
    intersect the window, or of all of them when none does (docs/contract.md, "Reading a window"). A list of more than
    a few segments is planned over numpy columns: its cost is a few array operations, not
    Python work per segment.
    """
    lo, hi = check_window(lo, hi)
    if isinstance(segments, list | tuple) and len(segments) <= _SMALL:  # not a SegmentList
        return _plan_few(validate_segments(segments), field, lo, hi, fill, dtype, ragged)
    got = checked_field(segments, field, fill, dtype, ragged)
    if got is None:
        return None
    lc, fc, out_dtype, fill = got
    if fc.disjoint:
        table, ends, hit_kinds = fc.table(lo, hi)
    else:
        table, ends, hits = table_of_columns(lc, fc.mine, lo, hi)
        hit_kinds = hits.tolist()
    row_shape, narrow = row_shape_of(lc, fc, hit_kinds)
    return WindowPlan(lo, hi, row_shape, out_dtype, fill, table, ends, narrow)


def _plan_few(
    segs: list[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    fill: Any,
    dtype: Any,
    ragged: bool | None = None,
) -> WindowPlan | None:
    """`plan_window` of a short, validated list: plain Python, no array operation."""
    mine = [s for s in segs if s.field == field]
    if not mine:
        return None
    if len(mine) == 1:
        s = mine[0]
        shape = tuple(s.shape)
        out_dtype, fill = check_kinds(field, ((s.dtype, shape),), fill, dtype)
        a, b = max(s.pos, lo), min(s.pos + s.rows, hi)
        if a >= b:
            return WindowPlan(lo, hi, shape, out_dtype, fill, (), {})
        rb = _ITEMSIZE[s.dtype] * math.prod(shape)
        end = s.offset + s.rows * rb
        piece = Piece(s.file, s.offset + (a - s.pos) * rb, (b - a) * rb, end, a - lo, b - a,
                      s.dtype, shape)  # fmt: skip
        return WindowPlan(lo, hi, shape, out_dtype, fill, (piece,), {s.file: end})
    kinds = {(s.dtype, tuple(s.shape)) for s in mine}
    if ragged is not None and len(kinds) > 1:
        check_patterns(segs, field, [k[1] for k in kinds], ragged)
    out_dtype, fill = check_kinds(field, kinds, fill, dtype)
    hits = []
    for s in mine:
        a, b = max(s.pos, lo), min(s.pos + s.rows, hi)
        if a < b:
            hits.append((s, a, b))
    narrow = False
    if len(hits) == 1:
        row_shape = tuple(hits[0][0].shape)
    else:
        shapes: list[Sequence[int]] = [s.shape for s, _, _ in hits] or [k[1] for k in kinds]
        row_shape = tuple(max(dims) for dims in zip(*shapes, strict=True))
        narrow = len(hits) > 1 and len({tuple(s) for s in shapes}) > 1
    pieces, ends = pieces_of_hits(hits, lo) if hits else ((), {})
    return WindowPlan(lo, hi, row_shape, out_dtype, fill, pieces, ends, narrow)


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
        if out.shape != want and (
            out.ndim != len(want)
            or out.shape[0] != want[0]
            or any(o < w for o, w in zip(out.shape[1:], want[1:], strict=True))
        ):
            raise InvalidRequestError(f"out has shape {out.shape}, the window needs {want}")
        if not out.flags.writeable:
            raise InvalidRequestError("out is read-only")
        wider = out.shape != want
    if wider or plan.narrow:  # rows narrower than the output's: fill first, all at once
        out[...] = plan.fill
        plan.filled = True
        return out
    # every row a piece touches is written whole; only the others start as fill
    n = plan.hi - plan.lo
    covered = plan.covered_rows
    if covered == n:
        return out
    if not covered:
        out[...] = plan.fill
    else:
        out[~plan.covered()] = plan.fill
    return out


def coverage(plan: WindowPlan | None, lo: int, hi: int) -> np.ndarray:
    """Which output rows of a window some segment covered: real rows, not fill.

    Computed from the plan alone (the pieces' ``dst`` and ``rows``), without any I/O.

    Parameters
    ----------
    plan : WindowPlan or None
        The window's plan, or ``None`` when no segment has the field.
    lo, hi : int
        The window ``[lo, hi)`` of token positions (``plan.lo``, ``plan.hi`` when planned).

    Returns
    -------
    numpy.ndarray
        A fresh ``bool`` array ``[hi - lo]``: ``True`` at the positions some row of a segment
        of the field covers (placeholders, with no rows, cover none); all ``False`` when
        ``plan`` is ``None``.

    Raises
    ------
    InvalidRequestError
        ``lo > hi`` or a bound that is not an integer.
    """
    lo, hi = check_window(lo, hi)
    if plan is None:
        return np.zeros(hi - lo, dtype=bool)
    return plan.covered()


def place(plan: WindowPlan, out: np.ndarray, piece: Piece, data: Any) -> None:
    """Write one piece's rows (its stored bytes ``data``) over its output rows, whole.

    Values go to the leading entries, ``fill`` to the rest of each row; numpy converts the
    dtype in one pass.
    """
    rows = np.frombuffer(data, dtype=_STORED[piece.dtype])
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
