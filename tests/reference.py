"""A dense, row-by-row reference model of docs/contract.md, "Reading a window", written for clarity, not speed."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from payload_client import PayloadSegment


def rows_of(files: Mapping[str, bytes], s: PayloadSegment) -> np.ndarray:
    """The rows a segment names, from a mirror of the files' bytes."""
    size = np.dtype(s.dtype).itemsize * int(np.prod(s.shape))
    raw = files[s.file][s.offset : s.offset + s.rows * size]
    assert len(raw) == s.rows * size, "the mirror must hold the segment's bytes"
    return np.frombuffer(raw, dtype=np.dtype(s.dtype).newbyteorder("<")).reshape(s.rows, *s.shape)


def dense_read(
    files: Mapping[str, bytes],
    segs: list[PayloadSegment],
    field: str,
    lo: int,
    hi: int,
    fill: int | float,
) -> np.ndarray | None:
    """What read_field must return, computed one row at a time."""
    mine = [s for s in segs if s.field == field]
    if not mine:
        return None
    hits = [s for s in mine if any(lo <= s.pos + k < hi for k in range(s.rows))]
    shapes = [s.shape for s in (hits or mine)]
    row_shape = [max(d[i] for d in shapes) for i in range(len(shapes[0]))]
    is_float = any(np.dtype(s.dtype).kind == "f" for s in mine)
    out = np.full([hi - lo, *row_shape], fill, np.float32 if is_float else np.int32)
    for s in mine:
        data = rows_of(files, s)
        for k in range(s.rows):
            p = s.pos + k
            if lo <= p < hi:
                out[p - lo] = fill
                out[p - lo][tuple(slice(0, d) for d in s.shape)] = data[k]
    return out


def dense_coverage(segs: list[PayloadSegment], field: str, lo: int, hi: int) -> np.ndarray:
    """What ``read_field(..., coverage=True)`` must return as ``covered``, row by row."""
    covered = np.zeros(hi - lo, dtype=bool)
    for s in segs:
        if s.field != field:
            continue
        for k in range(s.rows):
            if lo <= s.pos + k < hi:
                covered[s.pos + k - lo] = True
    return covered
