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
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from .._dataplane_wire import (
    AbortRequest,
    CommitReply,
    CommitRequest,
    DataReply,
    DataRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    LeaseReply,
    LeaseRequest,
    OpenReply,
    OpenRequest,
    ReserveReply,
    ReserveRequest,
)
from .._errors import (
    AppendInDoubtError,
    PayloadError,
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
from .._wire import AppendItem, FieldsTable
from ._base import DataPlaneDownError
from ._descriptors import (
    LEASE_ALONG,
    NOTE_EVERY,
    GenerationPage,
    LeaseCache,
    LeasedRange,
    ReadCache,
    Scratch,
)

__all__ = [
    "MAX_FDS",
    "Blocking",
    "Exchange",
    "Fresh",
    "Steps",
    "append_leased",
    "append_steps",
    "fields_steps",
    "note_steps",
    "read_cached",
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


Place = tuple[tuple[str, int, str], LeasedRange, int]
"""Where one item of an append goes: its key, its lease, the offset in the lease's file."""


def _removed(leases: Sequence[LeasedRange], page: GenerationPage | None) -> list[LeasedRange]:
    """Those of ``leases`` whose file was removed (call after writing into them): a lease
    seen linked at the removal generation read now is still linked (no ``fstat``); any
    other is checked, and seen at that generation when linked and no removal is under way
    (`GenerationPage.seen`)."""
    if page is None:
        return [lease for lease in leases if os.fstat(lease.fd).st_nlink == 0]
    now = page.seen()
    gone = []
    for lease in leases:
        if now < 0 or lease.seen != now:
            if os.fstat(lease.fd).st_nlink == 0:
                gone.append(lease)
            else:
                lease.seen = now
    return gone


def _write_leased(
    places: list[Place], bodies: Sequence[memoryview], page: GenerationPage | None
) -> list[tuple[str, int, str]]:
    """pwrite each item at its place (fsync where the lease says so); return the keys whose
    file garbage collection removed meanwhile: those rows are not acknowledged."""
    for (_, lease, offset), body in zip(places, bodies, strict=True):
        _pwrite_all(lease.fd, body, offset)
    for fd in {lease.fd for _, lease, _ in places if lease.fsync}:
        os.fsync(fd)
    gone = _removed([lease for _, lease, _ in places], page)
    return [key for key, lease, _ in places if lease in gone]


def _write_error(exc: OSError) -> PayloadError:
    """The error of a failed write of rows into leases."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFullError(f"payload file system is full: {exc.strerror}")
    return TransportError(f"writing rows through the data plane failed: {exc}")


def _claims(places: list[Place], sizes: list[int]) -> list[tuple[LeasedRange, int, int]]:
    """The ``(lease, offset, nbytes)`` of each item placed so far."""
    return [(lease, at, n) for (_, lease, at), n in zip(places, sizes[: len(places)], strict=True)]


def _lease_request(
    key: tuple[str, int, str],
    n: int,
    items: Sequence[AppendItem],
    sizes: list[int],
    later: int,
    leases: LeaseCache,
) -> LeaseRequest:
    """The lease request of ``key`` (``n`` bytes), with every key of ``items[later:]`` that
    has no lease either, then the fields the client appended to in the run's step before
    (ahead of need: appends usually go to the same fields step after step)."""
    run, step, _ = key
    want: dict[tuple[str, int, str], int] = {}
    for it, size in zip(items[later:], sizes[later:], strict=True):
        other = (it.run, it.step, it.field)
        if other != key and not leases.holds(other):
            want[other] = want.get(other, 0) + size
    for fld in leases.fields_before(run, step):
        other = (run, step, fld)
        if other != key and other not in want and not leases.holds(other):
            want[other] = 0
    more = [(r, s, f, size) for (r, s, f), size in want.items()][:LEASE_ALONG]
    return LeaseRequest(run, step, key[2], n, more)


def _take_leases(
    request: LeaseRequest, reply: DataReply, fds: list[int], leases: LeaseCache, seen: int
) -> None:
    """Keep the leases of ``reply`` (to ``request``), in the daemon's order; ``seen``: the
    removal generation read before the request (-1: none)."""
    _raise_for(reply, fds, LeaseReply)
    assert isinstance(reply, LeaseReply)
    if len(fds) != 1 + len(reply.more) or any(
        not 0 <= g.index < len(request.more) for g in reply.more
    ):
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"lease sent {len(fds)} descriptors for {1 + len(reply.more)} leases")
    grants = [((request.run, request.step, request.field), reply.file, reply.offset, reply.nbytes)]
    for g in reply.more:
        run, step, fld, _ = request.more[g.index]
        grants.append(((run, step, fld), g.file, g.offset, g.nbytes))
    for (key, file, offset, nbytes), fd in zip(grants, fds, strict=True):
        leases.put(key, LeasedRange(file, fd, offset, offset + nbytes, reply.fsync, offset, seen))


def append_leased(
    items: Sequence[AppendItem], bodies: Sequence[memoryview], leases: LeaseCache
) -> list[list[PayloadSegment]] | None:
    """The whole of `append_steps` when it needs no exchange: the fields table is known,
    every item fits in its key's lease, no note is due. ``None`` otherwise, or when a file
    was removed meanwhile: nothing acknowledged, `append_steps` places every item again.

    Raises
    ------
    InvalidRequestError
        An item the fields table refuses (nothing written).
    StorageFullError, TransportError
        The write failed.
    """
    fields = leases.fields
    if fields is None or leases.unnoted[0] >= NOTE_EVERY - 1:
        return None
    for i, item in enumerate(items):  # the daemon never sees these rows: check them here
        check_item(fields, item, i)
    sizes = [b.nbytes for b in bodies]
    places = leases.claim_all(items, sizes)  # and begun: no descriptor of them closes
    if places is None:
        return None
    try:
        synced = False
        for (lease, offset), body in zip(places, bodies, strict=True):
            n = os.pwrite(lease.fd, body, offset)
            if n != body.nbytes:  # a short write (a signal): the rest
                _pwrite_all(lease.fd, body[n:], offset + n)
            synced |= lease.fsync
        if synced:
            for fd in {lease.fd for lease, _ in places if lease.fsync}:
                os.fsync(fd)
        gone = _removed([lease for lease, _ in places], leases.generation)
    except OSError as exc:
        raise _write_error(exc) from exc
    finally:
        leases.end()
    if gone:
        for lease in gone:
            leases.forget_lease(lease)
        return None
    leases.note(items, sizes, every=sys.maxsize)  # told by the next `append_steps`
    return [
        [PayloadSegment(it.field, lease.file, offset, it.pos, it.rows, it.dtype, list(it.shape))]
        for it, (lease, offset) in zip(items, places, strict=True)
    ]


def append_steps(
    items: Sequence[AppendItem], bodies: Sequence[memoryview], leases: LeaseCache
) -> Steps[list[list[PayloadSegment]]]:
    """Place each item in the client's lease of its ``(run, step, field)`` and pwrite it.

    The items are checked against the daemon's fields table first (fetched once per daemon
    connection, with the daemon's removal generation, `GenerationPage`). No round trip
    while the leases have room; a new lease costs one, which also leases every other key of
    the append without one and, ahead of need, the fields the client appended to in the
    run's step before (`_lease_request`). Items the daemon will not lease (larger than its
    rotation size) go through `reserve_steps` instead.
    """
    yield Fresh()
    if leases.fields is None:
        yield from fields_steps(leases)
    assert leases.fields is not None
    for i, item in enumerate(items):  # the daemon never sees these rows: check them here
        check_item(leases.fields, item, i)
    sizes = [b.nbytes for b in bodies]
    while True:
        places: list[Place] = []
        too_large = False
        leases.begin()  # no lease descriptor is closed while this append writes
        try:
            try:
                for i, (item, n) in enumerate(zip(items, sizes, strict=True)):
                    key = (item.run, item.step, item.field)
                    got = leases.claim(key, n)
                    if got is None:
                        req = _lease_request(key, n, items, sizes, i + 1, leases)
                        page = leases.generation
                        seen = page.seen() if page is not None else -1
                        reply, fds = yield Exchange(req)
                        if isinstance(reply, ErrorReply) and reply.error == "PayloadTooLargeError":
                            for fd in fds:
                                os.close(fd)
                            too_large = True  # the whole append goes through a reservation
                            break
                        _take_leases(req, reply, fds, leases, seen)
                        got = leases.claim(key, n)
                        if got is None:
                            raise ProtocolError(f"lease of {req.nbytes} bytes cannot hold {n}")
                    places.append((key, *got))
            except BaseException:  # nothing written: the next append lands where these would
                leases.unclaim(_claims(places, sizes))
                raise
            if too_large:
                leases.unclaim(_claims(places, sizes))
                return (yield from reserve_steps(items, bodies))

            write = functools.partial(_write_leased, places, bodies, leases.generation)
            try:
                gone = yield Blocking(write, sum(sizes))
            except OSError as exc:
                raise _write_error(exc) from exc
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


def fields_steps(leases: LeaseCache) -> Steps[None]:
    """Fetch the daemon's fields table and its removal generation page (once a connection)."""
    reply, fds = yield Exchange(FieldsRequest())
    if isinstance(reply, FieldsReply) and reply.generation:
        leases.generation = GenerationPage.of(fds)
    else:
        for fd in fds:
            os.close(fd)
    if isinstance(reply, ErrorReply) and reply.error == "BusyError":
        raise error_from_wire(0, reply.error, reply.message)
    # a daemon from before the fields table answers with an error: it has no table
    leases.fields = reply.table if isinstance(reply, FieldsReply) else FieldsTable({})


def read_cached(
    plans: Sequence[WindowPlan | None],
    outs: Sequence[np.ndarray | None],
    cache: ReadCache,
    scratch: Scratch,
) -> bool:
    """The read at once, without steps, when every file it needs has a cached descriptor
    whose file is still linked and long enough (one ``fstat`` each: the daemon's removal
    generation does not count what another node's daemon removes on a shared root); the
    common read of a trainer's next window. ``False``: nothing was read, run `read_steps`."""
    layout = ReadLayout(plans, outs, kernel=True, alloc=scratch.take)
    try:
        fds = {}
        for f, end in layout.ends.items():
            fd = cache.get(f)
            if fd is None:
                return False
            try:
                st = os.fstat(fd)
            except OSError:  # ESTALE: the steps ask the daemon
                return False
            if st.st_nlink == 0 or st.st_size < end:
                return False
            fds[f] = fd
        cache.used.update(layout.ends)  # told to the daemon (GC spares runs in use)
        cache.begin()  # nothing this read uses is closed before it ends
        try:
            _read_extents(layout, fds)
        finally:
            cache.end()
        return True
    finally:
        if layout.stage is not None:
            scratch.give(layout.stage)


def _read_extents(layout: ReadLayout, fds: dict[str, int]) -> None:
    for (file, offset, _), bufs in zip(layout.extents, layout.buffers, strict=True):
        fd = fds[file]
        for at in range(0, len(bufs), IOV_MAX):
            chunk = bufs[at : at + IOV_MAX]
            _pread_into(fd, chunk, offset, file)
            offset += sum(b.nbytes for b in chunk)
    layout.finish()


def read_steps(
    plans: Sequence[WindowPlan | None],
    outs: Sequence[np.ndarray | None],
    cache: ReadCache,
    scratch: Scratch,
    leases: LeaseCache | None = None,
) -> Steps[None]:
    """Get descriptors for the files not cached yet, then preadv every extent of the call
    (`payload_client._layout.ReadLayout`: pieces back to back in a file are one ``preadv``)
    into its buffers, and lay the staged rows into the outputs.

    A descriptor the daemon marks ``read_once`` (`OpenReply`) serves this read only and is
    closed after it, never cached; a cached one is looked at (``fstat``: removed, long
    enough) before it is used. ``leases`` gets the fields table at the first read that asks
    the daemon anyway (and with it the removal generation, for appends).
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
        if missing and leases is not None and leases.fields is None:
            yield from fields_steps(leases)  # once a connection, as appends do
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

        yield Blocking(functools.partial(_read_extents, layout, fds_by_file), layout.nbytes)
    finally:
        cache.end()
        for fd in once:
            os.close(fd)
        if layout.stage is not None:
            scratch.give(layout.stage)
