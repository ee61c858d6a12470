"""The data plane's appends, as steps (`payload_client.transports.dataplane._steps`):
rows placed in the client's leases and pwritten by the client itself (`append_steps`,
`append_leased`: no round trip while a lease has room), or, for items larger than a lease,
a reservation the daemon makes, written by the client and committed (`reserve_steps`).

A lease request is built and answered under the connection's lock (`_LeaseAsk`): threads
of one client ask for a key once, and a renewed key's old lease is ended where its rows end
(`LeaseRequest.done`), so a client's lease files have no holes. Each lease counts the
claims of appends not settled yet (`LeaseCache.settle`, after their writes): one ended or
dropped with some is named to the daemon once they settle (`LeaseRequest.writing`,
``written``), which keeps its file open until then, so that the file's size on disk,
which decides what it counts once closed, includes every row of the client's.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import sys
from collections.abc import Sequence

from ..._errors import (
    AppendInDoubtError,
    PayloadError,
    ProtocolError,
    StorageFullError,
    TransportError,
)
from ...segments._segment import PayloadSegment
from ...wire._dataplane import (
    AbortRequest,
    CommitReply,
    CommitRequest,
    DataReply,
    ErrorReply,
    LeaseReply,
    LeaseRequest,
    ReserveReply,
    ReserveRequest,
    ShapesRequest,
)
from ...wire._fields import check_item, check_together, is_ragged, row_pattern
from ...wire._http import AppendItem
from .._base import DataPlaneDownError
from ._descriptors import (
    LEASE_ALONG,
    NOTE_EVERY,
    GenerationPage,
    LeaseCache,
    LeasedRange,
)
from ._steps import (
    Blocking,
    Exchange,
    Fresh,
    Steps,
    fields_steps,
    pwrite_all,
    raise_for,
)

__all__ = ["ASKS", "append_leased", "append_steps", "reserve_steps"]

ASKS = 64
"""Most leases one item of an append asks for (each one taken by other threads of the
client before it could claim its room): beyond, the daemon is not answering as it should."""


def reserve_steps(
    items: Sequence[AppendItem], bodies: Sequence[memoryview]
) -> Steps[list[list[PayloadSegment]]]:
    """Reserve, pwrite the rows through the daemon's descriptors, commit (two round trips;
    for items larger than a lease, which the daemon splits across files).

    ``bodies`` are the items' rows as little-endian bytes, in item order.
    """
    reply, fds = yield Exchange(ReserveRequest(list(items)))
    raise_for(reply, fds, ReserveReply)
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
                    pwrite_all(fds[e.file], chunk[:take], e.offset + done)
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
    raise_for(done, more, CommitReply)
    assert isinstance(done, CommitReply)
    return done.segments


def _pattern(leases: LeaseCache, item: AppendItem) -> tuple[int, ...]:
    """The row pattern of ``item`` under the daemon's table (`row_pattern`)."""
    table = leases.fields
    assert table is not None
    return row_pattern(item.shape, is_ragged(table.fields.get(item.field)))


def _taken(leases: LeaseCache, items: Sequence[AppendItem]) -> bool:
    """Whether the daemon took the row shape of every item for its run and field."""
    for it in items:
        have = leases.shapes.get((it.run, it.field))
        if have is None or (have[1] != it.shape and have[0] != _pattern(leases, it)):
            return False  # (the shape taken itself: no pattern to work out)
    return True


def declare_steps(
    items: Sequence[AppendItem], sizes: Sequence[int], leases: LeaseCache
) -> Steps[None]:
    """Ask the daemon about row shapes of ``items`` that no lease request will carry: a
    shape other than the one it took for the item's run and field (after a run was deleted
    the daemon fixes it anew), or none taken where the item's lease has room (a lease
    request carries the shapes of the keys it asks for: `_LeaseAsk`). Usually nothing:
    no round trip.

    Raises
    ------
    InvalidRequestError
        A shape other than the one the run's first append of the field fixed (nothing is
        written then).
    """
    todo: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}
    for it, n in zip(items, sizes, strict=True):
        have = leases.shapes.get((it.run, it.field))
        pattern = _pattern(leases, it)
        if have is not None and have[0] == pattern:
            continue
        if have is not None or leases.has_room((it.run, it.step, it.field), n):
            todo.setdefault((it.run, it.field, pattern), list(it.shape))
    if not todo:
        return
    reply, fds = yield Exchange(ShapesRequest([(r, f, s) for (r, f, _), s in todo.items()]))
    raise_for(reply, fds, CommitReply)
    for (run, fld, pattern), shape in todo.items():
        leases.shapes[(run, fld)] = (pattern, shape)


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
        pwrite_all(lease.fd, body, offset)
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


