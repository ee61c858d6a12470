"""A shared root read as a distributed file system would need it, without one: the file-system
kind and its defaults, reads of another node's file that grows late, another node's ledger
consulted before its files are served, the GC's grace, one writer a shared file, and the
read-ahead of windows (``prefetch``).

On this machine's local disk two daemons share one page cache, so the lag of a distributed
file system (GlusterFS: tests/integration, ``make check-glusterfs``) is made for real here:
a segment whose bytes reach the file only later (a writer that is slow, as another node's
view of a file is), a step listed in its node's ledger while its file is still on disk (as
other nodes see it during the GC's grace, or through their caches), and a file kept linked
elsewhere so that a descriptor of it never shows it removed (as FUSE and NFS clients do).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    Prefetched,
    SegmentFileError,
)
from payload_client.wire._http import AppendItem, Extent, GcReport, GcRequest
from payloadd import Store
from payloadd.store._fs_kind import FsKind, RootPolicy, _mount_of, detect
from payloadd.store._gc import GarbageCollector
from payloadd.store._ledger import LEDGER_NAME, Ledger
from tests.conftest import Daemons, wait_until

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

ROW = 384  # uint8 [48, 8]

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
45 27 0:40 / /mnt/gv rw,relatime - fuse.glusterfs host:/vol rw,user_id=0
46 45 0:41 / /mnt/gv/nfs rw,relatime - nfs4 srv:/export rw,vers=4.2
47 27 0:42 / /mnt/with\\040space rw - lustre 10.0.0.1@tcp:/fs rw
48 27 0:43 / /mnt/odd rw - weirdfs none rw
"""


def item(rows: int, pos: int = 0, run: str = "r", step: int = 0) -> AppendItem:
    return AppendItem("routed_experts", "uint8", [48, 8], rows, pos, run, step)


def distributed(wait: float = 2.0, grace: float = 0.0, reads: str = "reopen") -> RootPolicy:
    kind = FsKind("fuse.glusterfs", 0x65735546, "/", True)
    return RootPolicy.for_kind(kind, reads, wait, grace)  # type: ignore[arg-type]


# -- the kind and its defaults --------------------------------------------------------------


def test_the_mount_a_path_is_on_is_the_deepest_one_that_holds_it() -> None:
    assert _mount_of("/mnt/gv/run/3", MOUNTINFO) == ("/mnt/gv", "fuse.glusterfs")
    assert _mount_of("/mnt/gv/nfs/x", MOUNTINFO) == ("/mnt/gv/nfs", "nfs4")
    assert _mount_of("/mnt/gvx", MOUNTINFO) == ("/", "ext4")  # a prefix, not a parent
    assert _mount_of("/mnt/with space/a", MOUNTINFO) == ("/mnt/with space", "lustre")


def test_local_disks_are_local_and_everything_else_distributed(tmp_path: Path) -> None:
    here = detect(tmp_path)
    assert not here.distributed and here.magic != 0, here
    shm = detect("/dev/shm")
    assert not shm.distributed and shm.name == "tmpfs", shm
    # where statfs says nothing the mount table decides; unknown kinds count as distributed
    for path, name, dist in [("/mnt/gv/a", "fuse.glusterfs", True), ("/mnt/odd", "weirdfs", True)]:
        kind = detect(path, MOUNTINFO)
        if kind.magic == 0:  # the path does not exist here: by the mount table alone
            assert (kind.name, kind.distributed) == (name, dist)


def test_the_defaults_follow_the_kind_and_what_is_set_wins() -> None:
    local = RootPolicy.for_kind(FsKind("ext4", 0xEF53, "/", False))
    assert (local.foreign_reads, local.foreign_wait_s, local.gc_grace_s) == ("cached", 0.0, 0.0)
    assert not local.one_writer and local.client_keeps_foreign
    d = RootPolicy.for_kind(FsKind("nfs4", 0x6969, "/", True))
    assert (d.foreign_reads, d.foreign_wait_s, d.gc_grace_s) == ("reopen", 5.0, 2.5)
    assert (
        d.one_writer
        and not d.client_keeps_foreign
        and d.warnings(FsKind("nfs4", 0, "", True)) == []
    )
    set_ = RootPolicy.for_kind(FsKind("nfs4", 0x6969, "/", True), "cached", 0.0, 0.0)
    assert set_.foreign_reads == "cached" and not set_.client_keeps_foreign
    said = " ".join(set_.warnings(FsKind("nfs4", 0x6969, "/", True)))
    assert "foreign_wait_s is 0" in said and "gc_grace_s is 0" in said


