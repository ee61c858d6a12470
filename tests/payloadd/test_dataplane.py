"""The data plane: descriptors over ``<socket>.data``, its fallback to HTTP, and its edges."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import FileMissingError, PayloadClient, SegmentFileError
from payload_client._wire import FRAME_PREFIX, AppendItem, ReserveRequest
from payloadd._process import start_daemon
from tests.conftest import Daemon

R = "routed_experts"


def test_rows_move_by_descriptor_not_over_http(daemon: Daemon) -> None:
    rows = np.random.default_rng(0).integers(0, 128, (500, 48, 8)).astype(np.uint8)
    with PayloadClient(daemon.socket) as c:
        before = c.stats()
        segs = c.append(R, rows, 0, run="dp", step=0)
        got = c.read_field(segs, R, 100, 400, 0)
        after = c.stats()
    np.testing.assert_array_equal(got, rows[100:400])
    assert after.appends == before.appends + 1  # the client's note
    assert after.bytes_appended - before.bytes_appended == rows.nbytes
    assert after.reads == before.reads and after.bytes_read == before.bytes_read  # no HTTP read
    assert after.data_plane_requests - before.data_plane_requests == 3  # lease, note, open
    assert after.leases == before.leases + 1
    (s,) = segs
    assert (daemon.root / s.file).read_bytes()[s.offset : s.offset + rows.nbytes] == rows.tobytes()


def test_small_appends_fill_one_lease_without_round_trips(daemon: Daemon) -> None:
    rng = np.random.default_rng(1)
    with PayloadClient(daemon.socket) as a, PayloadClient(daemon.socket) as b:
        before = a.stats()
        written = []
        for k in range(50):  # two writers, interleaved, same run/step/field
            for c in (a, b):
                rows = rng.integers(0, 128, (int(rng.integers(1, 20)), 48, 8)).astype(np.uint8)
                written.append((rows, c.append(R, rows, k * 100, run="lease", step=0)))
        b.stats()  # each client tells the daemon's counters about its appends
        after = a.stats()
        assert after.leases - before.leases == 2  # one lease each, 100 appends
        assert after.appends - before.appends == 100
        spans = sorted(
            (s.file, s.offset, s.offset + s.rows * 384) for _, segs in written for s in segs
        )
        assert all(f1 != f2 or e1 <= s2 for (f1, _, e1), (f2, s2, _) in itertools.pairwise(spans))
        for rows, segs in written:
            np.testing.assert_array_equal(
                a.read_field(segs, R, segs[0].pos, segs[0].pos + len(rows), 0), rows
            )


def test_a_used_up_lease_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "payloadd.sock"
    with start_daemon(tmp_path / "root", sock, "--lease-bytes", "1000"), PayloadClient(sock) as c:
        segs = [c.append(R, np.full((1, 48, 8), k, np.uint8), k, run="r", step=0) for k in range(6)]
        assert c.stats().leases == 3  # 2 rows of 384 bytes per 1000-byte lease
        for k, seg in enumerate(segs):
            np.testing.assert_array_equal(c.read_field(seg, R, k, k + 1, 0), np.full((1, 48, 8), k))


def test_a_held_descriptor_reads_a_removed_file_intact_never_fill(daemon: Daemon) -> None:
    rows = np.arange(40 * 3, dtype=np.int32).reshape(40, 3)
    with (
        PayloadClient(daemon.socket) as fast,
        PayloadClient(daemon.socket, data_plane=False) as http,
    ):
        segs = fast.append("sampling_mask", rows, 0, run="held", step=0)
        np.testing.assert_array_equal(fast.read_field(segs, "sampling_mask", 0, 40, -1), rows)
        os.unlink(daemon.root / segs[0].file)  # as GC would: the client still holds it open
        np.testing.assert_array_equal(fast.read_field(segs, "sampling_mask", 0, 40, -1), rows)
        with pytest.raises(FileMissingError):
            http.read_field(segs, "sampling_mask", 0, 40, -1)
        longer = msgspec.structs.replace(segs[0], rows=41)
        with pytest.raises(SegmentFileError, match="ends at byte"):  # cached, still checked
            fast.read_field([longer], "sampling_mask", 0, 1, -1)


@pytest.fixture
def http_only(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "root", tmp_path / "payloadd.sock")
    with start_daemon(d.root, d.socket, "--data-plane", "false"):
        yield d


def test_without_a_data_plane_clients_fall_back_to_http(http_only: Daemon) -> None:
    assert not Path(f"{http_only.socket}.data").exists()
    with PayloadClient(http_only.socket) as c:
        segs = c.append(R, np.ones((3, 2), np.uint8), 0, run="fb", step=0)
        np.testing.assert_array_equal(c.read_field(segs, R, 0, 3, 0), np.ones((3, 2)))
        s = c.stats()
        assert s.data_plane_requests == 0 and s.reads == 1 and s.appends == 1


def test_a_restarted_daemon_is_found_again(tmp_path: Path) -> None:
    sock = tmp_path / "payloadd.sock"
    with PayloadClient(sock) as c:
        with start_daemon(tmp_path / "root", sock):
            first = c.append(R, np.full((2, 2), 5, np.uint8), 0, run="rs", step=0)
        with start_daemon(tmp_path / "root", sock):
            second = c.append(R, np.full((2, 2), 6, np.uint8), 0, run="rs", step=0)  # old
            got = c.read_field(first + second, R, 0, 2, 0)  # connection dropped: HTTP then
            assert got is not None and (got == 6).all()
            assert first[0].file != second[0].file


def test_a_client_that_dies_mid_reservation_harms_nobody(daemon: Daemon) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(f"{daemon.socket}.data")
    body = msgspec.msgpack.encode(ReserveRequest([AppendItem(R, "uint8", [2], 4, 0, "dead", 0)]))
    raw.sendall(FRAME_PREFIX.pack(len(body)) + body)
    msg, anc, _, _ = raw.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
    assert msg and anc  # a reservation with a descriptor came back
    for _level, _kind, data in anc:
        for fd in np.frombuffer(data[: len(data) - len(data) % 4], np.int32):
            os.close(int(fd))
    raw.close()  # never commits
    with PayloadClient(daemon.socket) as c:
        segs = c.append(R, np.full((4, 2), 9, np.uint8), 0, run="dead", step=0)
        np.testing.assert_array_equal(c.read_field(segs, R, 0, 4, 0), np.full((4, 2), 9))
        assert segs[0].offset == 8  # after the abandoned range, never over it


def test_garbage_on_the_data_socket_gets_an_error_reply(daemon: Daemon) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(f"{daemon.socket}.data")
    raw.sendall(FRAME_PREFIX.pack(3) + b"\xc1\xc1\xc1")
    reply = raw.recv(4096)
    assert b"InvalidRequestError" in reply
    raw.sendall(FRAME_PREFIX.pack(2**31))  # an absurd frame: the connection is dropped
    assert raw.recv(4096) == b""
    raw.close()
    with PayloadClient(daemon.socket) as c:
        assert c.health().status == "ok"
