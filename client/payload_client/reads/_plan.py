"""Which bytes of which files land on which output rows of a window (docs/contract.md, "Reading a window"), as pieces.

A window's plan is a set of **pieces**, each a run of rows of one segment: ``nbytes`` bytes of
``file`` from ``offset`` that land on output rows ``[dst, dst + rows)``. The rule "later
segments win, row by row" is applied here, once: the pieces of a plan cover disjoint output
rows (each row only by the last segment in list order that has it), so they may be read in
any order. They are sorted by ``(file, offset)``, and pieces that follow each other in the file,
in the output and are of one row kind are merged: back-to-back appends of one lease become one
piece, one ``preadv``.

Two planners give the same pieces: `payload_client.reads._few.pieces_of_hits` in plain Python for the few segments of a
small read (its cost is a handful of Python operations), `table_of_columns` over numpy
columns (`payload_client.segments._segment.SegmentColumns`) for many, where no Python loop runs per
segment unless segments overlap.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..segments._columns import SegmentList
from ..segments._dtypes import Kind
from ..segments._segment import (
    FirstSeen,
    PayloadSegment,
    SegmentColumns,
    segment_columns,
)

__all__ = [
    "FieldColumns",
    "in_file_order",
    "distinct",
    "Kind",
    "ListColumns",
    "Piece",
    "PieceTable",
    "list_columns",
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
    kind_codes : list of int
        The indices of ``kinds`` into the list's kinds.
    disjoint : bool
        Whether no two of them share a token position: then no window needs "later wins",
        and `table` plans one from columns sorted by file and offset once, for all windows.
    """

    __slots__ = ("_base", "_by_pos", "_fcode", "_fend", "_kind", "_link", "_one", "_pos", "_rb",
                 "_shared", "_stop", "checks", "disjoint", "kind_codes", "kinds", "lc",
                 "mine")  # fmt: skip

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
        self.kind_codes = uniq
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
        by_pos = ordered[1]
        self._by_pos = by_pos.size < 2 or bool((by_pos[1:] >= by_pos[:-1]).all())
        self._base, self._pos, rows, self._rb, self._fcode, self._kind = ordered
        self._stop = self._pos + rows
        self._fend = self._base + rows * self._rb
        same_file = self._fcode[1:] == self._fcode[:-1]
        # bytes of a file that two segments name (sorted by offset, some two next to each
        # other then overlap): their pieces' offsets need not follow the segments' order
        self._shared = bool((same_file & (self._base[1:] < self._fend[:-1])).any())
        # each segment and the next (in file order) back to back in the file and in positions
        # (the last one: with none after it, False)
        self._link = np.zeros(self._pos.size, bool)
        self._link[:-1] = (
            same_file
            & (self._fend[:-1] == self._base[1:])
            & (self._stop[:-1] == self._pos[1:])
            & (self._kind[1:] == self._kind[:-1])
        )

    def table(self, lo: int, hi: int) -> tuple[PieceTable, dict[str, int], list[int]]:
        """The pieces of ``[lo, hi)`` of a `disjoint` field, the end each file must reach,
        and the kinds (indices into the list's kinds) of the segments that intersect it."""
        table, ends, kinds, _ = self.table_spans(((lo, hi),))
        return table, ends, kinds

    def table_spans(
        self, spans: Sequence[tuple[int, int]]
    ) -> tuple[PieceTable, dict[str, int], list[int], bool]:
        """`table` of several windows read into one output, their rows one after another
        (a CP rank's chunks): the pieces (output rows counted over every window, sorted by
        file and offset), the files' ends, the kinds that intersect any window, and whether
        some window meets no segment."""
        pos, stop = self._pos, self._stop
        if self._by_pos:  # in position order too: each window's segments are a range
            first, last, lo_of, hi_of, zero_of, missed = self._runs_in_order(spans)
        else:
            first, last, lo_of, hi_of, zero_of, missed = self._runs_hit(spans)
        several = len(spans) > 1
        start = np.maximum(pos[first], lo_of)
        rows = np.minimum(stop[last], hi_of) - start
        rb = self._rb[first]
        off = self._base[first] + (start - pos[first]) * rb
        fcode, fend, kinds = self._fcode[first], self._fend[last], self._kind[first]
        dst = start - zero_of
        ascending = self._by_pos and all(b <= c for (_, b), (c, _) in itertools.pairwise(spans))
        shuffled = (several and not ascending) or self._shared
        if shuffled and fcode.size > 1 and not in_file_order(fcode, off):
            order = np.lexsort((off, fcode))  # windows one after another, bytes named twice
            fcode, off, rows, rb, fend, dst, kinds = (
                a[order] for a in (fcode, off, rows, rb, fend, dst, kinds)
            )
        files = self.lc.files
        if not fend.size:
            ends = {}
        elif len(files) == 1:
            ends = {files[0]: int(fend.max())}
        else:  # pieces sorted by file: the largest end of each file's run of pieces
            at = np.flatnonzero(np.concatenate(([True], fcode[1:] != fcode[:-1])))
            reach = np.maximum.reduceat(fend, at).tolist()
            ends = dict(zip(map(files.__getitem__, fcode[at].tolist()), reach, strict=True))
        table = PieceTable(
            files, tuple(self.lc.kinds), fcode, off, rows * rb, fend, dst, rows, kinds
        )
        if not first.size:
            return table, ends, [], missed
        hit = [self._one] if self._one is not None else distinct(kinds)
        return table, ends, hit, missed

    def _runs_in_order(self, spans: Sequence[tuple[int, int]]) -> tuple[Any, ...]:
        """`_runs_hit` when the segments are in position order (a window's segments are
        then a range of them, found by bisection)."""
        pos, stop, link = self._pos, self._stop, self._link
        got: list[tuple[np.ndarray, np.ndarray, int, int, int]] = []
        at, missed = 0, False
        for a, b in spans:
            i0 = int(stop.searchsorted(a, "right")) if a < b else 0
            i1 = int(pos.searchsorted(b, "left")) if a < b else 0
            if i0 < i1:
                cut = (~link[i0 : i1 - 1]).nonzero()[0]  # (link[i]: i runs into i + 1)
                if cut.size:
                    cut += i0
                    runs = np.concatenate(([i0], cut + 1)), np.concatenate((cut, [i1 - 1]))
                else:  # one run
                    runs = np.array([i0]), np.array([i1 - 1])
                got.append((*runs, a, b, a - at))
            else:
                missed = True
            at += b - a
        if len(got) == 1 or not got:
            first, last, lo, hi, zero = got[0] if got else (_NONE, _NONE, 0, 0, 0)
            return first, last, lo, hi, zero, missed
        counts = [g[0].size for g in got]
        bounds = np.array([g[2:] for g in got], np.int64).T.repeat(counts, axis=1)
        first, last = np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])
        return first, last, *bounds, missed

    def _runs_hit(self, spans: Sequence[tuple[int, int]]) -> tuple[Any, ...]:
        """The first and last segment of each run of linked segments a window meets (not
        across windows), each run's window (its first position, end and the position of
        the output's first row: scalars for one window), and whether a window meets none."""
        pos, stop = self._pos, self._stop
        if len(spans) == 1:
            lo, hi = spans[0]  # (an empty window has no hit)
            idx = np.flatnonzero((pos < hi) & (stop > lo)) if lo < hi else _NONE
            bounds: Any = (lo, hi, lo)
            sid = None
            missed = not idx.size
        else:
            hits = [np.flatnonzero((pos < b) & (stop > a)) if a < b else _NONE
                    for a, b in spans]  # fmt: skip
            counts = [h.size for h in hits]
            idx, sid = np.concatenate(hits), np.repeat(np.arange(len(spans)), counts)
            at, zeros = 0, []
            for a, b in spans:  # the position of each window's first output row
                zeros.append(a - at)
                at += b - a
            bounds = np.array([[a for a, _ in spans], [b for _, b in spans], zeros], np.int64)
            missed = 0 in counts
        fi: Any = slice(None)  # where each run's first and last segments are in idx
        li: Any = fi
        first = last = idx
        if idx.size > 1:
            brk = (idx[1:] != idx[:-1] + 1) | ~self._link[idx[:-1]]
            if sid is not None:
                brk |= sid[1:] != sid[:-1]
            cut = np.flatnonzero(brk)
            if cut.size or sid is not None:
                fi, li = np.concatenate(([0], cut + 1)), np.concatenate((cut, [idx.size - 1]))
            else:  # one run
                fi, li = slice(0, 1), slice(idx.size - 1, idx.size)
            first, last = idx[fi], idx[li]
        if sid is None:
            return first, last, *bounds, missed
        return first, last, *bounds[:, sid[fi]], missed


_NONE = np.zeros(0, np.intp)


def in_file_order(fcode: np.ndarray, offset: np.ndarray) -> bool:
    """Whether pieces (``file`` codes and ``offset`` columns) are sorted by file and offset."""
    df = np.diff(fcode)
    return bool(((df > 0) | ((df == 0) & (offset[1:] >= offset[:-1]))).all())


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
    last span that has it: ``(first row, rows, index of the span)``; a span's rows that
    others' bounds cut are one run (as `payload_client.reads._few` gives them)."""
    bounds = np.unique(np.concatenate((dst, dst + rows)))
    winner = np.full(bounds.size - 1, -1, np.intp)
    a = np.searchsorted(bounds, dst)
    b = np.searchsorted(bounds, dst + rows)
    for j, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=True)):
        winner[x:y] = j
    # a span's rows cut by another's bounds are one run again where it won on both sides
    change = np.concatenate(([True], winner[1:] != winner[:-1], [True]))
    starts = np.flatnonzero(change[:-1] & (winner >= 0))
    stops = np.flatnonzero(change[1:] & (winner >= 0)) + 1
    return bounds[starts], bounds[stops] - bounds[starts], winner[starts]