def test_the_daemon_says_what_its_root_is_and_takes_the_kind_as_a_setting(
    tmp_path: Path, daemons: Daemons
) -> None:
    log = tmp_path / "log"
    with daemons.run(socket=tmp_path / "s", log=log, log_level="info"):
        pass
    assert "payload root on ext4: local; other nodes' files kept open" in log.read_text()
    log = tmp_path / "log-distributed"
    distributed = ("--root-fs", "distributed", "--gc-grace-s", "0")
    with daemons.run(*distributed, socket=tmp_path / "s", log=log, log_level="info"):
        pass
    text = log.read_text()
    assert "distributed; other nodes' files opened anew at every read, waited for up to 5 s" in text
    assert "gc_grace_s is 0: for a moment after a collection" in text
    bad = subprocess.run(
        [sys.executable, "-m", "payloadd", "serve", "--root", str(tmp_path), "--root-fs", "nfs"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--root-fs" in bad.stderr


# -- a segment past the end this node sees ---------------------------------------------------


def grow_later(path: Path, data: bytes, at: int, after: float) -> threading.Thread:
    """Write ``data`` at ``at`` of ``path`` ``after`` seconds from now, in a thread."""

    def go() -> None:
        time.sleep(after)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, at)
        finally:
            os.close(fd)

    t = threading.Thread(target=go)
    t.start()
    return t


@pytest.mark.parametrize("reads", ["cached", "reopen"])
def test_a_read_waits_for_another_nodes_file_to_show_a_segment(tmp_path: Path, reads: str) -> None:
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(wait=5.0, reads=reads))
    (first,) = a.append([item(2)], bytes(range(256)) * 3)
    seg = first[0]
    assert b.read_extents([Extent(seg.file, 0, 2 * ROW, 2 * ROW)]) == bytes(range(256)) * 3
    more = bytes([7]) * ROW  # a segment of a's that b's view does not show yet
    t = grow_later(tmp_path / seg.file, more, 2 * ROW, 0.3)
    started = time.monotonic()
    got = b.read_extents([Extent(seg.file, 2 * ROW, ROW, 3 * ROW)])
    t.join()
    assert got == more and time.monotonic() - started >= 0.25
    # the wait has a bound: a segment that never comes fails once it is over
    started = time.monotonic()
    with pytest.raises(SegmentFileError, match="bytes but a segment ends at byte"):
        b.read_extents([Extent(seg.file, 0, ROW, 9 * ROW)])
    assert 4.5 < time.monotonic() - started < 30
    b.close()
    a.close()


def test_without_a_wait_a_late_segment_fails_at_once(tmp_path: Path) -> None:
    a, b = Store(tmp_path, "a"), Store(tmp_path, "b")  # local: no wait
    (first,) = a.append([item(1)], bytes(ROW))
    started = time.monotonic()
    with pytest.raises(SegmentFileError):
        b.read_extents([Extent(first[0].file, 0, ROW, 2 * ROW)])
    assert time.monotonic() - started < 1.0


def test_a_read_over_http_of_a_late_segment_waits_off_the_event_loop(
    tmp_path: Path, daemons: Daemons
) -> None:
    """While one read waits for a's file, the daemon answers everything else."""
    root = tmp_path / "root"
    daemons.start(node="a")
    daemons.start("--root-fs", "distributed", node="b")
    with (
        PayloadClient(tmp_path / "a.sock") as a,
        PayloadClient(tmp_path / "b.sock", data_plane=False) as b,
        PayloadClient(tmp_path / "b.sock", data_plane=False) as other,
    ):
        (seg,) = a.append("routed_experts", np.full((2, 48, 8), 3, np.uint8), 0, run="r", step=0)
        late = seg.__class__(seg.field, seg.file, seg.offset + 2 * ROW, 2, 1, seg.dtype, seg.shape)
        t = grow_later(root / seg.file, bytes([9]) * ROW, 2 * ROW, 1.0)
        result: list[object] = []
        reader = threading.Thread(
            target=lambda: result.append(b.read_field([late], "routed_experts", 2, 3, 0))
        )
        reader.start()
        time.sleep(0.2)  # the read is in flight, waiting for a's file (nothing shows it)
        started = time.monotonic()
        assert other.health().status == "ok"  # not behind the waiting read
        assert time.monotonic() - started < 0.5 and reader.is_alive()
        reader.join(30)
        t.join()
        out = result[0]
        assert isinstance(out, np.ndarray) and (out == 9).all()


