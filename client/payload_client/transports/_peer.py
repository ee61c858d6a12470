"""The peer port transports (`SyncPeerTransport`, `AsyncPeerTransport`): reads from another
node's daemon over TCP without HTTP (`payload_client.wire._peer`).

A read call's extents go out as one `PeerRead` frame; the answer's bytes are received with
``recvmsg_into`` straight into the call's targets (the output rows, or the layout's stage),
up to `IOV_MAX` buffers a system call. Connections are authenticated once (`PeerHello`),
kept in a small pool, and closed when idle longer than the client's ``keepalive``.

What happens is told to the client as the other transports tell it: a port that refuses
connections, or a connection that drops, is `DataPlaneDownError` (the client carries the call
over HTTP instead, and the next ones for a while); the daemon's error answer is raised as
the `PayloadError` it names (a wrong token: `UnauthorizedError`); a read that takes longer
than the read timeout is `TimeoutError`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import socket
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from .._errors import ProtocolError, TimeoutError, error_from_wire
from ..reads._layout import IOV_MAX
from ..wire._dataplane import ErrorReply
from ..wire._frames import FrameReader, decode_frame, encode_frame
from ..wire._http import Extent
from ..wire._peer import HELLO_BYTES, PeerBytes, PeerHello, PeerRead, PeerReply, PeerWelcome
from ._base import AsyncTransport, DataPlaneDownError, Transport, drive, drive_async
from ._call import Call, ReadCall, Target
from ._timeout import Timeout

__all__ = ["AsyncPeerTransport", "SyncPeerTransport"]

T = TypeVar("T")

POOL = 8
"""Most idle connections a client keeps to one daemon's peer port."""
CONNECT_S = 3.0
"""Most seconds a connection to a peer port and its hello may take."""

_reply = msgspec.msgpack.Decoder(PeerReply)


def _decode(body: bytes | bytearray) -> PeerWelcome | PeerBytes | ErrorReply:
    reply: PeerWelcome | PeerBytes | ErrorReply = decode_frame(_reply, body, "peer port reply")
    return reply


def _raise_error(reply: Any) -> None:
    if isinstance(reply, ErrorReply):
        raise error_from_wire(0, reply.error, reply.message)


class _Conn:
    """One authenticated connection and when it was last used."""

    __slots__ = ("sock", "used")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.used = time.monotonic()


class _Peer:
    """What both transports share: the address, the token, the pool, the daemon's limits.

    Parameters
    ----------
    host : str
        The daemon's host (that of the client's ``base_url``).
    port : int
        Its peer port.
    token : str
        The admin token sent in the hello.
    timeout : Timeout
        ``connect`` for connecting and the hello, ``read`` for each part of an answer,
        ``keepalive`` for how long a pooled connection may idle.
    where : str
        The daemon's URL, for messages.
    """

    def __init__(self, host: str, port: int, token: str, timeout: Timeout, where: str) -> None:
        self.address = (host, port)
        self.token = token
        self.timeout = timeout
        self.where = f"{where} (peer port {port})"
        self.welcome: PeerWelcome | None = None
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def takes(self, call: Call[Any]) -> bool:
        """Whether ``call`` can go here: a read within the daemon's limits (once known)."""
        if not isinstance(call, ReadCall):
            return False
        w = self.welcome
        return w is None or ((call.expected or 0) <= w.max_read_bytes)

    def _pooled(self) -> _Conn | None:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if now - conn.used <= self.timeout.keepalive:
                    return conn
                conn.sock.close()
        return None

    def _give(self, conn: _Conn) -> None:
        conn.used = time.monotonic()
        with self._lock:
            if len(self._idle) < POOL and not self._closed:
                self._idle.append(conn)
                return
        conn.sock.close()

    def close_idle(self) -> None:
        """Close the pooled connections; those in use are closed when their call ends."""
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for conn in idle:
            conn.sock.close()

    def _new_socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _welcomed(self, reply: Any) -> None:
        if isinstance(reply, ErrorReply) and reply.error == "BusyError":  # out of descriptors
            raise DataPlaneDownError(f"{self.where} is busy: {reply.message}")
        _raise_error(reply)
        if not isinstance(reply, PeerWelcome):
            raise ProtocolError(f"peer port answered the hello with {type(reply).__name__}")
        self.welcome = reply

    def _check(self, extents: list[Extent], call: Call[Any]) -> bytes:
        """The read's frame, or `DataPlaneDownError` when it is beyond the daemon's limits
        (HTTP answers it: its error, or its bytes)."""
        w = self.welcome
        frame = encode_frame(PeerRead(extents))
        if w is not None and (len(extents) > w.max_extents or len(frame) - 4 > w.max_frame):
            raise DataPlaneDownError("read beyond the peer port's limits", down=False)
        return frame

    def _targets(self, conn: _Conn, reply: Any, call: Call[Any]) -> list[Target]:
        """Where the answer's bytes go; the daemon's error raised (its connection kept),
        or a reply out of turn (its connection closed)."""
        if isinstance(reply, ErrorReply):
            self._give(conn)  # an error answer leaves the connection usable
            _raise_error(reply)
        if not isinstance(reply, PeerBytes) or reply.nbytes != (call.expected or 0):
            conn.sock.close()
            raise ProtocolError(
                f"{self.where} answered {reply!r} to a read of {call.expected or 0} bytes"
            )
        return call.targets() if call.targets is not None else []

    def _done(self, conn: _Conn, targets: list[Target], call: Call[T]) -> T:
        self._give(conn)
        for _, done in targets:
            if done is not None:
                done()
        return call.decode(b"")

    def _connect_s(self) -> float:
        """Seconds a connection and its hello may take: the client's ``connect`` limit, at
        most `CONNECT_S` (a port a firewall drops must not hold a read that HTTP can do)."""
        return min(self.timeout.connect or CONNECT_S, CONNECT_S)

    def _unreachable(self, exc: BaseException) -> DataPlaneDownError:
        """A connection or hello that failed: HTTP carries the call."""
        return DataPlaneDownError(f"cannot reach {self.where}: {exc!r}")

    def _error(self, exc: BaseException, *, answered: bool = False) -> Exception:
        """What a failed exchange raises: `TimeoutError` when the daemon took too long,
        else `DataPlaneDownError` (HTTP carries the call; the port counts as down unless
        it had ``answered``: an answer cut short, e.g. a file collected under it)."""
        if isinstance(exc, builtins.TimeoutError):
            return TimeoutError(f"timed out talking to {self.where}")
        return DataPlaneDownError(f"{self.where}: {exc!r}", down=not answered)


