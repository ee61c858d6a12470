"""The peer port: reads of this node's files by other nodes over TCP, without HTTP.

Off by default; the daemon serves it (``peer_port``) only with an admin token. Frames are
the data plane's (`payload_client.wire._peer` draws the exchange): a connection's first
frame is a `PeerHello`, at most `HELLO_BYTES`, within ``request_timeout_s`` of connecting;
its token is compared in constant time before anything of the root is touched, and a wrong
one is answered `UnauthorizedError` and the connection closed. Then each `PeerRead` is
checked and its files opened exactly as ``POST /v1/read`` does (`Store.open_extents`: the
ledger, the root's policy, the per-request descriptors), answered `PeerBytes` and the bytes,
sent with ``os.sendfile`` from the page cache to the socket (no copy through the daemon), or
answered with its error, the connection kept.

Bounded like the data plane (`payloadd.server.framed._listener.Listener`): connections (in
all, ``max_peer_connections``, and from one host, ``max_peer_connections_per_host``), frames
(``max_control_bytes``), extents a read (`MAX_EXTENTS`), bytes a read
(``max_request_bytes``), time: a frame that stalls, or a peer that takes no byte of an
answer for ``request_timeout_s``, has its connection dropped; a connection idle longer than
``keep_alive_s`` is closed.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

import msgspec

from payload_client import (
    BusyError,
    InvalidRequestError,
    PayloadError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from payload_client.protocol import (
    HELLO_BYTES,
    PEER_VERSION,
    FrameReader,
    PeerBytes,
    PeerHello,
    PeerRead,
    PeerRequest,
    PeerWelcome,
    encode_frame,
)
from payloadd.server._metrics import Metrics
from payloadd.server._tokens import Tokens
from payloadd.server.framed._listener import (
    SMALL_FRAME,
    Listener,
    StalledError,
    error_reply,
    set_timeouts,
)
from payloadd.store._budget import Descriptors, InFlight
from payloadd.store._counts import PEER
from payloadd.store._store import Store

__all__ = ["MAX_EXTENTS", "PeerServer"]

HELLO_S = 5.0
"""Seconds a new connection has to send its whole hello."""
MIN_RATE = 1 << 20
"""Bytes a second a peer must take an answer at, at least (over the whole answer)."""
MAX_EXTENTS = 1 << 20
"""Most extents one read may list (a packed micro batch of one-row segments needs one each)."""

_request = msgspec.msgpack.Decoder(PeerRequest)


class _IdleError(Exception):
    """The connection idled longer than ``keep_alive_s``."""


class PeerServer(Listener):
    """Serve reads of ``store``'s files to other nodes on a TCP listening socket, to those
    that show the admin token first.

    Parameters
    ----------
    store : Store
        The storage core (checks, opens, counters).
    token : Tokens
        The admin tokens (one of them: every connection must send it first).
    fds : Descriptors
        The daemon's descriptor shares: connections beyond ``peer_connections`` are closed
        at once; reads take their files from the per-request share.
    metrics : Metrics, optional
        Where requests, errors and refused connections are counted.
    max_frame : int
        Largest request frame, in bytes.
    max_per_host : int
        Most connections open at once from one address.
    request_timeout : float
        Seconds a started frame may take to arrive whole, or a send may wait.
    idle_timeout : float
        Seconds a connection may wait between requests; then it is closed.
    inflight : InFlight, optional
        Bytes of request frames being received at once, shared with HTTP and the data
        plane (default: a cap of 256 MiB of its own).
    """

    def __init__(
        self,
        store: Store,
        token: Tokens,
        fds: Descriptors,
        *,
        metrics: Metrics | None = None,
        max_frame: int = 16 << 20,
        max_per_host: int = 16,
        request_timeout: float = 30.0,
        idle_timeout: float = 5.0,
        inflight: InFlight | None = None,
    ) -> None:
        super().__init__("peer port", PEER, metrics, request_timeout)
        self.store, self.fds = store, fds
        self.max_frame, self.max_per_host = max_frame, max_per_host
        self.idle_timeout = idle_timeout
        self.inflight = inflight or InFlight(256 << 20)
        self._token = token
        self.port = 0  # once started
        self.welcome = PeerWelcome(store.node, max_frame, store.reads.max_read_bytes, MAX_EXTENTS)

    def start(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` (a bound TCP socket) in a background thread."""
        self.listen(listener)
        host, port = listener.getsockname()[:2]
        self.port = int(port)
        self.log.info("peer port on %s:%d (reads by other nodes; the admin token required)",
                      host, port)  # fmt: skip

    def limit(self) -> int:
        """The peer port's share of descriptors for connections."""
        return self.fds.shares.peer_connections

    def admits(self, address: Any, open_now: list[Any]) -> bool:
        """At most ``max_per_host`` connections from one host."""
        host = address[0]
        return sum(1 for a in open_now if a[0] == host) < self.max_per_host

    # -- serving one connection ----------------------------------------------------------

    def serve(self, sock: socket.socket, address: Any) -> None:
        """The hello, then the connection's reads one after the other until it ends."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self._hello(sock):
            return
        host = str(address[0])
        while True:
            try:
                got = self._frame(sock, self.max_frame, self.idle_timeout, host)
            except _IdleError:
                return
            except (PayloadTooLargeError, BusyError) as exc:
                if isinstance(exc, BusyError) and self.metrics is not None:
                    self.metrics.refused_one(PEER, "inflight")
                sock.sendall(encode_frame(error_reply(exc, self.name, self.log)))
                return
            if got is None:
                return
            body, held = got
            try:
                if not self._answer(sock, body):
                    return
            finally:
                if held:
                    self.inflight.release(held, host)

    def _hello(self, sock: socket.socket) -> bool:
        """Whether the connection's first frame, whole within `HELLO_S` of connecting, is a
        hello with a token the daemon accepts (it is answered either way, if it came)."""
        started = time.monotonic()
        set_timeouts(sock, min(HELLO_S, self.request_timeout))
        try:
            got = self._hello_frame(sock, started + min(HELLO_S, self.request_timeout))
        except (PayloadTooLargeError, StalledError):
            got = None
        hello = _decoded(got) if got is not None else None
        exc: PayloadError | None = None
        if not isinstance(hello, PeerHello) or not self._token.accepts(hello.token.encode()):
            what = "the token sent is not it" if isinstance(hello, PeerHello) else "no hello"
            exc = UnauthorizedError(f"the peer port needs the admin token first; {what}")
        elif hello.version != PEER_VERSION:
            exc = InvalidRequestError(
                f"this daemon's peer port speaks version {PEER_VERSION}, the hello says "
                f"{hello.version}: use a payload-client of the daemon's version"
            )
        if exc is not None:
            self._count("hello", started, exc)
            if got is not None:
                sock.sendall(encode_frame(error_reply(exc, self.name, self.log)))
            return False
        set_timeouts(sock, self.request_timeout)
        sock.sendall(encode_frame(self.welcome))
        self._count("hello", started)
        return True

    def _idle(self) -> None:
        raise _IdleError

    @staticmethod
    def _hello_frame(sock: socket.socket, deadline: float) -> bytearray | None:
        """The hello frame's body, whole by ``deadline`` however slowly it trickles in;
        ``None`` when the connection ended first.

        Raises
        ------
        StalledError
            The hello was not whole by ``deadline``.
        PayloadTooLargeError
            Its prefix gives a body above `HELLO_BYTES`.
        """
        frame = FrameReader(HELLO_BYTES, "peer hello")
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        while not frame.done():
            left = deadline - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000):
                raise StalledError
            try:
                k = sock.recv_into(frame.buffer())
            except BlockingIOError:  # woken with nothing to read
                continue
            if not k:
                return None
            frame.received(k)
        return frame.body()

    def _frame(
        self, sock: socket.socket, limit: int, first_wait: float, host: str
    ) -> tuple[bytearray, int] | None:
        """The next frame's body and the bytes of it counted in flight (to give back);
        ``None`` when the connection ended. Its first byte must come within
        ``first_wait`` seconds (else `_IdleError`), the rest within the socket's receive
        timeout of each other; a body above `SMALL_FRAME` waits for room under ``host``'s
        share of ``max_inflight_bytes`` (`BusyError`)."""
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        if not poll.poll(first_wait * 1000):
            raise _IdleError
        frame = FrameReader(limit, f"{self.name} frame")
        deadline = self.recv_part(sock, frame, None, self._idle)  # the prefix
        if deadline is None:
            return None
        held = frame.missing() if frame.missing() > SMALL_FRAME else 0
        if held:
            self.inflight.acquire(held, max(0.0, deadline - time.monotonic()), host)
        try:
            if self.recv_part(sock, frame, deadline) is None:
                if held:
                    self.inflight.release(held, host)
                return None
        except BaseException:
            if held:
                self.inflight.release(held, host)
            raise
        return frame.body(), held

    def _answer(self, sock: socket.socket, body: bytearray) -> bool:
        """Answer one read; whether the connection can go on (not after an error that came
        once bytes were on their way)."""
        start = time.perf_counter()
        req = _decoded(body)
        try:
            if not isinstance(req, PeerRead):
                raise InvalidRequestError(
                    f"the peer port takes reads after the hello, got {type(req).__name__}"
                )
            extents = req.extents
            if len(extents) > MAX_EXTENTS:
                raise PayloadTooLargeError(
                    f"a read of {len(extents)} extents is above the peer port's {MAX_EXTENTS}"
                )
            files = len({e.file for e in extents})
            self.fds.take(files, f"a read of {files} files", remote=True)
        except Exception as exc:
            return self._refuse(sock, exc, start)
        try:
            try:
                reader = self.store.open_extents(extents)
            except Exception as exc:
                return self._refuse(sock, exc, start)
            try:
                sock.sendall(encode_frame(PeerBytes(reader.total)))
                # a peer must take the answer at MIN_RATE at least, and each byte within
                # request_timeout_s of the last: a slow or stopped one does not hold this
                # thread and its descriptors
                until = time.monotonic() + self.request_timeout + reader.total / MIN_RATE
                sock.setblocking(False)  # sendfile ignores SO_SNDTIMEO: waits are polled
                try:
                    reader.send_to(sock.fileno(), lambda: self._writable(sock, until))
                finally:
                    sock.setblocking(True)
            except Exception as exc:  # the answer is cut: its client asks again
                self._count("read", start, None if isinstance(exc, OSError | StalledError) else exc)
                return False
            finally:
                reader.close()
        finally:
            self.fds.give(files, remote=True)
        self._count("read", start)
        return True

    def _writable(self, sock: socket.socket, until: float) -> None:
        """Wait until ``sock`` takes bytes again; a peer that takes none for
        ``request_timeout``, or is not done by ``until``, is given up on (`StalledError`:
        the connection is dropped)."""
        poll = select.poll()
        poll.register(sock, select.POLLOUT)
        wait = min(self.request_timeout, until - time.monotonic())
        if wait <= 0 or not poll.poll(wait * 1000):
            self.log.warning("%s: a peer took no byte of an answer for %.0f s; connection "
                             "dropped", self.name, self.request_timeout)  # fmt: skip
            if self.metrics is not None:
                self.metrics.refused_one(PEER, "stalled")
            raise StalledError

    def _refuse(self, sock: socket.socket, exc: Exception, start: float) -> bool:
        """Answer a read with its error (nothing of it was sent); the connection goes on."""
        sock.sendall(encode_frame(error_reply(exc, self.name, self.log)))
        self._count("read", start, exc)
        return True

    def _count(self, kind: str, start: float, error: Exception | None = None) -> None:
        if self.metrics is None:
            return
        self.metrics.peer_request(kind, time.perf_counter() - start)
        if error is not None:
            self.metrics.error(type(error).__name__, PEER)


def _decoded(body: bytearray) -> Any:
    try:
        return _request.decode(body)
    except msgspec.DecodeError:
        return None
