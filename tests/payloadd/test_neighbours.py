"""Strangers cannot starve the node.

Whatever arrives over TCP (HTTP or the peer port), idle, trickling or stalled mid-request,
the node's own clients on the Unix socket and its health probe are served; a stranger that
has not shown the token holds a connection for seconds, in a share of its own; one host holds
at most its share of the bytes in flight; and a call refused at a limit was not carried out.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from payload_client import BusyError, PayloadClient, PayloadSegment
from payload_client.protocol import PeerHello, PeerReply, PeerWelcome
from payload_client.wire._frames import FRAME_PREFIX
from tests.conftest import Daemons, free_port, wait_until
from tests.payloadd.procfs import accept_queue

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

R = "routed_experts"
TOKEN = "neighbours-token-" + "n" * 20
_reply = msgspec.msgpack.Decoder(PeerReply)


@dataclass(frozen=True)
class Node:
    root: Path
    sock: Path
    http: int
    peer: int
    log: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def stranger(self, source: str = "127.0.0.1") -> socket.socket:
        """A TCP connection to the HTTP port that sends nothing."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.settimeout(10)
        s.connect(("127.0.0.1", self.http))
        return s

    def server_errors(self) -> list[str]:
        text = self.log.read_text(errors="replace")
        return [line for line in text.splitlines() if "Exception in ASGI" in line]


