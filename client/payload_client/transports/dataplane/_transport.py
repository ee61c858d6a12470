"""The data plane transports: they run the steps of `payload_client.transports.dataplane._steps`.

`SyncDataPlane` (blocking sockets, a lock) and `AsyncDataPlane` (asyncio) only carry frames
(``u32 length | msgpack``, descriptors as SCM_RIGHTS) and run file I/O; every decision is in
the steps, and the loop that runs them is `drive` (`drive_async`), shared with the clients.
Both notice a daemon restart (the peer closed the connection) and a fork (another process
id) before they hand out anything cached.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import socket
import threading
import time
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

from ..._errors import TimeoutError, TransportError
from ...reads._windows import WindowPlan
from ...segments._segment import PayloadSegment
from ...wire._dataplane import DataReply, ErrorReply, NoteRequest
from ...wire._frames import encode_frame
from ...wire._http import AppendItem
from .._base import AsyncTransport, DataPlaneDownError, Transport, drive, drive_async
from .._call import AppendCall, Call, FieldsCall, ReadCall
from . import _descriptors
from ._appends import append_leased, append_steps
from ._descriptors import LeaseCache, ReadCache, Scratch
from ._socket import (
    ANCILLARY,
    Poll,
    RecvFirst,
    RecvMore,
    ReplyFrame,
    Send,
    answer_before_close,
    closed_by_peer,
    fds_of,
)
from ._steps import (
    Blocking,
    Exchange,
    Fresh,
    Steps,
    note_steps,
    read_cached,
    read_steps,
    table_steps,
)

__all__ = ["AsyncDataPlane", "SyncDataPlane"]

T = TypeVar("T")
THREAD_BYTES = 1 << 20
"""The async data plane moves more bytes than this in a worker thread."""

_pid = [os.getpid()]
"""This process's id, kept current across forks without asking the kernel on every call."""


def _after_fork() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


_MISSING = frozenset({"FileMissingError", "FileGoneError"})


def _then(steps: Steps[None], result: T) -> Steps[T]:
    yield from steps
    return result


