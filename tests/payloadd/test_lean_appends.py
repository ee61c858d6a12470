"""Data-plane appends without a round trip and without an ``fstat``: the removal generation
the daemon moves when it removes files, and the leases a new step takes in one round trip.

Real daemons on real sockets; the client's periodic checks of its descriptors and its notes
of runs in use are pushed out of the way, so that only the generation can tell a client that
its lease's file went.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import (
    FileGoneError,
    PayloadClient,
    PayloadSegment,
    StepCollectedError,
    StorageFullError,
)
from payload_client.transports.dataplane import _descriptors
from payload_client.transports.dataplane._appends import _removed
from payload_client.wire._dataplane import DATA_SOCKET_SUFFIX, FieldsReply, FieldsRequest
from payload_client.wire._frames import FRAME_PREFIX
from payloadd import Store
from payloadd.store._leases import AHEAD_ROOM
from tests.conftest import Daemon, Daemons, wait_until

R, M = "routed_experts", "sampling_mask"


@pytest.fixture(autouse=True)
def _no_periodic_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    # no look at every descriptor each second, no note of runs in use: what a client knows
    # of removed files comes from the generation only, and requests are counted exactly
    monkeypatch.setattr(_descriptors, "DROP_REMOVED_S", 1e9)
    monkeypatch.setattr(_descriptors, "TELL_USE_S", 1e9)


def rows(value: int, n: int = 2) -> np.ndarray:
    return np.full((n, 48, 8), value % 256, np.uint8)


def unique_run() -> str:
    return f"lean-{uuid.uuid4().hex[:8]}"


def read(c: PayloadClient, seg: PayloadSegment) -> np.ndarray:
    out = c.read_field([seg], seg.field, seg.pos, seg.pos + seg.rows, 0, dtype=np.uint8)
    assert out is not None
    return out


def test_an_append_after_a_deletion_of_its_lease_file_writes_a_new_file(
    daemon: Daemon,
) -> None:
    run = unique_run()
    with PayloadClient(daemon.socket) as c:
        (first,) = c.append(R, rows(1), 0, run=run, step=0)
        assert c.delete_run(run).files == 1  # the lease's file goes; the client still holds it
        (second,) = c.append(R, rows(2), 0, run=run, step=0)  # same key, room left in the lease
        assert second.file != first.file  # not into the removed file: a new lease
        np.testing.assert_array_equal(read(c, second), rows(2))
        with pytest.raises(FileGoneError):
            read(c, first)


def test_an_append_into_a_lease_of_a_collected_step_is_refused(daemon: Daemon) -> None:
    run = unique_run()
    with PayloadClient(daemon.socket) as c:
        (first,) = c.append(R, rows(1), 0, run=run, step=0)
        assert c.gc(run, 0).files == 1  # the lease's file goes; the client still holds it
        before = c.stats()
        with pytest.raises(StepCollectedError, match="through step 0"):  # room left in it
            c.append(R, rows(2), 0, run=run, step=0)
        after = c.stats()
        assert (after.appends, after.bytes_appended) == (before.appends, before.bytes_appended)
        assert not (daemon.root / "test" / run / "0").exists()  # no new file
        with pytest.raises(FileGoneError):
            read(c, first)
        (later,) = c.append(R, rows(3), 0, run=run, step=1)
        np.testing.assert_array_equal(read(c, later), rows(3))


def test_appends_racing_collections_never_return_rows_of_a_removed_file(daemon: Daemon) -> None:
    run, threads = unique_run(), 4
    start, stop = threading.Barrier(threads + 1), threading.Event()
    done: list[list[tuple[PayloadSegment, int]]] = [[] for _ in range(threads)]
    removed: list[int] = []
    errors: list[BaseException] = []
    with PayloadClient(daemon.socket) as c, PayloadClient(daemon.socket) as admin:

        def appender(t: int) -> None:
            try:
                start.wait()
                k = 0
                while not stop.is_set():
                    value = t * 1_000_000 + k
                    (seg,) = c.append(R, rows(value, 1), value, run=run, step=0)
                    done[t].append((seg, value))
                    k += 1
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        def collector() -> None:
            try:
                start.wait()
                deadline = time.monotonic() + 20
                # collections that removed lease files while the appends went on
                while sum(1 for n in removed if n) < 10 and time.monotonic() < deadline:
                    removed.append(admin.delete_run(run).files)  # no watermark: appends go on
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)
            finally:
                stop.set()

        workers = [threading.Thread(target=appender, args=(t,)) for t in range(threads)]
        workers.append(threading.Thread(target=collector))
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors
        assert sum(1 for n in removed if n) == 10
        admin.delete_run(run)  # every file the client holds a lease of goes now
        last = []
        for t in range(threads):  # ... and the next appends land in a new one
            value = 10_000 + t
            (seg,) = c.append(R, rows(value, 1), value, run=run, step=0)
            last.append((seg, value))
        admin.gc(run, 0)  # the step collected for good: appends into it are refused now
        with pytest.raises(StepCollectedError):
            c.append(R, rows(1, 1), 0, run=run, step=0)
        for segs in done:  # each acknowledged row is its own, or collected after it was
            for seg, value in segs[:: max(1, len(segs) // 200)]:
                try:
                    np.testing.assert_array_equal(read(c, seg), rows(value, 1))
                except FileGoneError:  # answered gone: its file is gone
                    assert not (daemon.root / seg.file).exists(), seg.file
        for seg, _ in last:  # appended after the last deletion, collected with its step
            with pytest.raises(FileGoneError):
                read(admin, seg)


def test_a_new_step_leases_the_fields_of_the_step_before_in_one_round_trip(
    daemon: Daemon,
) -> None:
    run = unique_run()
    mask = np.arange(14, dtype=np.int32).reshape(2, 7)
    with PayloadClient(daemon.socket) as c:
        c.append(R, rows(0), 0, run=run, step=0)  # the first step: one lease per field
        c.append(M, mask, 0, run=run, step=0)
        before = c.stats()  # (its note to the counters is one request)
        (r1,) = c.append(R, rows(1), 0, run=run, step=1)  # leases both fields of step 1
        (m1,) = c.append(M, mask + 1, 0, run=run, step=1)  # no round trip
        after = c.stats()
        assert after.data_plane_requests - before.data_plane_requests == 2  # lease, note
        assert after.leases - before.leases == 2
        # an append of fields new to the run: every one of them in the same round trip, their
        # row shapes with them
        segs = c.append_many(
            [("a", rows(3), 0), ("b", rows(4), 0), ("c", rows(5), 0)], run=run, step=1
        )
        again = c.stats()
        assert again.data_plane_requests - after.data_plane_requests == 2  # lease, note
        assert again.leases - after.leases == 3
        for (seg,), value in zip(segs, (3, 4, 5), strict=True):
            np.testing.assert_array_equal(read(c, seg), rows(value))
        np.testing.assert_array_equal(read(c, r1), rows(1))
        np.testing.assert_array_equal(c.read_field([m1], M, 0, 2, -1), mask + 1)


def test_a_lease_taken_ahead_and_never_written_leaves_nothing(daemon: Daemon) -> None:
    run = unique_run()
    with PayloadClient(daemon.socket) as c:
        c.append(R, rows(0), 0, run=run, step=0)
        c.append(M, np.zeros((1, 3), np.int32), 0, run=run, step=0)
        (seg,) = c.append(R, rows(1), 0, run=run, step=1)  # the mask of step 1 leased too
        step_dir = daemon.root / "test" / run / "1"
        assert len(list(step_dir.iterdir())) == 2  # one file of each field
    # the connection ended: the mask file, never written, goes; the rows stay
    wait_until(lambda: len(list(step_dir.iterdir())) <= 1, 5, "the unwritten file gone")
    assert [p.name for p in step_dir.iterdir()] == [Path(seg.file).name]
    with PayloadClient(daemon.socket) as c:
        np.testing.assert_array_equal(read(c, seg), rows(1))


def _fields_with_page(data_socket: str) -> tuple[FieldsReply, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(data_socket)
        body = msgspec.msgpack.encode(FieldsRequest())
        raw.sendall(FRAME_PREFIX.pack(len(body)) + body)
        data, fds, _flags, _addr = socket.recv_fds(raw, 1 << 16, 4)
        (n,) = FRAME_PREFIX.unpack_from(data)
        while len(data) < FRAME_PREFIX.size + n:
            data += raw.recv(1 << 16)
        return msgspec.msgpack.decode(data[FRAME_PREFIX.size :], type=FieldsReply), fds


def test_the_generation_page_counts_removals_and_no_client_can_write_it(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    with daemons.run(socket=sock):
        _check_the_page(sock)


def _check_the_page(sock: Path) -> None:
    reply, fds = _fields_with_page(f"{sock}{DATA_SOCKET_SUFFIX}")
    assert reply.generation and len(fds) == 1
    (fd,) = fds
    try:
        page = _descriptors.GenerationPage(os.dup(fd))
        for prot in (mmap.PROT_READ | mmap.PROT_WRITE, mmap.PROT_WRITE):
            with pytest.raises(PermissionError):  # sealed: no writable shared mapping
                mmap.mmap(fd, 8, mmap.MAP_SHARED, prot)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 8, 0)
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        run = unique_run()
        with PayloadClient(sock) as c:
            c.append(R, rows(0), 0, run=run, step=0)
            before = page.value()
            assert before % 2 == 0  # no removal under way
            assert c.gc(run, 0).files == 1
            assert page.value() == before + 2  # odd during the removal, even after
            c.gc(run, 0)  # nothing left to remove: no move
            assert page.value() == before + 2
    finally:
        os.close(fd)


def test_after_a_restart_the_new_daemon_s_removals_are_seen(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock, root, run = tmp_path / "payloadd.sock", tmp_path / "root", "rs"
    with PayloadClient(sock) as c:
        with daemons.run("--node", "n", root=root, socket=sock):
            (old,) = c.append(R, rows(1), 0, run=run, step=0)
        with daemons.run("--node", "n", root=root, socket=sock):
            (first,) = c.append(R, rows(2), 2, run=run, step=0)  # a new connection, page, lease
            assert first.file != old.file
            assert c.delete_run(run).files == 2  # both daemons' files
            (second,) = c.append(R, rows(3), 4, run=run, step=0)
            assert second.file not in (old.file, first.file)
            np.testing.assert_array_equal(read(c, second), rows(3))


@pytest.fixture
def tight_store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "root", "n", max_root_bytes=(AHEAD_ROOM - 1) * 4096)
    yield store
    store.close()


def test_a_lease_ahead_of_need_is_refused_near_the_disk_cap(tight_store: Store) -> None:
    ahead = tight_store.lease_ahead("r", 0, M, 0, 4096, owner=1)
    assert ahead is None and tight_store.root_bytes == 0  # nothing reserved, nothing created
    assert not (tight_store.root / "n" / "r").exists()
    lease = tight_store.lease("r", 0, R, 384, 4096, owner=1)  # a lease needed now: granted,
    assert lease.nbytes == (AHEAD_ROOM - 1) * 4096 // 8  # an eighth of the room left
    with pytest.raises(StorageFullError):
        tight_store.lease("r", 0, M, (AHEAD_ROOM - 1) * 4096, 4096, owner=1)
    assert tight_store.stats().appends_refused == 1  # the refusal ahead was not counted


def test_a_lease_ahead_of_need_far_from_the_limits_is_granted(tmp_path: Path) -> None:
    store = Store(tmp_path / "root", "n")
    try:
        lease = store.lease_ahead("r", 0, M, 0, 4096, owner=1)
        assert lease is not None and lease.nbytes == 4096
        fd = lease.writer()  # the descriptor the file was created with, for the client
        assert fd >= 0 and lease.writer() == -1  # handed over once
        os.close(fd)
        page = store.generation
        assert page is not None
        before = page.value
        lease.release()
        store.end_owner(1)  # never written: removed, and counted as a removal
        assert page.value == before + 2 and not (store.root / lease.file).exists()
    finally:
        store.close()


def test_leases_made_together_fsync_each_new_directory_entry_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "root", "n", fsync="always")
    synced: list[str] = []
    fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    try:
        for run, together in (("apart", False), ("together", True)):
            synced.clear()
            with store.syncs_together() if together else contextlib.nullcontext():
                for fld in (R, M):
                    store.lease(run, 0, fld, 8, 64, owner=1).release()
            step_dir = str(store.root / "n" / run / "0")
            dirs = [p for p in synced if os.path.isdir(p)]
            assert dirs.count(step_dir) == (1 if together else 2)  # an entry for each file
            assert str(store.root / "n" / run) in dirs  # the step's own entry
    finally:
        store.close()


def test_a_file_seen_linked_during_its_removal_is_checked_again_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a client that checks its lease's file between the start of a removal and its unlink
    # sees it linked; the value it read then must not count as checked, or the unlink that
    # follows would go unseen at its next append
    store = Store(tmp_path / "root", "n")
    try:
        assert store.generation is not None
        lease = store.lease("r", 0, R, 8, 64, owner=1)
        fd = lease.writer()
        page = _descriptors.GenerationPage(store.generation.reader())
        held = _descriptors.LeasedRange(lease.file, fd, 0, 64, False, 0, page.seen())
        assert _removed([held], page) == []  # linked, and seen so: no fstat next time
        unlink = os.unlink
        during: list[list[_descriptors.LeasedRange]] = []

        def check_then_unlink(path: str | os.PathLike[str]) -> None:
            during.append(_removed([held], page))  # the removal has begun, the file is there
            unlink(path)

        monkeypatch.setattr(os, "unlink", check_then_unlink)
        assert len(store.remove_step("r", 0, store.step_files("r", 0)).files) == 1
        monkeypatch.undo()
        assert during == [[]]
        assert _removed([held], page) == [held]  # the next check after the write sees it
        os.close(fd)
    finally:
        store.close()
