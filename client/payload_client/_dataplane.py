"""The data plane: row bytes by file descriptor, for clients on the daemon's node.

The daemon keeps naming, placement, permissions and lifecycle; the client never opens a
payload path. Over a second Unix socket (``<socket>.data``) it asks the daemon to reserve
room for an append and gets write-only descriptors of the files (SCM_RIGHTS), pwrites the rows
itself, then commits and gets the segments. For a read it gets read-only descriptors (cached,
one per file) and preads exactly the window's byte ranges, straight into the output array
when the stored dtype is the output dtype, else into a reused buffer that numpy widens from.

Each operation is written once, as a generator of steps (`Exchange`: a request and its reply
with descriptors; `Blocking`: file I/O); `SyncDataPlane` and `AsyncDataPlane` only run them.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import numpy as np

from . import _descriptors
from ._descriptors import Lease, LeaseCache, ReadCache, Scratch
from ._errors import (
    AppendInDoubtError,
    ProtocolError,
    SegmentFileError,
    StorageFullError,
    TimeoutError,
    TransportError,
    error_from_wire,
)
from ._read import PAGE, WindowPlan, direct_view, page_matched, place
from ._segment import PayloadSegment
from ._wire import (
    FRAME_PREFIX,
    AbortRequest,
    AppendItem,
    CommitReply,
    CommitRequest,
    DataReply,
    DataRequest,
    ErrorReply,
    LeaseReply,
    LeaseRequest,
    OpenReply,
    OpenRequest,
    ReserveReply,
    ReserveRequest,
)

__all__ = [
    "AsyncDataPlane",
    "DataPlaneDownError",
    "SyncDataPlane",
    "append_steps",
    "note_steps",
    "read_steps",
    "reserve_steps",
]

T = TypeVar("T")
MAX_FDS = 250
"""Most descriptors one reply may carry (Linux passes at most 253 in one message)."""
THREAD_BYTES = 1 << 20
"""The async data plane moves more bytes than this in a worker thread."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DataReply)


class DataPlaneDownError(Exception):
    """The data plane cannot be used right now; the caller falls back to HTTP.

    It leaves the steps only while nothing of the call reached a file: once an append's rows
    are written, a failing exchange ends in the segments (a lease append: the note is only
    counters) or in `AppendInDoubtError` (a reservation whose commit was lost), never in the
    rows being sent again over HTTP.
    """


@dataclass
class Exchange:
    """Step: send ``request``; the generator receives ``(reply, fds)``, or ``None`` when
    ``reply`` is false (a note the daemon does not answer)."""

    request: DataRequest
    reply: bool = True


@dataclass
class Blocking:
    """Step: run ``fn()`` (file I/O of ``nbytes``); the generator receives its result."""

    fn: Callable[[], Any]
    nbytes: int


@dataclass
class Fresh:
    """Step: forget the leases and descriptors of a daemon that went away (it restarted)
    before the generator uses any; the generator receives ``None``."""


Steps = Generator[Exchange | Blocking | Fresh, Any, T]

_pid = [os.getpid()]
"""This process's id, kept current across forks without asking the kernel on every call."""


def _after_fork() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def _raise_for(reply: DataReply, fds: list[int], expect: type) -> None:
    if isinstance(reply, expect):
        return
    for fd in fds:
        os.close(fd)
    if isinstance(reply, ErrorReply):
        raise error_from_wire(0, reply.error, reply.message)
    raise ProtocolError(f"data plane answered {type(reply).__name__}, expected {expect.__name__}")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_into(fd: int, dest: memoryview, offset: int, file: str) -> None:
    got = 0
    while got < dest.nbytes:
        n = os.preadv(fd, [dest[got:]], offset + got)
        if n == 0:
            raise SegmentFileError(f"payload file {file!r} ended during the read")
        got += n


def note_steps(leases: LeaseCache, ack: bool) -> Steps[None]:
    """Tell the daemon's counters about every append placed since the last note; with
    ``ack``, wait until the daemon has counted them."""
    yield Fresh()
    note = leases.take_note()
    if note is not None:
        note.ack = ack
        reply = yield Exchange(note, reply=ack)
        if ack:
            _raise_for(reply[0], reply[1], CommitReply)