# -- another node's ledger, consulted before its files are served ---------------------------


def listed_but_on_disk(root: Path, a: Store, run: str) -> list[Extent]:
    """A step of node a's that a's ledger lists as collected while its file is still there
    (as other nodes see it during a's GC grace, or through their caches)."""
    (segs,) = a.append([item(4, run=run)], bytes(range(256)) * 6)
    seg = segs[0]
    Ledger(root / "a" / LEDGER_NAME).record(run, "watermark", [seg.file], 4 * ROW)
    assert (root / seg.file).exists()
    return [Extent(seg.file, 0, 4 * ROW, 4 * ROW)]


@pytest.mark.parametrize("reads", ["cached", "reopen"])
def test_another_nodes_ledger_is_consulted_before_its_files_are_read(
    tmp_path: Path, reads: str
) -> None:
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(reads=reads))
    (segs,) = a.append([item(4, run="kept")], bytes(4 * ROW))
    kept = [Extent(segs[0].file, 0, 4 * ROW, 4 * ROW)]
    assert b.read_extents(kept) == bytes(4 * ROW)  # cached under "cached"
    gone = listed_but_on_disk(tmp_path, a, "r1")
    with pytest.raises(FileGoneError, match="step 0 of run 'r1' was garbage-collected"):
        b.read_extents(gone)
    Ledger(tmp_path / "a" / LEDGER_NAME).record("kept", "watermark", [segs[0].file], 4 * ROW)
    with pytest.raises(FileGoneError, match="run 'kept'"):  # its descriptor was cached
        b.read_extents(kept)
    # a's own daemon serves its own files by its own GC (which removes them after the line)
    assert a.read_extents(gone) == bytes(range(256)) * 6
    a.close()
    b.close()


