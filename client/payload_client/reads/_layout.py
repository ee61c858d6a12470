"""Where every byte of one read call goes: coalesced extents and their buffers (no I/O here).

The pieces of the call's windows (`payload_client.reads._plan`) are sorted by ``(file, offset)``
and gathered into **extents**: byte ranges of one file that one ``preadv`` (data plane) or
one range of the answer (HTTP) fills. Pieces back to back in a file join an extent; so do
pieces a small gap apart (at most `GAP` bytes, read into a throwaway buffer: cheaper than
another system call). Each extent comes with its buffers, in file order:

- **direct** buffers, the output's own bytes, where the stored bytes are the output bytes
  (same dtype, row shape, C-contiguous, and for a kernel copy not 1-63 bytes past the file
  offset modulo a page, see `payload_client.reads._windows.page_matched`); pieces that follow
  each other in the file and in one output share one buffer;
- **staged** buffers in one scratch array, for rows numpy converts or lays out (other dtype,
  narrower rows); pieces that follow each other in the file share one;
- the gaps.

`ReadLayout.finish` then lays the staged rows into the outputs: one numpy copy per run of
pieces when there are few, else one gather per stored dtype over every row at once (rows of
ragged widths included: values where a row has them, fill elsewhere), never a Python loop
per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._plan import Piece, PieceTable, distinct
from ._windows import _ALIASED, _STORED, PAGE, WindowPlan, place

__all__ = ["GAP", "IOV_MAX", "ReadLayout", "direct_view"]

GAP = 4096
"""Largest gap (bytes) between two pieces of one file that one extent reads through."""
IOV_MAX = 1024
"""Most buffers one ``preadv`` takes (Linux)."""
_FEW = 16
"""Calls of at most this many pieces are laid out piece by piece in Python."""
_DIRECT = 4096
"""Among many pieces, those smaller than this (bytes) are staged even where they could go
straight into the output."""
_ROWS_A_PIECE = 4
"""Staged pieces of at least this many rows on average are laid out one numpy copy each;
shorter ones (one-row segments) by one gather of every row."""
_MATCHED = 64 << 10
"""Staged buffers from this size on start at their file offset's place in a page."""


class _Pieces(NamedTuple):
    """The pieces of every window of a read, sorted by file and offset: file code, offset,
    bytes, whether the piece goes straight into its output, its window, its place there
    (bytes) and its index in its window's table."""

    fcode: np.ndarray
    off: np.ndarray
    nb: np.ndarray
    direct: np.ndarray
    win: np.ndarray
    dstb: np.ndarray
    idx: np.ndarray


def _sorted_pieces(
    live: list[tuple[WindowPlan, np.ndarray]], kernel: bool
) -> tuple[list[str], _Pieces]:
    """The file names and the pieces of ``live``'s windows (`_Pieces`)."""
    files: dict[str, int] = {}
    cols: list[list[np.ndarray]] = [[] for _ in range(7)]
    for w, (plan, out) in enumerate(live):
        t = plan.table
        fmap = np.array([files.setdefault(f, len(files)) for f in t.files], np.intp)
        ok = _direct_kinds(out, plan)
        # a small piece among many is staged: one buffer less, and one gather lays out all
        direct = ok[t.kind] & (t.nbytes >= _DIRECT)
        dstb = t.dst * (out.itemsize * math.prod(out.shape[1:]))
        if kernel and direct.any():
            shift = (out.ctypes.data + dstb - t.offset) % PAGE
            direct &= ~((shift > 0) & (shift < _ALIASED))
        for c, v in zip(
            cols,
            (fmap[t.file], t.offset, t.nbytes, direct, np.full(t.file.size, w), dstb,
             np.arange(t.file.size)),
            strict=True,
        ):  # fmt: skip
            c.append(v)
    merged = [np.concatenate(c) for c in cols]
    order = np.lexsort((merged[1], merged[0]))
    return list(files), _Pieces(*(c[order] for c in merged))