def reserve_steps(
    items: Sequence[AppendItem], bodies: Sequence[memoryview]
) -> Steps[list[list[PayloadSegment]]]:
    """Reserve, pwrite the rows through the daemon's descriptors, commit (two round trips;
    for items larger than a lease, which the daemon splits across files).

    ``bodies`` are the items' rows as little-endian bytes, in item order.
    """
    reply, fds = yield Exchange(ReserveRequest(list(items)))
    _raise_for(reply, fds, ReserveReply)
    assert isinstance(reply, ReserveReply)
    try:
        if len(fds) != len(reply.files):
            raise ProtocolError(f"reserve sent {len(fds)} descriptors for {len(reply.files)} files")
        stream = [b for b in bodies if b.nbytes]
        total = sum(e.nbytes for e in reply.extents)
        if total != sum(b.nbytes for b in stream):
            raise ProtocolError("reserved bytes differ from the rows sent")

        def write() -> None:
            chunks = iter(stream)
            chunk = memoryview(b"")
            for e in reply.extents:
                done = 0
                while done < e.nbytes:
                    if not chunk.nbytes:
                        chunk = next(chunks)
                    take = min(e.nbytes - done, chunk.nbytes)
                    _pwrite_all(fds[e.file], chunk[:take], e.offset + done)
                    chunk, done = chunk[take:], done + take

        try:
            yield Blocking(write, total)
        except OSError as exc:
            with contextlib.suppress(DataPlaneDownError, TransportError):  # the write's error wins
                yield Exchange(AbortRequest(reply.txn))
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageFullError(f"payload file system is full: {exc.strerror}") from exc
            raise TransportError(f"writing rows through the data plane failed: {exc}") from exc
    finally:
        for fd in fds:
            os.close(fd)
    try:
        done, more = yield Exchange(CommitRequest(reply.txn))
    except (DataPlaneDownError, TransportError) as exc:  # rows written, commit unanswered
        raise AppendInDoubtError(
            f"the commit of an append got no answer ({exc}): the append may or may not have "
            "been stored; it is not re-sent, and appending the rows again may store them twice"
        ) from exc
    _raise_for(done, more, CommitReply)
    assert isinstance(done, CommitReply)
    return done.segments


def _write_leased(
    places: list[tuple[tuple[str, int, str], Lease, int]], bodies: Sequence[memoryview]
) -> list[tuple[str, int, str]]:
    """pwrite each item at its place (fsync where the lease says so); return the keys whose
    file garbage collection removed meanwhile: those rows are not acknowledged."""
    for (_, lease, offset), body in zip(places, bodies, strict=True):
        _pwrite_all(lease.fd, body, offset)
    for fd in {lease.fd for _, lease, _ in places if lease.fsync}:
        os.fsync(fd)
    return [key for key, lease, _ in places if os.fstat(lease.fd).st_nlink == 0]


