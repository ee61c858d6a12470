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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._columns import SegmentList
from ._dtypes import Kind
from ._segment import (
    FirstSeen,
    PayloadSegment,
    SegmentColumns,
    _row_nbytes,
    segment_columns,
)

__all__ = [
    "FieldColumns",
    "distinct",
    "Kind",
    "ListColumns",
    "Piece",
    "PieceTable",
    "list_columns",
    "pieces_of_hits",
    "table_of_columns",
    "table_of_pieces",
]


def distinct(codes: np.ndarray) -> list[int]:
    """The distinct values of ``codes`` (small integers ``>= 0``: kind or file codes), in
    increasing order (a count of each: ten times cheaper than `numpy.unique` on a few
    hundred)."""
    return np.flatnonzero(np.bincount(codes)).tolist() if codes.size else []


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

    Made by `list_columns`: of a list of `PayloadSegment` (`of_columns`), or of a
    `SegmentList` (`of_list`, its own columns, once a list).

    Attributes
    ----------
    files : tuple of str
        The distinct files of the list.
    fcode : numpy.ndarray
        ``intp [n]``: each segment's index into ``files``.
    offset, pos, rows, row_nbytes : numpy.ndarray
        ``int64 [n]``.
    kind : numpy.ndarray
        ``intp [n]``: each segment's index into ``kinds``.
    kinds : list of Kind
        The distinct row kinds.
    """

    __slots__ = ("_by_field", "_codes", "_fields", "_matrix", "_select", "fcode", "files", "kind",
                 "kinds", "offset", "pos", "row_nbytes", "rows")  # fmt: skip

    def __init__(
        self,
        files: tuple[str, ...],
        fcode: np.ndarray,
        cols: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        kind: np.ndarray,
        kinds: Sequence[Kind],
        select: Callable[[str], np.ndarray],
        codes: tuple[tuple[str, ...], np.ndarray] | None = None,
    ) -> None:
        self.files, self.fcode = files, fcode
        self.offset, self.pos, self.rows, self.row_nbytes = cols
        self.kind, self.kinds = kind, list(kinds)
        self._select, self._codes = select, codes
        self._fields: dict[str, FieldColumns] = {}
        self._matrix: np.ndarray | None = None
        self._by_field: tuple[np.ndarray, np.ndarray, list[int]] | None = None

    def matrix(self) -> np.ndarray:
        """``int64 [6, n]``: offset, pos, rows, row_nbytes, fcode and kind (made once)."""
        if self._matrix is None:
            cols = (self.offset, self.pos, self.rows, self.row_nbytes, self.fcode, self.kind)
            self._matrix = np.stack([c.astype(np.int64, copy=False) for c in cols])
        return self._matrix

    @classmethod
    def of_columns(cls, cols: SegmentColumns) -> ListColumns:
        """Of a list of `PayloadSegment`, validated (`segment_columns`)."""
        names, n = cols.file, len(cols.file)
        if n and names.count(names[0]) == n:  # one file (found out at C speed)
            files: tuple[str, ...] = (names[0],)
            fcode = np.zeros(n, np.intp)
        else:
            codes = FirstSeen()
            fcode = np.fromiter(map(codes.__getitem__, names), np.intp, n)
            files = tuple(codes)
        fields = cols.field

        def select(name: str) -> np.ndarray:
            if fields.count(name) == len(fields):
                return np.arange(len(fields))
            return np.flatnonzero(np.fromiter(map(name.__eq__, fields), bool, len(fields)))

        return cls(files, fcode, (cols.offset, cols.pos, cols.rows, cols.row_nbytes),
                   cols.kind, cols.kinds, select)  # fmt: skip

    @classmethod
    def of_list(cls, sl: SegmentList) -> ListColumns:
        """Of a `SegmentList` (already valid)."""
        return cls(sl.files, sl.file, (sl.offset, sl.pos, sl.rows, sl.row_nbytes), sl.kind,
                   sl.kinds, sl.indices_of, (sl.fields, sl.field))  # fmt: skip

    def field(self, name: str) -> FieldColumns:
        """The columns of the segments of field ``name`` (made once per list and field)."""
        got = self._fields.get(name)
        if got is None:
            if self._codes is None:
                got = FieldColumns(self, self._select(name))
            else:  # every field's segments sorted at once, by file and offset
                order, ordered, bounds = self._sorted_by_field()
                try:
                    code = self._codes[0].index(name)
                except ValueError:
                    code = len(bounds) - 1  # no segment: an empty slice
                    bounds = [*bounds, bounds[-1]]
                a, b = bounds[code], bounds[code + 1]
                got = FieldColumns(self, order[a:b], ordered[:, a:b])
            self._fields[name] = got
        return got

    def _sorted_by_field(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The list's order by field, file and offset, its `matrix` in that order, and where
        each field's segments start in it (field codes, a last entry the list's length)."""
        if self._by_field is None:
            assert self._codes is not None
            fields, field = self._codes
            m = self.matrix()
            order = np.lexsort((m[0], m[4], field))
            bounds = np.searchsorted(field[order], np.arange(len(fields) + 1)).tolist()
            self._by_field = (order, m[:, order], bounds)
        return self._by_field


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
                 "checks", "disjoint", "kinds", "lc", "mine")  # fmt: skip

    def __init__(
        self, lc: ListColumns, mine: np.ndarray, ordered: np.ndarray | None = None
    ) -> None:
        self.lc, self.mine = lc, mine
        self.checks: dict[Any, tuple[np.dtype[Any], int | float]] = {}
        # offset, pos, rows, row size, file, kind: one array (``ordered``: of the segments
        # ``mine`` sorted by file and offset already)
        sub = lc.matrix()[:, mine] if ordered is None else ordered
        kind = sub[5]
        one = kind.size and (kind == kind[0]).all()
        uniq = [int(kind[0])] if one else distinct(kind)
        self.kinds = [lc.kinds[k] for k in uniq]
        self._one = uniq[0] if len(uniq) == 1 else None
        if not sub[2].all():
            sub = sub[:, sub[2] > 0]  # placeholders have no rows: no window reads them
        pos, stop = sub[1], sub[1] + sub[2]
        if pos.size > 1 and not (pos[1:] >= pos[:-1]).all():
            by_pos = np.argsort(pos, kind="stable")
            pos, stop = pos[by_pos], stop[by_pos]
        self.disjoint = not (pos[1:] < np.maximum.accumulate(stop)[:-1]).any()
        if not self.disjoint:
            self.mine = np.sort(mine)  # list order: later segments win
            return
        ordered = sub if ordered is not None else sub[:, np.lexsort((sub[0], sub[4]))]
        self._base, self._pos, rows, self._rb, self._fcode, self._kind = ordered
        self._stop = self._pos + rows
        self._fend = self._base + rows * self._rb
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
        first = last = idx
        if idx.size > 1:
            brk = (idx[1:] != idx[:-1] + 1) | ~self._link[idx[:-1]]
            cut = np.flatnonzero(brk)
            first = idx[np.concatenate(([0], cut + 1))] if cut.size else idx[:1]
            last = idx[np.concatenate((cut, [idx.size - 1]))] if cut.size else idx[-1:]
        start = np.maximum(self._pos[first], lo)
        rows = np.minimum(self._stop[last], hi) - start
        rb = self._rb[first]
        off = self._base[first] + (start - self._pos[first]) * rb
        fcode, fend = self._fcode[first], self._fend[last]
        files = self.lc.files
        if not fend.size:
            ends = {}
        elif len(files) == 1:
            ends = {files[0]: int(fend.max())}
        else:  # pieces sorted by file: the largest end of each file's run of pieces
            at = np.flatnonzero(np.concatenate(([True], fcode[1:] != fcode[:-1])))
            reach = np.maximum.reduceat(fend, at).tolist()
            ends = dict(zip(map(files.__getitem__, fcode[at].tolist()), reach, strict=True))
        kinds = self._kind[first]
        table = PieceTable(
            files, tuple(self.lc.kinds), fcode, off, rows * rb, fend, start - lo, rows, kinds
        )
        if not idx.size:
            return table, ends, []
        return table, ends, [self._one] if self._one is not None else distinct(kinds)


_CACHED: list[tuple[tuple[PayloadSegment, ...], ListColumns]] = []
"""The columns of the last lists planned (a trainer reads several windows of one list)."""
_CACHE_LISTS = 2


def list_columns(segments: Sequence[PayloadSegment]) -> ListColumns:
    """`ListColumns` of ``segments``, validated as `validate_segments` does (same errors).

    A `SegmentList`'s are made once and kept with it (it is valid already).

    The last lists' columns are kept: a list equal to one of them (the same segments, as
    values; compared at C speed, identity first) is not validated or taken apart again.
    Segments are values (`PayloadSegment` is frozen): a ``shape`` list changed in place
    after a read is not seen.
    """
    if isinstance(segments, SegmentList):
        return segments.derived(ListColumns, ListColumns.of_list)
    if not isinstance(segments, list | tuple):
        return ListColumns.of_columns(segment_columns(segments))  # raises for non-lists
    key = tuple(segments)
    for cached_key, cached in _CACHED:
        if cached_key == key:
            return cached
    got = ListColumns.of_columns(segment_columns(key))
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
    cols = lc
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
    return table, ends, np.array(distinct(cols.kind[h]), np.intp)


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