def start_node(daemons: Daemons, *extra: str, nofile: int | None = None) -> Node:
    """Start node ``nb`` (until ``daemons`` closes): TCP and the peer port on loopback, the
    admin token `TOKEN`, its log in ``daemon.log``; under RLIMIT_NOFILE ``nofile``."""
    http, peer = free_port(), free_port()
    log = daemons.folder / "daemon.log"
    flags = ["--node", "nb", "--tcp-port", str(http), "--peer-port", str(peer), *extra]
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN)
    popen: dict[str, Any] = {}
    if nofile is not None:

        def lowered() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        popen["preexec_fn"] = lowered
    d = daemons.start(*flags, log=log, env=env, **popen)
    return Node(d.root, d.socket, http, peer, log)


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the daemon closes ``s`` within ``seconds`` (what it sends is thrown away)."""
    s.settimeout(0.2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if not s.recv(65536):
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def local_calls(n: Node, rounds: int) -> Callable[[int], list[str]]:
    """What a thread of the node's own clients does: health, append, stats, read, gc; the
    failures it met."""

    def work(i: int) -> list[str]:
        failures = []
        rows = np.full((4, 48, 8), i, np.uint8)
        with PayloadClient(n.sock, data_plane=False, timeout=10, token=TOKEN) as c:
            for k in range(rounds):
                try:
                    c.health()
                    (seg,) = c.append(R, rows, 0, run=f"local{i}", step=k)
                    np.testing.assert_array_equal(c.read_field([seg], R, 0, 4, 0), rows)
                    c.stats()
                    c.gc(run=f"local{i}", through_step=k)
                except Exception as exc:  # counted, and the test fails on it
                    failures.append(f"{type(exc).__name__}: {exc}")
        return failures

    return work


def released_together(work: Callable[[int], list[str]], threads: int) -> list[str]:
    """``work(i)`` in ``threads`` threads released by one barrier; every failure."""
    barrier = threading.Barrier(threads)
    found: list[list[str]] = [[] for _ in range(threads)]

    def run(i: int) -> None:
        barrier.wait()
        found[i] = work(i)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert not any(t.is_alive() for t in pool)
    return [f for part in found for f in part]


def test_idle_tcp_strangers_do_not_refuse_the_unix_socket(daemons: Daemons) -> None:
    """200 TCP connections that never send a head, beside 8 local clients released together:
    every local call (the health probe among them) is served. (One share for both used to
    refuse them all.)"""
    n = start_node(daemons, "--max-connections", "8")
    strangers = []
    for _ in range(200):
        with contextlib.suppress(OSError):
            strangers.append(n.stranger())
    wait_until(lambda: accept_queue(n.http) == 0, 10, "the daemon taking in the strangers")
    failures = released_together(local_calls(n, rounds=5), threads=8)
    for s in strangers:
        s.close()
    assert failures == []
    assert n.server_errors() == []


def test_a_stranger_has_seconds_to_show_the_token(daemons: Daemons) -> None:
    """A TCP connection that sends no head is closed within 5 s though request_timeout_s is
    30; a head without the token is answered 401 and its connection closed; one with it is
    served, and its connection kept."""
    n = start_node(daemons, "--request-timeout-s", "30", "--keep-alive-s", "30")
    idle = n.stranger()
    started = time.monotonic()
    assert closed_within(idle, 10)
    assert time.monotonic() - started < 10  # far below request_timeout_s
    no_token = n.stranger()
    no_token.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    no_token.settimeout(5)
    assert no_token.recv(65536).startswith(b"HTTP/1.1 401")
    assert closed_within(no_token, 5)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(headers=headers, timeout=10) as h:
        for _ in range(3):  # one connection, kept: a trusted one has keep_alive_s
            assert h.get(n.url("/healthz")).status_code == 200
        time.sleep(6)  # beyond the strangers' deadline, within keep_alive_s
        assert h.get(n.url("/healthz")).status_code == 200


def test_strangers_of_one_host_hold_a_share_of_their_own(daemons: Daemons) -> None:
    """With max_tcp_connections 64, strangers may hold 8 connections, 2 of one host: the
    third of 127.0.0.1 is answered 503 at once; another host (127.0.0.2) is served, and a
    stranger's request with the token takes it out of the strangers' share."""
    n = start_node(daemons, "--max-tcp-connections", "64")
    held = [n.stranger(), n.stranger()]
    wait_until(lambda: accept_queue(n.http) == 0, 10, "the daemon taking in both")
    third = n.stranger()
    third.settimeout(5)
    answer = third.recv(65536)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"retry-after: 1" in answer and b"a host's" in answer
    other = httpx.Client(
        transport=httpx.HTTPTransport(local_address="127.0.0.2"),
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    with other:
        assert other.get(n.url("/healthz")).status_code == 200
    held[0].sendall(
        f"GET /healthz HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10) as h:
        assert h.get(n.url("/healthz")).status_code == 200  # a place again for this host
    for s in held:
        s.close()


def _peer_stall(n: Node, announced: int) -> socket.socket:
    """A peer-port connection with the token that announces a frame and never sends it."""
    s = socket.create_connection(("127.0.0.1", n.peer), timeout=10)
    body = msgspec.msgpack.encode(PeerHello(TOKEN))
    s.sendall(FRAME_PREFIX.pack(len(body)) + body)
    (k,) = FRAME_PREFIX.unpack(s.recv(4, socket.MSG_WAITALL))
    assert isinstance(_reply.decode(s.recv(k, socket.MSG_WAITALL)), PeerWelcome)
    s.sendall(FRAME_PREFIX.pack(announced))
    return s


def _http_stall(n: Node, announced: int) -> socket.socket:
    """An HTTP read over TCP with the token that announces a body and never sends it."""
    s = socket.create_connection(("127.0.0.1", n.http), timeout=10)
    s.sendall(
        f"POST /v1/read HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
        f"content-type: application/msgpack\r\ncontent-length: {announced}\r\n\r\n".encode()
    )
    return s


def test_one_host_cannot_take_every_byte_in_flight(daemons: Daemons) -> None:
    """16 peer connections and 16 HTTP reads over TCP of one host, each announcing 16 MiB
    and never sending it: the host holds its share of max_inflight_bytes (256 MiB) and no
    more; appends and reads on the Unix socket, both planes, are served all the while."""
    n = start_node(daemons, "--request-timeout-s", "20")
    rows = np.full((64, 48, 8), 5, np.uint8)
    stalls = [_peer_stall(n, 16 << 20) for _ in range(16)]
    stalls += [_http_stall(n, 16 << 20) for _ in range(16)]
    time.sleep(1.0)  # time for the host to take more than its share, were it let (a bound)
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(n.sock)), base_url="http://payloadd"
    ) as h:
        metrics = h.get("/metrics").text
    held = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("payloadd_inflight_bytes ")
    )
    assert 0 < held <= 32 << 20  # the host's eighth: two of its 16 MiB frames
    for data_plane in (False, True):
        with PayloadClient(n.sock, data_plane=data_plane, timeout=10) as c:
            segs: list[PayloadSegment] = []
            for step in range(4):
                segs += c.append(R, rows, 0, run=f"dp{data_plane}", step=step)
            for seg in segs:
                np.testing.assert_array_equal(c.read_field([seg], R, 0, 64, 0), rows)
            c.health()
    for s in stalls:
        s.close()
    assert n.server_errors() == []


def test_appends_refused_under_a_low_limit_were_not_stored(daemons: Daemons) -> None:
    """Under RLIMIT_NOFILE 64, 16 threads released together make 640 HTTP appends: every
    one answered BusyError stored nothing (the daemon counts exactly the appends answered
    with segments, and holds exactly their rows), and no server error was logged."""
    answered = [0] * 16

    def work(i: int) -> list[str]:
        rows = np.full((2, 48, 8), i, np.uint8)
        with PayloadClient(n.sock, data_plane=False, timeout=20) as c:
            for k in range(40):
                try:
                    c.append(R, rows, 0, run=f"t{i}", step=k)
                    answered[i] += 1
                except BusyError:
                    pass
        return []

    n = start_node(daemons, nofile=64)
    released_together(work, threads=16)
    with PayloadClient(n.sock, data_plane=False, timeout=20, token=TOKEN) as c:
        stats = c.stats()
        usage = c.usage(max_steps=10_000)
    done = sum(answered)
    assert 0 < done <= 640
    assert stats.appends == done  # not one refused append was carried out
    assert stats.bytes_appended == done * 2 * 48 * 8
    steps = sum(len(r.steps) for r in usage.runs)
    assert steps == done
    assert n.server_errors() == []
