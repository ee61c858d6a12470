"""The peer port (reads between nodes over TCP, no HTTP) against a real daemon: the token at
connect, its frames fuzzed, its limits (frame sizes, connections per host, a peer that stops
reading or sending), the errors a read answers, and the client's fallback to HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import resource
import socket
import struct
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from payload_client import (
    BusyError,
    FileGoneError,
    FileMissingError,
    PayloadClient,
    PayloadSegment,
    SegmentFileError,
)
from payload_client.protocol import (
    FRAME_PREFIX,
    PEER_VERSION,
    AppendItem,
    ErrorReply,
    Extent,
    PeerBytes,
    PeerHello,
    PeerRead,
    PeerReply,
    PeerWelcome,
)
from payload_client.transports import (
    AsyncPeerTransport,
    DataPlaneDownError,
    ReadCall,
    SyncPeerTransport,
)
from payload_client.transports._peer import CONNECT_S
from payload_client.transports._timeout import Timeout
from tests.conftest import Daemons, free_port, wait_until
from tests.payloadd.procfs import fds, status, tcp_open
from tests.payloadd.test_metrics import Samples, delta, scrape

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

TOKEN = "peer-port-token-" + "z" * 20
_reply = msgspec.msgpack.Decoder(PeerReply)


@dataclass(frozen=True)
class Peer:
    root: Path
    path: Path  # the daemon's Unix socket
    http: int
    port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def client(self, **kw: object) -> PayloadClient:
        return PayloadClient(base_url=self.url, token=TOKEN, **kw)  # type: ignore[arg-type]

    def local(self) -> PayloadClient:
        return PayloadClient(self.path, token=TOKEN)

    def connect(self, hello: bool = True) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if hello:
            send(s, PeerHello(TOKEN))
            assert isinstance(recv(s), PeerWelcome)
        return s

    def metrics(self) -> Samples:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            return scrape(h)


LIMITS = ("--request-timeout-s", "2", "--keep-alive-s", "1",
          "--max-peer-connections-per-host", "6")  # fmt: skip
"""The limits of the `peer` daemon."""


def start_peer(daemons: Daemons, *flags: str, **popen: Any) -> Peer:
    """Start node ``pp`` (until ``daemons`` closes) with TCP and the peer port on loopback,
    the admin token `TOKEN`, and ``flags``."""
    http, port = free_port(), free_port()
    ports = ("--tcp-port", str(http), "--peer-port", str(port))
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN)
    d = daemons.start("--node", "pp", *ports, *flags, env=env, **popen)
    return Peer(d.root, d.socket, http, port, d.pid)


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    with Daemons(tmp_path_factory.mktemp("peer")) as d:
        yield start_peer(d, *LIMITS)


def send(s: socket.socket, msg: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(msg)
    s.sendall(FRAME_PREFIX.pack(len(body)) + body)


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv(s: socket.socket) -> object:
    (n,) = FRAME_PREFIX.unpack(recv_exact(s, 4))
    return _reply.decode(recv_exact(s, n))


def closed(s: socket.socket, within: float = 10.0) -> bool:
    """Whether the daemon closes ``s`` (EOF or reset) within ``within`` seconds, what it
    sends before that read and thrown away."""
    s.settimeout(within)
    try:
        while s.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def read8(c: PayloadClient, segs: list[PayloadSegment], lo: int, hi: int) -> np.ndarray:
    """The routing rows ``[lo, hi)`` as stored (``uint8``)."""
    got = c.read_field(segs, "routed_experts", lo, hi, 0, dtype=np.uint8)
    assert got is not None
    return got


def written(peer: Peer, n: int = 64, seed: int = 0) -> tuple[list[PayloadSegment], np.ndarray]:
    rows = np.random.default_rng(seed).integers(0, 255, (n, 48, 8), dtype=np.uint8)
    with peer.local() as c:
        return c.append("routed_experts", rows, 0, run="pp", step=seed), rows


def test_a_read_over_the_peer_port(peer: Peer) -> None:
    segs, rows = written(peer)
    with peer.client() as c:
        assert c.health().peer_port == peer.port  # /healthz names it, and so does the
        before = peer.metrics()  # header of that answer: the read goes over the peer port
        got = read8(c, segs, 3, 60)
    assert np.array_equal(got, rows[3:60])
    after = peer.metrics()
    field = {"field": "routed_experts"}
    assert delta(before, after, "payloadd_read_bytes_total", transport="peer", **field) == 57 * 384
    assert delta(before, after, "payloadd_read_bytes_total", transport="http", **field) == 0


def test_a_wrong_token_or_no_hello_is_refused_before_anything_else(peer: Peer) -> None:
    segs, _ = written(peer, seed=1)
    extent = Extent(segs[0].file, 0, 384, 384 * 64)
    for first in (PeerHello("wrong-" * 8), PeerRead([extent]), PeerHello("")):
        with peer.connect(hello=False) as s:
            send(s, first)
            reply = recv(s)
            assert isinstance(reply, ErrorReply) and reply.error == "UnauthorizedError"
            assert "the peer port needs the admin token first" in reply.message
            with contextlib.suppress(OSError):
                send(s, PeerRead([extent]))  # never answered: the connection is closed
            assert closed(s)


def test_a_hello_too_large_or_too_late_is_cut_off(peer: Peer) -> None:
    with peer.connect(hello=False) as s:
        s.sendall(FRAME_PREFIX.pack(1 << 30))  # a gigabyte of hello is never waited for
        assert closed(s, 5)
    with peer.connect(hello=False) as s:
        start = time.monotonic()
        assert closed(s, 10)  # silence after connecting: dropped after request_timeout_s
        assert 1.5 < time.monotonic() - start < 9
    with peer.connect(hello=False) as s:
        s.sendall(FRAME_PREFIX.pack(40) + b"\x93")  # a hello that stops mid-way
        assert closed(s, 10)


def test_a_trickling_hello_is_cut_off_at_its_deadline(peer: Peer) -> None:
    """A byte every 1.5 s, each within the socket's receive timeout (2 s here): the hello
    must still be whole within its 2 s (``request_timeout_s``), however it trickles."""
    body = msgspec.msgpack.encode(PeerHello(TOKEN))
    data = FRAME_PREFIX.pack(len(body)) + body
    stop = threading.Event()
    with peer.connect(hello=False) as s:

        def trickle() -> None:
            for b in data[:-1]:  # never whole
                if stop.wait(1.5):
                    return
                with contextlib.suppress(OSError):
                    s.send(bytes([b]))

        start = time.monotonic()
        t = threading.Thread(target=trickle)
        t.start()
        try:
            assert closed(s, 12)
            assert time.monotonic() - start < 2 + 1.5  # its deadline, not bytes x gaps
        finally:
            stop.set()
            t.join(10)


def test_a_hello_of_another_protocol_version_is_refused_in_words(peer: Peer) -> None:
    with peer.connect(hello=False) as s:
        send(s, PeerHello(TOKEN, version=PEER_VERSION + 1))
        got = recv(s)
        assert isinstance(got, ErrorReply) and got.error == "InvalidRequestError"
        assert f"version {PEER_VERSION}, the hello says {PEER_VERSION + 1}" in got.message
        assert closed(s, 5)


def test_errors_of_a_read_keep_the_connection(peer: Peer) -> None:
    segs, rows = written(peer, seed=2)
    f = segs[0].file
    with peer.connect() as s:
        for extents, error in [
            ([Extent("pp/pp/2/missing", 0, 8, 8)], "FileMissingError"),
            ([Extent("../etc/passwd", 0, 8, 8)], "InvalidSegmentError"),
            ([Extent(f, 0, 384, 384 * 65)], "SegmentFileError"),  # longer than the file
            ([Extent(f, 0, 10, 5)], "InvalidRequestError"),  # past its segment's end
        ]:
            send(s, PeerRead(extents))
            reply = recv(s)
            assert isinstance(reply, ErrorReply) and reply.error == error, reply
        send(s, PeerRead([Extent(f, 384, 768, 384 * 64)]))  # and then a good read
        reply = recv(s)
        assert reply == PeerBytes(768)
        assert recv_exact(s, 768) == rows[1:3].tobytes()


def test_read_errors_reach_the_client_as_their_classes(peer: Peer) -> None:
    segs, _ = written(peer, seed=3)
    with peer.client() as c:
        bad = [msgspec.structs.replace(s, file="pp/pp/3/nothere") for s in segs]
        with pytest.raises(FileMissingError):
            c.read_field(bad, "routed_experts", 0, 4, 0)
        long = [msgspec.structs.replace(s, rows=s.rows + 1) for s in segs]
        with pytest.raises(SegmentFileError):
            c.read_field(long, "routed_experts", 0, 4, 0)
        with peer.local() as local:
            local.gc(run="pp", through_step=3)
        with pytest.raises(FileGoneError, match="garbage-collected"):
            c.read_field(segs, "routed_experts", 0, 4, 0)


def test_fuzzed_frames_get_an_answer_or_a_closed_connection(peer: Peer) -> None:
    """Seeded garbage after a good hello: random bytes, random msgpack, requests with bad
    fields, absurd lengths. Each connection is answered or closed within seconds; the daemon
    then still serves, with no thread left behind."""
    segs, rows = written(peer, seed=4)
    rng = np.random.default_rng(2026)
    before = status(peer.pid, "Threads")
    shapes = [
        lambda: rng.bytes(int(rng.integers(0, 64))),
        lambda: msgspec.msgpack.encode(["read", [[str(rng.integers(9)), -1, 5, 2]]]),
        lambda: msgspec.msgpack.encode(["read", "not a list"]),
        lambda: msgspec.msgpack.encode(["hello", TOKEN]),
        lambda: msgspec.msgpack.encode(["welcome", "x", 1, 1, 1]),
        lambda: msgspec.msgpack.encode(["read", [[segs[0].file, 0, 1 << 62, 1 << 62]]]),
        lambda: msgspec.msgpack.encode({"extents": []}),
        lambda: msgspec.msgpack.encode(["read", [[segs[0].file, 0, 0, 0]] * 3]),
    ]
    for i in range(120):
        body = shapes[i % len(shapes)]()
        prefix = FRAME_PREFIX.pack(len(body))
        if i % 11 == 0:
            prefix = FRAME_PREFIX.pack(int(rng.integers(1 << 24, 1 << 32)))  # above any limit
        with peer.connect() as s:
            s.sendall(prefix + body)
            s.settimeout(10)
            try:
                reply = recv(s)
            except (ConnectionError, TimeoutError):
                assert i % 11 == 0 or len(body) == 0, (i, body)
                continue
            assert isinstance(reply, ErrorReply | PeerBytes), (i, reply)
            if isinstance(reply, PeerBytes):
                recv_exact(s, reply.nbytes)
    with peer.client() as c:
        assert np.array_equal(read8(c, segs, 0, 64), rows)
    wait_until(lambda: status(peer.pid, "Threads") <= before, 10, "the daemon's threads back")


def _unread(s: socket.socket) -> int:
    """Bytes waiting in the receive buffer of ``s``."""
    return int(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, bytes(4)))[0])


def test_a_peer_that_stops_reading_does_not_hold_the_daemon(daemons: Daemons) -> None:
    peer = start_peer(daemons, *LIMITS)
    rows = np.random.default_rng(5).integers(0, 255, (1 << 17, 48, 8), dtype=np.uint8)
    with peer.local() as c:  # 48 MiB: far more than the socket buffers hold
        segs = c.append("routed_experts", rows, 0, run="big", step=0)
    extents = [Extent(s.file, s.offset, s.rows * 384, s.offset + s.rows * 384) for s in segs]
    stuck = peer.connect()
    send(stuck, PeerRead(extents))
    wait_until(lambda: _unread(stuck) > 0, 10, "the answer to the stuck peer")
    with peer.client() as c:  # others are served meanwhile
        got = read8(c, segs, 100, 200)
        assert np.array_equal(got, rows[100:200])
    mine = {stuck.getsockname()[1]}  # request_timeout_s is 2: the daemon gives up on it
    wait_until(lambda: not tcp_open(peer.port, mine), 10, "the daemon closing the stuck one")
    total = 0
    with contextlib.suppress(ConnectionError):
        stuck.settimeout(10)
        while chunk := stuck.recv(1 << 20):
            total += len(chunk)
    stuck.close()
    assert total < len(rows) * 384  # cut short, not waited for


def test_connections_beyond_the_limit_per_host_are_closed_at_once(
    peer: Peer, caplog: pytest.LogCaptureFixture
) -> None:
    held = [peer.connect() for _ in range(6)]
    try:
        with socket.create_connection(("127.0.0.1", peer.port), timeout=10) as s:
            with contextlib.suppress(OSError):
                send(s, PeerHello(TOKEN))
            assert closed(s, 5)
        segs, rows = written(peer, seed=6)
        with peer.client() as c:
            c.stats()  # an answer names the peer port: the read tries it first
            before = peer.metrics()
            with caplog.at_level("WARNING", logger="payload_client"):
                assert np.array_equal(read8(c, segs, 0, 8), rows[:8])  # then reads over HTTP
            after = peer.metrics()
        said = [r.getMessage() for r in caplog.records if r.name == "payload_client"]
        assert len(said) == 1 and f"(peer port {peer.port})" in said[0], said
        assert "its reads go over HTTP for 30 s" in said[0], said
        assert delta(before, after, "payloadd_read_bytes_total", field="routed_experts",
                     transport="http") == 8 * 384  # fmt: skip
        assert delta(before, after, "payloadd_refused_total", transport="peer",
                     reason="connections") >= 1  # fmt: skip
    finally:
        for s in held:
            s.close()


def test_idle_connections_are_closed_and_the_client_makes_new_ones(peer: Peer) -> None:
    segs, rows = written(peer, seed=7)
    with peer.client(timeout=httpx.Timeout(10.0)) as c:
        for pause in (0.0, 1.5, 0.0):  # the daemon closes connections idle for 1 s
            time.sleep(pause)
            assert np.array_equal(read8(c, segs, 0, 64), rows)


def test_ranks_at_once_on_the_peer_port(peer: Peer) -> None:
    """Threads sharing one client, and threads with their own, released by a barrier onto
    a new step: every window right."""
    segs, rows = written(peer, n=4096, seed=8)
    barrier = threading.Barrier(12)
    errors: list[BaseException] = []
    shared = peer.client()

    def rank(r: int) -> None:
        try:
            own = r % 2 == 0
            c = peer.client() if own else shared
            lo = (r * 300) % 3800
            barrier.wait(timeout=30)
            for _ in range(10):
                got = read8(c, segs, lo, lo + 256)
                assert np.array_equal(got, rows[lo : lo + 256])
            if own:
                c.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    shared.close()
    assert not errors, errors


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_port_that_never_answers_the_hello_is_given_up_in_seconds(mode: str) -> None:
    """A peer port behind a firewall that drops, or a process that accepts and hangs: the
    client gives it up after `CONNECT_S` (HTTP carries the read), not after its 60 s."""
    with socket.create_server(("127.0.0.1", 0)) as hole:  # listens, never accepts
        port = hole.getsockname()[1]
        call = ReadCall("POST", "/v1/read", decode=lambda _: [], expected=0,
                        extents=lambda: [])  # fmt: skip
        timeout = Timeout(connect=60.0)
        start = time.monotonic()
        with pytest.raises(DataPlaneDownError, match="cannot reach"):
            if mode == "sync":
                SyncPeerTransport("127.0.0.1", port, TOKEN, timeout, "x").handle_call(call)
            else:
                t = AsyncPeerTransport("127.0.0.1", port, TOKEN, timeout, "x")
                asyncio.run(t.handle_async_call(call))
        assert CONNECT_S - 0.5 < time.monotonic() - start < CONNECT_S + 5


def test_where_sendfile_is_not_served_the_bytes_are_sent_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some FUSE file systems answer ``sendfile`` with EINVAL: the answer is then pread and
    written by hand, the same bytes, through a socket that fills up."""
    from payloadd.store._store import Store

    store = Store(tmp_path / "root", "n")
    rows = np.random.default_rng(9).integers(0, 255, (1 << 14, 48, 8), dtype=np.uint8)
    pending = store.begin_append([AppendItem("f", "uint8", [48, 8], len(rows), 0, "r", 0)])
    try:
        pending.write(rows.tobytes())
        seg = pending.commit()[0][0]
    finally:
        pending.close()
    calls = []

    def refuse(*args: object) -> int:
        calls.append(args)
        raise OSError(errno.EINVAL, "sendfile: not here")

    monkeypatch.setattr(os, "sendfile", refuse)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        got = bytearray()

        def wait() -> None:  # the reader drains what the writer could not send
            got.extend(b.recv(1 << 20))

        reader = store.open_extents([Extent(seg.file, seg.offset, rows.nbytes, rows.nbytes)])
        try:
            reader.send_to(a.fileno(), wait)
        finally:
            reader.close()
        b.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while chunk := b.recv(1 << 20):
                got.extend(chunk)
    assert len(calls) == 1 and bytes(got) == rows.tobytes()


