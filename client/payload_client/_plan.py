"""Which bytes of which files land on which output rows of a window (docs/contract.md, "Reading a window"), as pieces.

A window's plan is a set of **pieces**, each a run of rows of one segment: ``nbytes`` bytes of
``file`` from ``offset`` that land on output rows ``[dst, dst + rows)``. The rule "later
segments win, row by row" is applied here, once: the pieces of a plan cover disjoint output
rows (each row only by the last segment in list order that has it), so they may be read in
any order. They are sorted by ``(file, offset)``, and pieces that follow each other in the file,
in the output and are of one row kind are merged: back-to-back appends of one lease become one
piece, one ``preadv``.

Two planners give the same pieces: `pieces_of_hits` in plain Python for the few segments of a
small read (its cost is a handful of Python operations), `table_of_columns` over numpy
columns (`payload_client._segment.SegmentColumns`) for many, where no Python loop runs per
segment unless segments overlap.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._errors import InvalidRequestError, InvalidSegmentError
from ._segment import (
    SUPPORTED_DTYPES,
    FirstSeen,
    PayloadSegment,
    SegmentColumns,
    _row_nbytes,
    segment_columns,
)

__all__ = [
    "FieldColumns",
    "Kind",
    "ListColumns",
    "Piece",
    "PieceTable",
    "check_kinds",
    "list_columns",
    "pieces_of_hits",
    "table_of_columns",
    "table_of_pieces",
]

_KIND = {name: np.dtype(name).kind for name in SUPPORTED_DTYPES}

Kind = tuple[str, tuple[int, ...]]
"""A row kind: the stored dtype name and the shape of one row."""


class Piece(NamedTuple):
    """Rows of one segment that a window reads: the rows of the window no later segment has.

    Attributes
    ----------
    file : str
        Data file relative to the payload root.
    offset : int
        Byte offset of the first needed row.
    nbytes : int
        Bytes to read (needed rows times the row size).
    end : int
        Byte offset just past the whole segment (of the last, if merged ones): the file must be
        at least this long.
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


class PieceTable(NamedTuple):
    """The pieces of a plan as columns (``[m]`` each), sorted by ``(file, offset)``.

    Attributes
    ----------
    files : tuple of str
        The files ``file`` indexes.
    kinds : tuple of Kind
        The row kinds ``kind`` indexes.
    file, kind : numpy.ndarray
        ``intp [m]``.
    offset, nbytes, end, dst, rows : numpy.ndarray
        ``int64 [m]``, as the attributes of `Piece`.
    """

    files: tuple[str, ...]
    kinds: tuple[Kind, ...]
    file: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    end: np.ndarray
    dst: np.ndarray
    rows: np.ndarray
    kind: np.ndarray

    def pieces(self) -> tuple[Piece, ...]:
        """The same pieces as `Piece` tuples."""
        files, kinds = self.files, self.kinds
        cols = zip(
            self.file.tolist(),
            self.offset.tolist(),
            self.nbytes.tolist(),
            self.end.tolist(),
            self.dst.tolist(),
            self.rows.tolist(),
            self.kind.tolist(),
            strict=True,
        )
        return tuple(Piece(files[f], o, n, e, d, r, *kinds[k]) for f, o, n, e, d, r, k in cols)


def table_of_pieces(pieces: Sequence[Piece]) -> PieceTable:
    """Columns of ``pieces`` (as given: already disjoint and sorted)."""
    files: dict[str, int] = {}
    kinds: dict[Kind, int] = {}
    m = len(pieces)
    fcode = np.fromiter((files.setdefault(p.file, len(files)) for p in pieces), np.intp, m)
    kcode = np.fromiter(
        (kinds.setdefault((p.dtype, p.shape), len(kinds)) for p in pieces), np.intp, m
    )

    def col(i: int) -> np.ndarray:
        return np.fromiter((p[i] for p in pieces), np.int64, m)

    return PieceTable(
        tuple(files), tuple(kinds), fcode, col(1), col(2), col(3), col(4), col(5), kcode
    )


