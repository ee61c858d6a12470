"""The pieces of a window that few segments meet, in plain Python (`payload_client.reads._plan`'s
planners over numpy columns give the same pieces for long lists): a handful of Python
operations cost less than numpy's per call."""

from __future__ import annotations

from collections.abc import Sequence

from ..segments._segment import PayloadSegment, _row_nbytes
from ._plan import Piece

__all__ = ["merge_ranges", "pieces_of_hits"]


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
            taken = merge_ranges([*taken, (a, b)])
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


def merge_ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges sorted, those that touch or overlap joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
