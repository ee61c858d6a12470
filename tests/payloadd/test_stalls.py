"""Requests that stall, memory in flight, and reservations that must end with their client.

A real daemon with a short ``request_timeout_s``; stalled peers are raw sockets that send
part of a request and stop, or stop reading an answer.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient
from payload_client.wire._dataplane import LeaseRequest, ReserveRequest
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import APPEND_CONTENT_TYPE, AppendItem, AppendRequest
from tests.conftest import Daemon, Daemons, wait_until
from tests.payloadd import procfs

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

R = "routed_experts"
GiB = 1 << 30


@pytest.fixture
def strict(tmp_path: Path, daemons: Daemons) -> Iterator[tuple[Daemon, int]]:
    """A daemon with a 1 s request timeout, a 2 s reservation timeout and a disk cap of
    64 GiB (so that reserved bytes show in ``root_bytes``); yields it and its pid."""
    d = Daemon(tmp_path / "root", tmp_path / "s.sock")
    extra = ("--node", "n", "--request-timeout-s", "1", "--reservation-timeout-s", "2",
             "--max-root-bytes", str(64 * GiB), "--min-free-bytes", "0")  # fmt: skip
    with daemons.run(*extra, root=d.root, socket=d.socket, log_level="error") as dm:
        yield d, dm.pid


def _raw(path: Path | str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(10)
    return s


def _until_closed(s: socket.socket) -> bytes:
    """Everything ``s`` receives until the daemon closes it (at most its 10 s timeout a
    receive)."""
    got = b""
    while chunk := s.recv(4096):
        got += chunk
    return got


def _append_head(items: list[AppendItem]) -> tuple[bytes, int]:
    """An HTTP append's request head and frame header; and the whole body's length."""
    header = msgspec.msgpack.encode(AppendRequest(items))
    rows = sum(it.rows * int(np.prod(it.shape)) for it in items)  # uint8 rows
    length = FRAME_PREFIX.size + len(header) + rows
    head = (
        f"POST /v1/append HTTP/1.1\r\nhost: payloadd\r\ncontent-type: {APPEND_CONTENT_TYPE}\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()
    return head + FRAME_PREFIX.pack(len(header)) + header, length


def _root_bytes(d: Daemon) -> int:
    with PayloadClient(d.socket, data_plane=False) as c:
        return c.stats().root_bytes


def _files(d: Daemon, run: str) -> list[Path]:
    base = d.root / "n" / run
    return sorted(p for p in base.rglob("*") if p.is_file()) if base.exists() else []


def test_a_stalled_append_body_is_cut_off_and_gives_back_what_it_held(
    strict: tuple[Daemon, int],
) -> None:
    d, _ = strict
    base = _root_bytes(d)
    head, _ = _append_head([AppendItem(R, "uint8", [48, 8], 8 << 20, 0, "stall", 0)])  # 3 GiB
    s = _raw(d.socket)
    s.sendall(head + bytes(2 << 20))  # 2 MiB of the rows, then nothing
    wait_until(lambda: _root_bytes(d) >= base + 3 * GiB, 10)  # reserved while it may still come
    assert len(_files(d, "stall")) == 4  # files of its own, rotated at 1 GiB (384-byte rows)
    answer = _until_closed(s)  # within about request_timeout_s (head and body may come apart)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"RequestTimeoutError" in answer
    assert s.recv(4096) == b""  # and closed
    s.close()
    wait_until(lambda: _root_bytes(d) == base, 10)  # the reservation is given back
    assert _files(d, "stall") == []  # nothing of it was acknowledged: no file is left
    with PayloadClient(d.socket) as c:  # and the step is collectable
        c.append(R, np.ones((1, 48, 8), np.uint8), 0, run="stall", step=0)
        report = c.gc(run="stall", through_step=0)
        assert report.in_use == 0 and report.files == 1


def test_an_append_whose_client_leaves_gives_back_its_reservation(
    strict: tuple[Daemon, int],
) -> None:
    d, _ = strict
    base = _root_bytes(d)
    head, _ = _append_head([AppendItem(R, "uint8", [48, 8], 8 << 20, 0, "gone", 0)])
    s = _raw(d.socket)
    s.sendall(head + bytes(2 << 20))
    wait_until(lambda: _root_bytes(d) >= base + 3 * GiB, 10)
    s.close()  # gone before its body ended
    wait_until(lambda: _root_bytes(d) == base, 10)
    assert _files(d, "gone") == []


def test_a_stalled_read_body_and_a_silent_connection_are_cut_off(
    strict: tuple[Daemon, int],
) -> None:
    d, _ = strict
    s = _raw(d.socket)
    s.sendall(b"POST /v1/read HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
              b"content-length: 100\r\n\r\n{\"extents\": [")  # fmt: skip
    start = time.monotonic()
    answer = s.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0]
    assert time.monotonic() - start < 5
    s.close()
    silent = _raw(d.socket)  # connects, sends nothing
    assert silent.recv(1) == b""
    silent.close()
    frame = _raw(f"{d.socket}.data")  # a data-plane frame that stops after its length
    frame.sendall(FRAME_PREFIX.pack(100) + b"\x92")
    assert frame.recv(1) == b""
    frame.close()


def test_a_client_that_stops_reading_an_answer_lets_go_of_its_files(
    strict: tuple[Daemon, int],
) -> None:
    d, pid = strict
    rows = np.zeros((200_000, 48, 8), np.uint8)  # 73 MiB: streamed, far beyond the buffers
    with PayloadClient(d.socket) as c:
        (seg,) = c.append(R, rows, 0, run="slow", step=0)
    body = msgspec.json.encode({"extents": [[seg.file, seg.offset, rows.nbytes, rows.nbytes]]})
    s = _raw(d.socket)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(b"POST /v1/read HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert s.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
    target = str(d.root / seg.file)

    def held() -> int:
        return sum(t.startswith(target) for t in procfs.fds(pid))

    wait_until(lambda: held() == 2, 10)  # the read's descriptor, and the one the cache keeps
    wait_until(lambda: held() == 1, timeout=15)  # cut off after request_timeout_s
    s.close()
    with PayloadClient(d.socket, data_plane=False) as c:  # its descriptors are given back
        metrics = c._http.client.get("/metrics").text
    assert "\npayloadd_request_descriptors 0.0\n" in metrics
    with PayloadClient(d.socket) as c:
        c.gc(run="slow", through_step=0)
    assert procfs.deleted_fds(pid, d.root) == []


def test_reservations_and_leases_end_with_their_connection(strict: tuple[Daemon, int]) -> None:
    d, _ = strict
    base = _root_bytes(d)
    dp = _raw(f"{d.socket}.data")

    def ask(request: object) -> tuple[list[object], int]:
        body = msgspec.msgpack.encode(request)
        dp.sendall(FRAME_PREFIX.pack(len(body)) + body)
        msg, anc, _, _ = dp.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
        n = 0
        for _level, _kind, data in anc:
            for fd in np.frombuffer(data[: len(data) - len(data) % 4], np.int32):
                os.close(int(fd))
                n += 1
        return msgspec.msgpack.decode(msg[FRAME_PREFIX.size :]), n

    for step in range(7):  # 7 GiB of leases, not a byte written
        reply, n = ask(LeaseRequest("held", step, R, GiB))
        assert reply[0] == "leased" and n == 1, reply
    reply, n = ask(ReserveRequest([AppendItem(R, "uint8", [48, 8], 8 << 20, 0, "held", 9)]))
    assert reply[0] == "reserved" and n == 4, reply  # 3 GiB: 4 files of its own
    assert _root_bytes(d) >= base + 10 * GiB
    dp.close()  # the client goes: everything it held is given back
    wait_until(lambda: _root_bytes(d) == base, 10)
    assert _files(d, "held") == []  # its empty lease files and its reservation: no debris


def test_an_uncommitted_reservation_expires(strict: tuple[Daemon, int]) -> None:
    d, _ = strict
    base = _root_bytes(d)
    dp = _raw(f"{d.socket}.data")
    body = msgspec.msgpack.encode(
        ReserveRequest([AppendItem(R, "uint8", [48, 8], 4 << 20, 0, "late", 0)])
    )
    dp.sendall(FRAME_PREFIX.pack(len(body)) + body)
    msg, anc, _, _ = dp.recvmsg(1 << 16, socket.CMSG_SPACE(4))
    for _level, _kind, data in anc:
        os.close(int(np.frombuffer(data[:4], np.int32)[0]))
    txn = msgspec.msgpack.decode(msg[FRAME_PREFIX.size :])[1]
    assert _root_bytes(d) >= base + (4 << 20) * 384
    wait_until(lambda: _root_bytes(d) == base, timeout=10)  # given back after 2 s idle
    commit = msgspec.msgpack.encode(["commit", txn])
    dp.sendall(FRAME_PREFIX.pack(len(commit)) + commit)
    reply = dp.recv(4096)
    assert b"no open reservation" in reply
    dp.close()
    assert _files(d, "late") == []


def test_data_plane_frames_are_bounded_in_size_and_in_memory(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "s.sock"
    cap = 16 << 20
    extra = ("--max-control-bytes", str(8 << 20), "--max-inflight-bytes", str(cap),
             "--request-timeout-s", "20")  # fmt: skip
    with daemons.run(*extra, socket=sock, log_level="error") as d:
        big = _raw(f"{sock}.data")  # above the frame limit: refused in words
        big.sendall(FRAME_PREFIX.pack(60 << 20))
        reply = big.recv(4096)
        assert b"PayloadTooLargeError" in reply and b"max_control_bytes" in reply
        big.close()
        wait_until(lambda: procfs.unix_connections(f"{sock}.data") == (0, 0), 10, "big gone")
        procfs.reset_peak_rss(d.pid)
        base = procfs.status(d.pid, "VmRSS")
        frame = FRAME_PREFIX.pack(7 << 20) + b"\x91" + bytes((7 << 20) - 1)  # garbage, 7 MiB
        answers: list[bytes] = []

        def send() -> None:
            s = _raw(f"{sock}.data")
            s.settimeout(60)
            s.sendall(frame)
            answers.append(s.recv(4096))
            s.close()

        threads = [threading.Thread(target=send) for _ in range(20)]  # 140 MiB at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) == 20 and all(b"Error" in a for a in answers)
        peak = procfs.status(d.pid, "VmHWM")
        assert (peak - base) * 1024 < cap + (24 << 20), (base, peak)  # not 20 x 7 MiB
        with PayloadClient(sock) as c:
            assert c.health().status == "ok"


def _dp_ask(s: socket.socket, request: object) -> list[object]:
    """Send one data-plane request on ``s``; its reply (descriptors closed)."""
    body = msgspec.msgpack.encode(request)
    s.sendall(FRAME_PREFIX.pack(len(body)) + body)
    msg, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
    for _level, _kind, data in anc:
        for fd in np.frombuffer(data[: len(data) - len(data) % 4], np.int32):
            os.close(int(fd))
    reply: list[object] = msgspec.msgpack.decode(msg[FRAME_PREFIX.size :])
    return reply


def test_a_reservation_is_committed_only_on_its_own_connection(
    strict: tuple[Daemon, int],
) -> None:
    d, _ = strict
    a, b = _raw(f"{d.socket}.data"), _raw(f"{d.socket}.data")
    item = AppendItem(R, "uint8", [48, 8], 2, 0, "own", 0)
    ra, rb = _dp_ask(a, ReserveRequest([item])), _dp_ask(b, ReserveRequest([item]))
    assert ra[0] == rb[0] == "reserved" and ra[1] != rb[1]  # ids unique across connections
    wrong = _dp_ask(b, ["commit", ra[1]])  # a commit sent on another connection
    assert wrong[0] == "error" and "no open reservation" in str(wrong[2])
    assert _dp_ask(b, ["commit", rb[1]])[0] == "committed"
    assert _dp_ask(a, ["commit", ra[1]])[0] == "committed"
    a.close()
    b.close()


def test_a_busy_connection_s_reservation_expires_too(strict: tuple[Daemon, int]) -> None:
    d, _ = strict
    dp = _raw(f"{d.socket}.data")
    reply = _dp_ask(dp, ReserveRequest([AppendItem(R, "uint8", [48, 8], 2, 0, "busy", 0)]))
    for _ in range(8):  # 4 s of other requests, past the 2 s reservation timeout
        assert _dp_ask(dp, ["fields"])[0] == "fieldtable"
        time.sleep(0.5)
    late = _dp_ask(dp, ["commit", reply[1]])
    assert late[0] == "error" and "no open reservation" in str(late[2])
    dp.close()
    assert _files(d, "busy") == []


def test_a_frame_trickled_past_the_timeout_is_cut_off(strict: tuple[Daemon, int]) -> None:
    d, _ = strict
    s = _raw(f"{d.socket}.data")
    frame = FRAME_PREFIX.pack(8) + b"\x91\x00" + bytes(6)
    start = time.monotonic()
    with contextlib.suppress(OSError):  # each byte within the timeout, the frame not
        for byte in frame:
            s.sendall(bytes([byte]))
            time.sleep(0.4)
    assert s.recv(1) == b""
    assert time.monotonic() - start < 4
    s.close()


def test_a_large_append_holds_no_memory_in_flight_while_it_streams(
    strict: tuple[Daemon, int],
) -> None:
    d, _ = strict
    head, _ = _append_head([AppendItem(R, "uint8", [48, 8], 40_000, 0, "flow", 0)])  # 15 MiB
    s = _raw(d.socket)
    s.sendall(head + bytes(4 << 20))  # its first MiB is buffered, the rest streams
    with PayloadClient(d.socket, data_plane=False) as c:
        wait_until(lambda: len(_files(d, "flow")) == 1, 10)
        time.sleep(0.2)  # a moment into the stream: time for bytes held in flight to show
        metrics = c._http.client.get("/metrics").text
    assert "\npayloadd_inflight_bytes 0.0\n" in metrics
    s.close()
