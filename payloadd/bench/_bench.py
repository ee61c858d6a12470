"""``payloadd bench``: throughput and latency, as ratios to raw I/O measured in the same run.

A daemon starts on a temporary root (on the file system of ``--root``); every measurement is
repeated, interleaved with the others, and reported as median (min-max):

- baselines on that file system: ``os.pwrite`` of the same bytes to a growing file (append),
  ``os.preadv`` of the stored bytes into a preallocated buffer (stored-dtype read), and the
  ideal direct reader: that ``preadv`` plus the widening to ``int32`` into a preallocated
  output (the physical limit of an ``int32`` window read);
- payloadd append and window read for each item size, over the data plane (descriptors) and
  over HTTP; reads go into a preallocated ``out=`` array, ``int32`` and stored ``uint8``;
- one-row append round trips, p50 and p99, sync and async, on both transports;
- 1, 4 and 8 concurrent writers (one client each) on the data plane;
- the cost of each ``--fsync`` policy: 1 MiB and one-row appends, measured alike on a daemon
  so configured (``never`` on the main one), as ratios to ``never``;
- the seed's RL batch (`payloadd.bench._rl_batch`) carried inline versus by handle (`payloadd.bench._rl`):
  orchestrator memory, bytes sent, pack + encode and per-rank decode times;
- the RL job end to end on Ray's object store versus payloadd (`payloadd.bench._ray`), when
  Ray is installed (the ``ray`` extra), else a note;
- the same job on TransferQueue versus payloadd (`payloadd.bench._transferqueue`), when
  TransferQueue is installed (the ``peers`` extra), else a note;
- each against its physical baseline measured alike: a packed micro batch read by CP window
  against a per-segment direct reader (`payloadd.bench._packed`); a trainer rank's step on
  it, a new segment list (msgpack bytes) every micro batch, routing + mask, against that
  reader and raw ``preadv`` (`payloadd.bench._trainer_step`); windows of N one-row
  segments against ``pread`` (`payloadd.bench._one_row`, also one-row read round trips); the
  orchestrator's segment operations against msgpack encode (`payloadd.bench._seg_ops`);
  appends that open a new key against appends to open keys, and 16 MiB appends against raw
  ``pwrite`` variants, call by call (`payloadd.bench._appends`); payloadd's HTTP reads against
  a bare uvicorn app (`payloadd.bench._http_ceiling`);
- reads across nodes (`payloadd.bench._cluster`): three daemons, cross-node windows over the
  peer port and HTTP against raw loopback TCP (``sendfile`` -> ``recv_into``), and a packed
  micro batch spread over the three through `ClusterClient` against the direct reader.

Rows are router-replay ids, ``uint8 [n, 48, 8]`` (384 bytes a row), unless a section says
otherwise. Results go to a table on stdout, a JSON file and (when matplotlib is installed) a
PNG plot (`payloadd.bench._plot`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import os
import platform
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import AsyncPayloadClient, PayloadClient, PayloadSegment
from payloadd._version import __version__
from payloadd.bench._appends import bench_new_keys, bench_writes
from payloadd.bench._cluster import bench_cluster
from payloadd.bench._daemon_process import start_daemon
from payloadd.bench._http_ceiling import bench_http_ceiling
from payloadd.bench._measure import page_aligned, pct, timed
from payloadd.bench._one_row import bench_one_row_reads, bench_one_rows
from payloadd.bench._packed import bench_packed
from payloadd.bench._ray import PAYLOADD, RAY, bench_ray, ray_available
from payloadd.bench._rl import BARE, bench_rl
from payloadd.bench._rl_batch import RLBatch
from payloadd.bench._seg_ops import bench_segment_ops
from payloadd.bench._trainer_step import bench_trainer_step
from payloadd.bench._transferqueue import (
    TQ,
    TQ_MEASURES,
    bench_transferqueue,
    transferqueue_available,
)

__all__ = [
    "RL_BATCH",
    "RL_QUICK",
    "SIZES",
    "Bench",
    "Result",
    "format_table",
    "machine",
    "report",
]

ROW = (48, 8)
ROW_BYTES = 384
FIELD = "routed_experts"
SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
RL_BATCH = RLBatch()
"""The seed's batch scaled to a 2-vCPU machine: 16 samples x 32k tokens, 30 turns, 2 DP x CP 4."""
RL_QUICK = RLBatch(samples=4, tokens=4096, turns=6, seq_len=8192)
RL_MEASURES = {
    "resident": ("RL orchestrator resident", "MiB"),
    "peak": ("RL orchestrator peak", "MiB"),
    "wire": ("RL bytes sent", "MiB"),
    "encode": ("RL pack + encode", "s"),
    "decode": ("RL decode + materialise, a rank", "s"),
}
READ_SET = 64 << 20
"""Bytes of distinct stored copies the reads of one item size rotate over."""
WRITE_RUN = "bench-writes"
"""Run the append measurements write to; removed after every sample."""