def append_steps(
    items: Sequence[AppendItem], bodies: Sequence[memoryview], leases: LeaseCache
) -> Steps[list[list[PayloadSegment]]]:
    """Place each item in the client's lease of its ``(run, step, field)`` and pwrite it.

    No round trip while the leases have room; a new lease costs one. Items the daemon will
    not lease (larger than its rotation size) go through `reserve_steps` instead.
    """
    yield Fresh()
    sizes = [b.nbytes for b in bodies]
    while True:
        places: list[tuple[tuple[str, int, str], Lease, int]] = []
        leases.begin()  # no lease descriptor is closed while this append writes
        try:
            for item, n in zip(items, sizes, strict=True):
                key = (item.run, item.step, item.field)
                got = leases.claim(key, n)
                if got is None:
                    reply, fds = yield Exchange(LeaseRequest(item.run, item.step, item.field, n))
                    if isinstance(reply, ErrorReply) and reply.error == "PayloadTooLargeError":
                        for fd in fds:
                            os.close(fd)
                        return (yield from reserve_steps(items, bodies))
                    _raise_for(reply, fds, LeaseReply)
                    assert isinstance(reply, LeaseReply)
                    if len(fds) != 1:
                        for fd in fds:
                            os.close(fd)
                        raise ProtocolError(f"lease sent {len(fds)} descriptors, expected 1")
                    end = reply.offset + reply.nbytes
                    leases.put(key, Lease(reply.file, fds[0], reply.offset, end, reply.fsync))
                    got = leases.claim(key, n)
                    if got is None:
                        raise ProtocolError(f"lease of {reply.nbytes} bytes cannot hold {n}")
                places.append((key, *got))

            try:
                gone = yield Blocking(functools.partial(_write_leased, places, bodies), sum(sizes))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StorageFullError(f"payload file system is full: {exc.strerror}") from exc
                raise TransportError(f"writing rows through the data plane failed: {exc}") from exc
        finally:
            leases.end()
        if not gone:
            break
        for key in set(gone):  # place the rows again, in new leases (new files)
            leases.forget(key)
    note = leases.note(sum(it.rows for it in items), sum(sizes))
    if note is not None:  # counters only: the rows are in place, the append is done
        with contextlib.suppress(DataPlaneDownError, TransportError):
            yield Exchange(note, reply=False)
    return [
        [PayloadSegment(it.field, lease.file, offset, it.pos, it.rows, it.dtype, list(it.shape))]
        for it, (_, lease, offset) in zip(items, places, strict=True)
    ]


def read_steps(
    plans: Sequence[WindowPlan | None],
    outs: Sequence[np.ndarray | None],
    cache: ReadCache,
    scratch: Scratch,
) -> Steps[None]:
    """Get descriptors for the files not cached yet, then pread every piece into its output."""
    ends: dict[str, int] = {}
    for plan in plans:
        for p in plan.pieces if plan is not None else ():
            ends[p.file] = max(ends.get(p.file, 0), p.end)
    if not ends:
        return
    cache.begin()  # nothing this read uses is closed before it ends
    try:
        fds_by_file: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for f in ends:
            fd = cache.get(f)
            if fd is None:
                continue
            st = os.fstat(fd)
            if st.st_nlink == 0:  # removed (collected): ask the daemon again
                cache.forget(f)
                continue
            fds_by_file[f] = fd
            sizes[f] = st.st_size
        missing = [(f, e) for f, e in ends.items() if f not in fds_by_file]
        for start in range(0, len(missing), MAX_FDS):
            batch = missing[start : start + MAX_FDS]
            reply, fds = yield Exchange(OpenRequest(batch))
            _raise_for(reply, fds, OpenReply)
            if len(fds) != len(batch):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"open sent {len(fds)} descriptors for {len(batch)} files")
            for (f, _), fd in zip(batch, fds, strict=True):
                cache.put(f, fd)
                fds_by_file[f] = fd
                sizes[f] = os.fstat(fd).st_size
        for f, end in ends.items():  # a cached descriptor is re-checked: the same rule as HTTP
            if sizes[f] < end:
                raise SegmentFileError(
                    f"payload file {f!r} has {sizes[f]} bytes but a segment ends at byte {end}"
                )
        total = sum(plan.nbytes for plan in plans if plan is not None)

        def read() -> None:
            for plan, out in zip(plans, outs, strict=True):
                if plan is None or out is None:
                    continue
                for p in plan.pieces:
                    fd = fds_by_file[p.file]
                    view = direct_view(plan, out, p)
                    if view is not None:
                        _pread_into(fd, view, p.offset, p.file)
                        continue
                    buf = scratch.take(p.nbytes + PAGE)
                    try:
                        dest = page_matched(buf, p.offset, p.nbytes)
                        _pread_into(fd, dest.data, p.offset, p.file)
                        place(plan, out, p, dest)
                    finally:
                        scratch.give(buf)

        yield Blocking(read, total)
    finally:
        cache.end()


# -- drivers -----------------------------------------------------------------------------


def _frame(request: DataRequest) -> bytes:
    body = _encoder.encode(request)
    return FRAME_PREFIX.pack(len(body)) + body


