"""Wire types of the data plane: the second Unix socket, ``<socket>`` + `DATA_SOCKET_SUFFIX`.

Frames are ``u32 little-endian N | N bytes of msgpack``; one request, then one reply, on a
connection at a time. Replies that hand out file descriptors carry them as SCM_RIGHTS
ancillary data of the reply's first byte, in the order the reply lists them. The Structs
evolve as those of `payload_client.wire._http` do: fields appended at the end, with defaults.
"""

from __future__ import annotations

import msgspec

from ..segments._segment import PayloadSegment
from ._http import AppendItem, FieldsTable, NonNegInt

__all__ = [
    "DATA_SOCKET_SUFFIX",
    "AbortRequest",
    "CommitReply",
    "CommitRequest",
    "DataReply",
    "DataRequest",
    "ErrorReply",
    "FieldsReply",
    "FieldsRequest",
    "LeaseGrant",
    "LeaseReply",
    "LeaseRequest",
    "NoteRequest",
    "OpenReply",
    "OpenRequest",
    "ReserveReply",
    "ReserveRequest",
    "ReservedExtent",
    "ShapesRequest",
]

DATA_SOCKET_SUFFIX = ".data"
"""The data plane listens on the control socket's path plus this suffix."""


class OpenRequest(msgspec.Struct, tag="open", array_like=True):
    """Ask for read-only descriptors of ``files`` (each must be at least ``end`` bytes)."""

    files: list[tuple[str, NonNegInt]]


class OpenReply(msgspec.Struct, tag="opened", array_like=True):
    """One read-only descriptor per requested file, in order, as SCM_RIGHTS.

    ``read_once`` lists the indexes (in reply order) of the descriptors the client uses for
    this read only and then closes, instead of keeping them for later reads: files of
    another node's prefix under the daemon's ``foreign_reads="reopen"`` (on NFS a kept
    descriptor may show stale sizes and pages).
    """

    count: int
    read_once: list[int] = []


class ReserveRequest(msgspec.Struct, tag="reserve", array_like=True):
    """Reserve room for the rows of ``items`` (as in an append body's header)."""

    items: list[AppendItem]


class ReservedExtent(msgspec.Struct, array_like=True):
    """Where the client writes: ``nbytes`` of the row stream at ``offset`` of ``files[file]``."""

    file: int
    offset: int
    nbytes: int


class ReserveReply(msgspec.Struct, tag="reserved", array_like=True):
    """Reserved ranges in row-stream order, and one write-only descriptor per file."""

    txn: int
    files: list[str]
    extents: list[ReservedExtent]


class LeaseRequest(msgspec.Struct, tag="lease", array_like=True):
    """Ask for a private byte range of the current file of ``(run, step, field)``: at least
    ``nbytes``; the client places rows in it itself, without asking again.

    ``more``: other keys ``(run, step, field, nbytes)`` to lease in the same round trip, as
    the daemon can (each one may be left out: the client asks for it again when it needs
    it). ``nbytes`` 0 asks ahead of need: granted only far from the disk limits. A daemon
    from before ``more`` leases the first key only.

    ``done``: leases the client is finished with, ``(file, offset, used)``, each the range
    granted at ``offset`` of ``file``: the client wrote nothing of it from file offset
    ``used`` on, and never will. The daemon takes the rest back before it grants anything
    of this request (a key renewed goes on at ``used``, with no hole); a range it ended
    already is passed over. A daemon from before ``done`` ends those leases when their
    file closes.

    ``shapes``: the row shape ``(run, field, shape)`` the client places in the leases of
    each ``(run, field)`` asked for (the daemon never sees those rows). The daemon checks
    them as it checks an append's, and fixes those it has none of, before it grants
    anything: another shape than the one fixed refuses the request (naming both). A key
    of ``more`` asked ahead of need (``nbytes`` 0) whose ``(run, field)`` has no fixed
    shape is left out.

    ``writing``: ``(file, offset)`` of the leases of ``done`` whose rows below ``used`` are
    not all in place yet (other threads of the client are writing them). The daemon takes
    their tails back all the same, but keeps them held, their files open and counting up
    to ``used``, until the client names them in ``written``: a file closed before its
    rows landed would count its size on disk without them.

    ``written``: ``(file, offset)`` of leases the client let go of whose rows are all in
    place now: those of an earlier ``writing``, and those it dropped without ``done`` (one
    beyond the `LEASES` it keeps, one whose file was removed). The daemon lets them go (a
    file sealed and unused closes, its size on disk counting). Those it does not hold are
    passed over. A daemon from before these two fields ends ``done`` at once."""

    run: str
    step: NonNegInt
    field: str
    nbytes: NonNegInt
    more: list[tuple[str, NonNegInt, str, NonNegInt]] = []
    done: list[tuple[str, NonNegInt, NonNegInt]] = []
    shapes: list[tuple[str, str, list[int]]] = []
    writing: list[tuple[str, NonNegInt]] = []
    written: list[tuple[str, NonNegInt]] = []