class _DataPlane:
    """What both drivers hold: the socket, descriptor caches, leases, scratch buffers."""

    def __init__(
        self, path: str, timeout: float | None = None, connect_timeout: float | None = None
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.pid = _pid[0]
        self.sock: socket.socket | None = None
        self.poll: Poll | None = None  # of sock: readable means gone (or a reply)
        self.cache = ReadCache()
        self.leases = LeaseCache()
        self._checked = time.monotonic()  # last look for removed files
        self._told = 0.0  # last note of the runs in use
        self.scratch = Scratch()

    calls = (AppendCall, ReadCall, FieldsCall)
    """The kinds of call the data plane carries (any other goes over HTTP)."""

    def steps_of(self, call: Call[T]) -> Steps[T]:
        """The data plane's steps of ``call``, one of `calls`."""
        steps: Steps[Any] = self._steps_any(call)
        return steps

    def _steps_any(self, call: Call[Any]) -> Steps[Any]:
        if isinstance(call, ReadCall):
            return _then(
                read_steps(call.plans, call.outs, self.cache, self.scratch, self.leases),
                call.results,
            )
        if isinstance(call, AppendCall):
            return append_steps(call.items, call.bodies, self.leases)
        if isinstance(call, FieldsCall):
            return table_steps(self.leases)
        raise TypeError(f"the data plane carries no {type(call).__name__}")

    def _drop(self) -> None:
        """Forget the connection and everything the daemon handed out on it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.poll is not None:
            self.poll.close()
            self.poll = None
        self.cache.clear()
        self.leases.clear()

    def _failed(self, exc: OSError | None, frame: ReplyFrame | None) -> DataPlaneDownError:
        if frame is not None:
            frame.close_fds()
        self._drop()
        return DataPlaneDownError(f"data plane at {self.path} failed: {exc}")

    def _timed_out(self, frame: ReplyFrame | None) -> TimeoutError:
        """A daemon that does not answer in time is stuck: HTTP would wait as long again, so
        the call fails (a late reply must not reach the next exchange: the connection goes)."""
        self._failed(None, frame)
        return TimeoutError(f"data plane at {self.path} gave no answer within {self.timeout} s")

    def _check_owner(self, exact: bool = False) -> None:
        """A forked child starts over: its parent's leases and socket are not its own.

        ``exact`` asks the kernel (a fork made outside Python, e.g. by a C extension, runs no
        fork hook): before every exchange and before leases are used; reads through cached
        descriptors, safe in a child, skip that system call.
        """
        if exact:
            _pid[0] = os.getpid()
        if self.pid != _pid[0]:
            self._drop()
            self.pid = _pid[0]

    def _use_note(self) -> NoteRequest | None:
        """The note of the runs used through held descriptors, when one is due."""
        now = time.monotonic()
        if self.sock is None or now - self._told < _descriptors.TELL_USE_S:
            return None
        runs = self.cache.take_used() | self.leases.take_used()
        if not runs:
            return None
        self._told = now
        return NoteRequest(0, 0, 0, runs=sorted(runs))

    def _noted(self, steps: Steps[T]) -> Steps[T]:
        """``steps``, then the note of the runs in use when one is due (only counters: a
        failure of it fails nothing)."""
        result = yield from steps
        note = self._use_note()
        if note is not None:
            with contextlib.suppress(DataPlaneDownError, TransportError):
                yield Exchange(note, reply=False)
        return result

    def _connected(self, sock: socket.socket) -> None:
        """``sock`` is the connection from now on."""
        self.sock = sock
        self.poll = Poll(sock)

    def _answered(self, answer: tuple[DataReply, list[int]]) -> tuple[DataReply, list[int]]:
        """``answer``, as received; one naming a missing file of the daemon's (maybe removed
        by hand: the removal generation does not count that) has every lease's file checked
        before the next rows in it are acknowledged."""
        reply = answer[0]
        if type(reply) is ErrorReply and reply.error in _MISSING:
            self.leases.suspect()
        return answer

    def append_now(
        self, items: Sequence[AppendItem], bodies: Sequence[memoryview]
    ) -> list[list[PayloadSegment]] | None:
        """The append, at once, without an exchange (`append_leased`), when no check or
        note is due first; ``None``: run `append_steps` instead (nothing acknowledged).

        What the steps' `Fresh` does is checked without waiting for the lock: another
        process's leases (a fork), a daemon that closed the connection (it restarted: the
        socket is readable), a look for removed files or a note of the runs in use due.

        Raises
        ------
        PayloadError
            As `append_leased`.
        """
        if not self._now_ok():
            return None
        return append_leased(items, bodies, self.leases)

    def _now_ok(self) -> bool:
        """Whether a call may skip its steps' `Fresh` (see `append_now`)."""
        if self.sock is None or self.pid != os.getpid():
            return False
        now = time.monotonic()
        if (
            now - self._checked >= _descriptors.DROP_REMOVED_S
            or now - self._told >= _descriptors.TELL_USE_S
        ):
            return False
        poll = self.poll
        return poll is not None and not poll.readable()

    def read_now(self, plans: Sequence[WindowPlan | None], outs: Sequence[Any]) -> bool:
        """The read, at once, without an exchange (`read_cached`: every file it needs has a
        cached descriptor, still linked and long enough), when no check or note is due
        first; ``False``: nothing was read, run `read_steps` instead.

        Raises
        ------
        PayloadError
            As `read_steps` (a file that ends during the read).
        """
        if not self._now_ok():
            return False
        return read_cached(plans, outs, self.cache, self.scratch)

    def _refresh(self) -> None:
        """Drop what a parent process or a daemon that went away handed out; call only when
        no reply is on its way."""
        self._check_owner(exact=True)
        if closed_by_peer(self.sock, self.poll):  # restarted: a new connection, fresh ones
            self._drop()
        now = time.monotonic()
        if now - self._checked >= _descriptors.DROP_REMOVED_S:
            self._checked = now  # collected files: close their descriptors, free their space
            self.cache.drop_removed()
            self.leases.drop_removed()

    def _exchange_steps(
        self, step: Exchange, request: Any, sock: socket.socket
    ) -> Generator[Send | RecvFirst | RecvMore, Any, Any]:
        """One exchange on ``sock`` as I/O-free steps, run under the connection's lock: the
        request sent, its reply and descriptors received; the connection dropped when it
        fails (a late reply must not reach the next exchange)."""
        frame: ReplyFrame | None = None
        try:
            try:
                yield Send(sock, encode_frame(request))
            except (BrokenPipeError, ConnectionResetError):
                early = answer_before_close(sock)
                if early is None:
                    raise
                self._drop()
                return early
            if not step.reply:
                return None
            frame = ReplyFrame(*(yield RecvFirst(sock)))
            while (n := frame.missing()) > 0:
                frame.add((yield RecvMore(sock, max(n, 1 << 16))))
        except builtins.TimeoutError as exc:
            raise self._timed_out(frame) from exc
        except OSError as exc:
            raise self._failed(exc, frame) from exc
        except BaseException:  # cancelled, interrupted: its reply would go to the next
            self._failed(None, frame)
            raise
        answer = self._answered(frame.reply())
        return answer if step.take is None else step.take(answer)


