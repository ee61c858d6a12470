"""The data plane's requests: what a connection holds, and one handler per message type.

`DataPlaneRequests.answer` decodes a request frame, picks its handler in a table (message
type -> handler method) and turns what it raises into an ``ErrorReply`` through
`wire_error`, like an HTTP answer. `DataPlaneServer` moves the frames and the descriptors;
the `Store` does all placement and checking. Notes (`NoteRequest`, counters a client reports
of appends written through its descriptors) are answered only when they ask for it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from payload_client import (
    BusyError,
    InvalidRequestError,
    PayloadError,
    PayloadTooLargeError,
    ServerError,
)
from payload_client.protocol import (
    LEASE_ALONG,
    LEASES,
    MAX_FDS,
    AbortRequest,
    CommitReply,
    CommitRequest,
    DataReply,
    DataRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    NoteRequest,
    OpenReply,
    OpenRequest,
    ReservedExtent,
    ReserveReply,
    ReserveRequest,
    ShapesRequest,
)
from payloadd.server._errors import wire_error
from payloadd.server._metrics import Metrics
from payloadd.store._appends import LeasedRange, PendingAppend
from payloadd.store._budget import Descriptors, out_of_descriptors
from payloadd.store._counts import DATA_PLANE
from payloadd.store._shapes import check_shapes
from payloadd.store._store import Store

__all__ = ["FIRST_LEASE", "HELD", "LEASE_ALONG", "Answer", "Connection", "DataPlaneRequests"]

log = logging.getLogger("payloadd.dataplane")

FIRST_LEASE = 64 << 10
"""Bytes of a key's first lease on a connection (more when its append needs more); each
renewal of the key doubles it, up to ``lease_bytes``."""
HELD = 2 * LEASES
"""Most leases a connection holds for rows still on their way (`Connection.writing`); beyond,
the oldest is let go (its file may close before them: counted at the next recount)."""

_decoder = msgspec.msgpack.Decoder(DataRequest)
_note_decoder = msgspec.msgpack.Decoder(NoteRequest)


class Connection:
    """What one connection holds; all of it ends with the connection (`DataPlaneRequests.end`).

    Parameters
    ----------
    sock : socket.socket
        The connection.
    owner : int
        Its owner id in the store (`Store.new_owner`): its lease files are private to it.
    """

    def __init__(self, sock: socket.socket, owner: int) -> None:
        self.sock = sock
        self.owner = owner
        # txn -> (append, deadline, per-request descriptors it holds)
        self.pending: dict[int, tuple[PendingAppend, float, int]] = {}
        self.leases: dict[tuple[str, int, str], LeasedRange] = {}
        # (file, offset) -> a lease no longer its key's current one, its rows maybe on their
        # way: held (its file open) until named (`LeaseRequest.written`) or the end
        self.writing: dict[tuple[str, int], LeasedRange] = {}


class Answer(NamedTuple):
    """A request's reply: its ``kind`` (for the metrics), the ``reply``, the descriptors to
    pass with it and the per-request descriptors ``taken`` for them; the sender closes the
    descriptors and gives those back, then calls each of ``after`` (`DataPlaneRequests.after`:
    what the reply need not wait for)."""

    kind: str
    reply: DataReply
    fds: list[int]
    taken: int
    after: list[Callable[[], object]]


class _Passing:
    """What a handler passes so far: descriptors opened, per-request descriptors taken (all
    closed and given back if it fails), what is done once the reply is sent."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.taken = 0
        self.after: list[Callable[[], object]] = []


_Handler = Callable[["DataPlaneRequests", Connection, Any, _Passing], DataReply]