def _reply_frame() -> FrameReader:
    """A reply frame to receive: a peer port's replies are small, the bytes follow them."""
    return FrameReader(HELLO_BYTES * 16, "peer port reply frame", ProtocolError)


def _extents_of(call: Call[Any]) -> list[Extent]:
    """The extents of a read call (`takes` let only reads through)."""
    assert isinstance(call, ReadCall)
    return call.extents()


class _ShortError(Exception):
    """The connection ended before the whole answer came."""


@dataclass(slots=True)
class _Open:
    """Effect: connect ``sock`` to the port, within ``wait`` seconds."""

    sock: socket.socket
    wait: float | None


@dataclass(slots=True)
class _Send:
    """Effect: send all of ``data`` on ``sock``, each wait at most ``wait`` seconds."""

    sock: socket.socket
    data: bytes
    wait: float | None


@dataclass(slots=True)
class _Recv:
    """Effect: fill ``views`` in order from ``sock``, each wait at most ``wait`` seconds;
    `_ShortError` when the connection ends first."""

    sock: socket.socket
    views: list[memoryview]
    wait: float | None


_Effect = _Open | _Send | _Recv


def _left(by: float) -> float:
    """Seconds left until the monotonic deadline ``by`` (a thousandth at least: a socket
    given no time would not wait at all)."""
    return max(by - time.monotonic(), 0.001)


def _advance(views: list[memoryview], i: int, got: int) -> int:
    """The view to fill next after ``got`` more bytes went into ``views[i:]`` (a view
    partly filled is cut to what it still misses)."""
    while got and i < len(views):
        k = min(got, views[i].nbytes)
        got -= k
        if k == views[i].nbytes:
            i += 1
        else:
            views[i] = views[i][k:]
    return i