class LeaseGrant(msgspec.Struct, array_like=True):
    """One more lease of a `LeaseReply`: of key ``more[index]`` of the request, the range
    ``[offset, offset + nbytes)`` of ``file``."""

    index: int
    file: str
    offset: int
    nbytes: int


class LeaseReply(msgspec.Struct, tag="leased", array_like=True):
    """The leased range ``[offset, offset + nbytes)`` of ``file``, with one write-only
    descriptor as SCM_RIGHTS; ``fsync``: the client fsyncs before returning segments.
    ``more``: the leases granted of the request's ``more``, each with one more descriptor,
    in this order after the first."""

    file: str
    offset: int
    nbytes: int
    fsync: bool
    more: list[LeaseGrant] = []


class NoteRequest(msgspec.Struct, tag="note", array_like=True):
    """The client placed ``appends`` appends of ``rows`` rows, ``nbytes`` bytes, in its
    leases (for the daemon's counters). The daemon replies (an empty `CommitReply`) only
    when ``ack`` is true. ``fields`` splits ``rows`` and ``nbytes`` by field."""

    appends: NonNegInt
    rows: NonNegInt
    nbytes: NonNegInt
    ack: bool = False
    runs: list[tuple[str, str]] = []
    """``(node, run)`` of the runs the client read or appended to through descriptors it
    held since its last note: in use, so the daemon's GC age rule spares them."""
    fields: list[tuple[str, NonNegInt, NonNegInt]] = []
    """``(field, rows, nbytes)`` of those appends, one entry per field (for the daemon's
    metrics by field)."""


class CommitRequest(msgspec.Struct, tag="commit", array_like=True):
    """The rows of reservation ``txn`` are written: return their segments."""

    txn: int


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    """Give up reservation ``txn`` (its bytes stay unreferenced)."""

    txn: int


class CommitReply(msgspec.Struct, tag="committed", array_like=True):
    """Segments of each item of the committed reservation."""

    segments: list[list[PayloadSegment]]


class FieldsRequest(msgspec.Struct, tag="fields", array_like=True):
    """Ask for the daemon's fields table (a client checks data-plane appends against it)."""


class FieldsReply(msgspec.Struct, tag="fieldtable", array_like=True):
    """The daemon's fields table, as ``GET /v1/fields`` answers it.

    ``generation``: a read-only descriptor of the daemon's removal generation comes with it
    (SCM_RIGHTS): a page whose first 8 bytes are a little-endian ``u64`` that the daemon
    increments before it removes any data file (`payload_client.transports.dataplane._descriptors.GenerationPage`).
    A client maps it once per connection."""

    table: FieldsTable
    generation: bool = False


class ShapesRequest(msgspec.Struct, tag="shapes", array_like=True):
    """Row shapes ``(run, field, shape)`` checked as `LeaseRequest.shapes` are, without a
    lease: a client whose lease of a key has room asks this before it places rows of a
    shape other than the one the daemon took for the run and field (after a run was
    deleted, its shapes are fixed anew). Answered by an empty `CommitReply`, or an
    `ErrorReply` naming both shapes."""

    shapes: list[tuple[str, str, list[int]]]


class ErrorReply(msgspec.Struct, tag="error", array_like=True):
    """The request failed: the error class name (see `STATUS_BY_ERROR`) and a message."""

    error: str
    message: str


DataRequest = (
    OpenRequest
    | LeaseRequest
    | ReserveRequest
    | CommitRequest
    | AbortRequest
    | NoteRequest
    | FieldsRequest
    | ShapesRequest
)
DataReply = OpenReply | LeaseReply | ReserveReply | CommitReply | ErrorReply | FieldsReply
