"""A shared payload root on GlusterFS: node ``na``'s daemon on one FUSE mount, ``nb``'s on the
other, one volume (``make check-glusterfs``; see tests/integration/glusterfs.py).

Each mount has its own client caches (FUSE attributes, GlusterFS's metadata cache, pages),
as two real nodes would: what ``na`` writes, ``nb`` sees a moment later. Every read below
starts right after the write or the collection it checks, with no pause, and every answer
is compared bit for bit or must be the error named.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    FileGoneError,
    PayloadClient,
    PayloadSegment,
    Window,
)
from payloadd.store._fs_kind import detect
from tests.conftest import Daemons
from tests.integration.glusterfs import GlusterVolume

TRANSPORTS = ["data-plane", "http"]
RUNS = 9  # of the cold and warm reads: their medians are reported
COMPUTE_S = 2.0
"""What a rank computes between two reads, in seconds: the warm read and the read after a
prefetch both come this long after the last look at the file (FUSE's and GlusterFS's
metadata caches, 1 s each, have expired for both)."""
ROW = (48, 8)  # MoE routing ids of Qwen3-30B-A3B: uint8 [tokens, 48, 8]


@dataclass
class Nodes:
    """The daemons of ``na`` (writer) and ``nb`` (reader) on the two mounts."""

    root_a: Path
    root_b: Path
    sock_a: Path
    sock_b: Path
    log_b: Path

    def a(self, transport: str = "data-plane") -> PayloadClient:
        return PayloadClient(self.sock_a, data_plane=transport == "data-plane")

    def b(self, transport: str = "data-plane") -> PayloadClient:
        return PayloadClient(self.sock_b, data_plane=transport == "data-plane")


def on_mount(gluster: GlusterVolume, daemons: Daemons, node: str) -> dict[str, Any]:
    """The options of `Daemons.run` for ``payloadd serve --node node`` on its mount (``na``:
    mount a, ``nb``: mount b): its socket on local disk (no Unix socket lives on FUSE), its
    log ``<node>.log`` beside it."""
    mount = gluster.mounts[0 if node == "na" else 1]
    log = daemons.folder / f"{node}.log"
    return {"node": node, "root": mount / "root", "log": log, "log_level": "info"}


def start_nodes(gluster: GlusterVolume, daemons: Daemons, *flags: str) -> Nodes:
    """Start both daemons with ``flags`` (until ``daemons`` closes)."""
    a = daemons.start(*flags, **on_mount(gluster, daemons, "na"))
    b = daemons.start(*flags, **on_mount(gluster, daemons, "nb"))
    return Nodes(a.root, b.root, a.socket, b.socket, daemons.folder / "nb.log")


@pytest.fixture(scope="module")
def pair(gluster: GlusterVolume, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    """Both daemons with the defaults (for a distributed file system: see the docs)."""
    with Daemons(tmp_path_factory.mktemp("defaults")) as d:
        yield start_nodes(gluster, d)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return (
        ((np.arange(n * 384, dtype=np.int64) * 7 + seed * 13) % 251)
        .astype(np.uint8)
        .reshape(n, *ROW)
    )


def new_run() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def read(c: PayloadClient, segs: list[PayloadSegment]) -> np.ndarray:
    lo = min(s.pos for s in segs)
    hi = max(s.pos + s.rows for s in segs)
    out = c.read_field(segs, "routed_experts", lo, hi, 255, dtype=np.uint8)
    assert out is not None
    return out


# -- the set-up itself ---------------------------------------------------------------------


def test_everything_listens_on_loopback_only_and_the_root_is_told_distributed(
    gluster: GlusterVolume, pair: Nodes
) -> None:
    listening = gluster.listeners()
    assert listening, "no glusterd or brick socket found"
    assert all(a.startswith("127.0.0.1:") for a in listening), listening
    kind = detect(pair.root_b)
    assert kind.distributed and kind.name == "fuse.glusterfs", kind
    log = pair.log_b.read_text()
    assert "payload root on fuse.glusterfs: distributed" in log, log[-2000:]


# -- A writes, B reads -----------------------------------------------------------------------


@pytest.mark.parametrize("read_via", TRANSPORTS)
@pytest.mark.parametrize("write_via", TRANSPORTS)
def test_a_writes_b_reads_at_once(pair: Nodes, write_via: str, read_via: str) -> None:
    run = new_run()
    with pair.a(write_via) as a, pair.b(read_via) as b:
        segs = a.append("routed_experts", rows(4096), 0, run=run, step=0)
        np.testing.assert_array_equal(read(b, segs), rows(4096))


@pytest.mark.parametrize("read_via", TRANSPORTS)
def test_a_writes_b_reads_async(pair: Nodes, read_via: str) -> None:
    async def go() -> None:
        run = new_run()
        dp = read_via == "data-plane"
        async with (
            AsyncPayloadClient(pair.sock_a, data_plane=dp) as a,
            AsyncPayloadClient(pair.sock_b, data_plane=dp) as b,
        ):
            segs = await a.append("routed_experts", rows(4096, 1), 0, run=run, step=0)
            out = await b.read_field(segs, "routed_experts", 0, 4096, 255, dtype=np.uint8)
            np.testing.assert_array_equal(out, rows(4096, 1))
            grown = await a.append("routed_experts", rows(100, 2), 4096, run=run, step=0)
            assert grown[0].file == segs[0].file  # the same file, grown after b's read
            out = await b.read_field(grown, "routed_experts", 4096, 4196, 255, dtype=np.uint8)
            np.testing.assert_array_equal(out, rows(100, 2))

    asyncio.run(go())


def grown_rounds(p: Nodes, read_via: str, rounds: int = 50) -> list[float]:
    """a appends to one file after b read it, ``rounds`` times; b reads each append at once.
    Returns the seconds each of b's reads took."""
    run = new_run()
    took = []
    with p.a("http") as a, p.b(read_via) as b:
        first = a.append("routed_experts", rows(4096), 0, run=run, step=0)
        np.testing.assert_array_equal(read(b, first), rows(4096))
        segs, pos = list(first), 4096
        for r in range(rounds):
            more = a.append("routed_experts", rows(100, r + 1), pos, run=run, step=0)
            assert more[0].file == first[0].file
            started = time.perf_counter()
            got = read(b, more)
            took.append(time.perf_counter() - started)
            np.testing.assert_array_equal(got, rows(100, r + 1))
            segs += more
            pos += 100
        whole = np.concatenate([rows(4096)] + [rows(100, r + 1) for r in range(rounds)])
        np.testing.assert_array_equal(read(b, segs), whole)
    return took