def _free(a: int, b: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[a, b)`` outside ``taken`` (sorted, disjoint intervals)."""
    out, cur = [], a
    for x, y in taken:
        if y <= cur:
            continue
        if x >= b:
            break
        if x > cur:
            out.append((cur, x))
        cur = max(cur, y)
        if cur >= b:
            return out
    if cur < b:
        out.append((cur, b))
    return out


def pieces_of_hits(
    hits: Sequence[tuple[PayloadSegment, int, int]], lo: int
) -> tuple[tuple[Piece, ...], dict[str, int]]:
    """Pieces of a few segments that intersect a window, and the end each file must reach.

    Parameters
    ----------
    hits : sequence of (segment, start, stop)
        Valid segments in list order with the positions ``[start, stop)`` of the window they
        have (non-empty).
    lo : int
        The window's first position.

    Returns
    -------
    pieces : tuple of Piece
        Disjoint in output rows (later hits win), sorted by ``(file, offset)``, merged.
    ends : dict
        Each file any hit names, with the largest segment end in it (bytes).
    """
    ends: dict[str, int] = {}
    spans: list[tuple[PayloadSegment, int, int, int]] = []  # (segment, row bytes, x, y)
    if len(hits) == 1:
        s, a, b = hits[0]
        rb = _row_nbytes(s)
        ends[s.file] = s.offset + s.rows * rb
        spans.append((s, rb, a, b))
    else:
        taken: list[tuple[int, int]] = []
        for s, a, b in reversed(hits):  # the last hit has its rows; earlier ones what is left
            rb = _row_nbytes(s)
            end = s.offset + s.rows * rb
            if ends.get(s.file, -1) < end:
                ends[s.file] = end
            for x, y in _free(a, b, taken):
                spans.append((s, rb, x, y))
            taken = _merged([*taken, (a, b)])
    pieces = sorted(
        Piece(
            s.file,
            s.offset + (x - s.pos) * rb,
            (y - x) * rb,
            s.offset + s.rows * rb,
            x - lo,
            y - x,
            s.dtype,
            tuple(s.shape),
        )
        for s, rb, x, y in spans
    )
    merged: list[Piece] = []
    for p in pieces:
        if merged:
            q = merged[-1]
            if (
                q.file == p.file
                and q.offset + q.nbytes == p.offset
                and q.dst + q.rows == p.dst
                and q.dtype == p.dtype
                and q.shape == p.shape
            ):
                merged[-1] = q._replace(
                    nbytes=q.nbytes + p.nbytes, rows=q.rows + p.rows, end=max(q.end, p.end)
                )
                continue
        merged.append(p)
    return tuple(merged), ends


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class ListColumns:
    """A validated segment list as columns, with what every plan of it reuses.

    Parameters
    ----------
    cols : SegmentColumns
        The list's columns (`payload_client._segment.segment_columns`).

    Attributes
    ----------
    cols : SegmentColumns
        As given.
    files : tuple of str
        The distinct files of the list.
    fcode : numpy.ndarray
        ``intp [n]``: each segment's index into ``files``.
    """

    __slots__ = ("_fields", "cols", "fcode", "files")

    def __init__(self, cols: SegmentColumns) -> None:
        self.cols = cols
        names, n = cols.file, len(cols.file)
        if n and names.count(names[0]) == n:  # one file (found out at C speed)
            self.files: tuple[str, ...] = (names[0],)
            self.fcode = np.zeros(n, np.intp)
        else:
            codes = FirstSeen()
            self.fcode = np.fromiter(map(codes.__getitem__, names), np.intp, n)
            self.files = tuple(codes)
        self._fields: dict[str, FieldColumns] = {}

    def field(self, name: str) -> FieldColumns:
        """The columns of the segments of field ``name`` (made once per list and field)."""
        got = self._fields.get(name)
        if got is None:
            names = self.cols.field
            if names.count(name) == len(names):
                mine = np.arange(len(names))
            else:
                mine = np.flatnonzero(np.fromiter(map(name.__eq__, names), bool, len(names)))
            got = self._fields[name] = FieldColumns(self, mine)
        return got


class FieldColumns:
    """The segments of one field of a list, ready for many windows.

    Attributes
    ----------
    mine : numpy.ndarray
        ``intp``: their indices in the list, in list order.
    kinds : list of Kind
        Their distinct row kinds (placeholders included).
    disjoint : bool
        Whether no two of them share a token position: then no window needs "later wins",
        and `table` plans one from columns sorted by file and offset once, for all windows.
    """

    __slots__ = ("_base", "_fcode", "_fend", "_kind", "_link", "_one", "_pos", "_rb", "_stop",
                 "disjoint", "kinds", "lc", "mine")  # fmt: skip

    def __init__(self, lc: ListColumns, mine: np.ndarray) -> None:
        cols = lc.cols
        self.lc, self.mine = lc, mine
        kind = cols.kind[mine]
        uniq = np.unique(kind).tolist()
        self.kinds = [cols.kinds[k] for k in uniq]
        self._one = uniq[0] if len(uniq) == 1 else None
        rows = cols.rows[mine]
        m = mine[rows > 0]  # placeholders have no rows: no window reads them
        pos, stop = cols.pos[m], cols.pos[m] + cols.rows[m]
        by_pos = np.argsort(pos, kind="stable")
        self.disjoint = not (pos[by_pos][1:] < np.maximum.accumulate(stop[by_pos])[:-1]).any()
        if not self.disjoint:
            return
        base, fcode = cols.offset[m], lc.fcode[m]
        order = np.lexsort((base, fcode))
        self._pos, self._stop, self._base = pos[order], stop[order], base[order]
        self._rb, self._fcode, self._kind = (
            cols.row_nbytes[m][order],
            fcode[order],
            cols.kind[m][order],
        )
        self._fend = self._base + (self._stop - self._pos) * self._rb
        # each segment and the next (in file order) back to back in the file and in positions
        self._link = (
            (self._fcode[1:] == self._fcode[:-1])
            & (self._fend[:-1] == self._base[1:])
            & (self._stop[:-1] == self._pos[1:])
            & (self._kind[1:] == self._kind[:-1])
        )

    def table(self, lo: int, hi: int) -> tuple[PieceTable, dict[str, int], list[int]]:
        """The pieces of ``[lo, hi)`` of a `disjoint` field, the end each file must reach,
        and the kinds (indices into the list's kinds) of the segments that intersect it."""
        hit = (self._pos < hi) & (self._stop > lo)  # (an empty window has no hit)
        idx = np.flatnonzero(hit) if lo < hi else np.zeros(0, np.intp)
        if idx.size > 1:
            brk = (idx[1:] != idx[:-1] + 1) | ~self._link[idx[:-1]]
            first = idx[np.concatenate(([True], brk))]
            last = idx[np.concatenate((brk, [True]))]
        else:
            first = last = idx
        start = np.maximum(self._pos[first], lo)
        rows = np.minimum(self._stop[last], hi) - start
        rb = self._rb[first]
        off = self._base[first] + (start - self._pos[first]) * rb
        fcode, fend = self._fcode[first], self._fend[last]
        files = self.lc.files
        if len(files) == 1:
            ends = {files[0]: int(fend.max())} if fend.size else {}
        else:
            reach = np.full(len(files), -1, np.int64)
            np.maximum.at(reach, fcode, fend)
            used = np.flatnonzero(reach >= 0).tolist()
            ends = {files[i]: e for i, e in zip(used, reach[used].tolist(), strict=True)}
        kinds = self._kind[first]
        table = PieceTable(
            files, tuple(self.lc.cols.kinds), fcode, off, rows * rb, fend, start - lo, rows, kinds
        )
        if not idx.size:
            return table, ends, []
        return table, ends, [self._one] if self._one is not None else np.unique(kinds).tolist()


_CACHED: list[tuple[tuple[PayloadSegment, ...], ListColumns]] = []
"""The columns of the last lists planned (a trainer reads several windows of one list)."""
_CACHE_LISTS = 2


def list_columns(segments: Sequence[PayloadSegment]) -> ListColumns:
    """`ListColumns` of ``segments``, validated as `validate_segments` does (same errors).

    The last lists' columns are kept: a list equal to one of them (the same segments, as
    values; compared at C speed, identity first) is not validated or taken apart again.
    Segments are values (`PayloadSegment` is frozen): a ``shape`` list changed in place
    after a read is not seen.
    """
    if not isinstance(segments, list | tuple):
        return ListColumns(segment_columns(segments))  # validates, raises for non-lists
    key = tuple(segments)
    for cached_key, cached in _CACHED:
        if cached_key == key:
            return cached
    got = ListColumns(segment_columns(key))
    _CACHED[:] = [(key, got), *_CACHED[: _CACHE_LISTS - 1]]
    return got


def table_of_columns(
    lc: ListColumns, mine: np.ndarray, lo: int, hi: int
) -> tuple[PieceTable, dict[str, int], np.ndarray]:
    """Pieces of the segments ``mine`` (indices into ``lc``, in list order) for ``[lo, hi)``.

    Returns
    -------
    table : PieceTable
        Disjoint in output rows (later segments win), sorted by ``(file, offset)``, merged.
    ends : dict
        Each file an intersecting segment names, with the largest segment end in it.
    hit_kinds : numpy.ndarray
        ``intp``: the distinct kinds (indices into ``cols.kinds``) of the intersecting
        segments.
    """
    cols = lc.cols
    pos, nrows_all = cols.pos[mine], cols.rows[mine]
    start = np.maximum(pos, lo)
    stop = np.minimum(pos + nrows_all, hi)
    hit = start < stop
    h = mine[hit]
    start, stop, pos = start[hit], stop[hit], pos[hit]
    rb = cols.row_nbytes[h]
    base = cols.offset[h]
    end = base + cols.rows[h] * rb
    kind = cols.kind[h]
    fcode = lc.fcode[h]
    reach = np.full(len(lc.files), -1, np.int64)
    np.maximum.at(reach, fcode, end)
    used = np.flatnonzero(reach >= 0).tolist()
    files = lc.files
    ends = {files[i]: e for i, e in zip(used, reach[used].tolist(), strict=True)}
    dst, rows = start - lo, stop - start
    off = base + (start - pos) * rb
    if h.size > 1:
        order = np.argsort(dst, kind="stable")
        first, last = dst[order], (dst + rows)[order]
        if (first[1:] < np.maximum.accumulate(last)[:-1]).any():  # overlaps: later wins
            dst, rows, w = _winners(dst, rows)
            off = off[w] + (dst - (start[w] - lo)) * rb[w]
            fcode, kind, rb, end = fcode[w], kind[w], rb[w], end[w]
    nbytes = rows * rb
    order = np.lexsort((off, fcode))
    fcode, off, nbytes, end = fcode[order], off[order], nbytes[order], end[order]
    dst, rows, kind = dst[order], rows[order], kind[order]
    if fcode.size > 1:
        brk = (
            (fcode[1:] != fcode[:-1])
            | (off[1:] != off[:-1] + nbytes[:-1])
            | (dst[1:] != dst[:-1] + rows[:-1])
            | (kind[1:] != kind[:-1])
        )
        if not brk.all():
            at = np.flatnonzero(np.concatenate(([True], brk)))
            nbytes = np.add.reduceat(nbytes, at)
            rows = np.add.reduceat(rows, at)
            end = np.maximum.reduceat(end, at)
            fcode, off, dst, kind = fcode[at], off[at], dst[at], kind[at]
    table = PieceTable(files, tuple(cols.kinds), fcode, off, nbytes, end, dst, rows, kind)
    return table, ends, np.unique(cols.kind[h])


def _winners(dst: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Overlapping spans ``[dst, dst + rows)`` in list order → disjoint runs, each with the
    last span that has it: ``(first row, rows, index of the span)``."""
    bounds = np.unique(np.concatenate((dst, dst + rows)))
    winner = np.full(bounds.size - 1, -1, np.intp)
    a = np.searchsorted(bounds, dst)
    b = np.searchsorted(bounds, dst + rows)
    for j, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        winner[x:y] = j
    keep = winner >= 0
    first = bounds[:-1][keep]
    return first, bounds[1:][keep] - first, winner[keep]


def _check_fill(fill: Any, dtype: np.dtype[Any]) -> int | float:
    if type(fill) is int and dtype.kind in "iu":  # the usual case, quickly
        lo, hi = _int_range(dtype)
        if lo <= fill <= hi:
            return fill
        raise _bad_fill(fill, dtype)
    if isinstance(fill, bool) or not isinstance(fill, int | float | np.integer | np.floating):
        raise InvalidRequestError(f"fill must be a number, got {type(fill).__name__}")
    if dtype.kind in "iu":
        lo, hi = _int_range(dtype)  # an int fill is compared as it is, never through float
        if isinstance(fill, float | np.floating) and not float(fill).is_integer():
            raise _bad_fill(fill, dtype)
        if not lo <= fill <= hi:
            raise _bad_fill(fill, dtype)
        return int(fill)
    try:
        value = float(fill)
    except OverflowError:  # an int no float holds
        raise _bad_fill(fill, dtype) from None
    if math.isfinite(value) and abs(value) > _float_max(dtype):  # NaN and inf are values
        raise _bad_fill(fill, dtype)
    return value


def _bad_fill(fill: Any, dtype: np.dtype[Any]) -> InvalidRequestError:
    return InvalidRequestError(f"fill {str(fill)[:40]} does not fit the output dtype {dtype}")


@functools.lru_cache(maxsize=64)
def _float_max(dtype: np.dtype[Any]) -> float:
    return float(np.finfo(dtype).max)


@functools.lru_cache(maxsize=64)
def _int_range(dtype: np.dtype[Any]) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _output_dtype(field: str, stored: frozenset[str], dtype: Any) -> np.dtype[Any]:
    """The output dtype: int32/float32 by default (docs/contract.md, "Reading a window"), else ``dtype`` if it holds
    every stored dtype of the field without loss."""
    try:
        try:
            return _output_dtype_cached(stored, dtype)
        except TypeError:  # an unhashable dtype argument: not cached
            return _output_dtype_of(stored, dtype)
    except _NarrowDtypeError as exc:
        raise InvalidRequestError(
            f"dtype {exc.args[0]} cannot hold the {exc.args[1]} rows of field {field!r}"
        ) from None


class _NarrowDtypeError(Exception):
    """Raised (and cached nowhere) when an output dtype cannot hold a stored dtype."""


def _output_dtype_of(stored: frozenset[str], dtype: Any) -> np.dtype[Any]:
    float_field = any(_KIND[d] == "f" for d in stored)
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
        raise _NarrowDtypeError(out, ", ".join(narrow))
    native: np.dtype[Any] = out.newbyteorder("=")
    return native


_output_dtype_cached = functools.lru_cache(maxsize=256)(_output_dtype_of)


def check_kinds(
    field: str, kinds: Iterable[Kind], fill: Any, dtype: Any
) -> tuple[np.dtype[Any], int | float]:
    """The output dtype and fill of a field whose segments have these row kinds.

    Raises
    ------
    InvalidSegmentError
        Row shapes of different ranks; integer and float dtypes mixed.
    InvalidRequestError
        A ``dtype`` or ``fill`` that does not fit.
    """
    kinds = list(kinds)
    if len(kinds) == 1:
        stored = frozenset((kinds[0][0],))
        out_dtype = _output_dtype(field, stored, dtype)
        return out_dtype, _check_fill(fill, out_dtype)
    ranks = {len(shape) for _, shape in kinds}
    if len(ranks) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} have row shapes of different ranks {sorted(ranks)}",
            field="shape",
        )
    stored = frozenset(d for d, _ in kinds)
    if len(stored) > 1 and len({_KIND[d] == "f" for d in stored}) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} mix integer and float dtypes", field="dtype"
        )
    out_dtype = _output_dtype(field, stored, dtype)
    return out_dtype, _check_fill(fill, out_dtype)