class SyncDataPlane(_DataPlane, Transport):
    """Runs data-plane steps with blocking sockets; thread-safe (exchanges are serialised).

    Parameters
    ----------
    path : str
        The daemon's data socket.
    timeout : float or None
        Seconds to wait for each send and reply; then `TimeoutError` (``None``: forever).
    connect_timeout : float or None
        Seconds to wait for the connection; then the caller falls back to HTTP.
    """

    def __init__(
        self, path: str, timeout: float | None = None, connect_timeout: float | None = None
    ) -> None:
        super().__init__(path, timeout, connect_timeout)
        self.lock = threading.Lock()

    def _connect(self) -> socket.socket:
        sock = self.sock
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise DataPlaneDownError(f"no data plane at {self.path}: {exc}") from exc
            sock.settimeout(self.timeout)  # a stuck daemon fails the call, as over HTTP
            self._connected(sock)
        return sock

    def _exchange(self, step: Exchange) -> Any:
        with self.lock:
            self._refresh()
            request = step.request() if callable(step.request) else step.request
            if request is None:
                return None
            steps = self._exchange_steps(step, request, self._connect())
            try:
                return drive(steps, self._io)
            finally:
                steps.close()  # interrupted: the connection dropped (`_exchange_steps`)

    @staticmethod
    def _io(effect: Send | RecvFirst | RecvMore) -> Any:
        if isinstance(effect, Send):
            return effect.sock.sendall(effect.data)
        if isinstance(effect, RecvFirst):
            msg, anc, _flags, _addr = effect.sock.recvmsg(1 << 16, ANCILLARY)
            return msg, fds_of(anc)
        return effect.sock.recv(effect.n)

    def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to its result; a step's failure is raised inside ``steps``.

        Leases and descriptors of a daemon that went away are dropped at a `Fresh` step and
        before every exchange: a restarted daemon hands out new ones.
        """
        with self.lock:
            self._check_owner()
        return drive(self._noted(steps), self._perform)

    def _perform(self, step: Exchange | Blocking | Fresh) -> Any:
        if isinstance(step, Exchange):
            return self._exchange(step)
        if isinstance(step, Fresh):
            with self.lock:
                self._refresh()
            return None
        return step.fn()

    def handle_call(self, call: Call[T]) -> T:
        """Run the data plane's steps of ``call`` (`calls`: an append, a read, the table).

        Raises
        ------
        DataPlaneDownError
            The data plane cannot be used now; nothing of the call reached a file.
        PayloadError
            As the steps raise it (the daemon's error, a timeout, an append in doubt).
        """
        return self.run(self.steps_of(call))

    def tell_counters(self, ack: bool = False) -> None:
        """Tell the daemon's counters about the appends placed in leases and not told yet
        (with ``ack``, once it has counted them); a failure is ignored."""
        if self.sock is not None:
            with contextlib.suppress(DataPlaneDownError, TransportError):
                self.run(note_steps(self.leases, ack))

    def close(self) -> None:
        """Close the socket and every cached descriptor."""
        with self.lock:
            self._drop()


class AsyncDataPlane(_DataPlane, AsyncTransport):
    """Runs data-plane steps on the event loop; file I/O above 1 MiB goes to a thread."""

    def __init__(
        self, path: str, timeout: float | None = None, connect_timeout: float | None = None
    ) -> None:
        super().__init__(path, timeout, connect_timeout)
        self.lock: asyncio.Lock | None = None

    async def _connect(self) -> socket.socket:
        sock = self.sock
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                connect = asyncio.get_running_loop().sock_connect(sock, self.path)
                await asyncio.wait_for(connect, self.connect_timeout)
            except OSError as exc:  # TimeoutError included
                sock.close()
                raise DataPlaneDownError(f"no data plane at {self.path}: {exc}") from exc
            self._connected(sock)
        return sock

    async def _recvmsg(self, sock: socket.socket) -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg, anc, _flags, _addr = sock.recvmsg(1 << 16, ANCILLARY)
                return msg, fds_of(anc)
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_reader(sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_reader(sock.fileno())

    async def _exchange(self, step: Exchange) -> Any:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:
            self._refresh()
            request = step.request() if callable(step.request) else step.request
            if request is None:
                return None
            steps = self._exchange_steps(step, request, await self._connect())
            try:
                return await drive_async(steps, self._io)
            finally:
                steps.close()  # cancelled: the connection dropped (`_exchange_steps`)

    async def _io(self, effect: Send | RecvFirst | RecvMore) -> Any:
        loop = asyncio.get_running_loop()
        if isinstance(effect, Send):
            data, sock = effect.data, effect.sock
            try:
                sent = sock.send(data)  # a frame fits the socket buffer: no wait
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                rest = loop.sock_sendall(sock, memoryview(data)[sent:])
                await asyncio.wait_for(rest, self.timeout)
            return None
        if isinstance(effect, RecvFirst):
            return await asyncio.wait_for(self._recvmsg(effect.sock), self.timeout)
        return await asyncio.wait_for(loop.sock_recv(effect.sock, effect.n), self.timeout)

    async def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to its result; a step's failure is raised inside ``steps``.

        Leases and descriptors of a daemon that went away are dropped at a `Fresh` step and
        before every exchange.
        """
        self._check_owner()
        return await drive_async(self._noted(steps), self._perform)

    async def _perform(self, step: Exchange | Blocking | Fresh) -> Any:
        if isinstance(step, Exchange):
            return await self._exchange(step)
        if isinstance(step, Fresh):
            if self.lock is None or not self.lock.locked():  # no reply on its way
                self._refresh()
            else:
                self._check_owner(exact=True)
            return None
        if step.nbytes > THREAD_BYTES:
            return await asyncio.to_thread(step.fn)
        return step.fn()

    def append_now(
        self, items: Sequence[AppendItem], bodies: Sequence[memoryview]
    ) -> list[list[PayloadSegment]] | None:
        """`SyncDataPlane.append_now`, on the event loop: for rows a thread would not
        write (up to `THREAD_BYTES`)."""
        if sum(b.nbytes for b in bodies) > THREAD_BYTES:
            return None
        return super().append_now(items, bodies)

    def read_now(self, plans: Sequence[WindowPlan | None], outs: Sequence[Any]) -> bool:
        """`SyncDataPlane.read_now`, on the event loop: for reads a thread would not do (up
        to `THREAD_BYTES`)."""
        if sum(p.nbytes for p in plans if p is not None) > THREAD_BYTES:
            return False
        return super().read_now(plans, outs)

    async def handle_async_call(self, call: Call[T]) -> T:
        """Awaitable `SyncDataPlane.handle_call`."""
        return await self.run(self.steps_of(call))

    async def tell_counters(self, ack: bool = False) -> None:
        """Awaitable `SyncDataPlane.tell_counters`."""
        if self.sock is not None:
            with contextlib.suppress(DataPlaneDownError, TransportError):
                await self.run(note_steps(self.leases, ack))

    async def aclose(self) -> None:
        """Close the socket and every cached descriptor."""
        self._drop()