def _parse(head: bytes | bytearray) -> int:
    if len(head) < FRAME_PREFIX.size:
        raise ProtocolError("data plane frame too short")
    (n,) = FRAME_PREFIX.unpack_from(head)
    return int(n)


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += list(np.frombuffer(data[:usable], dtype=np.int32).tolist())
    return fds


def _decode(body: bytes | bytearray | memoryview, fds: list[int]) -> DataReply:
    try:
        reply: DataReply = _decoder.decode(body)
        return reply
    except msgspec.DecodeError as exc:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"malformed data plane reply: {exc}") from exc


_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)


def _closed_by_peer(sock: socket.socket | None) -> bool:
    """Whether the daemon closed ``sock`` (it restarted): a poll that never waits."""
    if sock is None:
        return False
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False  # open, nothing pending: the normal case
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable: end of stream, or an error
    except OSError:
        return True


class _Frame:
    """One reply frame being received: ``u32 length | msgpack``, descriptors with it."""

    def __init__(self, first: bytes, fds: list[int]) -> None:
        self.buf = bytearray(first)
        self.fds = fds
        if not first:
            self.close_fds()
            raise ConnectionResetError("data plane closed the connection")

    def missing(self) -> int:
        if len(self.buf) < FRAME_PREFIX.size:
            return FRAME_PREFIX.size - len(self.buf)
        return FRAME_PREFIX.size + _parse(self.buf) - len(self.buf)

    def add(self, more: bytes) -> None:
        if not more:
            raise ConnectionResetError("data plane closed the connection")
        self.buf += more

    def reply(self) -> tuple[DataReply, list[int]]:
        body = memoryview(self.buf)[FRAME_PREFIX.size :]
        return _decode(body, self.fds), self.fds

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


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
        self.cache = ReadCache()
        self.leases = LeaseCache()
        self._checked = time.monotonic()  # last look for removed files
        self.scratch = Scratch()

    def _drop(self) -> None:
        """Forget the connection and everything the daemon handed out on it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.cache.clear()
        self.leases.clear()

    def _failed(self, exc: OSError | None, frame: _Frame | None) -> DataPlaneDownError:
        if frame is not None:
            frame.close_fds()
        self._drop()
        return DataPlaneDownError(f"data plane at {self.path} failed: {exc}")

    def _timed_out(self, frame: _Frame | None) -> TimeoutError:
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

    def _refresh(self) -> None:
        """Drop what a parent process or a daemon that went away handed out; call only when
        no reply is on its way."""
        self._check_owner(exact=True)
        if _closed_by_peer(self.sock):  # restarted: a new connection, fresh descriptors
            self._drop()
        now = time.monotonic()
        if now - self._checked >= _descriptors.DROP_REMOVED_S:
            self._checked = now  # collected files: close their descriptors, free their space
            self.cache.drop_removed()
            self.leases.drop_removed()


class SyncDataPlane(_DataPlane):
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
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise DataPlaneDownError(f"no data plane at {self.path}: {exc}") from exc
            sock.settimeout(self.timeout)  # a stuck daemon fails the call, as over HTTP
            self.sock = sock
        return self.sock

    def _exchange(self, request: DataRequest, reply: bool = True) -> Any:
        frame: _Frame | None = None
        with self.lock:
            self._refresh()
            sock = self._connect()
            try:
                sock.sendall(_frame(request))
                if not reply:
                    return None
                msg, anc, _flags, _addr = sock.recvmsg(1 << 16, _ANCILLARY)
                frame = _Frame(msg, _fds_of(anc))
                while (n := frame.missing()) > 0:
                    frame.add(sock.recv(max(n, 1 << 16)))
            except builtins.TimeoutError as exc:
                raise self._timed_out(frame) from exc
            except OSError as exc:
                raise self._failed(exc, frame) from exc
            except BaseException:  # cancelled, interrupted: its reply would go to the next
                self._failed(None, frame)
                raise
        return frame.reply()

    def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to its result; a step's failure is raised inside ``steps``.

        Leases and descriptors of a daemon that went away are dropped at a `Fresh` step and
        before every exchange: a restarted daemon hands out new ones.
        """
        with self.lock:
            self._check_owner()
        resume: Callable[[Any], Exchange | Blocking | Fresh] = steps.send
        value: Any = None
        while True:
            try:
                step = resume(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            try:
                if isinstance(step, Exchange):
                    value = self._exchange(step.request, step.reply)
                elif isinstance(step, Fresh):
                    with self.lock:
                        self._refresh()
                    value = None
                else:
                    value = step.fn()
                resume = steps.send
            except Exception as exc:
                value, resume = exc, steps.throw

    def close(self) -> None:
        """Close the socket and every cached descriptor."""
        with self.lock:
            self._drop()


class AsyncDataPlane(_DataPlane):
    """Runs data-plane steps on the event loop; file I/O above 1 MiB goes to a thread."""

    def __init__(
        self, path: str, timeout: float | None = None, connect_timeout: float | None = None
    ) -> None:
        super().__init__(path, timeout, connect_timeout)
        self.lock: asyncio.Lock | None = None

    async def _connect(self) -> socket.socket:
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                connect = asyncio.get_running_loop().sock_connect(sock, self.path)
                await asyncio.wait_for(connect, self.connect_timeout)
            except OSError as exc:  # TimeoutError included
                sock.close()
                raise DataPlaneDownError(f"no data plane at {self.path}: {exc}") from exc
            self.sock = sock
        return self.sock

    async def _recvmsg(self, sock: socket.socket) -> tuple[bytes, list[int]]:
        loop = asyncio.get_running_loop()
        while True:
            try:
                msg, anc, _flags, _addr = sock.recvmsg(1 << 16, _ANCILLARY)
                return msg, _fds_of(anc)
            except BlockingIOError:
                ready = loop.create_future()
                loop.add_reader(sock.fileno(), ready.set_result, None)
                try:
                    await ready
                finally:
                    loop.remove_reader(sock.fileno())

    async def _exchange(self, request: DataRequest, reply: bool = True) -> Any:
        if self.lock is None:
            self.lock = asyncio.Lock()
        frame: _Frame | None = None
        async with self.lock:
            self._refresh()
            sock = await self._connect()
            loop = asyncio.get_running_loop()
            try:
                data = _frame(request)
                try:
                    sent = sock.send(data)  # a frame fits the socket buffer: no task, no wait
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    rest = loop.sock_sendall(sock, memoryview(data)[sent:])
                    await asyncio.wait_for(rest, self.timeout)
                if not reply:
                    return None
                msg, fds = await asyncio.wait_for(self._recvmsg(sock), self.timeout)
                frame = _Frame(msg, fds)
                while (n := frame.missing()) > 0:
                    more = loop.sock_recv(sock, max(n, 1 << 16))
                    frame.add(await asyncio.wait_for(more, self.timeout))
            except builtins.TimeoutError as exc:
                raise self._timed_out(frame) from exc
            except OSError as exc:
                raise self._failed(exc, frame) from exc
            except BaseException:  # cancelled, interrupted: its reply would go to the next
                self._failed(None, frame)
                raise
        return frame.reply()

    async def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to its result; a step's failure is raised inside ``steps``.

        Leases and descriptors of a daemon that went away are dropped at a `Fresh` step and
        before every exchange.
        """
        self._check_owner()
        resume: Callable[[Any], Exchange | Blocking | Fresh] = steps.send
        value: Any = None
        while True:
            try:
                step = resume(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            try:
                if isinstance(step, Exchange):
                    value = await self._exchange(step.request, step.reply)
                elif isinstance(step, Fresh):
                    if self.lock is None or not self.lock.locked():  # no reply on its way
                        self._refresh()
                    else:
                        self._check_owner(exact=True)
                    value = None
                elif step.nbytes > THREAD_BYTES:
                    value = await asyncio.to_thread(step.fn)
                else:
                    value = step.fn()
                resume = steps.send
            except Exception as exc:
                value, resume = exc, steps.throw

    def close(self) -> None:
        """Close the socket and every cached descriptor."""
        self._drop()