@pytest.mark.parametrize("transport", ["data-plane", "http"])
def test_a_collection_on_a_reads_gone_on_b_where_b_still_sees_the_file(
    tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    """b's client and daemon had a's file open; a's GC removes it, but a link elsewhere
    keeps it alive (as a FUSE or NFS client still shows a removed file): b answers 410."""
    root = tmp_path / "root"
    daemons.start(node="a")
    daemons.start("--root-fs", "distributed", node="b")
    with (
        PayloadClient(tmp_path / "a.sock") as a,
        PayloadClient(tmp_path / "b.sock", data_plane=transport == "data-plane") as b,
    ):
        data = np.arange(8 * ROW, dtype=np.uint8).reshape(8, 48, 8)
        segs = a.append("routed_experts", data, 0, run="r", step=0)
        for _ in range(2):
            np.testing.assert_array_equal(b.read_field(segs, "routed_experts", 0, 8, 0), data)
        os.link(root / segs[0].file, tmp_path / "still-linked")
        assert a.gc(run="r", through_step=0).files == 1
        with pytest.raises(FileGoneError, match="run 'r'"):
            b.read_field(segs, "routed_experts", 0, 8, 0)


def test_the_gc_grace_puts_the_ledger_line_first_and_other_nodes_answer_410(
    tmp_path: Path, daemons: Daemons
) -> None:
    root = tmp_path / "root"
    daemons.start("--gc-grace-s", "1.5", node="a")
    daemons.start("--root-fs", "distributed", node="b")
    with (
        PayloadClient(tmp_path / "a.sock") as a,
        PayloadClient(tmp_path / "b.sock", data_plane=False) as b,
    ):
        segs = a.append("routed_experts", np.ones((4, 48, 8), np.uint8), 0, run="r", step=0)
        done: list[float] = []
        started = time.monotonic()
        gc = threading.Thread(target=lambda: done.append(a.gc(run="r", through_step=0).files))
        gc.start()
        ledger = root / "a" / LEDGER_NAME
        wait_until(lambda: _has_a_line(ledger), timeout=10, what="a's ledger line")
        assert (root / segs[0].file).exists()  # the grace: listed, not removed yet
        with pytest.raises(FileGoneError):
            b.read_field(segs, "routed_experts", 0, 4, 0)
        gc.join(30)
        assert done == [1] and time.monotonic() - started >= 1.5
        assert not (root / segs[0].file).exists()


def _has_a_line(ledger: Path) -> bool:
    return ledger.exists() and b"\n" in ledger.read_bytes()


# -- one writer a shared file -----------------------------------------------------------------


def test_under_one_writer_appends_at_once_never_share_a_file(tmp_path: Path) -> None:
    one = Store(tmp_path / "d", "n", policy=distributed())
    shared = Store(tmp_path / "l", "n")  # local: appends at once share the current file
    for store, apart in ((one, True), (shared, False)):
        p1 = store.begin_append([item(1)])
        p2 = store.begin_append([item(1)])  # p1 has not written yet
        assert (set(p1.files) != set(p2.files)) == apart
        for p in (p2, p1):
            p.write(bytes(ROW))
            p.commit()
        p3 = store.begin_append([item(1)])  # nobody writes now: a current file again
        assert p3.files[0] in {*p1.files, *p2.files}
        p3.write(bytes(ROW))
        p3.commit()
        assert store.stats().files_open_for_append == (2 if apart else 1)
        store.close()


def test_under_one_writer_threads_released_at_once_read_back_whole(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", policy=distributed())
    barrier = threading.Barrier(8)
    out: dict[int, list[list[list[PayloadSegment]]]] = {}

    def write(w: int) -> None:
        barrier.wait(10)
        out[w] = [store.append([item(3, pos=w * 100 + k)], bytes([w]) * 3 * ROW) for k in range(20)]

    threads = [threading.Thread(target=write, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for w, appends in out.items():
        for (segs,) in appends:
            (s,) = segs
            assert (
                store.read_extents([Extent(s.file, s.offset, 3 * ROW, s.offset + 3 * ROW)])
                == bytes([w]) * 3 * ROW
            )
    assert len(out) == 8
    store.close()


# -- prefetch ------------------------------------------------------------------------------


@pytest.fixture()
def prefetch_daemon(daemons: Daemons) -> tuple[Path, Path]:
    d = daemons.start("--node", "n")
    return d.root, d.socket


@pytest.mark.parametrize("transport", ["data-plane", "http"])
def test_prefetch_queues_the_windows_bytes_and_reads_them_ahead(
    prefetch_daemon: tuple[Path, Path], transport: str
) -> None:
    _, sock = prefetch_daemon
    with PayloadClient(sock, data_plane=transport == "data-plane") as c:
        data = np.arange(64 * ROW, dtype=np.uint8).reshape(64, 48, 8)
        segs = [c.append("routed_experts", data[i * 8 : i * 8 + 8], i * 8, run="r", step=0)[0]
                for i in range(8)]  # fmt: skip
        window = (segs, "routed_experts", 4, 60, 0)
        before = c.stats()
        got = c.prefetch([window])
        assert got == Prefetched(1, 56 * ROW)  # one file; the window's bytes, merged
        wanted = before.bytes_prefetched + 56 * ROW
        wait_until(lambda: c.stats().bytes_prefetched >= wanted, 10, "the bytes read ahead")
        after = c.stats()
        assert after.prefetches == before.prefetches + 1
        assert c.prefetch([]) == Prefetched(0, 0)  # nothing to ask: no call
        assert c.prefetch([(segs, "routed_experts", 100, 200, 0)]) == Prefetched(0, 0)
        assert c.stats().prefetches == after.prefetches
        (out,) = c.read_many([window])
        np.testing.assert_array_equal(out, data[4:60])


def test_prefetch_errors_are_a_reads_errors(prefetch_daemon: tuple[Path, Path]) -> None:
    _, sock = prefetch_daemon
    with PayloadClient(sock) as c:
        segs = c.append("routed_experts", np.ones((4, 48, 8), np.uint8), 0, run="r", step=0)
        with pytest.raises(InvalidRequestError, match="window"):
            c.prefetch([(segs, "routed_experts", 0)])  # type: ignore[list-item]
        with pytest.raises(InvalidRequestError, match="windows must be a list"):
            c.prefetch((segs, "routed_experts", 0, 4, 0))  # type: ignore[arg-type]
        c.gc(run="r", through_step=0)
        with pytest.raises(FileGoneError, match="run 'r'"):
            c.prefetch([(segs, "routed_experts", 0, 4, 0)])


def test_prefetch_queues_what_fits_and_leaves_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path, "n")
    extents = []
    for step in range(40):  # 40 files: more than are queued at once
        (segs,) = store.append([item(1, step=step)], bytes(ROW))
        extents.append(Extent(segs[0].file, 0, ROW, ROW))
    store.prefetcher.max_pending_files = 4
    with store.prefetcher._cv:  # the read-ahead thread waits: the queue stays full
        files, nbytes = store.prefetcher.submit(extents)
    assert (files, nbytes) == (4, 4 * ROW)
    store.close()
    assert store.prefetcher.pending() == 0


def test_prefetch_async(prefetch_daemon: tuple[Path, Path]) -> None:
    _, sock = prefetch_daemon

    async def go() -> Prefetched:
        async with AsyncPayloadClient(sock) as c:
            segs = await c.append(
                "routed_experts", np.ones((4, 48, 8), np.uint8), 0, run="r", step=1
            )
            return await c.prefetch([(segs, "routed_experts", 0, 4, 0)])

    assert asyncio.run(go()) == Prefetched(1, 4 * ROW)


# -- what a collection lists is what it removes ----------------------------------------------


def ledger_files(root: Path, node: str) -> set[str]:
    led, _ = Ledger(root / node / LEDGER_NAME).recent(1000)
    return {f for c in led for f in c.files}


def test_a_file_kept_in_use_by_a_collection_is_not_listed_and_reads_everywhere(
    tmp_path: Path,
) -> None:
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(wait=0.5))
    a.append([item(1)], bytes(ROW))
    pending = a.begin_append([item(1, pos=1)])  # in flight in the step's file
    report = GarbageCollector(a, 0.0, 0.0).collect(GcRequest(run="r", through_step=0))
    assert (report.files, report.in_use) == (0, 1)
    pending.write(bytes([5]) * ROW)
    ((s,),) = pending.commit()
    pending.close()
    assert s.file not in ledger_files(tmp_path, "a")
    extent = [Extent(s.file, s.offset, ROW, s.offset + ROW)]
    assert b.read_extents(extent) == a.read_extents(extent) == bytes([5]) * ROW
    a.close()
    b.close()


def test_a_run_used_during_the_grace_is_collected_as_planned_listed_and_removed(
    tmp_path: Path,
) -> None:
    """The age rule decides before its ledger line: a read during the grace does not make
    it keep files the line lists (other nodes would answer 410 for files still there)."""
    a = Store(tmp_path, "a")
    ((s,),) = a.append([item(1)], bytes([7]) * ROW)
    hour_ago = time.time() - 3600
    os.utime(tmp_path / s.file, (hour_ago, hour_ago))
    a.last_used["r"] = time.monotonic() - 3600
    gc = GarbageCollector(a, 0.0, grace_s=1.0)
    reports: list[GcReport] = []
    t = threading.Thread(target=lambda: reports.append(gc.collect(GcRequest(ttl_s=60))))
    t.start()
    wait_until(lambda: _has_a_line(tmp_path / "a" / LEDGER_NAME), 10, "the ledger line")
    extent = [Extent(s.file, s.offset, ROW, s.offset + ROW)]
    assert a.read_extents(extent) == bytes([7]) * ROW  # during the grace: still there
    t.join(30)
    assert reports[0].steps == [("r", 0)] and not (tmp_path / s.file).exists()
    assert s.file in ledger_files(tmp_path, "a")
    a.close()


def test_the_grace_is_waited_once_a_collection_whatever_its_steps(tmp_path: Path) -> None:
    a = Store(tmp_path, "a")
    hour_ago = time.time() - 3600
    for step in range(6):
        ((s,),) = a.append([item(1, step=step)], bytes(ROW))
        os.utime(tmp_path / s.file, (hour_ago, hour_ago))
    a.last_used["r"] = time.monotonic() - 3600
    started = time.monotonic()
    report = GarbageCollector(a, 0.0, grace_s=0.5).collect(GcRequest(ttl_s=60))
    took = time.monotonic() - started
    assert len(report.steps) == 6 and 0.5 <= took < 2.5, took
    a.close()


# -- bounds of the wait, the read-ahead and the spares ---------------------------------------


def test_a_path_no_file_of_another_node_can_have_is_answered_at_once(tmp_path: Path) -> None:
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(wait=5.0))
    a.append([item(1)], bytes(ROW))
    for rel in ("a/@gc-ledger.jsonl", "nobody/r/0/f-00000000-000001.bin", "a/r/x.bin"):
        started = time.monotonic()
        with pytest.raises(FileMissingError):
            b.read_extents([Extent(rel, 0, 1, 1)])
        assert time.monotonic() - started < 1.0, rel
    a.close()
    b.close()


def test_a_read_of_several_late_files_waits_once_for_all(tmp_path: Path) -> None:
    """Three files whose segments come 0.6 s apart: each would come within a wait of its
    own, but a request waits ``foreign_wait_s`` in all (so a thread is not held for a wait
    per file)."""
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(wait=1.0))
    extents, growers = [], []
    for step in range(3):
        (segs,) = a.append([item(1, step=step)], bytes(ROW))
        extents.append(Extent(segs[0].file, ROW, ROW, 2 * ROW))
        growers.append(grow_later(tmp_path / segs[0].file, bytes(ROW), ROW, 0.6 * (step + 1)))
    started = time.monotonic()
    with pytest.raises(SegmentFileError):
        b.read_extents(extents)
    assert time.monotonic() - started < 1.5
    for t in growers:
        t.join()
    assert b.read_extents(extents) == bytes(3 * ROW)  # all there now
    a.close()
    b.close()