def _shapes(
    key: tuple[str, int, str],
    more: list[tuple[str, int, str, int]],
    items: Sequence[AppendItem],
    leases: LeaseCache,
) -> list[tuple[str, str, list[int]]]:
    """The row shape of each ``(run, field)`` a lease request asks for: an item's, or the
    one the daemon took before (a key asked ahead of need); none for a key of neither."""
    mine = {(it.run, it.field): list(it.shape) for it in reversed(items)}  # the first wins
    out: dict[tuple[str, str], list[int]] = {}
    for run, _, fld in [key, *((r, s, f) for r, s, f, _ in more)]:
        shape = mine.get((run, fld))
        if shape is None and (have := leases.shapes.get((run, fld))) is not None:
            shape = have[1]
        if shape is not None:
            out.setdefault((run, fld), shape)
    return [(run, fld, shape) for (run, fld), shape in out.items()]


class _LeaseAsk:
    """The lease request of ``key`` for ``n`` bytes, built and answered under the
    connection's lock (`Exchange`): not sent when another thread's lease of ``key`` came in
    meanwhile with room for ``n`` (threads of one client ask once, and no lease leaves a
    hole), and its leases in place before the lock is let go."""

    def __init__(
        self,
        key: tuple[str, int, str],
        n: int,
        items: Sequence[AppendItem],
        sizes: list[int],
        later: int,
        leases: LeaseCache,
    ) -> None:
        self.key, self.n, self.items, self.sizes, self.later = key, n, items, sizes, later
        self.leases = leases
        self.seen = -1
        self.sent: LeaseRequest | None = None

    def request(self) -> LeaseRequest | None:
        if self.leases.has_room(self.key, self.n):
            return None
        page = self.leases.generation
        self.seen = page.seen() if page is not None else -1
        self.sent = self._build()
        return self.sent

    def _build(self) -> LeaseRequest:
        """The lease request of ``key`` (``n`` bytes), with every key of ``items[later:]``
        that has no lease either, then the fields the client appended to in the run's step
        before (ahead of need: appends usually go to the same fields step after step)."""
        key, leases = self.key, self.leases
        run, step, _ = key
        want: dict[tuple[str, int, str], int] = {}
        for it, size in zip(self.items[self.later :], self.sizes[self.later :], strict=True):
            other = (it.run, it.step, it.field)
            if other != key and not leases.holds(other):
                want[other] = want.get(other, 0) + size
        for fld in leases.fields_before(run, step):
            other = (run, step, fld)
            if other != key and other not in want and not leases.holds(other):
                want[other] = 0
        more = [(r, s, f, size) for (r, s, f), size in want.items()][:LEASE_ALONG]
        done, writing = leases.finish(key)
        shapes = _shapes(key, more, self.items, leases)
        return LeaseRequest(
            run, step, key[2], self.n, more, done, shapes, writing, leases.take_written()
        )

    def take(self, answer: tuple[DataReply, list[int]]) -> bool:
        """Keep the leases granted; ``False`` when the daemon refused the key as too large
        for a lease (its rotation size: the append goes through a reservation)."""
        reply, fds = answer
        if isinstance(reply, ErrorReply) and reply.error == "PayloadTooLargeError":
            for fd in fds:
                os.close(fd)
            return False
        assert self.sent is not None
        _take_leases(self.sent, reply, fds, self.leases, self.seen)
        if isinstance(reply, LeaseReply) and reply.nbytes < self.n:
            raise ProtocolError(f"lease of {reply.nbytes} bytes cannot hold {self.n}")
        return True