class DataPlaneRequests:
    """Serve the data plane's requests of each connection against ``store``.

    Parameters
    ----------
    store : Store
        The storage core (placement, checks, counters).
    fds : Descriptors
        The descriptor shares: a request takes what it passes from the per-request share.
    lease_bytes : int
        Most bytes of one lease (a byte range a client places small appends in). A key's
        first lease is `FIRST_LEASE` bytes (or what its append needs), each renewal twice
        the last, up to this: what a lease holds unwritten stays about what its key has
        written so far, not ``lease_bytes`` a field and a client.
    reservation_timeout : float
        Seconds a reservation may stay uncommitted; then it is given back (`expire`).
    metrics : Metrics, optional
        Where leases, descriptors handed out, appends and errors are counted.
    """

    def __init__(
        self,
        store: Store,
        fds: Descriptors,
        lease_bytes: int,
        reservation_timeout: float,
        metrics: Metrics | None = None,
    ) -> None:
        self.store, self.fds, self.metrics = store, fds, metrics
        self.lease_bytes = lease_bytes
        self.first_lease = min(FIRST_LEASE, lease_bytes)
        self.reservation_timeout = reservation_timeout
        # reservation ids, unique across connections (a client shared by threads may send a
        # commit on a new connection) and, from a random start, across restarts
        self._txns = itertools.count(secrets.randbits(62))

    # -- the connection's life -----------------------------------------------------------

    def connect(self, sock: socket.socket) -> Connection:
        """A new connection's state (an owner of its own in the store)."""
        return Connection(sock, self.store.new_owner())

    def end(self, conn: Connection) -> None:
        """End everything ``conn`` held; one failing step (an I/O error removing a file) is
        logged and the rest still ends."""
        ends: list[Callable[[], object]] = [
            *(functools.partial(self.give_back, conn, txn) for txn in list(conn.pending)),
            *(lease.release for lease in conn.leases.values()),
            *(lease.release for lease in conn.writing.values()),
            functools.partial(self.store.end_owner, conn.owner),
        ]
        for end in ends:
            try:
                end()
            except Exception:
                log.exception("data plane: ending what a closed connection held")

    def give_back(self, conn: Connection, txn: int) -> None:
        """Give reservation ``txn`` of ``conn`` back, uncommitted (its files go)."""
        self._end_reservation(conn, txn).close()

    def expire(self, conn: Connection) -> None:
        """Give back the reservations of ``conn`` past their deadline."""
        now = time.monotonic()
        for txn in [t for t, (_, deadline, _) in conn.pending.items() if deadline <= now]:
            self.give_back(conn, txn)
            log.warning("data plane: reservation %d not committed within %.0f s; given back",
                        txn, self.reservation_timeout)  # fmt: skip

    def _end_reservation(self, conn: Connection, txn: int) -> PendingAppend:
        """Take reservation ``txn`` off the connection, giving back its descriptors.

        Raises
        ------
        KeyError
            No such reservation is open.
        """
        pending, _, held = conn.pending.pop(txn)
        self.fds.give(held)
        return pending

    # -- notes ---------------------------------------------------------------------------

    @staticmethod
    def note_of(body: bytearray) -> NoteRequest | None:
        """The note in ``body``, or ``None`` for another request.

        Raises
        ------
        ConnectionAbortedError
            For a malformed note: answering it would hand the reply to the next request
            of a client that waits for none, so the connection is dropped instead.
        """
        tag = _tag(body)
        if tag is not None and tag != _NOTE:  # another request: no decoding here
            return None
        try:
            return _note_decoder.decode(body)
        except msgspec.DecodeError:
            try:
                tag = msgspec.msgpack.decode(body)[0]
            except (msgspec.DecodeError, TypeError, KeyError, IndexError):
                return None
            if tag == "note":
                raise ConnectionAbortedError("malformed note") from None
            return None

    def count_note(self, note: NoteRequest) -> None:
        """Add what ``note`` reports to the counters; the runs it names are in use."""
        self.store.counts.noted(note)
        for node, run in note.runs:  # runs in use: the GC age rule spares them
            if node == self.store.node:
                self.store.touch(run)

    # -- requests ------------------------------------------------------------------------

    def answer(self, body: bytearray, conn: Connection) -> Answer:
        """Serve one request (not a note): its `Answer`; an error is an ``ErrorReply``."""
        passing = _Passing()
        kind = "invalid"
        try:
            req = _decoder.decode(body)
            kind, handler = _HANDLERS.get(type(req), ("invalid", None))
            if handler is None:
                raise InvalidRequestError(f"unexpected request {type(req).__name__}")
            reply = handler(self, conn, req, passing)
            return Answer(kind, reply, passing.fds, passing.taken, passing.after)
        except Exception as exc:
            for fd in passing.fds:
                os.close(fd)
            self.fds.give(passing.taken)
            return Answer(kind, self._error(exc), [], 0, passing.after)

    @staticmethod
    def after(answer: Answer) -> None:
        """Do what ``answer``'s request left for after its reply (leases it ended); one
        failing step is logged and the rest still done."""
        for fn in answer.after:
            try:
                fn()
            except Exception:
                log.exception("data plane: ending a lease after a reply")

    def _error(self, exc: Exception) -> ErrorReply:
        """The reply to a failed request (`wire_error`), counted."""
        metrics = self.metrics
        if isinstance(exc, msgspec.DecodeError):  # the request's, or one from below
            exc = InvalidRequestError(f"bad data plane request: {exc}")
        wire = wire_error(exc, "data plane", log)
        if wire.status == 503:  # refused, short of descriptors: counted, and (unlike HTTP) logged
            if metrics is not None:
                metrics.refused_one(DATA_PLANE, "descriptors")
            log.error("data plane: %s: %s", wire.error, wire.message)
        if metrics is not None:
            metrics.error(wire.error, DATA_PLANE)
        return ErrorReply(wire.error, wire.message)

    def _lease(self, conn: Connection, req: LeaseRequest, passing: _Passing) -> DataReply:
        key = (req.run, req.step, req.field)
        last = conn.leases.get(key)  # a key renewed: its next range twice the last one
        size = self.first_lease if last is None else min(2 * last.nbytes, self.lease_bytes)
        if req.written:  # what the client let go of: first, whatever comes next
            self._written(conn, req.written)
        self._finish(conn, req, key)
        check_shapes(self.store.fields, req.shapes)
        shapes = {(run, fld): shape for run, fld, shape in req.shapes}  # checked with each lease
        more = req.more[:LEASE_ALONG]
        try:  # the keys asked for besides: only as the descriptors allow
            self.fds.take(1 + len(more), "a lease")
        except (BusyError, PayloadTooLargeError):
            self.fds.take(1, "a lease")
            more = []
        passing.taken = 1 + len(more)
        with self.store.syncs_together():  # fsync="always": each new directory entry once
            got = self._lease_file(conn, key, req.nbytes, size, False, shapes)
            assert got is not None  # not ahead: granted or raised
            lease, fd = got
            passing.fds.append(fd)
            self._hold(conn, key, lease, passing)
            grants = self._lease_more(conn, more, key, passing, shapes)
        self.fds.give(passing.taken - len(passing.fds))  # those of keys left out
        passing.taken = len(passing.fds)
        files = [lease.file, *(g.file for g in grants)]
        passing.after.append(functools.partial(self.store.counts.handed_out, "write", files))
        fsync = self.store.fsync == "always"
        return LeaseReply(lease.file, lease.offset, lease.nbytes, fsync, grants)

    def _lease_more(
        self,
        conn: Connection,
        more: list[tuple[str, int, str, int]],
        key: tuple[str, int, str],
        passing: _Passing,
        shapes: dict[tuple[str, str], list[int]],
    ) -> list[LeaseGrant]:
        """The leases of a request's ``more`` (besides ``key``), as many as can be had."""
        grants: list[LeaseGrant] = []
        for i, (run, step, fld, nbytes) in enumerate(more):
            other = (run, step, fld)
            if other == key or other in conn.leases:
                continue  # the client holds it (or asked twice)
            try:
                got = self._lease_file(conn, other, nbytes, self.first_lease, nbytes == 0, shapes)
            except (PayloadError, OSError) as exc:  # left out: asked again when needed
                log.debug("data plane: a lease asked along was left out: %s", exc)
                continue
            if got is None:  # near a disk limit: only what is needed now
                continue
            passing.fds.append(got[1])
            self._hold(conn, other, got[0], passing)
            grants.append(LeaseGrant(i, got[0].file, got[0].offset, got[0].nbytes))
        return grants

    def _finish(self, conn: Connection, req: LeaseRequest, key: tuple[str, int, str]) -> None:
        """End the leases the client said it is done with (`LeaseRequest.done`), each at the
        offset it gave: their unused tails stop counting, and a key renewed (``key``) goes
        on there. Those whose rows are still on their way (`LeaseRequest.writing`) stay
        held (`Connection.writing`) until the client names them. Ranges the connection
        holds no more (ended already, by a request of another thread of the client) are
        passed over; the files of keys other than ``key`` are sealed (closed once unused).

        Raises
        ------
        InvalidRequestError
            An end outside its lease's range (nothing is ended then).
        """
        if not req.done:
            return
        held = {(lease.file, lease.offset): k for k, lease in conn.leases.items()}
        ends: list[tuple[tuple[str, int, str] | None, LeasedRange, int]] = []
        for file, offset, used in req.done[:LEASES]:
            k = held.get((file, offset))
            lease = conn.writing.get((file, offset)) if k is None else conn.leases[k]
            if lease is None:
                continue
            if not offset <= used <= offset + lease.nbytes:
                raise InvalidRequestError(
                    f"the lease of bytes [{offset}, {offset + lease.nbytes}) of {file} "
                    f"cannot end at {used}"
                )
            ends.append((k, lease, used))
        writing = {(file, offset) for file, offset in req.writing[:LEASES]}
        for k, lease, used in ends:
            name = (lease.file, lease.offset)
            if k is not None:
                del conn.leases[k]
            if name not in writing:
                conn.writing.pop(name, None)
                lease.release(used)
            else:  # the client's rows are on their way: held until it names it
                lease.end(used)
                self._keep(conn, lease)
            if k is not None and k != key:
                self.store.seal_lease(conn.owner, k)

    def _written(self, conn: Connection, names: list[tuple[str, int]]) -> None:
        """Let go of the leases the client let go of, its rows in place (`LeaseRequest.written`):
        held ones, and current ones it dropped (their keys' files sealed); others pass."""
        current = {(lease.file, lease.offset): k for k, lease in conn.leases.items()}
        for name in names[:HELD]:
            lease = conn.writing.pop(name, None)
            if lease is not None:
                lease.release()
                continue
            k = current.get(name)
            if k is not None:
                conn.leases.pop(k).release()
                self.store.seal_lease(conn.owner, k)

    @staticmethod
    def _keep(conn: Connection, lease: LeasedRange) -> None:
        """Hold ``lease``, no longer the client's current one of its key, until the client
        names it (`_written`); beyond `HELD`, the oldest held is let go."""
        conn.writing[(lease.file, lease.offset)] = lease
        while len(conn.writing) > HELD:
            conn.writing.pop(next(iter(conn.writing))).release()

    def _hold(
        self, conn: Connection, key: tuple[str, int, str], lease: LeasedRange, passing: _Passing
    ) -> None:
        """``conn``'s lease of ``key`` is ``lease`` from now on; beyond `LEASES`, its oldest
        one ends (the client keeps as many, in the same order; its file sealed once the
        reply is sent). That one, or an old one of ``key`` (the client dropped it), is held
        until the client names it (`_written`): rows of its may still be on their way."""
        old = conn.leases.pop(key, None)  # this client moves on to the new range
        if old is not None:
            self._keep(conn, old)
        conn.leases[key] = lease
        while len(conn.leases) > LEASES:  # as many as a client keeps: the oldest is done
            done = next(iter(conn.leases))
            self._keep(conn, conn.leases.pop(done))  # its unused tail stops counting, once
            passing.after.append(functools.partial(self.store.seal_lease, conn.owner, done))

    def _fields(self, conn: Connection, req: FieldsRequest, passing: _Passing) -> DataReply:
        page = self.store.generation
        if page is None:
            return FieldsReply(self.store.fields)
        try:  # the removal generation, once per connection; without it, clients fstat
            self.fds.take(1, "the generation page")
        except (BusyError, PayloadTooLargeError):
            return FieldsReply(self.store.fields)
        try:
            passing.fds.append(page.reader())
        except OSError:
            self.fds.give(1)
            return FieldsReply(self.store.fields)
        passing.taken = 1
        return FieldsReply(self.store.fields, generation=True)

    def _shapes(self, conn: Connection, req: ShapesRequest, passing: _Passing) -> DataReply:
        self.store.declare_shapes(req.shapes)  # a client's rows of another shape, lease held
        return CommitReply([])

    def _open(self, conn: Connection, req: OpenRequest, passing: _Passing) -> DataReply:
        if len(req.files) > MAX_FDS:
            raise PayloadTooLargeError(
                f"open of {len(req.files)} files is above the limit of {MAX_FDS} a "
                "request (what one message can pass)"
            )
        self.fds.take(len(req.files), f"an open of {len(req.files)} files")
        passing.taken = len(req.files)
        deadline = self.store.reads.deadline()  # one wait for the whole request
        for rel, end in req.files:
            passing.fds.append(self.store.open_for_read(rel, end, deadline))
        keeps = self.store.reads.client_keeps
        once = [i for i, (rel, _) in enumerate(req.files) if not keeps(rel)]
        self.store.counts.handed_out("read", [rel for rel, _ in req.files])
        return OpenReply(len(passing.fds), once)

    def _reserve(self, conn: Connection, req: ReserveRequest, passing: _Passing) -> DataReply:
        need = self.store.files_needed(req.items)
        what = f"a reservation of {len(req.items)} items"
        self.fds.take(2 * need, what)  # the store's while it lasts, and the client's
        passing.taken = 2 * need
        pending = self.store.begin_append(req.items, private=True, transport=DATA_PLANE)
        try:
            files = pending.files
            if len(files) > MAX_FDS:
                raise PayloadTooLargeError(
                    f"reservation spans {len(files)} files, above the {MAX_FDS} one "
                    "reply can pass; split it"
                )
            for rel in files:  # one by one: the except closes what was opened
                passing.fds.append(self._writer(rel))
        except BaseException:
            pending.close()
            raise
        txn = next(self._txns)
        deadline = time.monotonic() + self.reservation_timeout
        conn.pending[txn] = (pending, deadline, need)  # the store's are given back with it
        passing.taken = need  # the client's: given back once sent
        index = {rel: i for i, rel in enumerate(files)}
        extents = [ReservedExtent(index[rel], off, n) for rel, off, n in pending.extents]
        self.store.counts.handed_out("write", files)
        return ReserveReply(txn, files, extents)

    def _reservation(self, conn: Connection, txn: int) -> PendingAppend:
        """Reservation ``txn``, taken off the connection, or `InvalidRequestError`."""
        try:
            return self._end_reservation(conn, txn)
        except KeyError:
            raise InvalidRequestError(
                f"no open reservation {txn} on this connection: never made, "
                "committed already, made on a connection that ended, or given back "
                f"after {self.reservation_timeout:.0f} s uncommitted"
            ) from None

    def _commit(self, conn: Connection, req: CommitRequest, passing: _Passing) -> DataReply:
        pending = self._reservation(conn, req.txn)
        pending.written_elsewhere()
        try:
            reply = CommitReply(pending.commit())
        finally:
            pending.close()
        return reply

    def _abort(self, conn: Connection, req: AbortRequest, passing: _Passing) -> DataReply:
        self._reservation(conn, req.txn).close()
        return CommitReply([])

    # -- descriptors -----------------------------------------------------------------------

    def _writer(self, rel: str) -> int:
        """A write-only descriptor of its own for a client: not a dup of the store's, so
        nothing a client does to its file status flags (O_APPEND...) reaches the store.

        Raises
        ------
        FileNotFoundError
            The file was removed (garbage collection).
        BusyError
            No descriptor is left (``EMFILE``).
        """
        try:
            return os.open(self.store.root / rel, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            busy = out_of_descriptors(exc)
            if busy is not None:
                raise busy from exc
            raise

    def _lease_file(
        self,
        conn: Connection,
        key: tuple[str, int, str],
        nbytes: int,
        size: int,
        ahead: bool,
        shapes: dict[tuple[str, str], list[int]],
    ) -> tuple[LeasedRange, int] | None:
        """A lease of ``key`` (at least ``nbytes``, ``size`` where the limits allow) in a
        file of this connection's, and the client's descriptor (``ahead``: of need,
        `Store.lease_ahead`: ``None`` near a disk limit, or for a shape the run has not
        taken). ``shapes``: the rows' shape of each ``(run, field)`` the request names,
        checked (and fixed where first) as the lease is granted.

        A new file's descriptor is the one the store created it with (`LeasedRange.writer`),
        else one of the client's own is opened. Garbage collection may remove a leased file
        at any time, also before its descriptor is handed out here: then the range is given
        up and a new one leased (in a new file).
        """
        shape = shapes.get((key[0], key[2]))
        for _ in range(8):
            if ahead:
                got = self.store.lease_ahead(*key, nbytes, size, conn.owner, shape)
                if got is None:
                    return None
                lease = got
            else:
                lease = self.store.lease(*key, nbytes, size, conn.owner, shape)
            try:
                writer = lease.writer()
                if writer < 0:
                    writer = self._writer(lease.file)
                elif os.fstat(writer).st_nlink == 0:  # removed since it was created
                    os.close(writer)
                    raise FileNotFoundError(lease.file)
            except FileNotFoundError:
                lease.release()
            except BaseException:
                lease.release()
                raise
            else:  # counted once handed out: not a lease refused, nor one tried again
                self.store.counts.leased(key[2], lease.nbytes)
                return lease, writer
        raise ServerError(f"every file leased for run {key[0]!r} step {key[1]} was removed at once")


_NOTE = b"\xa4note"


def _tag(body: bytearray) -> bytes | None:
    """The msgpack of the tag of the request ``body`` when it is a short string (every tag
    is) right after the array header; ``None`` when its form is another."""
    if not body:
        return None
    head = body[0]
    at = 1 if 0x90 <= head <= 0x9F else 3 if head == 0xDC else 5 if head == 0xDD else 0
    if not at or len(body) <= at or not 0xA0 <= body[at] <= 0xBF:
        return None
    return bytes(body[at : at + 1 + (body[at] & 0x1F)])


_HANDLERS: dict[type[Any], tuple[str, _Handler]] = {
    LeaseRequest: ("lease", DataPlaneRequests._lease),
    FieldsRequest: ("fields", DataPlaneRequests._fields),
    ShapesRequest: ("shapes", DataPlaneRequests._shapes),
    OpenRequest: ("open", DataPlaneRequests._open),
    ReserveRequest: ("reserve", DataPlaneRequests._reserve),
    CommitRequest: ("commit", DataPlaneRequests._commit),
    AbortRequest: ("abort", DataPlaneRequests._abort),
}
"""The dispatch table: request type -> (kind, for the metrics; handler)."""