def test_prefetch_holds_no_descriptor_while_queued_and_checks_only_what_it_queues(
    tmp_path: Path,
) -> None:
    a = Store(tmp_path, "a")
    b = Store(tmp_path, "b", policy=distributed(reads="reopen"))  # b keeps no descriptor of a's
    extents = []
    for step in range(200):
        (segs,) = a.append([item(1, step=step)], bytes(ROW))
        extents.append(Extent(segs[0].file, 0, ROW, ROW))
    gone = Extent("a/r/7/routed_experts-00000000-999999.bin", 0, ROW, ROW)  # beyond the queue
    before = len(os.listdir("/proc/self/fd"))
    with b.prefetcher._cv:  # the read-ahead thread waits: the queue stays full
        files, nbytes = b.prefetcher.submit([*extents, gone])
        held = len(os.listdir("/proc/self/fd")) - before
    assert (files, nbytes) == (16, 16 * ROW) and held <= 1, held
    a.close()
    b.close()


def test_spare_files_count_against_the_append_files_share(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", policy=distributed(), append_files=2)
    pending = [store.begin_append([item(1, pos=i)]) for i in range(8)]  # 8 at once: 8 files
    assert len({p.files[0] for p in pending}) == 8
    for p in pending:
        p.write(bytes(ROW))
        p.commit()
        p.close()
    appending, _, _ = store.open_descriptors()
    assert store.stats().files_open_for_append <= 2 and appending <= 2
    store.close()


def test_under_one_writer_a_range_given_up_is_not_taken_back(tmp_path: Path) -> None:
    for policy, back in ((distributed(), False), (None, True)):
        store = Store(tmp_path / str(back), "n", policy=policy)
        (first,) = store.append([item(1)], bytes(ROW))
        gave_up = store.begin_append([item(1, pos=1)])
        gave_up.write(bytes([9]) * (ROW // 2))  # half written, then the append fails
        gave_up.close()
        (after,) = store.append([item(1, pos=1)], bytes([3]) * ROW)
        assert after[0].file == first[0].file
        assert (after[0].offset == ROW) == back  # taken back only where one cache reads
        store.close()


def test_collections_at_once_wait_their_graces_together(tmp_path: Path) -> None:
    a = Store(tmp_path, "a")
    for run in ("r1", "r2", "r3"):
        a.append([item(1, run=run)], bytes(ROW))
    gc = GarbageCollector(a, 0.0, grace_s=1.0)
    barrier = threading.Barrier(3)
    reports: list[GcReport] = []

    def collect(run: str) -> None:
        barrier.wait(10)
        reports.append(gc.collect(GcRequest(run=run, through_step=0)))

    threads = [threading.Thread(target=collect, args=(r,)) for r in ("r1", "r2", "r3")]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r.files for r in reports) == [1, 1, 1]
    assert time.monotonic() - started < 2.5  # not one grace after the other (3 s)
    a.close()