def _take_leases(
    request: LeaseRequest, reply: DataReply, fds: list[int], leases: LeaseCache, seen: int
) -> None:
    """Keep the leases of ``reply`` (to ``request``), in the daemon's order; ``seen``: the
    removal generation read before the request (-1: none)."""
    raise_for(reply, fds, LeaseReply)
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
    table = leases.fields
    granted = {(key[0], key[2]) for key, *_ in grants}
    for run, fld, shape in request.shapes:  # the daemon took the shapes of leases granted
        if (run, fld) in granted:
            spec = None if table is None else table.fields.get(fld)
            leases.shapes[(run, fld)] = (row_pattern(shape, is_ragged(spec)), shape)


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
    if not _taken(leases, items):  # a run and field's first shape goes with its lease
        return None
    sizes = [b.nbytes for b in bodies]
    places = leases.claim_all(items, sizes)  # and begun: no descriptor of them closes
    if places is None:
        return None
    try:
        synced = False
        for (lease, offset), body in zip(places, bodies, strict=True):
            n = os.pwrite(lease.fd, body, offset)
            if n != body.nbytes:  # a short write (a signal): the rest
                pwrite_all(lease.fd, body[n:], offset + n)
            synced |= lease.fsync
        if synced:
            for fd in {lease.fd for lease, _ in places if lease.fsync}:
                os.fsync(fd)
        gone = _removed([lease for lease, _ in places], leases.generation)
    except OSError as exc:
        raise _write_error(exc) from exc
    finally:
        leases.settle(places)
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
    connection, with the daemon's removal generation, `GenerationPage`); their row shapes
    go with the lease requests (`_LeaseAsk`), or in a request of their own where no
    lease is asked for (`declare_steps`). No round trip
    while the leases have room; a new lease costs one, which also leases every other key of
    the append without one and, ahead of need, the fields the client appended to in the
    run's step before (`_LeaseAsk`). Items the daemon will not lease (larger than its
    rotation size) go through `reserve_steps` instead.
    """
    yield Fresh()
    if leases.fields is None:
        yield from fields_steps(leases)
    assert leases.fields is not None
    for i, item in enumerate(items):  # the daemon never sees these rows: check them here
        check_item(leases.fields, item, i)
    check_together(items, leases.fields)
    sizes = [b.nbytes for b in bodies]
    yield from declare_steps(items, sizes, leases)
    asked_shapes = False
    while True:
        places: list[Place] = []
        too_large = False
        leases.begin()  # no lease descriptor is closed while this append writes (`settle`)
        try:
            try:
                for i, (item, n) in enumerate(zip(items, sizes, strict=True)):
                    key = (item.run, item.step, item.field)
                    asked = 0
                    while (got := leases.claim(key, n)) is None:
                        if asked >= ASKS:  # each lease taken by other threads before this one
                            raise ProtocolError(f"leases of {key} keep having no room for {n}")
                        ask = _LeaseAsk(key, n, items, sizes, i + 1, leases)
                        leased = yield Exchange(ask.request, take=ask.take)
                        if leased is False:
                            too_large = True  # the whole append goes through a reservation
                            break
                        asked += leased is True
                    if got is None:
                        break
                    places.append((key, *got))
            except BaseException:  # nothing written: the next append lands where these would
                leases.unclaim(_claims(places, sizes))
                raise
            if too_large:
                leases.unclaim(_claims(places, sizes))
                return (yield from reserve_steps(items, bodies))
            if not _taken(leases, items):  # another thread's lease, of another shape
                leases.unclaim(_claims(places, sizes))
                if asked_shapes:
                    raise ProtocolError("the daemon took a row shape and then another")
                asked_shapes = True
                yield from declare_steps(items, sizes, leases)  # refused, or taken now
                continue  # (the finally below ends this round's claims)

            write = functools.partial(_write_leased, places, bodies, leases.generation)
            try:
                gone = yield Blocking(write, sum(sizes))
            except OSError as exc:
                raise _write_error(exc) from exc
        finally:  # (its claims settled: written, or given back)
            leases.settle([(lease, at) for _, lease, at in places])
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