class ReadLayout:
    """The extents of one read call and the buffers their bytes go to.

    Parameters
    ----------
    plans : sequence of WindowPlan or None
        The call's windows.
    outs : sequence of numpy.ndarray or None
        Their outputs (`payload_client.reads._windows.prepare_output` done), same order.
    kernel : bool
        Whether the kernel copies into the buffers (``preadv``): then a direct buffer
        must not start 1-63 bytes past its file offset modulo a page.
    gap : int, default GAP
        Largest gap between pieces that one extent reads through (0: none; over HTTP the
        answer carries only the pieces' bytes).
    alloc : callable, optional
        ``alloc(n)`` returns a ``uint8`` array of at least ``n`` bytes for the staged rows
        (default `numpy.empty`).

    Attributes
    ----------
    extents : list of tuple
        ``(file, offset, nbytes)`` of each extent, sorted by file and offset.
    buffers : list of list of memoryview
        Each extent's buffers, in file order; their sizes add up to its ``nbytes``.
    ends : dict
        Every file the windows name, with the largest segment end in it (bytes).
    nbytes : int
        Bytes of all extents (gaps included).
    stages : list of numpy.ndarray
        The scratch arrays of staged rows (to give back to their allocator after `finish`).
    """

    def __init__(
        self,
        plans: Sequence[WindowPlan | None],
        outs: Sequence[np.ndarray | None],
        *,
        kernel: bool,
        gap: int = GAP,
        alloc: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        self._gap = min(gap, GAP)
        self.extents: list[tuple[str, int, int]] = []
        self.buffers: list[list[memoryview]] = []
        self.ends: dict[str, int] = {}
        self.stages: list[np.ndarray] = []
        self._alloc = alloc or (lambda n: np.empty(n, np.uint8))
        self._staged: list[tuple[WindowPlan, np.ndarray, Any, np.ndarray | None]] = []
        live = []
        count = 0
        for plan, out in zip(plans, outs, strict=True):
            if plan is None:
                continue
            if not self.ends:
                self.ends.update(plan.ends)
            else:
                for f, e in plan.ends.items():
                    if self.ends.get(f, -1) < e:
                        self.ends[f] = e
            if out is not None and plan.count:
                if plan.narrow and plan.count > _FEW:  # rows of several widths: all staged
                    self._staged_only(plan, out)
                    continue
                live.append((plan, out))
                count += plan.count
        if live and count <= _FEW:
            self._few(live, kernel)
        elif live:
            self._many(live, kernel)
        self.nbytes = sum(n for _, _, n in self.extents)

    # -- few pieces: one Python step each ----------------------------------------------

    def _few(self, live: list[tuple[WindowPlan, np.ndarray]], kernel: bool) -> None:
        if len(live) == 1 and live[0][0].count == 1:  # one piece: the most common small read
            plan, out = live[0]
            p = plan.pieces[0]
            view = None
            if out.flags.c_contiguous:
                view = _direct(plan, out, out.data.cast("B"), p, kernel)
            if view is None:
                buf = self._take(p.nbytes + (PAGE if p.nbytes >= _MATCHED else 0))
                at = (p.offset - buf.ctypes.data) % PAGE if p.nbytes >= _MATCHED else 0
                view = buf.data[at : at + p.nbytes]
                self._staged.append((plan, out, (p, view), None))
            self.extents.append((p.file, p.offset, p.nbytes))
            self.buffers.append([view])
            return
        items: list[tuple[str, int, int, memoryview | None, WindowPlan, np.ndarray, Piece]] = []
        staged = 0
        for plan, out in live:
            flat = out.data.cast("B") if out.flags.c_contiguous else None
            for p in plan.pieces:
                view = None if flat is None else _direct(plan, out, flat, p, kernel)
                if view is None:
                    staged += p.nbytes + (PAGE if p.nbytes >= _MATCHED else 0)
                items.append((p.file, p.offset, p.nbytes, view, plan, out, p))
        items.sort(key=lambda it: (it[0], it[1]))
        stage = self._take(staged) if staged else None
        at = 0
        for file, offset, nbytes, got, plan, out, p in items:
            view = got
            if view is None:
                assert stage is not None
                if nbytes >= _MATCHED:
                    at += (offset - stage.ctypes.data - at) % PAGE
                view = stage.data[at : at + nbytes]
                self._staged.append((plan, out, (p, view), None))
                at += nbytes
            self._add(file, offset, nbytes, view)

    def _add(self, file: str, offset: int, nbytes: int, view: memoryview) -> None:
        """Append a buffer: to the last extent when it follows it closely enough."""
        if self.extents:
            f, o, n = self.extents[-1]
            gap = offset - (o + n)
            if f == file and 0 <= gap <= self._gap:
                bufs = self.buffers[-1]
                if gap:
                    bufs.append(_junk(gap))
                bufs.append(view)
                self.extents[-1] = (f, o, n + gap + nbytes)
                return
        self.extents.append((file, offset, nbytes))
        self.buffers.append([view])

    @property
    def stage(self) -> np.ndarray | None:
        """The first scratch array of staged rows (``None``: every piece went straight into
        its output)."""
        return self.stages[0] if self.stages else None

    def _take(self, n: int) -> np.ndarray:
        stage = self._alloc(n)
        self.stages.append(stage)
        return stage

    # -- many pieces: array operations -------------------------------------------------

    def _many(self, live: list[tuple[WindowPlan, np.ndarray]], kernel: bool) -> None:
        if len(live) == 1 and not _direct_kinds(*live[0][::-1]).any():
            self._staged_only(*live[0])  # rows numpy lays out (another dtype, row shape)
            return
        names, p = _sorted_pieces(live, kernel)
        gap = p.off[1:] - (p.off[:-1] + p.nb[:-1])
        ext_break = (p.fcode[1:] != p.fcode[:-1]) | (gap < 0) | (gap > self._gap)
        buf_break = (
            ext_break
            | (gap > 0)
            | (p.direct[1:] != p.direct[:-1])
            | (p.direct[1:] & ((p.win[1:] != p.win[:-1]) | (p.dstb[1:] != p.dstb[:-1] + p.nb[:-1])))
        )
        first = np.flatnonzero(np.concatenate(([True], buf_break)))
        buf_bytes = np.add.reduceat(p.nb, first)
        buf_direct = p.direct[first]
        # staged buffers: back to back in the stage, large ones page-matched to the file
        staged_bytes = np.where(buf_direct, 0, buf_bytes + np.where(buf_bytes >= _MATCHED, PAGE, 0))
        total = int(staged_bytes.sum())
        # room past the end: a gather of ragged rows reads an output row's width from each
        tail = max(math.prod(out.shape[1:]) for _, out in live) * 4
        stage = self._take(total + tail) if total else None
        buf_at = np.concatenate(([0], np.cumsum(staged_bytes)[:-1]))
        if stage is not None:
            big = (~buf_direct) & (buf_bytes >= _MATCHED)
            buf_at[big] += (p.off[first][big] - stage.ctypes.data - buf_at[big]) % PAGE
        self._add_buffers(
            names, live, stage, (p.fcode[first], p.off[first], buf_bytes, buf_direct,
            p.win[first], p.dstb[first], buf_at, np.concatenate(([True], ext_break))[first],
            np.concatenate(([0], gap))[first]),
        )  # fmt: skip
        # where each staged piece's bytes lie in the stage
        staged = ~p.direct
        if staged.any():
            of_buf = np.cumsum(np.concatenate(([True], buf_break))) - 1
            src = buf_at[of_buf] + (p.off - p.off[first][of_buf])
            for w, (plan, out) in enumerate(live):
                mine = staged & (p.win == w)
                if mine.any():
                    self._staged.append((plan, out, (p.idx[mine], src[mine]), stage))

    def _add_buffers(
        self,
        names: list[str],
        live: list[tuple[WindowPlan, np.ndarray]],
        stage: np.ndarray | None,
        columns: tuple[np.ndarray, ...],
    ) -> None:
        """The extents and their buffers, one Python step a buffer (not one a piece: a run
        of pieces is one buffer); ``columns``: a buffer's file code, offset, bytes, whether
        it is direct, its window, its place there, its place in the stage, whether it starts
        an extent, and the gap before it."""
        flats = [out.data.cast("B") if out.flags.c_contiguous else None for _, out in live]
        stage_view = stage.data if stage is not None else None
        for fi, o, n, d, w, db, at, new, g in zip(*(c.tolist() for c in columns), strict=True):
            if d:
                flat = flats[w]
                assert flat is not None
                view = flat[db : db + n]
            else:
                assert stage_view is not None
                view = stage_view[at : at + n]
            if new:
                self.extents.append((names[fi], o, n))
                self.buffers.append([view])
            else:
                f, eo, en = self.extents[-1]
                bufs = self.buffers[-1]
                if g:
                    bufs.append(_junk(g))
                bufs.append(view)
                self.extents[-1] = (f, eo, en + g + n)

    def _staged_only(self, plan: WindowPlan, out: np.ndarray) -> None:
        """One window none of whose pieces goes straight into the output: its extents read
        into the stage, each extent one buffer (large ones page-matched), gaps into junk."""
        t = plan.table  # sorted by file and offset, disjoint
        off, nb, fcode = t.offset, t.nbytes, t.file
        end = off + nb
        gap = off[1:] - end[:-1]
        brk = (fcode[1:] != fcode[:-1]) | (gap < 0) | (gap > self._gap)
        first = np.flatnonzero(np.concatenate(([True], brk)))
        last = np.concatenate((first[1:], [off.size])) - 1
        ext_off, ext_n = off[first], end[last] - off[first]
        pad = np.where(ext_n >= _MATCHED, PAGE, 0)
        tail = math.prod(out.shape[1:]) * 4  # room past the end for a gather of ragged rows
        stage = self._take(int((ext_n + pad).sum()) + tail)
        addr, at, starts = stage.ctypes.data, 0, []
        names, data = t.files, stage.data
        for f, o, n, p in zip(fcode[first].tolist(), ext_off.tolist(), ext_n.tolist(),
                              pad.tolist(), strict=True):  # fmt: skip
            if p:
                at += (o - addr - at) % PAGE
            starts.append(at)
            self.extents.append((names[f], o, n))
            self.buffers.append([data[at : at + n]])
            at += n
        of_ext = np.cumsum(np.concatenate(([0], brk))) if off.size > 1 else np.zeros(1, np.intp)
        src = np.array(starts, np.int64)[of_ext] + (off - ext_off[of_ext])
        self._staged.append((plan, out, (np.arange(off.size), src), stage))

    # -- after the I/O -----------------------------------------------------------------

    def finish(self) -> None:
        """Lay the staged rows into their outputs (after every extent's bytes arrived)."""
        for plan, out, what, stage in self._staged:
            if isinstance(what[0], Piece):
                place(plan, out, what[0], what[1])
                continue
            idx, src = what
            assert stage is not None
            _scatter(plan, out, stage, idx, src)


def direct_view(
    plan: WindowPlan, out: np.ndarray, piece: Piece, *, kernel: bool = True
) -> memoryview | None:
    """The bytes of ``out`` a piece's rows can be read straight into, or ``None``.

    Possible when ``out`` is C-contiguous, little-endian, has the piece's dtype and row shape:
    then the stored bytes are the output bytes (a stored-dtype read needs no copy). ``None``
    too, when ``kernel`` (the kernel copies into them), if those bytes start 1 to 63 bytes
    past the piece's offset modulo `PAGE`: the kernel's copy is up to ten times slower there
    than a read into a page-matched buffer plus numpy's copy (see `page_matched`).
    """
    if (
        piece.shape != out.shape[1:]
        or out.dtype != _STORED[piece.dtype]  # the same type, little-endian
        or not out.flags.c_contiguous
    ):
        return None
    row = out.itemsize * math.prod(piece.shape)
    start = piece.dst * row
    if kernel and 0 < (out.ctypes.data + start - piece.offset) % PAGE < _ALIASED:
        return None
    return out.data.cast("B")[start : start + piece.rows * row]


def _direct(
    plan: WindowPlan, out: np.ndarray, flat: memoryview, p: Piece, kernel: bool
) -> memoryview | None:
    if p.shape != out.shape[1:] or out.dtype != _STORED[p.dtype]:
        return None
    start = p.dst * (p.nbytes // p.rows)
    # a copy of less than a page is fast wherever it lands (and finding out costs more)
    if kernel and p.nbytes >= PAGE and 0 < (out.ctypes.data + start - p.offset) % PAGE < _ALIASED:
        return None
    return flat[start : start + p.nbytes]


def _direct_kinds(out: np.ndarray, plan: WindowPlan) -> np.ndarray:
    """``bool [len(t.kinds)]``: which kinds' stored bytes are ``out``'s bytes."""
    t = plan.table
    c = out.flags.c_contiguous
    return np.array(
        [c and shape == out.shape[1:] and out.dtype == _STORED[d] for d, shape in t.kinds]
        or [False],
        bool,
    )


_JUNK = np.empty(GAP, np.uint8)


def _junk(n: int) -> memoryview:
    """A throwaway buffer for a gap (bytes nobody looks at: one buffer serves every gap)."""
    return _JUNK.data[:n]


def _scatter(
    plan: WindowPlan, out: np.ndarray, stage: np.ndarray, idx: np.ndarray, src: np.ndarray
) -> None:
    """Lay pieces ``idx`` of ``plan.table`` (their bytes at ``src`` of ``stage``) into
    ``out``: few pieces one copy each, many as one gather per stored dtype and rank."""
    t = plan.table
    rows = t.rows[idx]
    if idx.size <= _FEW or int(rows.sum()) >= _ROWS_A_PIECE * idx.size:
        # pieces of many rows (a turn's rows): one copy each beats a gather of every row
        _copy_pieces(plan, out, stage, t, idx, src)
        return
    kind = t.kind[idx]
    groups: dict[tuple[str, int], list[int]] = {}  # rank-1 rows of one dtype: one gather
    for k in distinct(kind):
        dtype, shape = t.kinds[k]
        key = (dtype, -1) if len(shape) == 1 else (dtype, k)
        groups.setdefault(key, []).append(k)
    for (dtype, _), ks in groups.items():
        sel = kind == ks[0] if len(ks) == 1 else np.isin(kind, ks)
        _gather(plan, out, stage, np.dtype(_STORED[dtype]), t, idx[sel], src[sel])


def _copy_pieces(
    plan: WindowPlan, out: np.ndarray, stage: np.ndarray, t: PieceTable, idx: np.ndarray,
    src: np.ndarray,
) -> None:  # fmt: skip
    """Lay pieces ``idx`` of ``t`` (their bytes at ``src`` of ``stage``) into ``out``, one
    numpy copy each (a second for the fill beyond a narrower row, unless ``plan.filled``)."""
    dst, rows, kind = t.dst[idx].tolist(), t.rows[idx].tolist(), t.kind[idx].tolist()
    at = src.tolist()
    kinds = t.kinds
    if plan.filled and out.ndim == 2 and len({kinds[k][0] for k in set(kind)}) == 1:
        # rows of one dtype and several widths into an output already fill: the common
        # ragged read (sampling masks), one copy a piece
        stored = _STORED[kinds[kind[0]][0]]
        size = stored.itemsize
        if not any(a % size for a in at):
            view = np.frombuffer(stage, stored, stage.nbytes // size)
            width = {k: kinds[k][1][0] for k in set(kind)}
            for d, r, k, a in zip(dst, rows, kind, at, strict=True):
                w = width[k]
                out[d : d + r, :w] = view[a // size : a // size + r * w].reshape(r, w)
            return
    fill, filled = plan.fill, plan.filled
    for d, r, k, a in zip(dst, rows, kind, at, strict=True):
        dtype, shape = kinds[k]
        values = np.frombuffer(stage, _STORED[dtype], r * math.prod(shape), a)
        rows_out = out[d : d + r]
        if shape == rows_out.shape[1:]:
            rows_out[...] = values.reshape(r, *shape)
        elif len(shape) == 1:
            rows_out[:, : shape[0]] = values.reshape(r, shape[0])
            if not filled:
                rows_out[:, shape[0] :] = fill
        else:
            if not filled:
                rows_out[...] = fill
            rows_out[(slice(None), *(slice(0, n) for n in shape))] = values.reshape(r, *shape)


def _gather(
    plan: WindowPlan,
    out: np.ndarray,
    stage: np.ndarray,
    dtype: np.dtype[Any],
    t: PieceTable,
    idx: np.ndarray,
    src: np.ndarray,
) -> None:
    """Copy every row of some pieces of one stored dtype from the stage into ``out`` in one
    gather: pieces of one row shape, or of rank-1 rows of any widths (values where a row has
    them, fill in the rest of the output row)."""
    k = dtype.itemsize
    kinds = t.kind[idx]
    shapes = [t.kinds[j][1] for j in distinct(kinds)]
    ragged = len(shapes) > 1
    per_kind = np.array([math.prod(t.kinds[j][1]) for j in range(len(t.kinds))], np.int64)
    per = per_kind[kinds]  # elements a row, each piece
    rows = t.rows[idx]
    total = int(rows.sum())
    rep = np.repeat(np.arange(idx.size), rows)
    within = np.arange(total) - (np.cumsum(rows) - rows)[rep]
    dst_rows = t.dst[idx][rep] + within
    phase = src % k
    width = int(out.shape[1]) if ragged else int(per[0])
    for r in np.unique(phase).tolist():  # elements of a dtype lie at one byte phase
        sel = None if r == phase[0] and (phase == r).all() else (phase == r)[rep]
        typed = np.ndarray(((stage.nbytes - r) // k,), dtype, buffer=stage.data, offset=r)
        first = (src[rep] - r) // k + within * per[rep]
        dr = dst_rows
        if sel is not None:
            first, dr = first[sel], dst_rows[sel]
        got = np.lib.stride_tricks.sliding_window_view(typed, width)[first]
        if ragged:  # rank-1 rows of several widths: the stage has room past its end
            n = per[rep] if sel is None else per[rep][sel]
            fill = np.array(plan.fill, out.dtype)
            out[dr] = np.where(np.arange(width) < n[:, None], got, fill)
            continue
        shape = shapes[0]
        got = got.reshape(-1, *shape)
        if shape == out.shape[1:]:
            out[dr] = got
        else:
            out[dr] = plan.fill
            out[(dr, *(slice(0, d) for d in shape))] = got
