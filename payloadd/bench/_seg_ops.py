"""The orchestrator's operations on segment lists, per segment (part of ``payloadd bench``).

A list of 100,000 router-id segments (``uint8 [rows, 48, 8]``, 1 to 64 rows each, back to
back in positions, spread over 100 files) as an orchestrator holds them for a large batch.
Timed, each once a sample, in microseconds per input segment:

- ``clip_segments`` to a window that cuts into the first and the last segment (every segment
  kept, two trimmed);
- ``shift_segments`` by a micro batch offset;
- ``merge_pd_segments`` of a prefill side (the first half) and a decode side (the second half,
  starting with the prefill's last segment again, which the merge drops);
- msgpack decode of the encoded list with `decode_segments` (msgspec's typed decoder
  ``list[PayloadSegment]``, the garbage collector paused), and that decode followed by
  ``validate_segments``;
- the same on a `SegmentList` (the list as columns): ``clip_segments``, ``shift_segments``,
  ``merge_pd_segments`` (array operations), and `decode_columns` of the columnar wire form
  (``encode_segments(segments, "columns")``; validated on the way, as every `SegmentList`);
- baseline: msgpack encode of the same list (msgspec), the least a list of segments costs to
  move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from payload_client import (
    PayloadSegment,
    SegmentList,
    clip_segments,
    decode_columns,
    decode_segments,
    encode_segments,
    merge_pd_segments,
    shift_segments,
    validate_segments,
)
from payloadd.bench._measure import Add, rotated, timed
from payloadd.bench._rl_batch import LAYERS, ROUTED, TOP_K

__all__ = ["SEGMENTS", "bench_segment_ops", "segment_list"]

SEGMENTS = 100_000
BASELINE = "segments: msgpack encode"


def segment_list(n: int = SEGMENTS, seed: int = 0) -> list[PayloadSegment]:
    """``n`` router-id segments, back to back in positions, over ``n // 1000`` (at least 1)
    files, each file's segments back to back in it.

    Parameters
    ----------
    n : int
        Segments.
    seed : int
        Seed of the row counts.

    Returns
    -------
    list of PayloadSegment
        The segments, in position order.
    """
    rows = np.random.default_rng(seed).integers(1, 65, n).tolist()
    files = max(1, n // 1000)
    offsets = [0] * files
    out, pos = [], 0
    for i, r in enumerate(rows):
        f = i % files
        name = f"node-0/run/{f}/routed_experts-0-{f:06d}.bin"
        out.append(PayloadSegment(ROUTED, name, offsets[f], pos, r, "uint8", [LAYERS, TOP_K]))
        offsets[f] += r * LAYERS * TOP_K
        pos += r
    return out


def _ops(segs: list[PayloadSegment]) -> list[tuple[str, Callable[[], Any], int]]:
    """``(name, call, input segments)`` of each measured operation."""
    lo, hi = segs[0].pos + 1, segs[-1].pos + segs[-1].rows - 1
    half = len(segs) // 2
    prefill, decode = segs[:half], segs[half - 1 :]
    encoder = msgspec.msgpack.Encoder()
    wire = encoder.encode(segs)
    n = len(segs)
    cols = SegmentList(segs)
    pre_cols, dec_cols = cols[:half], cols[half - 1 :]
    columns = encode_segments(cols, "columns")
    return [
        (BASELINE, lambda: encoder.encode(segs), n),
        ("segments: clip_segments", lambda: clip_segments(segs, lo, hi), n),
        ("segments: shift_segments", lambda: shift_segments(segs, 65_536), n),
        ("segments: merge_pd_segments", lambda: merge_pd_segments(prefill, decode),
         len(prefill) + len(decode)),
        ("segments: msgpack decode", lambda: decode_segments(wire), n),
        ("segments: msgpack decode + validate",
         lambda: validate_segments(decode_segments(wire)), n),
        ("segments: clip_segments, columns", lambda: clip_segments(cols, lo, hi), n),
        ("segments: shift_segments, columns", lambda: shift_segments(cols, 65_536), n),
        ("segments: merge_pd_segments, columns",
         lambda: merge_pd_segments(pre_cols, dec_cols), len(pre_cols) + len(dec_cols)),
        ("segments: decode_columns (validated)", lambda: decode_columns(columns), n),
    ]  # fmt: skip


def bench_segment_ops(add: Add, repeat: int, quick: bool, n: int = SEGMENTS) -> None:
    """Time each operation on ``n`` segments, interleaved, in microseconds per segment.

    Parameters
    ----------
    add : Add
        Records the samples (`Bench.add`).
    repeat : int
        Repetitions.
    quick : bool
        One call a sample instead of three.
    n : int
        Segments in the list.
    """
    segs = segment_list(n)
    size = f"{n // 1000}k" if n >= 1000 else str(n)
    ops = _ops(segs)
    for r in range(repeat):
        for name, op, count in rotated(ops, r):
            if r == 0:
                op()  # warm (pure operations: once is enough)
            add(name, size, "µs", timed(op, 1 if quick else 3) / count * 1e6,
                None if name == BASELINE else BASELINE)  # fmt: skip
