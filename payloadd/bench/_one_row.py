"""Windows of many one-row segments, and one-row read round trips (part of ``payloadd bench``).

A sampling mask as a sampler may write it: one append per masked position, each at its own
width (1 to 64 ids), all in one step, so the rows lie back to back in one file. For N = 10,
100, 1,000 and 10,000 such segments, one window over all of them (``read_field`` into a
preallocated ``int32 [N, 64]``, fill ``-1``) costs, per segment:

- payloadd, on the data plane and over HTTP; each read is of one of three lists of the same
  rows at other positions (``shift_segments``), so never of a list the client has just read
  (it keeps what it worked out of the last two);
- baseline (a): one ``os.pread`` per segment (the file opened once beforehand);
- baseline (b): one ``os.pread`` of the whole contiguous byte range (one per run of
  back-to-back segments, should they not all be).

Also the round trip of a one-row read (``read_field`` of a one-row window of router ids,
``uint8 [1, 48, 8]``, returned as a new ``int32`` array), p50 and p99, on both transports.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import PayloadClient, PayloadSegment, shift_segments
from payloadd.bench._measure import Add, page_aligned, pct, rotated, timed
from payloadd.bench._packed import MAX_WIDTH
from payloadd.bench._rl_batch import LAYERS, MASK, MASK_FILL, ROUTED, ROUTED_FILL, TOP_K, VOCAB

__all__ = ["COUNTS", "bench_one_row_reads", "bench_one_rows", "contiguous_runs", "write_one_rows"]

COUNTS = (10, 100, 1_000, 10_000)
"""Segments in a window."""
RUN = "bench-one-rows"


def write_one_rows(
    client: PayloadClient, n: int, run: str, step: int, seed: int = 0
) -> list[PayloadSegment]:
    """Append ``n`` one-row mask rows, positions ``0..n-1``, each at a random width <= 64.

    Parameters
    ----------
    client : PayloadClient
        Client of the daemon.
    n : int
        Rows (appends).
    run : str
        Run of the appends.
    step : int
        Step of the appends (one step: they go to one file).
    seed : int
        Seed of the widths and ids.

    Returns
    -------
    list of PayloadSegment
        One segment per row, in position order.
    """
    rng = np.random.default_rng((seed, n))
    segs: list[PayloadSegment] = []
    for i, w in enumerate(rng.integers(1, MAX_WIDTH + 1, n).tolist()):
        rows = rng.integers(0, VOCAB, (1, w), dtype=np.int32)
        segs += client.append(MASK, rows, i, run=run, step=step)
    return segs


def contiguous_runs(segments: list[PayloadSegment]) -> list[tuple[str, int, int]]:
    """``(file, offset, nbytes)`` of each run of segments whose bytes lie back to back.

    Parameters
    ----------
    segments : list of PayloadSegment
        Segments in file order.

    Returns
    -------
    list of tuple
        One entry per run; a single one when all are back to back in one file.
    """
    runs: list[list[Any]] = []
    for s in segments:
        nb = s.rows * _row_bytes(s)
        if runs and runs[-1][0] == s.file and runs[-1][1] + runs[-1][2] == s.offset:
            runs[-1][2] += nb
        else:
            runs.append([s.file, s.offset, nb])
    return [(f, o, n) for f, o, n in runs]


def _row_bytes(s: PayloadSegment) -> int:
    return int(np.dtype(s.dtype).itemsize * np.prod(s.shape))


def bench_one_rows(
    add: Add, socket: Path, root: Path, repeat: int, quick: bool, counts: tuple[int, ...] = COUNTS
) -> None:
    """Measure one window over ``N`` one-row segments, per segment, against preads, in
    microseconds per segment.

    Parameters
    ----------
    add, socket, root, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`).
    quick : bool
        Fewer calls a sample.
    counts : tuple of int
        The ``N`` to measure.
    """
    with (
        PayloadClient(socket) as fast,
        PayloadClient(socket, data_plane=False) as http,
    ):
        for n in counts:
            segs = write_one_rows(fast, n, RUN, n)
            size = f"N={n // 1000}k" if n >= 1000 else f"N={n}"
            out = page_aligned(n * MAX_WIDTH * 4).view(np.int32).reshape(n, MAX_WIDTH)
            fds = {f: os.open(root / f, os.O_RDONLY | os.O_CLOEXEC) for f in {s.file for s in segs}}
            try:
                each = [(fds[s.file], s.rows * _row_bytes(s), s.offset) for s in segs]
                whole = [(fds[f], nb, off) for f, off, nb in contiguous_runs(segs)]
                ops = _ops(segs, out, each, whole, fast, http)
                k = max(3, min(100, 20_000 // n)) // (2 if quick else 1)
                for r in range(repeat):
                    for name, op, base in rotated(ops, r):
                        op()  # warm
                        add(name, size, "µs", timed(op, max(k, 2)) / n * 1e6, base)
            finally:
                for fd in fds.values():
                    os.close(fd)


def _ops(
    segs: list[PayloadSegment],
    out: np.ndarray,
    each: list[tuple[int, int, int]],
    whole: list[tuple[int, int, int]],
    fast: PayloadClient,
    http: PayloadClient,
) -> list[tuple[str, Callable[[], Any], str | None]]:
    n = len(segs)
    pread = os.pread

    def pread_each() -> None:
        for fd, nb, off in each:
            pread(fd, nb, off)

    def pread_whole() -> None:
        for fd, nb, off in whole:
            pread(fd, nb, off)

    # three lists of the same rows at other positions (the client keeps what it worked out
    # of the last two lists read): every read is of a list it has not just read
    lists = itertools.cycle([(shift_segments(segs, k * n), k * n) for k in range(3)])

    def read(c: PayloadClient) -> Callable[[], Any]:
        def one() -> None:
            these, lo = next(lists)
            c.read_field(these, MASK, lo, lo + n, MASK_FILL, out=out)

        return one

    base = "one-row segments, a pread each"
    return [
        (base, pread_each, None),
        ("one-row segments, one pread of the range", pread_whole, None),
        ("one-row segments, read out= (data plane)", read(fast), base),
        ("one-row segments, read out= (http)", read(http), base),
    ]


def bench_one_row_reads(add: Add, socket: Path, repeat: int, quick: bool) -> None:
    """Round trips of one-row reads, p50 and p99 of each repetition, on both transports, in
    milliseconds.

    Parameters
    ----------
    add, socket, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`).
    quick : bool
        100 reads a repetition instead of 500.
    """
    count = 100 if quick else 500
    one = np.random.default_rng(1).integers(0, 128, (1, LAYERS, TOP_K), dtype=np.uint8)
    for name, dp in (("data plane", True), ("http", False)):
        with PayloadClient(socket, data_plane=dp) as c:
            (seg,) = c.append(ROUTED, one, 0, run=RUN, step=0)
            c.read_field([seg], ROUTED, 0, 1, ROUTED_FILL)  # connected, descriptor cached
            for _ in range(repeat):
                ts = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    c.read_field([seg], ROUTED, 0, 1, ROUTED_FILL)
                    ts.append(time.perf_counter() - t0)
                add(f"one-row read p50, sync ({name})", "384B", "ms", pct(ts, 50), None)
                add(f"one-row read p99, sync ({name})", "384B", "ms", pct(ts, 99), None)