class _PeerSteps(_Peer):
    """A read on the peer port as I/O-free steps (`_Open`, `_Send`, `_Recv`): the sync and
    async transports only perform them (`drive`, `drive_async`)."""

    def _reply_steps(
        self, sock: socket.socket, wait: float | None, by: float | None = None
    ) -> Generator[_Effect, Any, Any]:
        """A reply frame, each receive within ``wait`` seconds (or what is left until the
        monotonic deadline ``by``)."""
        frame = _reply_frame()
        while not frame.done():
            n = frame.missing()
            yield _Recv(sock, [frame.buffer()], wait if by is None else _left(by))
            frame.received(n)
        return _decode(frame.body())

    def _connect_steps(self) -> Generator[_Effect, Any, _Conn]:
        """A new connection and its hello, all within `_connect_s` seconds."""
        sock = self._new_socket()
        by = time.monotonic() + self._connect_s()
        try:
            yield _Open(sock, _left(by))
            yield _Send(sock, encode_frame(PeerHello(self.token)), _left(by))
            self._welcomed((yield from self._reply_steps(sock, None, by)))
        except (_ShortError, OSError) as exc:
            sock.close()
            raise self._unreachable(exc) from None
        except BaseException:
            sock.close()
            raise
        return _Conn(sock)

    def _ask_steps(self, frame: bytes) -> Generator[_Effect, Any, tuple[_Conn, Any]]:
        """Send the read's ``frame``, on a pooled connection or a new one, and receive the
        reply; a pooled connection the daemon closed meanwhile is replaced once."""
        wait = self.timeout.read
        conn = self._pooled()
        for fresh in (conn is None, True):
            try:
                if conn is None:
                    conn = yield from self._connect_steps()
                yield _Send(conn.sock, frame, wait)
                return conn, (yield from self._reply_steps(conn.sock, wait))
            except (_ShortError, OSError) as exc:
                if conn is not None:
                    conn.sock.close()
                    conn = None
                if fresh or isinstance(exc, builtins.TimeoutError):
                    raise self._error(exc) from None
            except BaseException:
                if conn is not None:
                    conn.sock.close()
                raise
        raise AssertionError("unreachable: the second try is fresh")

    def _read_steps(self, call: Call[T]) -> Generator[_Effect, Any, T]:
        frame = self._check(_extents_of(call), call)
        conn, reply = yield from self._ask_steps(frame)
        targets = self._targets(conn, reply, call)
        try:
            yield _Recv(conn.sock, [view for view, _ in targets], self.timeout.read)
        except (_ShortError, OSError) as exc:
            conn.sock.close()
            raise self._error(exc, answered=True) from None
        except BaseException:
            conn.sock.close()
            raise
        return self._done(conn, targets, call)


class SyncPeerTransport(_PeerSteps, Transport):
    """Carries read calls to a daemon's peer port with blocking sockets; thread-safe
    (a connection per call at a time, from the pool)."""

    def _perform(self, effect: _Effect) -> None:
        effect.sock.settimeout(effect.wait)
        if isinstance(effect, _Open):
            effect.sock.connect(self.address)
        elif isinstance(effect, _Send):
            effect.sock.sendall(effect.data)
        else:
            self._recv_into(effect.sock, effect.views)

    @staticmethod
    def _recv_into(sock: socket.socket, views: list[memoryview]) -> None:
        """Fill ``views`` in order from ``sock`` (``recvmsg_into``, `IOV_MAX` at a time)."""
        i = 0
        views = [v for v in views if v.nbytes]
        while i < len(views):
            got = sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            if not got:
                raise _ShortError
            i = _advance(views, i, got)

    def handle_call(self, call: Call[T]) -> T:
        """Send a read call's extents and receive their bytes into its targets.

        Raises
        ------
        DataPlaneDownError
            The port cannot be reached, or the connection dropped (HTTP carries the call).
        TimeoutError
            The daemon did not answer within the read timeout.
        PayloadError
            The daemon's error answer (`UnauthorizedError` for a wrong token).
        """
        steps = self._read_steps(call)
        try:
            return drive(steps, self._perform)
        finally:
            steps.close()  # interrupted: its connection closed

    def close(self) -> None:
        """Close the pooled connections."""
        self.close_idle()


class AsyncPeerTransport(_PeerSteps, AsyncTransport):
    """Carries read calls to a daemon's peer port on the event loop (non-blocking sockets)."""

    async def _perform(self, effect: _Effect) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(effect, _Recv):
            await self._recv_into(effect.sock, effect.views, effect.wait)
            return
        async with asyncio.timeout(effect.wait):
            if isinstance(effect, _Open):
                effect.sock.setblocking(False)
                await loop.sock_connect(effect.sock, self.address)
            else:
                await loop.sock_sendall(effect.sock, effect.data)

    @staticmethod
    async def _recv_into(
        sock: socket.socket, views: list[memoryview], wait: float | None = None
    ) -> None:
        """`SyncPeerTransport._recv_into`, waiting on the loop while nothing is there, each
        wait at most ``wait`` seconds (as the sync socket's timeout bounds each receive)."""
        loop = asyncio.get_running_loop()
        i = 0
        views = [v for v in views if v.nbytes]
        while i < len(views):
            try:
                got = sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            except (BlockingIOError, InterruptedError):
                async with asyncio.timeout(wait):
                    await _readable(loop, sock)
                continue
            if not got:
                raise _ShortError
            i = _advance(views, i, got)

    async def handle_async_call(self, call: Call[T]) -> T:
        """Awaitable `SyncPeerTransport.handle_call`."""
        steps = self._read_steps(call)
        try:
            return await drive_async(steps, self._perform)
        finally:
            steps.close()  # cancelled: its connection closed

    async def aclose(self) -> None:
        """Close the pooled connections."""
        self.close_idle()


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Wait until ``sock`` has something to read (or is closed)."""
    ready: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
