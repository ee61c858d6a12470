"""The hostile neighbours of ``payloadd soak --hostile``: strangers and a greedy token holder
pressing on the daemon's TCP port and peer port while the soak's load runs (`Neighbours`).

Every kind of neighbour keeps a number of connections open (`NeighbourPlan`), opens one
again when the daemon closes or refuses it, and counts what happened to it:

``idle_tcp``
    TCP connections that never send a byte (no head, no token).
``trickle_tcp``
    TCP connections sending a request head (no token) a byte every `TRICKLE_S` seconds;
    the head never ends.
``stalled_http``
    An HTTP request over TCP with the admin token, ``POST /v1/read`` announcing a body of
    `STALLED_BYTES` whose first bytes only are sent.
``idle_peer``
    Peer-port connections that never send their hello.
``trickle_peer``
    Peer-port connections trickling a hello (a wrong token) a byte every `TRICKLE_S`.
``stalled_peer``
    Peer-port connections with the right token: the hello, then a frame announcing
    `STALLED_BYTES` (at most the daemon's largest frame) of which nothing more is sent.

The strangers connect from ``127.0.0.2`` to ``127.0.0.5`` in turn (`HOSTS`; all of them
loopback addresses on Linux), so that they are several hosts to the daemon's per-host
shares; ``127.0.0.1``, the address of the soak's own TCP calls, is none of them. One thread
drives every connection (non-blocking sockets and a selector); it stops at the end of the
soak, closing them all.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from payload_client.protocol import FRAME_PREFIX, ErrorReply, PeerHello, PeerReply, PeerWelcome

__all__ = [
    "HOSTS",
    "KINDS",
    "STALLED_BYTES",
    "TRICKLE_S",
    "NeighbourPlan",
    "Neighbours",
]

KINDS = ("idle_tcp", "trickle_tcp", "stalled_http", "idle_peer", "trickle_peer", "stalled_peer")
"""The kinds of neighbour, in the report's order."""
HOSTS = 4
"""The strangers' source addresses: ``127.0.0.2`` and the next ``HOSTS - 1``."""
TRICKLE_S = 2.0
"""Seconds between two bytes of a trickling head or hello."""
STALLED_BYTES = 16 << 20
"""Bytes a stalled request announces (a peer frame: at most the daemon's largest frame)."""
REFUSED_S = 0.25
"""A connection the daemon ends this soon after it opened, unasked, was refused (the peer
port closes one beyond its limits at once)."""
REOPEN_S = 0.5
"""Seconds before a neighbour the daemon closed opens its connection again."""
BACKOFF_S = (0.25, 2.0)
"""After a refusal: the first pause before connecting again, and the longest (doubling). A
place the daemon frees goes to whichever neighbour asks first: of any kind, in the end."""
CONNECT_S = 2.0
"""Seconds a connect may take; then it counts as refused."""

_reply = msgspec.msgpack.Decoder(PeerReply)