@dataclass
class Result:
    """One measured quantity: per-repetition samples, and what it is compared with."""

    name: str
    size: str
    unit: str  # "GB/s", "ms", "MiB" or "s"
    samples: list[float] = field(default_factory=list)
    baseline: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def _rows(nbytes: int, seed: int = 0) -> np.ndarray:
    n = max(1, nbytes // ROW_BYTES)
    return np.random.default_rng(seed).integers(0, 128, (n, *ROW), dtype=np.uint8)


def _calls_for(nbytes: int, quick: bool) -> int:
    budget = (32 << 20) if quick else (256 << 20)  # bytes moved per sample and method
    return max(2, min(200, budget // max(nbytes, 1)))


class Bench:
    """Holds the daemon's root and socket, the clients and the results of one run."""

    def __init__(self, root: Path, socket: Path, repeat: int, quick: bool) -> None:
        self.root, self.socket, self.repeat, self.quick = root, socket, repeat, quick
        self.results: dict[tuple[str, str], Result] = {}
        self.scratch = root.parent / "raw"
        self.scratch.mkdir(exist_ok=True)

    def add(self, name: str, size: str, unit: str, value: float, baseline: str | None) -> None:
        key = (name, size)
        if key not in self.results:
            self.results[key] = Result(name, size, unit, baseline=baseline)
        self.results[key].samples.append(value)

    # -- throughput ------------------------------------------------------------------

    def throughput(self, sizes: dict[str, int]) -> None:
        with (
            PayloadClient(self.socket) as fast,
            PayloadClient(self.socket, data_plane=False) as http,
        ):
            for label, nbytes in sizes.items():
                self._throughput(label, _rows(nbytes), fast, http)

    def _throughput(
        self, label: str, rows: np.ndarray, fast: PayloadClient, http: PayloadClient
    ) -> None:
        n = rows.nbytes
        k = _calls_for(n, self.quick)
        # reads rotate over distinct stored copies (64 MiB in all, more than the CPU's
        # caches), as a trainer reads new windows every time; baselines rotate the same way
        segs = [s for _ in range(max(1, READ_SET // n)) for s in fast.append(FIELD, rows, 0,
                run="bench", step=0)]  # fmt: skip
        # page-aligned, as a pinned buffer a trainer reuses: a destination 1-63 bytes past the
        # source in its page makes the kernel's copy up to 10x slower (see _read.page_matched)
        out32 = page_aligned(n * 4).view(np.int32).reshape(len(rows), *ROW)
        out8 = page_aligned(n).reshape(len(rows), *ROW)
        buf = page_aligned(n)
        raw = self.scratch / f"pwrite-{label}.bin"  # beside the root, on its file system
        rfds = {f: os.open(self.root / f, os.O_RDONLY) for f in {s.file for s in segs}}
        turn = itertools.cycle([(rfds[s.file], s.offset) for s in segs])  # the stored bytes
        wfd = [os.open(raw, os.O_WRONLY | os.O_CREAT)]
        end = [0]
        data = rows.tobytes()

        def pwrite() -> None:
            os.pwrite(wfd[0], data, end[0])
            end[0] += n

        def new_raw_file() -> None:  # like payloadd's appends: a fresh file each sample
            os.close(wfd[0])
            raw.unlink()
            wfd[0] = os.open(raw, os.O_WRONLY | os.O_CREAT)
            end[0] = 0

        def preadv() -> None:
            fd, offset = next(turn)
            os.preadv(fd, [buf.data], offset)

        def ideal() -> None:
            fd, offset = next(turn)
            os.preadv(fd, [buf.data], offset)
            out32[...] = buf.reshape(out32.shape)

        ops: list[tuple[str, Callable[[], Any], str | None]] = [
            ("raw pwrite", pwrite, None),
            ("raw preadv", preadv, None),
            ("ideal int32 reader", ideal, None),
        ]
        for name, c in (("data plane", fast), ("http", http)):
            ops += [
                (f"append ({name})", _append(c, rows), "raw pwrite"),
                (f"read int32 out= ({name})", _read(c, segs, out32), "ideal int32 reader"),
                (f"read uint8 out= ({name})", _read(c, segs, out8), "raw preadv"),
            ]
        try:
            for r in range(self.repeat):
                # a different method goes first in each repetition: whatever the kernel still
                # does after the last clean-up does not always hit the same one
                for name, op, base in ops[r % len(ops) :] + ops[: r % len(ops)]:
                    op()  # warm: descriptors, caches, the file's pages
                    self.add(name, label, "GB/s", n / timed(op, k) / 1e9, base)
                self.drop_writes()
                new_raw_file()  # both baselines and appends start each repetition anew
        finally:
            for fd in rfds.values():
                os.close(fd)
            os.close(wfd[0])
            raw.unlink()

    def drop_writes(self) -> None:
        """Remove what the append measurements wrote, so that the kernel never starts
        throttling writers for dirty pages: every sample then measures the same thing."""
        for d in self.root.glob(f"*/{WRITE_RUN}"):
            shutil.rmtree(d, ignore_errors=True)

    # -- latency ---------------------------------------------------------------------

    def latency(self) -> None:
        one = _rows(ROW_BYTES)
        count = 100 if self.quick else 500
        for name, dp in (("data plane", True), ("http", False)):
            with PayloadClient(self.socket, data_plane=dp) as c:
                c.append(FIELD, one, 0, run=WRITE_RUN, step=1)
                for _ in range(self.repeat):
                    ts = [timed(_append(c, one), 1) for _ in range(count)]
                    self.add(f"one-row append p50, sync ({name})", "384B", "ms", pct(ts, 50), None)
                    self.add(f"one-row append p99, sync ({name})", "384B", "ms", pct(ts, 99), None)
            ts_async = asyncio.run(_async_latency(self.socket, dp, one, count, self.repeat))
            for ts in ts_async:
                self.add(f"one-row append p50, async ({name})", "384B", "ms", pct(ts, 50), None)
                self.add(f"one-row append p99, async ({name})", "384B", "ms", pct(ts, 99), None)

    # -- durability ----------------------------------------------------------------------

    def fsync_cost(self) -> None:
        """1 MiB and one-row appends under each ``--fsync`` policy, measured alike: ``never``
        on the main daemon, ``interval`` (default interval) and ``always`` each on a daemon
        of its own on the same file system; ``never`` is the baseline of the others."""
        for policy in ("never", "interval", "always"):
            if policy == "never":
                self._fsync_cost(policy, self.root, self.socket)
                continue
            root = self.root.parent / f"root-fsync-{policy}"
            socket = self.root.parent / f"fs-{policy[0]}.sock"  # AF_UNIX paths are short
            with start_daemon(root, socket, "--fsync", policy):
                self._fsync_cost(policy, root, socket)

    def _fsync_cost(self, policy: str, root: Path, socket: Path) -> None:
        rows, one = _rows(1 << 20), _rows(ROW_BYTES)
        k, count = (8, 50) if self.quick else (32, 200)
        big, small = "append, fsync {} (data plane)", "one-row append p50, fsync {} (data plane)"
        baseline = policy != "never"
        with PayloadClient(socket) as c:
            for _ in range(self.repeat):
                _append(c, rows)()  # lease held
                per_call = timed(_append(c, rows), k)
                self.add(big.format(policy), "1MiB", "GB/s", rows.nbytes / per_call / 1e9,
                         big.format("never") if baseline else None)  # fmt: skip
                ts = [timed(_append(c, one), 1) for _ in range(count)]
                self.add(small.format(policy), "384B", "ms", pct(ts, 50),
                         small.format("never") if baseline else None)  # fmt: skip
                for d in root.glob(f"*/{WRITE_RUN}"):
                    shutil.rmtree(d, ignore_errors=True)

    # -- concurrent writers ------------------------------------------------------------

    def writers(self, counts: tuple[int, ...] = (1, 4, 8)) -> None:
        rows = _rows(1 << 20)
        for _ in range(self.repeat):
            for w in counts:
                gbps = self._writers(w, rows, 8 if self.quick else 32)
                self.add(f"append, {w} writers (data plane)", "1MiB", "GB/s", gbps, None)
                self.drop_writes()

    def _writers(self, w: int, rows: np.ndarray, per_writer: int) -> float:
        clients = [PayloadClient(self.socket) for _ in range(w)]
        barrier = threading.Barrier(w + 1)

        def work(c: PayloadClient) -> None:
            barrier.wait()
            for _ in range(per_writer):
                c.append(FIELD, rows, 0, run=WRITE_RUN, step=2)

        try:
            for c in clients:
                c.append(FIELD, rows, 0, run=WRITE_RUN, step=2)  # connected, leases held
            threads = [threading.Thread(target=work, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
        finally:
            for c in clients:
                c.close()
        return w * per_writer * rows.nbytes / seconds / 1e9

    # -- each against its physical baseline (modules of their own) ----------------------

    def packed(self) -> None:
        """A packed micro batch by CP window against the direct reader (`_packed`); a
        trainer rank's step on it, a new list, routing + mask, against the direct reader and
        raw preadv (`_trainer_step`)."""
        bench_packed(self.add, self.socket, self.root, self.repeat, self.quick)
        bench_trainer_step(self.add, self.socket, self.root, self.repeat, self.quick)

    def one_rows(self) -> None:
        """Windows of N one-row segments against pread; one-row reads (`_one_row`)."""
        bench_one_rows(self.add, self.socket, self.root, self.repeat, self.quick)
        bench_one_row_reads(self.add, self.socket, self.repeat, self.quick)

    def segment_ops(self) -> None:
        """The orchestrator's segment operations against msgpack encode (`_seg_ops`)."""
        bench_segment_ops(self.add, self.repeat, self.quick)

    def new_keys(self) -> None:
        """Appends that open a new key against appends to open keys (`_appends`)."""
        bench_new_keys(self.add, self.socket, self.repeat)

    def writes(self) -> None:
        """16 MiB appends and raw pwrite variants, call by call (`_appends`)."""
        bench_writes(self.add, self.socket, self.root, self.scratch, self.repeat, self.quick)

    def http_ceiling(self) -> None:
        """payloadd's HTTP reads against a bare uvicorn app (`_http_ceiling`)."""
        bench_http_ceiling(self.add, self.socket, self.root, self.root.parent, self.repeat,
                           self.quick)  # fmt: skip

    # -- the RL batch ------------------------------------------------------------------

    def cluster(self) -> None:
        """Reads across three daemons' nodes: cross-node windows against raw loopback TCP,
        the packed micro batch over three nodes (`payloadd.bench._cluster`)."""
        bench_cluster(self.add, self.root.parent / "c", self.repeat, self.quick)

    def rl(self, spec: RLBatch) -> str | None:
        """The seed's batch inline versus by handle (see `payloadd.bench._rl`); a note if no
        pyzmq."""
        if importlib.util.find_spec("zmq") is None:
            return "the RL batch: pyzmq is not installed: pip install 'payloadd[bench]'"
        size = spec.label
        res = bench_rl(spec, self.socket, self.root.parent, self.repeat)
        for key, (label, unit) in RL_MEASURES.items():
            for value in res["inline"][key]:
                self.add(f"{label} (inline)", size, unit, value, None)
            for value in res["handle"][key]:
                self.add(f"{label} (by handle)", size, unit, value, f"{label} (inline)")
        resident = zip(res["inline"]["resident"], res["handle"]["resident"],
                       res[BARE]["resident"], strict=True)  # fmt: skip
        for inline, handle, bare in resident:
            self.add("RL orchestrator resident (no payload)", size, "MiB", bare, None)
            # the payload's part of the resident memory, by handle against inline
            if inline > bare:
                share = (handle - bare) / (inline - bare)
                self.add("RL resident payload share (by handle)", size, "x", share, None)
        return None

    def ray(self, spec: RLBatch) -> str | None:
        """The RL job end to end on Ray's object store and on payloadd; a note if no Ray."""

        def run(spec: RLBatch, socket: Path, repeat: int) -> dict[str, dict[str, list[float]]]:
            return {name: {"job": t} for name, t in bench_ray(spec, socket, repeat).items()}

        return self._peer_job(spec, ray_available(), run, {"job": ("RL job", "s")},
                              RAY, PAYLOADD)  # fmt: skip

    def transferqueue(self, spec: RLBatch) -> str | None:
        """The RL job end to end on TransferQueue and on payloadd; a note if no TransferQueue."""
        return self._peer_job(spec, transferqueue_available(), bench_transferqueue, TQ_MEASURES,
                              TQ, f"{PAYLOADD} vs TQ")  # fmt: skip

    def _peer_job(
        self,
        spec: RLBatch,
        note: str | None,
        run: Callable[[RLBatch, Path, int], dict[str, dict[str, list[float]]]],
        measures: dict[str, tuple[str, str]],
        peer: str,
        mine: str,
    ) -> str | None:
        """The RL job on ``peer`` and on payloadd (``run``), a row ``label (peer)`` and a row
        ``label (mine)`` against it per measure of ``measures`` (key to label and unit);
        ``note`` instead, if not ``None`` (the peer cannot be imported)."""
        if note is not None:
            return note
        # at most 3: every repetition writes the batch anew and nothing frees it before
        # GC; on a VM that hands freed memory back, fresh page cache costs time
        stats = run(spec, self.socket, min(self.repeat, 3))
        for key, (label, unit) in measures.items():
            base = f"{label} ({peer})"
            for value in stats[peer][key]:
                self.add(base, spec.label, unit, value, None)
            for value in stats[PAYLOADD][key]:
                self.add(f"{label} ({mine})", spec.label, unit, value, base)
        return None


def _append(c: PayloadClient, rows: np.ndarray) -> Callable[[], Any]:
    return lambda: c.append(FIELD, rows, 0, run=WRITE_RUN, step=0)


def _read(c: PayloadClient, segs: list[PayloadSegment], out: np.ndarray) -> Callable[[], Any]:
    turn = itertools.cycle([[s] for s in segs])

    def read() -> Any:
        one = next(turn)
        return c.read_field(one, FIELD, one[0].pos, one[0].pos + one[0].rows, 0, out=out)

    return read


async def _async_latency(
    socket: Path, dp: bool, one: np.ndarray, count: int, repeat: int
) -> list[list[float]]:
    out = []
    async with AsyncPayloadClient(socket, data_plane=dp) as c:
        await c.append(FIELD, one, 0, run=WRITE_RUN, step=1)
        for _ in range(repeat):
            ts = []
            for _ in range(count):
                t0 = time.perf_counter()
                await c.append(FIELD, one, 0, run=WRITE_RUN, step=1)
                ts.append(time.perf_counter() - t0)
            out.append(ts)
    return out


# -- report ---------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the figures were measured on: Python, the platform, CPUs, numpy, payloadd."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "payloadd": __version__,
    }


def report(results: list[Result]) -> list[dict[str, Any]]:
    """Rows of the table: median, min, max, and the ratio of medians to the baseline."""
    by_key = {(r.name, r.size): r for r in results}
    rows = []
    for r in results:
        base = by_key.get((r.baseline, r.size)) if r.baseline else None
        rows.append(
            {
                "name": r.name,
                "size": r.size,
                "unit": r.unit,
                "median": r.median,
                "min": min(r.samples),
                "max": max(r.samples),
                "samples": r.samples,
                "baseline": r.baseline,
                "ratio": r.median / base.median if base else None,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'measurement':44} {'size':>6} {'median':>9} {'(min-max)':>19}  {'ratio':>7}  vs"]
    for r in rows:
        span = f"({r['min']:.3g}-{r['max']:.3g})"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else ""
        lines.append(
            f"{r['name']:44} {r['size']:>6} {r['median']:>7.3g} {r['unit']:<4}{span:>16}  "
            f"{ratio:>7}  {r['baseline'] or ''}"
        )
    return "\n".join(lines)