def test_under_a_low_descriptor_limit_the_peer_port_sheds_and_keeps_serving(
    daemons: Daemons,
) -> None:
    """RLIMIT_NOFILE 96: 60 connections that never send a hello, then a read of 20 new
    files at once (its per-request share is 30): the daemon stays under its limit, answers (rows, or a clear refusal),
    drops the silent ones after the hello's time, and serves over the peer port again."""

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    flags = ("--request-timeout-s", "2", "--max-peer-connections-per-host", "200")
    peer = start_peer(daemons, *flags, preexec_fn=low)
    port, pid = peer.port, peer.pid
    rows = np.arange(20 * 384, dtype=np.uint32).astype(np.uint8).reshape(20, 48, 8)
    with peer.local() as c:
        segs = [s for i in range(20)
                for s in c.append("routed_experts", rows[i : i + 1], i, run="low", step=i)]  # fmt: skip
    silent = []
    for _ in range(60):
        with contextlib.suppress(OSError):
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    silent_ports = {s.getsockname()[1] for s in silent}
    try:
        assert len(fds(pid)) <= 96
        with peer.client(timeout=10) as c:
            c.stats()  # the port is named: the read tries it first
            try:
                assert np.array_equal(read8(c, segs, 0, 20), rows)
            except BusyError as exc:
                assert "try again" in str(exc)
        assert len(fds(pid)) <= 96
    finally:
        for s in silent:
            s.close()
    wait_until(lambda: not tcp_open(port, silent_ports), 30, "the silent ones gone")
    with peer.client() as c:
        c.stats()
        before = peer.metrics()
        assert np.array_equal(read8(c, segs, 0, 20), rows)
        after = peer.metrics()
    assert delta(before, after, "payloadd_read_bytes_total", field="routed_experts",
                 transport="peer") == 20 * 384  # fmt: skip
