"""The data plane's operations: row bytes by file descriptor, for clients on the daemon's node.

The daemon keeps naming, placement, permissions and lifecycle; the client never opens a
payload path. Over a second Unix socket (``<socket>.data``) it asks the daemon to reserve
room for an append and gets write-only descriptors of the files (SCM_RIGHTS), pwrites the rows
itself, then commits and gets the segments. For a read it gets read-only descriptors (cached,
one per file) and preads exactly the window's byte ranges, straight into the output array
when the stored dtype is the output dtype, else into a reused buffer that numpy widens from.

Each operation is written once, here, as a generator of steps (`Exchange`: a request and its
reply with descriptors; `Blocking`: file I/O; `Fresh`: drop what a gone daemon handed out);
the data plane transports (`payload_client._transports._dataplane.SyncDataPlane` and
``AsyncDataPlane``) only run them. ("Steps" here are steps of an operation, not training
steps.)
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .._errors import (
    AppendInDoubtError,
    ProtocolError,
    SegmentFileError,
    StorageFullError,
    TransportError,
    error_from_wire,
)
from .._fields import check_item
from .._layout import IOV_MAX, ReadLayout
from .._segment import PayloadSegment
from .._windows import WindowPlan
from .._wire import (
    AbortRequest,
    AppendItem,
    CommitReply,
    CommitRequest,
    DataReply,
    DataRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    FieldsTable,
    LeaseReply,
    LeaseRequest,
    OpenReply,
    OpenRequest,
    ReserveReply,
    ReserveRequest,
)
from ._base import DataPlaneDownError
from ._descriptors import LeaseCache, LeasedRange, ReadCache, Scratch

__all__ = [
    "MAX_FDS",
    "Blocking",
    "Exchange",
    "Fresh",
    "Steps",
    "append_steps",
    "note_steps",
    "read_steps",
    "reserve_steps",
]

T = TypeVar("T")
MAX_FDS = 250
"""Most descriptors one reply may carry (Linux passes at most 253 in one message)."""


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


SHORT_READ_WAIT_S = 2.0
"""Longest wait for a file that the daemon saw long enough but that a pread finds shorter:
on a distributed file system this node's size of it may still catch up (seen on GlusterFS's
FUSE client, about once in hundreds of reads of a file being appended to on another node,
for over 0.5 s: its attribute cache keeps a size for 1 s)."""


def _pread_into(fd: int, bufs: list[memoryview], offset: int, file: str) -> None:
    """Fill ``bufs`` (in order) from ``offset`` of ``fd``: one ``preadv`` unless it comes
    back short."""
    want = n = os.preadv(fd, bufs, offset)
    if len(bufs) > 1 or n != bufs[0].nbytes:
        want = sum(b.nbytes for b in bufs)
    if n == want:
        return
    pause, waited = 0.001, 0.0
    while True:
        while bufs and n >= bufs[0].nbytes:  # drop the buffers filled
            n -= bufs[0].nbytes
            offset += bufs[0].nbytes
            bufs = bufs[1:]
        if not bufs:
            return
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]
            offset += n
            n = 0
        got = os.preadv(fd, bufs, offset)
        if got == 0:
            if waited >= SHORT_READ_WAIT_S:
                raise SegmentFileError(f"payload file {file!r} ended during the read")
            os.fstat(fd)  # this node looks at the file's size again
            time.sleep(pause)
            waited, pause = waited + pause, min(2 * pause, 0.1)
            continue
        n = got


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
    places: list[tuple[tuple[str, int, str], LeasedRange, int]], bodies: Sequence[memoryview]
) -> list[tuple[str, int, str]]:
    """pwrite each item at its place (fsync where the lease says so); return the keys whose
    file garbage collection removed meanwhile: those rows are not acknowledged."""
    for (_, lease, offset), body in zip(places, bodies, strict=True):
        _pwrite_all(lease.fd, body, offset)
    for fd in {lease.fd for _, lease, _ in places if lease.fsync}:
        os.fsync(fd)
    return [key for key, lease, _ in places if os.fstat(lease.fd).st_nlink == 0]


def _claims(
    places: list[tuple[tuple[str, int, str], LeasedRange, int]], sizes: list[int]
) -> list[tuple[LeasedRange, int, int]]:
    """The ``(lease, offset, nbytes)`` of each item placed so far."""
    return [(lease, at, n) for (_, lease, at), n in zip(places, sizes[: len(places)], strict=True)]


def append_steps(
    items: Sequence[AppendItem], bodies: Sequence[memoryview], leases: LeaseCache
) -> Steps[list[list[PayloadSegment]]]:
    """Place each item in the client's lease of its ``(run, step, field)`` and pwrite it.

    The items are checked against the daemon's fields table first (fetched once per daemon
    connection). No round trip while the leases have room; a new lease costs one. Items the daemon will
    not lease (larger than its rotation size) go through `reserve_steps` instead.
    """
    yield Fresh()
    if leases.fields is None:
        reply, fds = yield Exchange(FieldsRequest())
        for fd in fds:
            os.close(fd)
        if isinstance(reply, ErrorReply) and reply.error == "BusyError":
            raise error_from_wire(0, reply.error, reply.message)
        # a daemon from before the fields table answers with an error: it has no table
        leases.fields = reply.table if isinstance(reply, FieldsReply) else FieldsTable({})
    for i, item in enumerate(items):  # the daemon never sees these rows: check them here
        check_item(leases.fields, item, i)
    sizes = [b.nbytes for b in bodies]
    while True:
        places: list[tuple[tuple[str, int, str], LeasedRange, int]] = []
        too_large = False
        leases.begin()  # no lease descriptor is closed while this append writes
        try:
            try:
                for item, n in zip(items, sizes, strict=True):
                    key = (item.run, item.step, item.field)
                    got = leases.claim(key, n)
                    if got is None:
                        req = LeaseRequest(item.run, item.step, item.field, n)
                        reply, fds = yield Exchange(req)
                        if isinstance(reply, ErrorReply) and reply.error == "PayloadTooLargeError":
                            for fd in fds:
                                os.close(fd)
                            too_large = True  # the whole append goes through a reservation
                            break
                        _raise_for(reply, fds, LeaseReply)
                        assert isinstance(reply, LeaseReply)
                        if len(fds) != 1:
                            for fd in fds:
                                os.close(fd)
                            raise ProtocolError(f"lease sent {len(fds)} descriptors, expected 1")
                        end = reply.offset + reply.nbytes
                        leases.put(
                            key, LeasedRange(reply.file, fds[0], reply.offset, end, reply.fsync)
                        )
                        got = leases.claim(key, n)
                        if got is None:
                            raise ProtocolError(f"lease of {reply.nbytes} bytes cannot hold {n}")
                    places.append((key, *got))
            except BaseException:  # nothing written: the next append lands where these would
                leases.unclaim(_claims(places, sizes))
                raise
            if too_large:
                leases.unclaim(_claims(places, sizes))
                return (yield from reserve_steps(items, bodies))

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
    note = leases.note(items, sizes)
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
    """Get descriptors for the files not cached yet, then preadv every extent of the call
    (`payload_client._layout.ReadLayout`: pieces back to back in a file are one ``preadv``)
    into its buffers, and lay the staged rows into the outputs.

    A descriptor the daemon marks ``read_once`` (`OpenReply`) serves this read only and is
    closed after it, never cached.
    """
    layout = ReadLayout(plans, outs, kernel=True, alloc=scratch.take)
    ends = layout.ends
    if not ends:
        return
    cache.used.update(ends)  # told to the daemon (GC spares runs in use)
    once: list[int] = []  # descriptors of this read only: closed at its end
    cache.begin()  # nothing this read uses is closed before it ends
    try:
        fds_by_file: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for f in ends:
            fd = cache.get(f)
            if fd is None:
                continue
            try:
                st = os.fstat(fd)
            except OSError:  # ESTALE: another node removed it (FUSE, NFS)
                st = None
            if st is None or st.st_nlink == 0 or st.st_size < ends[f]:
                # removed (collected), or shorter than a segment says (this node's view of
                # a file another node writes may lag): ask the daemon, which checks the
                # ledger and waits for the file to grow
                cache.forget(f)
                continue
            fds_by_file[f] = fd
            sizes[f] = st.st_size
        missing = [(f, e) for f, e in ends.items() if f not in fds_by_file]
        for start in range(0, len(missing), MAX_FDS):
            batch = missing[start : start + MAX_FDS]
            reply, fds = yield Exchange(OpenRequest(batch))
            _raise_for(reply, fds, OpenReply)
            assert isinstance(reply, OpenReply)
            if len(fds) != len(batch):
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"open sent {len(fds)} descriptors for {len(batch)} files")
            keep = set(range(len(fds))).difference(reply.read_once)
            for i, ((f, _), fd) in enumerate(zip(batch, fds, strict=True)):
                if i in keep:
                    cache.put(f, fd)
                else:
                    once.append(fd)
                fds_by_file[f] = fd
            for f, _ in batch:  # every descriptor is the cache's or this read's by now
                try:
                    sizes[f] = os.fstat(fds_by_file[f]).st_size
                except OSError as exc:  # ESTALE: another node removed it meanwhile
                    cache.forget(f)
                    raise SegmentFileError(f"payload file {f!r} cannot be read: {exc}") from exc
        for f, end in ends.items():  # a cached descriptor is re-checked: the same rule as HTTP
            if sizes[f] < end:
                raise SegmentFileError(
                    f"payload file {f!r} has {sizes[f]} bytes but a segment ends at byte {end}"
                )

        def read() -> None:
            for (file, offset, _), bufs in zip(layout.extents, layout.buffers, strict=True):
                fd = fds_by_file[file]
                for at in range(0, len(bufs), IOV_MAX):
                    chunk = bufs[at : at + IOV_MAX]
                    _pread_into(fd, chunk, offset, file)
                    offset += sum(b.nbytes for b in chunk)
            layout.finish()

        yield Blocking(read, layout.nbytes)
    finally:
        cache.end()
        for fd in once:
            os.close(fd)
        if layout.stage is not None:
            scratch.give(layout.stage)
