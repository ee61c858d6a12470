"""The data plane's operations: row bytes by file descriptor, for clients on the daemon's node.

The daemon keeps naming, placement, permissions and lifecycle; the client never opens a
payload path. Over a second Unix socket (``<socket>.data``) it asks the daemon to reserve
room for an append and gets write-only descriptors of the files (SCM_RIGHTS), pwrites the rows
itself, then commits and gets the segments. For a read it gets read-only descriptors (cached,
one per file) and preads exactly the window's byte ranges, straight into the output array
when the stored dtype is the output dtype, else into a reused buffer that numpy widens from.

Each operation is written once, here, as a generator of steps (`Exchange`: a request and its
reply with descriptors; `Blocking`: file I/O; `Fresh`: drop what a gone daemon handed out);
the data plane transports (`payload_client.transports.dataplane._transport.SyncDataPlane` and
``AsyncDataPlane``) only run them. ("Steps" here are steps of an operation, not training
steps.)
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..._errors import (
    ProtocolError,
    SegmentFileError,
    error_from_wire,
)
from ...reads._layout import IOV_MAX, ReadLayout
from ...reads._windows import WindowPlan
from ...wire._dataplane import (
    CommitReply,
    DataReply,
    DataRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    OpenReply,
    OpenRequest,
)
from ...wire._http import FieldsTable
from ._descriptors import (
    MAX_FDS,
    GenerationPage,
    LeaseCache,
    ReadCache,
    Scratch,
)

__all__ = [
    "MAX_FDS",
    "Blocking",
    "Exchange",
    "Fresh",
    "Steps",
    "fields_steps",
    "table_steps",
    "note_steps",
    "pwrite_all",
    "raise_for",
    "read_cached",
    "read_steps",
]

T = TypeVar("T")


@dataclass
class Exchange:
    """Step: send ``request``; the generator receives ``(reply, fds)``, or ``None`` when
    ``reply`` is false (a note the daemon does not answer).

    A callable ``request`` is called under the connection's lock, right before sending:
    ``None`` sends nothing (the generator receives ``None``). ``take``, when given, gets the
    answer under the lock too, and the generator receives what it returns: so that what one
    exchange changes (a lease) is in place before the next thread builds its request."""

    request: DataRequest | Callable[[], DataRequest | None]
    reply: bool = True
    take: Callable[[tuple[DataReply, list[int]]], Any] | None = None


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


def raise_for(reply: DataReply, fds: list[int], expect: type) -> None:
    if isinstance(reply, expect):
        return
    for fd in fds:
        os.close(fd)
    if isinstance(reply, ErrorReply):
        raise error_from_wire(0, reply.error, reply.message)
    raise ProtocolError(f"data plane answered {type(reply).__name__}, expected {expect.__name__}")


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
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
            raise_for(reply[0], reply[1], CommitReply)


def table_steps(leases: LeaseCache) -> Steps[FieldsTable]:
    """The daemon's fields table, as this connection fetched it (`fields_steps`, once)."""
    yield Fresh()
    if leases.fields is None:
        yield from fields_steps(leases)
    assert leases.fields is not None
    return leases.fields


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
        for stage in layout.stages:
            scratch.give(stage)


def _read_extents(layout: ReadLayout, fds: dict[str, int]) -> None:
    for (file, offset, _), bufs in zip(layout.extents, layout.buffers, strict=True):
        fd = fds[file]
        for at in range(0, len(bufs), IOV_MAX):
            chunk = bufs[at : at + IOV_MAX]
            _pread_into(fd, chunk, offset, file)
            offset += sum(b.nbytes for b in chunk)
    layout.finish()


def _cached_descriptors(
    ends: dict[str, int], cache: ReadCache
) -> tuple[dict[str, int], dict[str, int]]:
    """The cached descriptors of the files of ``ends`` still usable, and their sizes; one
    removed, or shorter than a segment says, is forgotten (the daemon is asked for it)."""
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
            # removed (collected), or shorter than a segment says (this node's view of a
            # file another node writes may lag): ask the daemon, which checks the ledger and
            # waits for the file to grow
            cache.forget(f)
            continue
        fds_by_file[f] = fd
        sizes[f] = st.st_size
    return fds_by_file, sizes


def _opened(
    batch: list[tuple[str, int]],
    reply: Any,
    fds: list[int],
    cache: ReadCache,
    once: list[int],
    fds_by_file: dict[str, int],
    sizes: dict[str, int],
) -> None:
    """Take the descriptors of an `OpenReply` to ``batch``: cached, or kept for this read
    only (``once``: ``read_once``); each file's size looked at."""
    raise_for(reply, fds, OpenReply)
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


def read_steps(
    plans: Sequence[WindowPlan | None],
    outs: Sequence[np.ndarray | None],
    cache: ReadCache,
    scratch: Scratch,
    leases: LeaseCache | None = None,
) -> Steps[None]:
    """Get descriptors for the files not cached yet, then preadv every extent of the call
    (`payload_client.reads._layout.ReadLayout`: pieces back to back in a file are one ``preadv``)
    into its buffers, and lay the staged rows into the outputs.

    A descriptor the daemon marks ``read_once`` (`OpenReply`) serves this read only and is
    closed after it, never cached; a cached one is looked at (``fstat``: removed, long
    enough) before it is used. ``leases`` gets the fields table at the first read that asks
    the daemon anyway (and with it the removal generation, for appends).
    """
    yield Fresh()  # the checks `read_now` found due (removed files, a restart), done here
    layout = ReadLayout(plans, outs, kernel=True, alloc=scratch.take)
    ends = layout.ends
    if not ends:
        return
    cache.used.update(ends)  # told to the daemon (GC spares runs in use)
    once: list[int] = []  # descriptors of this read only: closed at its end
    cache.begin()  # nothing this read uses is closed before it ends
    try:
        fds_by_file, sizes = _cached_descriptors(ends, cache)
        missing = [(f, e) for f, e in ends.items() if f not in fds_by_file]
        if missing and leases is not None and leases.fields is None:
            yield from fields_steps(leases)  # once a connection, as appends do
        for start in range(0, len(missing), MAX_FDS):
            batch = missing[start : start + MAX_FDS]
            reply, fds = yield Exchange(OpenRequest(batch))
            _opened(batch, reply, fds, cache, once, fds_by_file, sizes)
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
        for stage in layout.stages:
            scratch.give(stage)