@dataclass
class NeighbourPlan:
    """How many connections of each kind the neighbours keep open (`KINDS`)."""

    idle_tcp: int = 200
    trickle_tcp: int = 8
    stalled_http: int = 1
    idle_peer: int = 25
    trickle_peer: int = 8
    stalled_peer: int = 4

    @classmethod
    def of(cls, idle: int, trickle: int, stalled: int) -> NeighbourPlan:
        """The plan of ``--hostile-idle``, ``--hostile-trickle`` and ``--hostile-stalled``:
        an eighth as many idle peer connections as idle TCP ones (at least one), one stalled
        HTTP request."""
        return cls(idle, trickle, 1, max(1, idle // 8), trickle, stalled)

    def total(self) -> int:
        """Connections at most open at once."""
        return sum(getattr(self, k) for k in KINDS)


@dataclass
class _Slot:
    """One neighbour: its connection (``None`` between two), and what it does next."""

    kind: str
    source: str | None
    sock: socket.socket | None = None
    state: str = "closed"  # connecting, open (sending its script), welcome (awaiting it)
    opened: float = 0.0
    sent: int = 0  # bytes of its script sent
    next_at: float = 0.0  # when to connect again, or to send its next byte
    refusals: int = 0  # in a row
    inbox: bytearray = field(default_factory=bytearray)


def _http_head(token: str | None) -> bytes:
    if token is None:  # a stranger's head, trickled, that never ends
        return b"GET /healthz HTTP/1.1\r\nHost: payloadd\r\nX-Pad: " + b"a" * 65536
    return (
        (
            "POST /v1/read HTTP/1.1\r\nHost: payloadd\r\nContent-Type: application/msgpack\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {STALLED_BYTES}\r\n\r\n"
        ).encode()
        + b"\x91"
        + b"\x00" * 15
    )


def _frame(message: object) -> bytes:
    body = msgspec.msgpack.encode(message)
    return FRAME_PREFIX.pack(len(body)) + body


class Neighbours:
    """The hostile neighbours of one soak (see the module docstring).

    Parameters
    ----------
    tcp : tuple of (str, int)
        The daemon's TCP listener.
    peer : tuple of (str, int)
        Its peer port.
    token : str
        The admin token (the stalled HTTP request and the stalled peer frames hold it).
    plan : NeighbourPlan
        How many of each kind.
    """

    def __init__(
        self, tcp: tuple[str, int], peer: tuple[str, int], token: str, plan: NeighbourPlan
    ) -> None:
        self.tcp, self.peer, self.token, self.plan = tcp, peer, token, plan
        self.counts: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
        self.held_s: dict[str, float] = dict.fromkeys(KINDS, 0.0)  # longest a daemon kept one
        self.most_open = 0
        self.failed: str | None = None  # why the thread ended before it was stopped
        self.hosts = HOSTS  # 1 where the other loopback addresses cannot be bound
        self._sel = selectors.DefaultSelector()
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._scripts = {
            "trickle_tcp": _http_head(None),
            "stalled_http": _http_head(token),
            "trickle_peer": _frame(PeerHello("not-the-token-" + "x" * 32)),
            "stalled_peer": _frame(PeerHello(token)),
        }

    # -- the thread ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Keep every neighbour's connection open until ``stop`` is set; then close them."""
        most = max(getattr(self.plan, kind) for kind in KINDS)
        kinds = [k for i in range(most) for k in KINDS if i < getattr(self.plan, k)]
        for n, kind in enumerate(kinds):  # the kinds in turn, spread over the hosts
            source = f"127.0.0.{2 + n % HOSTS}"
            self._slots.append(_Slot(kind, source, next_at=time.monotonic() + 0.002 * n))
        try:
            while not stop.is_set():
                now = time.monotonic()
                for slot in self._slots:
                    if slot.next_at <= now:
                        self._due(slot, now)
                soonest = min((s.next_at for s in self._slots), default=now + 0.1)
                wait = min(max(soonest - time.monotonic(), 0.0), 0.1)
                for key, _ in self._sel.select(wait):
                    self._ready(key.data)
        except OSError as exc:  # (out of descriptors, say): the soak fails, saying so
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            now = time.monotonic()
            for slot in self._slots:
                if slot.sock is not None and slot.state != "connecting":
                    self._held(slot, now)  # still open at the end
                self._close(slot)
            self._sel.close()

    def _due(self, slot: _Slot, now: float) -> None:
        """The slot's time has come: connect, give up a connect, or send a trickled byte."""
        if slot.state == "closed":
            self._connect(slot, now)
        elif slot.state == "connecting":
            self._end(slot, "refused", now)  # no connection within CONNECT_S
        elif slot.state == "open" and slot.kind.startswith("trickle"):
            script = self._scripts[slot.kind]
            if slot.sent < len(script):
                try:
                    slot.sent += slot.sock.send(script[slot.sent : slot.sent + 1])  # type: ignore[union-attr]
                except OSError:
                    self._end(slot, "closed", now)
                    return
            slot.next_at = now + TRICKLE_S
        else:
            slot.next_at = float("inf")  # it waits for the daemon

    def _connect(self, slot: _Slot, now: float) -> None:
        peer = slot.kind.endswith("_peer")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if slot.source is not None:
                sock.bind((slot.source, 0))
        except OSError as exc:  # no such loopback address here: every stranger from one
            if exc.errno != errno.EADDRNOTAVAIL:
                sock.close()
                raise
            self.hosts = 1
            for s in self._slots:
                s.source = None
            sock.close()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
        err = sock.connect_ex(self.peer if peer else self.tcp)
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._count(slot.kind, "opened")
            slot.opened = now
            self._end(slot, "refused", now)
            return
        slot.sock, slot.state, slot.opened, slot.sent = sock, "connecting", now, 0
        slot.inbox.clear()
        slot.next_at = now + CONNECT_S
        self._count(slot.kind, "opened")
        self._sel.register(sock, selectors.EVENT_WRITE, slot)
        with self._lock:
            self.most_open = max(self.most_open, len(self._sel.get_map()))

    def _ready(self, slot: _Slot) -> None:
        now = time.monotonic()
        sock = slot.sock
        if sock is None:
            return
        if slot.state == "connecting":
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._end(slot, "refused", now)
                return
            slot.state = "open"
            self._sel.modify(sock, selectors.EVENT_READ, slot)
            slot.next_at = now + (TRICKLE_S if slot.kind.startswith("trickle") else float("inf"))
            if slot.kind.startswith("stalled"):
                self._send_all(slot, self._scripts[slot.kind], now)
                slot.state = "welcome" if slot.kind == "stalled_peer" else "open"
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            unasked = slot.sent == 0 and now - slot.opened < REFUSED_S
            self._end(slot, "refused" if unasked else "closed", now)
            return
        slot.inbox += data
        if slot.kind.endswith("_peer"):
            self._peer_reply(slot, now)
        else:
            self._http_answer(slot, now)

    def _http_answer(self, slot: _Slot, now: float) -> None:
        """An answer to a TCP neighbour: a 503 is a refusal; another status (408, 401) ends
        its connection, counted by status."""
        line = bytes(slot.inbox.split(b"\r\n", 1)[0])
        if b"\r\n" not in slot.inbox and len(slot.inbox) < 64:
            return  # the status line is not whole yet
        status = line.split(b" ")[1].decode(errors="replace") if b" " in line else "?"
        self._count(slot.kind, f"answered {status}")
        self._end(slot, "refused" if status == "503" else "closed", now)

    def _peer_reply(self, slot: _Slot, now: float) -> None:
        """A frame to a peer neighbour: the welcome lets the stalled one announce its frame;
        an error is a refusal."""
        if len(slot.inbox) < FRAME_PREFIX.size:
            return
        (n,) = FRAME_PREFIX.unpack_from(slot.inbox)
        if len(slot.inbox) < FRAME_PREFIX.size + n:
            return
        try:
            reply: Any = _reply.decode(slot.inbox[FRAME_PREFIX.size : FRAME_PREFIX.size + n])
        except msgspec.DecodeError:
            reply = None
        if isinstance(reply, PeerWelcome) and slot.state == "welcome":
            slot.inbox.clear()
            slot.state = "open"
            announced = min(STALLED_BYTES, reply.max_frame)
            self._send_all(slot, FRAME_PREFIX.pack(announced) + b"\x00" * 16, now)
            return
        what = reply.error if isinstance(reply, ErrorReply) else "?"
        self._count(slot.kind, f"answered {what}")
        self._end(slot, "refused" if what in ("BusyError", "?") else "closed", now)

    def _send_all(self, slot: _Slot, data: bytes, now: float) -> None:
        try:
            assert slot.sock is not None
            slot.sock.sendall(data)  # a few hundred bytes at most: the buffer takes them
            slot.sent += len(data)
        except OSError:
            self._end(slot, "closed", now)

    def _end(self, slot: _Slot, how: str, now: float) -> None:
        """The daemon ended (``closed``) or refused (``refused``) the slot's connection."""
        if slot.sock is not None and how == "closed":
            self._held(slot, now)
        self._count(slot.kind, how)
        self._close(slot)
        if how == "refused":
            slot.refusals += 1
            first, most = BACKOFF_S
            slot.next_at = now + min(most, first * 2 ** (slot.refusals - 1))
        else:
            slot.refusals = 0
            slot.next_at = now + REOPEN_S

    def _held(self, slot: _Slot, now: float) -> None:
        with self._lock:
            self.held_s[slot.kind] = max(self.held_s[slot.kind], now - slot.opened)

    def _close(self, slot: _Slot) -> None:
        if slot.sock is not None:
            self._sel.unregister(slot.sock)
            slot.sock.close()
            slot.sock = None
        slot.state = "closed"

    def _count(self, kind: str, what: str) -> None:
        with self._lock:
            self.counts[kind][what] += 1

    # -- the report ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What the neighbours did, per kind: connections opened, closed by the daemon,
        refused (a 503, an error frame, a connection ended at once or never made), the
        answers by status, and the longest one was open (seconds; those still open at the
        end included)."""
        with self._lock:
            kinds = {
                k: {
                    "planned": getattr(self.plan, k),
                    "opened": c["opened"],
                    "closed": c["closed"],
                    "refused": c["refused"],
                    "answers": {
                        a[9:]: n for a, n in sorted(c.items()) if a.startswith("answered ")
                    },
                    "held_max_s": round(self.held_s[k], 1),
                }
                for k, c in self.counts.items()
            }
            return {"kinds": kinds, "most_open": self.most_open, "hosts": self.hosts}