@pytest.mark.parametrize("read_via", TRANSPORTS)
def test_a_file_grown_after_b_read_it_is_read_whole_every_round(pair: Nodes, read_via: str) -> None:
    """The repro of the grown-file read failure: 0 of 50 rounds read right before the fix."""
    took = grown_rounds(pair, read_via)
    print(f"\n{read_via}: b's read of a's append took {statistics.median(took) * 1e3:.1f} ms "
          f"(median), {max(took) * 1e3:.1f} ms (max)")  # fmt: skip


def small_appends_at_once(p: Nodes, write_via: str) -> None:
    """8 writers released at once append multi-turn samples (1..40 rows) to one step and
    field; b reads each segment as soon as it is acknowledged, then all of them packed in
    one window (hundreds of segments)."""
    run, writers, per = new_run(), 8, 40
    barrier = threading.Barrier(writers + 1)
    done: list[tuple[PayloadSegment, np.ndarray]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    fresh: list[tuple[PayloadSegment, np.ndarray]] = []

    def write(w: int) -> None:
        rng = np.random.default_rng(w)
        try:
            with p.a(write_via) as a:
                barrier.wait(30)
                for k in range(per):
                    n = int(rng.integers(1, 41))
                    pos = (w * per + k) * 64
                    data = rows(n, w * 1000 + k)
                    (seg,) = a.append("routed_experts", data, pos, run=run, step=0)
                    with lock:
                        done.append((seg, data))
                        fresh.append((seg, data))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    checked = 0
    with p.b("data-plane") as b:
        barrier.wait(30)
        while any(t.is_alive() for t in threads) or fresh:
            with lock:
                batch, fresh[:] = list(fresh), []
            for seg, data in batch:  # read while the others still write the same files
                np.testing.assert_array_equal(read(b, [seg]), data)
                checked += 1
            if not batch:
                time.sleep(0.001)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert checked == writers * per
        segs = [s for s, _ in done]
        lo, hi = min(s.pos for s in segs), max(s.pos + s.rows for s in segs)
        out = b.read_field(segs, "routed_experts", lo, hi, 255, dtype=np.uint8)
        assert out is not None
        for seg, data in done:
            np.testing.assert_array_equal(out[seg.pos - lo : seg.pos - lo + seg.rows], data)


@pytest.mark.parametrize("write_via", TRANSPORTS)
def test_many_small_appends_at_once_read_back_on_b_while_and_after(
    pair: Nodes, write_via: str
) -> None:
    small_appends_at_once(pair, write_via)


# -- collected on A: gone on B -------------------------------------------------------------


def assert_gone(c: PayloadClient, segs: list[PayloadSegment], run: str) -> None:
    with pytest.raises(FileGoneError, match=f"run '{run}'"):
        read(c, segs)


@pytest.mark.parametrize("read_via", TRANSPORTS)
def test_a_step_collected_on_a_reads_gone_on_b_at_once(pair: Nodes, read_via: str) -> None:
    run = new_run()
    with pair.a("http") as a, pair.b(read_via) as b:
        segs = a.append("routed_experts", rows(512), 0, run=run, step=0)
        keep = a.append("routed_experts", rows(64, 5), 0, run=run, step=1)
        for _ in range(3):  # b's daemon and client have it open, its pages cached
            np.testing.assert_array_equal(read(b, segs), rows(512))
        report = a.gc(run=run, through_step=0)
        assert report.files == 1 and report.steps == [(run, 0)]
        for _ in range(20):  # never the old rows, never fill
            assert_gone(b, segs, run)
            time.sleep(0.05)
        np.testing.assert_array_equal(read(b, keep), rows(64, 5))


def test_a_step_expired_by_ttl_on_a_reads_gone_on_b(pair: Nodes) -> None:
    run = new_run()
    with pair.a("http") as a, pair.b("data-plane") as b, pair.b("http") as bh:
        segs = a.append("routed_experts", rows(256), 0, run=run, step=0)
        np.testing.assert_array_equal(read(b, segs), rows(256))
        time.sleep(2.5)  # the files and the run idle for longer than the age rule below
        report = a.gc(ttl_s=2.0)
        assert (run, 0) in report.steps and report.by_reason["ttl"].files >= 1
        assert_gone(b, segs, run)
        assert_gone(bh, segs, run)


# -- restarts ------------------------------------------------------------------------------


def test_each_daemon_restarted_serves_what_it_acknowledged(
    gluster: GlusterVolume, daemons: Daemons
) -> None:
    run = new_run()
    na, nb = on_mount(gluster, daemons, "na"), on_mount(gluster, daemons, "nb")
    with daemons.run(**nb) as sb:
        with daemons.run(**na) as sa, PayloadClient(sa.socket) as a:
            first = a.append("routed_experts", rows(300), 0, run=run, step=0)
        # a stopped: b still reads a's files
        with PayloadClient(sb.socket) as b:
            np.testing.assert_array_equal(read(b, first), rows(300))
        with daemons.run(**na) as sa, PayloadClient(sa.socket) as a:
            second = a.append("routed_experts", rows(200, 1), 300, run=run, step=0)
            assert second[0].file != first[0].file  # a restarted daemon appends to new files
            with PayloadClient(sb.socket) as b:
                both = np.concatenate([rows(300), rows(200, 1)])
                np.testing.assert_array_equal(read(b, first + second), both)
            np.testing.assert_array_equal(read(a, first + second), both)
    with daemons.run(**nb) as sb, PayloadClient(sb.socket) as b:  # b restarted
        np.testing.assert_array_equal(read(b, first + second), both)
        theirs = b.append("routed_experts", rows(10, 2), 0, run=run, step=0)
    with daemons.run(**na) as sa, PayloadClient(sa.socket) as a:
        np.testing.assert_array_equal(read(a, theirs), rows(10, 2))


# -- every fsync x foreign_reads mode --------------------------------------------------------


@pytest.mark.parametrize("foreign_reads", ["cached", "reopen"])
@pytest.mark.parametrize("fsync", ["never", "interval", "always"])
def test_every_mode_reads_growth_and_collection_right(
    gluster: GlusterVolume, daemons: Daemons, fsync: str, foreign_reads: str
) -> None:
    flags = ("--fsync", fsync, "--foreign-reads", foreign_reads)
    p = start_nodes(gluster, daemons, *flags)
    for via in TRANSPORTS:
        run = new_run()
        with p.a(via) as a, p.b(via) as b, p.b("http" if via != "http" else via) as bh:
            first = a.append("routed_experts", rows(1024), 0, run=run, step=0)
            np.testing.assert_array_equal(read(b, first), rows(1024))
            segs, pos = list(first), 1024
            for r in range(10):
                more = a.append("routed_experts", rows(50, r + 1), pos, run=run, step=0)
                np.testing.assert_array_equal(read(b, more), rows(50, r + 1))
                segs, pos = segs + more, pos + 50
            a.gc(run=run, through_step=0)
            assert_gone(b, segs, run)
            assert_gone(bh, segs, run)


# -- cold and warm reads ---------------------------------------------------------------------


def _timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def test_cold_warm_and_prefetched_reads_are_measured(gluster: GlusterVolume, pair: Nodes) -> None:
    """A rank's micro batch of 256 multi-turn samples (96 MiB of routing ids), read through
    ``nb``'s mount: raw pread of the same bytes, and payloadd's data plane, warm and cold, and
    cold after a prefetch that finished while the rank "computed" (medians of `RUNS`). Figures go to
    ``$PAYLOADD_GLUSTERFS_REPORT`` (JSON) and the test's output; only the bytes are
    asserted (speed is measured, not asserted)."""
    run = new_run()
    samples, tokens = 256, 1024
    with pair.a("http") as a:
        segs = [
            a.append("routed_experts", rows(tokens, i), i * tokens, run=run, step=0)[0]
            for i in range(samples)
        ]
    files = sorted({s.file for s in segs})
    paths = [pair.root_b / f for f in files]
    nbytes = samples * tokens * 384
    expect = np.concatenate([rows(tokens, i) for i in range(samples)])
    out = np.empty_like(expect)  # the stored dtype, no conversion: the read's cost alone
    window = [Window(segs, "routed_experts", 0, samples * tokens, 255, out, np.uint8)]
    time.sleep(2.5)  # b's caches have caught up with a's writes: sizes are b's to see

    def raw() -> None:
        got = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                buf = bytearray(8 << 20)
                at = 0
                while at < size:
                    n = os.preadv(fd, [memoryview(buf)[: min(len(buf), size - at)]], at)
                    assert n > 0
                    at += n
                got += at
            finally:
                os.close(fd)
        assert got >= nbytes

    figures: dict[str, list[float]] = {k: [] for k in
        ("raw_warm", "raw_cold", "payloadd_warm_at_once", "payloadd_warm", "payloadd_cold",
         "payloadd_prefetched", "prefetch_s")}  # fmt: skip
    with pair.b("data-plane") as b:

        def ours() -> None:
            b.read_many(window)

        def check() -> None:
            np.testing.assert_array_equal(out, expect)
            out.fill(0)

        for _ in range(RUNS):
            raw()
            figures["raw_warm"].append(_timed(raw))
            gluster.drop_caches(*paths)
            figures["raw_cold"].append(_timed(raw))
            ours()
            figures["payloadd_warm_at_once"].append(_timed(ours))
            time.sleep(COMPUTE_S)  # the rank computes: the metadata caches expire
            figures["payloadd_warm"].append(_timed(ours))
            check()
            gluster.drop_caches(*paths)
            figures["payloadd_cold"].append(_timed(ours))
            check()
            gluster.drop_caches(*paths)
            before = b.stats().bytes_prefetched
            started = time.monotonic()
            queued = b.prefetch(window)
            assert queued.bytes == nbytes and queued.files == len(files)
            while b.stats().bytes_prefetched < before + queued.bytes:  # the rank computes
                assert time.monotonic() < started + 120, "the read-ahead did not finish"
                time.sleep(0.01)
            ahead = time.monotonic() - started
            figures["prefetch_s"].append(ahead)
            time.sleep(max(0.0, COMPUTE_S - ahead))  # as long as before the warm read
            figures["payloadd_prefetched"].append(_timed(ours))
            check()
    med = {k: statistics.median(v) for k, v in figures.items()}
    mbs = {k: nbytes / v / 1e6 for k, v in med.items() if k != "prefetch_s"}
    report = {
        "bytes": nbytes,
        "segments": samples,
        "files": len(files),
        "runs": RUNS,
        "median_s": med,
        "MB_per_s": mbs,
        "prefetched_vs_warm": med["payloadd_warm"] / med["payloadd_prefetched"],
        "cold_vs_warm": med["payloadd_warm"] / med["payloadd_cold"],
        "payloadd_warm_vs_raw_warm": med["raw_warm"] / med["payloadd_warm"],
        "kernel": subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip(),
    }
    print(json.dumps(report, indent=2))
    path = os.environ.get("PAYLOADD_GLUSTERFS_REPORT")
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


# -- without GlusterFS's metadata cache ------------------------------------------------------


def test_without_the_metadata_cache_reads_wait_less_and_are_as_right(
    gluster: GlusterVolume, pair: Nodes
) -> None:
    """``performance.stat-prefetch off`` (md-cache): a mount sees another mount's sizes at
    once instead of a second later; everything above still holds (last: it changes the
    volume for the tests after it)."""
    gluster.set("performance.stat-prefetch", "off")
    try:
        time.sleep(3)  # the clients switch to the new graph
        for via in TRANSPORTS:
            took = grown_rounds(pair, via)
            print(f"\nno md-cache, {via}: b's read of a's append took "
                  f"{statistics.median(took) * 1e3:.1f} ms (median), {max(took) * 1e3:.1f} ms (max)")  # fmt: skip
            small_appends_at_once(pair, via)
            run = new_run()
            with pair.a("http") as a, pair.b(via) as b:
                segs = a.append("routed_experts", rows(512), 0, run=run, step=0)
                np.testing.assert_array_equal(read(b, segs), rows(512))
                a.gc(run=run, through_step=0)
                assert_gone(b, segs, run)
    finally:
        gluster.reset("performance.stat-prefetch")
