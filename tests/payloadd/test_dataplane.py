"""The data plane: descriptors over ``<socket>.data``, its fallback to HTTP, and its edges."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from payload_client import (
    FileMissingError,
    PayloadClient,
    PayloadSegment,
    SegmentFileError,
    StorageFullError,
)
from payload_client.transports.dataplane import _descriptors
from payload_client.transports.dataplane._steps import Exchange
from payload_client.wire._dataplane import ReserveRequest
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import AppendItem
from tests.conftest import Daemon, Daemons, wait_until

R = "routed_experts"


def test_rows_move_by_descriptor_not_over_http(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, run_name: str
) -> None:
    monkeypatch.setattr(_descriptors, "TELL_USE_S", 1e9)  # no note of runs in use: counted here
    rows = np.random.default_rng(0).integers(0, 128, (500, 48, 8)).astype(np.uint8)
    with PayloadClient(daemon.socket) as c:
        before = c.stats()
        segs = c.append(R, rows, 0, run=run_name, step=0)
        got = c.read_field(segs, R, 100, 400, 0)
        after = c.stats()
    np.testing.assert_array_equal(got, rows[100:400])
    assert after.appends == before.appends + 1  # the client's note
    assert after.bytes_appended - before.bytes_appended == rows.nbytes
    assert after.reads == before.reads and after.bytes_read == before.bytes_read  # no HTTP read
    # the fields table, the lease (with the rows' shape), the note, the open
    assert after.data_plane_requests - before.data_plane_requests == 4
    assert after.leases == before.leases + 1
    (s,) = segs
    assert (daemon.root / s.file).read_bytes()[s.offset : s.offset + rows.nbytes] == rows.tobytes()


def test_small_appends_fill_one_lease_without_round_trips(daemon: Daemon, run_name: str) -> None:
    rng = np.random.default_rng(1)
    with PayloadClient(daemon.socket) as a, PayloadClient(daemon.socket) as b:
        before = a.stats()
        written = []
        for k in range(50):  # two writers, interleaved, same run/step/field
            for c in (a, b):
                rows = rng.integers(0, 128, (int(rng.integers(1, 20)), 48, 8)).astype(np.uint8)
                written.append((rows, c.append(R, rows, k * 100, run=run_name, step=0)))
        b.stats()  # each client tells the daemon's counters about its appends
        after = a.stats()
        # ≈190 KB a client: leases of 64, 128 and 256 KiB at most (each renewal doubles),
        # not one a append
        assert 2 <= after.leases - before.leases <= 6
        assert after.appends - before.appends == 100
        spans = sorted(
            (s.file, s.offset, s.offset + s.rows * 384) for _, segs in written for s in segs
        )
        # back to back in each client's file: a renewed lease goes on where the last one's
        # rows end (the client said so: `LeaseRequest.done`), no hole between them
        assert all(f1 != f2 or e1 == s2 for (f1, _, e1), (f2, s2, _) in itertools.pairwise(spans))
        assert len({f for f, _, _ in spans}) == 2
        for rows, segs in written:
            np.testing.assert_array_equal(
                a.read_field(segs, R, segs[0].pos, segs[0].pos + len(rows), 0), rows
            )


def test_a_used_up_lease_is_replaced(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "payloadd.sock"
    with daemons.run("--lease-bytes", "1000", socket=sock), PayloadClient(sock) as c:
        segs = [c.append(R, np.full((1, 48, 8), k, np.uint8), k, run="r", step=0) for k in range(6)]
        assert c.stats().leases == 3  # 2 rows of 384 bytes per 1000-byte lease
        for k, seg in enumerate(segs):
            np.testing.assert_array_equal(c.read_field(seg, R, k, k + 1, 0), np.full((1, 48, 8), k))


def test_a_removed_file_is_never_read_through_a_held_descriptor(
    daemon: Daemon, run_name: str
) -> None:
    rows = np.arange(40 * 3, dtype=np.int32).reshape(40, 3)
    with (
        PayloadClient(daemon.socket) as fast,
        PayloadClient(daemon.socket, data_plane=False) as http,
    ):
        segs = fast.append("sampling_mask", rows, 0, run=run_name, step=0)
        np.testing.assert_array_equal(fast.read_field(segs, "sampling_mask", 0, 40, -1), rows)
        longer = msgspec.structs.replace(segs[0], rows=41)
        with pytest.raises(SegmentFileError, match="ends at byte"):  # cached, still checked
            fast.read_field([longer], "sampling_mask", 0, 1, -1)
        os.unlink(daemon.root / segs[0].file)  # as GC does; the client holds it open
        # docs/contract.md, "Reading a window": a file that is gone is an error, never fill
        # or old bytes
        for c in (fast, http):
            with pytest.raises(FileMissingError):
                c.read_field(segs, "sampling_mask", 0, 40, -1)
        again = fast.append(
            "sampling_mask", rows, 0, run=run_name, step=0
        )  # not into the dead file
        assert again[0].file != segs[0].file
        np.testing.assert_array_equal(http.read_field(again, "sampling_mask", 0, 40, -1), rows)


@pytest.fixture
def http_only(tmp_path: Path, daemons: Daemons) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "root", tmp_path / "payloadd.sock")
    with daemons.run("--data-plane", "false", root=d.root, socket=d.socket):
        yield d


def test_without_a_data_plane_clients_fall_back_to_http(http_only: Daemon) -> None:
    assert not Path(f"{http_only.socket}.data").exists()
    with PayloadClient(http_only.socket) as c:
        segs = c.append(R, np.ones((3, 2), np.uint8), 0, run="fb", step=0)
        np.testing.assert_array_equal(c.read_field(segs, R, 0, 3, 0), np.ones((3, 2)))
        s = c.stats()
        assert s.data_plane_requests == 0 and s.reads == 1 and s.appends == 1


def test_a_restarted_daemon_is_found_again(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "payloadd.sock"
    with PayloadClient(sock) as c:
        with daemons.run(socket=sock):
            first = c.append(R, np.full((2, 2), 5, np.uint8), 0, run="rs", step=0)
        with daemons.run(socket=sock):
            second = c.append(R, np.full((2, 2), 6, np.uint8), 0, run="rs", step=0)  # old
            got = c.read_field(first + second, R, 0, 2, 0)  # connection dropped: HTTP then
            assert got is not None and (got == 6).all()
            assert first[0].file != second[0].file


def test_a_client_that_dies_mid_reservation_harms_nobody(daemon: Daemon, run_name: str) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(f"{daemon.socket}.data")
    body = msgspec.msgpack.encode(ReserveRequest([AppendItem(R, "uint8", [2], 4, 0, run_name, 0)]))
    raw.sendall(FRAME_PREFIX.pack(len(body)) + body)
    msg, anc, _, _ = raw.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
    assert msg and anc  # a reservation with a descriptor came back
    for _level, _kind, data in anc:
        for fd in np.frombuffer(data[: len(data) - len(data) % 4], np.int32):
            os.close(int(fd))
    reply = msgspec.msgpack.decode(msg[FRAME_PREFIX.size :])
    (reserved,) = reply[2]  # ["reserve", txn, files, extents]
    assert (daemon.root / reserved).is_file()
    raw.close()  # never commits
    with PayloadClient(daemon.socket) as c:
        segs = c.append(R, np.full((4, 2), 9, np.uint8), 0, run=run_name, step=0)
        np.testing.assert_array_equal(c.read_field(segs, R, 0, 4, 0), np.full((4, 2), 9))
        assert segs[0].file != reserved  # never in the abandoned file
    abandoned = daemon.root / reserved  # nothing of it was acknowledged: no debris
    wait_until(lambda: not abandoned.exists(), 5, "the abandoned reservation's file gone")


def test_garbage_on_the_data_socket_gets_an_error_reply(daemon: Daemon) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(f"{daemon.socket}.data")
    raw.sendall(FRAME_PREFIX.pack(3) + b"\xc1\xc1\xc1")
    reply = raw.recv(4096)
    assert b"InvalidRequestError" in reply
    raw.sendall(FRAME_PREFIX.pack(2**31))  # an absurd frame: told why, then dropped
    reply = raw.recv(4096)
    assert b"PayloadTooLargeError" in reply and b"max_control_bytes" in reply
    assert raw.recv(4096) == b""
    raw.close()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(f"{daemon.socket}.data")
    note = msgspec.msgpack.encode(["note", -1, 0, 0])  # no reply is awaited: never answer it
    raw.sendall(FRAME_PREFIX.pack(len(note)) + note)
    assert raw.recv(4096) == b""
    raw.close()
    with PayloadClient(daemon.socket) as c:
        assert c.health().status == "ok"


def test_a_cancelled_exchange_never_hands_its_reply_to_the_next(
    daemon: Daemon, run_name: str
) -> None:
    import asyncio

    from payload_client import AsyncPayloadClient

    async def main() -> None:
        async with AsyncPayloadClient(daemon.socket) as c:
            x = await c.append(R, np.full((4, 2), 1, np.uint8), 0, run=f"{run_name}-x", step=0)
            y = await c.append(R, np.full((4, 2), 2, np.uint8), 0, run=f"{run_name}-y", step=0)
            for _ in range(20):  # cancel reads at every point of their exchange
                task = asyncio.ensure_future(c.read_field(x, R, 0, 4, 0))
                await asyncio.sleep(0)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                got = await c.read_field(y, R, 0, 4, 0)
                assert got is not None and (got == 2).all()
                c._data_plane.cache.clear() if c._data_plane else None  # make the next read ask again

    asyncio.run(main())


@pytest.mark.parametrize("fork", ["os.fork", "libc.fork"])
def test_a_forked_child_gets_its_own_leases(daemon: Daemon, fork: str) -> None:
    # a fork made outside Python (a C extension) runs no fork hook: the client asks the kernel
    do_fork = os.fork if fork == "os.fork" else ctypes.CDLL(None).fork
    with PayloadClient(daemon.socket) as c:
        c.append(R, np.zeros((1, 2), np.uint8), 0, run=fork, step=0)  # the parent's lease
        r, w = os.pipe()
        pid = do_fork()
        if pid == 0:  # the child: append, report the segment, leave without cleanup
            os.close(r)
            seg = c.append(R, np.full((1, 2), 7, np.uint8), 0, run=fork, step=0)[0]
            os.write(w, msgspec.msgpack.encode(seg))
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            child = msgspec.msgpack.decode(f.read(), type=PayloadSegment)
        os.waitpid(pid, 0)
        mine = c.append(R, np.full((1, 2), 9, np.uint8), 0, run=fork, step=0)[0]
        assert (child.file, child.offset) != (mine.file, mine.offset)
        np.testing.assert_array_equal(c.read_field([child], R, 0, 1, 0), [[7, 7]])
        np.testing.assert_array_equal(c.read_field([mine], R, 0, 1, 0), [[9, 9]])


def test_reads_of_hundreds_of_files_stay_on_the_data_plane(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    flags = ("--max-file-bytes", "64", "--lease-bytes", "64")
    with daemons.run(*flags, socket=sock), PayloadClient(sock) as c:
        segs = [c.append(R, np.full((1, 64), k % 250, np.uint8), k, run="many", step=0)[0]
                for k in range(300)]  # fmt: skip
        assert len({s.file for s in segs}) == 300
        before = c.stats()
        got = c.read_field(segs, R, 0, 300, 0)
        after = c.stats()
        assert got is not None
        np.testing.assert_array_equal(got[:, 0], [k % 250 for k in range(300)])
        assert after.reads == before.reads  # no fallback to HTTP
        assert after.data_plane_fds - before.data_plane_fds == 300


def test_open_descriptors_stay_bounded_over_many_steps(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "payloadd.sock"
    with daemons.run(socket=sock) as d, PayloadClient(sock) as c:
        for step in range(600):
            c.append(R, np.ones((1, 2), np.uint8), 0, run="steps", step=step)
            c.append("sampling_mask", np.ones((1, 2), np.int32), 0, run="steps", step=step)
        daemon_fds = len(os.listdir(f"/proc/{d.pid}/fd"))
        client_fds = len(os.listdir("/proc/self/fd"))
    assert daemon_fds < 256 + 64 + 100, daemon_fds  # open-for-append cap, leases, the rest
    assert client_fds < 64 + 128 + 100, client_fds


def test_a_stuck_daemon_times_out(tmp_path: Path, daemons: Daemons) -> None:
    import signal

    from payload_client import TimeoutError
    from payload_client.transports import SyncDataPlane
    from payload_client.wire._dataplane import OpenRequest

    sock = tmp_path / "payloadd.sock"
    with daemons.run(socket=sock) as d, PayloadClient(sock) as c:
        (seg,) = c.append(R, np.ones((1, 2), np.uint8), 0, run="stuck", step=0)
        dp = SyncDataPlane(f"{sock}.data", timeout=1.0)
        for fd in dp._exchange(Exchange(OpenRequest([(seg.file, 0)])))[
            1
        ]:  # connected and answering
            os.close(fd)
        os.kill(d.pid, signal.SIGSTOP)
        os.waitpid(d.pid, os.WUNTRACED)  # stopped for sure, not merely signalled
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"no answer within 1\.0 s"):  # not HTTP then
                dp._exchange(Exchange(OpenRequest([(seg.file, 0)])))
            assert dp.sock is None  # a late reply can never reach the next exchange
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(d.pid, signal.SIGCONT)
            dp.close()


def test_what_a_client_does_to_its_descriptor_never_reaches_the_daemon(
    daemon: Daemon, run_name: str
) -> None:
    import fcntl

    with (
        PayloadClient(daemon.socket) as fast,
        PayloadClient(daemon.socket, data_plane=False) as http,
    ):
        fast.append(R, np.zeros((1, 2), np.uint8), 0, run=run_name, step=0)
        assert fast._data_plane is not None
        (lease,) = fast._data_plane.leases.items.values()
        fcntl.fcntl(lease.fd, fcntl.F_SETFL, fcntl.fcntl(lease.fd, fcntl.F_GETFL) | os.O_APPEND)
        rows = np.full((3, 2), 5, np.uint8)
        seg = http.append(R, rows, 0, run=run_name, step=0)  # the daemon's own pwrite
        assert seg[0].file != lease.file  # a client's file is its own
        more = http.append(R, rows + 1, 3, run=run_name, step=0)
        assert more[0].file == seg[0].file and more[0].offset == seg[0].offset + rows.nbytes
        np.testing.assert_array_equal(
            http.read_field(seg + more, R, 0, 6, 0), np.r_[rows, rows + 1]
        )


def test_reads_into_outputs_at_any_page_offset_are_exact(daemon: Daemon, run_name: str) -> None:
    # destinations a few bytes past the source in its page take the copy detour: same bytes
    rows = np.random.default_rng(7).integers(0, 256, (300, 48, 8)).astype(np.uint8)
    nbytes = rows.nbytes
    with PayloadClient(daemon.socket) as c:
        segs = c.append(R, rows, 0, run=run_name, step=0)
        src = segs[0].offset % 4096
        buf = np.empty(nbytes + 2 * 4096, np.uint8)
        base = (src - buf.ctypes.data) % 4096  # page offset of buf[base] == the source's
        for shift in (0, 1, 8, 31, 32, 63, 64, 200, 4095):
            out = buf[base + shift : base + shift + nbytes].reshape(rows.shape)
            out[...] = 255
            assert c.read_field(segs, R, 0, 300, 0, out=out) is out
            np.testing.assert_array_equal(out, rows, err_msg=f"shift {shift}")
        np.testing.assert_array_equal(
            c.read_field(segs, R, 17, 290, 0, dtype=np.uint8), rows[17:290]
        )


def test_after_a_restart_reads_and_appends_stay_on_the_data_plane(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    with PayloadClient(sock) as c:
        with daemons.run(socket=sock):
            first = c.append(R, np.full((2, 2), 5, np.uint8), 0, run="rs2", step=0)
            assert c.read_field(first, R, 0, 2, 0) is not None  # its descriptor is cached
        with daemons.run(socket=sock):
            second = c.append(R, np.full((2, 2), 6, np.uint8), 2, run="rs2", step=0)
            got = c.read_field(first + second, R, 0, 4, 0)  # cached + a new file to open
            np.testing.assert_array_equal(got, [[5, 5]] * 2 + [[6, 6]] * 2)
            stats = c.stats()
            assert stats.reads == 0 and stats.appends == 1  # nothing went over HTTP
            assert stats.data_plane_requests >= 2  # a lease, an open
            assert first[0].file != second[0].file


@pytest.mark.parametrize("rule", ["run", "watermark"])
def test_a_lease_whose_file_gc_removes_at_once_is_placed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str
) -> None:
    # the lease's file goes between the lease and the client's descriptor: a run deletion
    # leaves the step open, and the rows are placed again in a new file; a watermark over
    # the step closes it, and the append is refused (StepCollectedError), nothing stored
    from payload_client import StepCollectedError
    from payload_client.transports import SyncDataPlane, append_steps
    from payload_client.wire._http import Extent, GcReport, GcRequest
    from payloadd import Store
    from payloadd.server.framed._dataplane_server import DataPlaneServer
    from payloadd.store._appends import LeasedRange
    from payloadd.store._gc import GarbageCollector

    store = Store(tmp_path / "root", "n")
    collector = GarbageCollector(store)
    lease = store.lease
    raced: list[GcReport] = []
    leased: list[str] = []

    def lease_then_gc(
        run: str, step: int, field: str, nbytes: int, size: int, owner: int, shape: Any = None
    ) -> LeasedRange:
        got = lease(run, step, field, nbytes, size, owner, shape)
        leased.append(got.file)
        if not raced:  # a collection lands between the lease and the client's descriptor
            if rule == "run":
                raced.append(collector.delete_run("r"))
            else:
                raced.append(collector.collect(GcRequest(run="r", through_step=0)))
        return got

    monkeypatch.setattr(store, "lease", lease_then_gc)
    server = DataPlaneServer(store, tmp_path / "p.sock.data")
    server.start()
    dp = SyncDataPlane(str(tmp_path / "p.sock.data"), timeout=5)
    try:
        rows = bytes(range(8))
        item = AppendItem(R, "uint8", [2], 4, 0, "r", 0)
        if rule == "watermark":
            with pytest.raises(StepCollectedError, match="step 0 of run 'r'"):
                dp.run(append_steps([item], [memoryview(rows)], dp.leases))
            assert raced[0].files == 1  # the first lease's file went
            assert list((tmp_path / "root").rglob("*.bin")) == []  # and no other came
            return
        ((seg,),) = dp.run(append_steps([item], [memoryview(rows)], dp.leases))
        assert raced[0].files == 1  # the first lease's file went
        assert not (tmp_path / "root" / leased[0]).exists()
        assert seg.file == leased[1] != leased[0]  # placed again, in a new lease's file
        got = store.read_extents([Extent(seg.file, seg.offset, 8, seg.offset + 8)])
        assert bytes(got) == rows
    finally:
        dp.close()
        server.stop()
        store.close()


@pytest.mark.parametrize("refusal", ["full", "too-large"])
def test_an_append_the_daemon_refuses_gives_back_what_it_claimed(
    tmp_path: Path, daemons: Daemons, refusal: str
) -> None:
    # item 0 fits its lease; item 1 needs a lease the daemon refuses: too big for the room
    # left under the cap (the append fails, 507), or for the rotation size (the append goes
    # through a reservation instead). Either way item 0's claim is given back: the next
    # append of its key lands right after the last one stored.
    sock = tmp_path / "payloadd.sock"
    flags = ["--lease-bytes", "4096", "--max-file-bytes", "8192", "--min-free-bytes", "0"]
    if refusal == "full":
        flags += ["--max-root-bytes", "8192"]  # the two leases take 1/8 of the room each
    with daemons.run(*flags, socket=sock), PayloadClient(sock) as c:
        one = np.ones((1, 16), np.uint8)
        (first,) = c.append("a", one, 0, run="r", step=0)
        c.append("c", one, 0, run="r", step=0)  # a second lease
        big = ("b", np.ones((1, 7000 if refusal == "full" else 9000), np.uint8), 0)
        if refusal == "full":
            with pytest.raises(StorageFullError):
                c.append_many([("a", one, 1), big], run="r", step=0)
        else:
            c.append_many([("a", one, 1), big], run="r", step=0)
        (nxt,) = c.append("a", one, 2, run="r", step=0)
        assert (nxt.file, nxt.offset) == (first.file, first.offset + 16)
