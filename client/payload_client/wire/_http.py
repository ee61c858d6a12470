"""Wire types of the HTTP control plane (msgspec Structs) and the append body framing.

Evolution rule: a Struct only gains fields appended at the end, with defaults (an older peer
ignores unknown trailing fields, a newer one fills missing ones); never reordered, renamed,
retyped or removed; tags stay. The one strict Struct, `GcRequest`, refuses unknown fields
(docs/http-api.md, "Wire evolution") and is encoded without fields at their defaults, so an
older daemon takes a newer client's request unless it uses a field the daemon does not know.
The data plane's types are in `payload_client.wire._dataplane`, the peer port's in
`payload_client.wire._peer`.

Append body (``POST /v1/append``, ``Content-Type: application/x-payload-append``)::

    u32 little-endian N | N bytes: msgpack AppendRequest | row bytes of item 0 | item 1 | ...

Row bytes are raw little-endian C-order rows, never JSON lists or base64.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ..segments._segment import INT64_MAX, PayloadSegment

__all__ = [
    "APPEND_CONTENT_TYPE",
    "MSGPACK_CONTENT_TYPE",
    "AppendItem",
    "AppendRequest",
    "AppendResponse",
    "ErrorBody",
    "Extent",
    "FieldSpec",
    "FieldsTable",
    "GcCount",
    "GcEntry",
    "GcReport",
    "GcRequest",
    "Health",
    "Prefetched",
    "ReadRequest",
    "RunUsage",
    "Stats",
    "StepUsage",
    "Usage",
]

APPEND_CONTENT_TYPE = "application/x-payload-append"
MSGPACK_CONTENT_TYPE = "application/msgpack"

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class AppendItem(msgspec.Struct, forbid_unknown_fields=False):
    """Header of one block of rows in an append body.

    Attributes
    ----------
    field : str
        Field name, ``[A-Za-z0-9._-]{1,128}``.
    dtype : str
        Element dtype name (one of ``SUPPORTED_DTYPES``: docs/contract.md, "The segment model").
    shape : list of int
        Shape of one row; every entry > 0.
    rows : int
        Number of rows; the item's bytes are ``rows * row_nbytes``.
    pos : int
        Token position of the first row.
    run : str
        Run name, ``[A-Za-z0-9._-]{1,128}``, not ``.`` or ``..``.
    step : int
        Training step the rows belong to (>= 0); GC removes whole steps.
    """

    field: str
    dtype: str
    shape: list[int]
    rows: NonNegInt
    pos: NonNegInt
    run: str
    step: NonNegInt


class AppendRequest(msgspec.Struct):
    """The msgpack header of an append body: one entry per block of rows that follows."""

    items: list[AppendItem]


class AppendResponse(msgspec.Struct):
    """Segments of an append, one list per item, covering ``[pos, pos + rows)`` in order."""

    segments: list[list[PayloadSegment]]


class Extent(msgspec.Struct, array_like=True):
    """A byte range to read: ``nbytes`` bytes of ``file`` from ``offset``.

    ``end`` is the end of the whole segment the range belongs to: the daemon refuses the read
    when the file is shorter than that, even if the range itself is present.
    """

    file: str
    offset: NonNegInt
    nbytes: NonNegInt
    end: NonNegInt


class ReadRequest(msgspec.Struct):
    """Body of ``POST /v1/read``: the answer is the extents' bytes, concatenated in order."""

    extents: list[Extent]


class Prefetched(msgspec.Struct):
    """Answer of ``POST /v1/prefetch`` (body: a `ReadRequest`): what the daemon queued for
    read-ahead.

    Attributes
    ----------
    files : int
        Files queued.
    bytes : int
        Bytes queued (ranges merged); less than asked when the daemon's queue was full.
    """

    files: int
    bytes: int


class Stats(msgspec.Struct):
    """Counters of a running daemon (``GET /v1/stats``); bytes in bytes, times in seconds.

    ``reads`` and ``bytes_read`` count reads the daemon answers with bytes (HTTP, peer
    port); ``appends``, ``bytes_appended`` all appends. On the data plane clients pread and
    pwrite themselves: the daemon counts its requests, the descriptors it handed out, and
    the leases (byte ranges clients place small appends in) it granted. Durability: ``fsync`` is the policy (``never``, ``interval`` or ``always``); under
    ``interval``, ``flushes`` counts the flushes that fsync'd something, ``files_flushed`` the
    data files fsync'd, ``files_dirty`` those the next flush will fsync, ``flush_errors`` the
    fsyncs that failed. Disk limits: ``root_bytes`` is what counts against the cap
    ``max_root_bytes`` (0: none): the bytes of this node's files plus ``reserved_bytes``,
    ranges reserved for appends and leases in progress and not written yet; ``free_bytes`` the free space of the root's file system
    against the floor ``min_free_bytes`` (0: none), ``appends_refused`` the appends and leases
    refused by either limit (507). Read-ahead: ``prefetches`` counts ``POST /v1/prefetch``
    calls that queued something, ``bytes_prefetched`` the bytes read ahead so far.
    """

    node: str
    root: str
    uptime_s: float
    appends: int
    rows_appended: int
    bytes_appended: int
    reads: int
    bytes_read: int
    files_open_for_append: int
    max_file_bytes: int
    data_plane_requests: int = 0
    data_plane_fds: int = 0
    leases: int = 0
    leased_bytes: int = 0
    fsync: str = ""
    flushes: int = 0
    files_flushed: int = 0
    files_dirty: int = 0
    flush_errors: int = 0
    root_bytes: int = 0
    max_root_bytes: int = 0
    free_bytes: int = 0
    min_free_bytes: int = 0
    appends_refused: int = 0
    prefetches: int = 0
    bytes_prefetched: int = 0
    reserved_bytes: int = 0


class Health(msgspec.Struct):
    """Answer of ``GET /healthz``.

    Attributes
    ----------
    status : str
        ``"ok"``, or ``"degraded"`` when a part of the daemon cannot serve now (see
        ``data_plane``).
    node, version : str
        The daemon's node prefix and payloadd version.
    data_plane : str
        ``"serving"``, ``"off"`` (the ``data_plane`` setting), or what keeps it from serving
        (e.g. ``"refusing connections: out of file descriptors (EMFILE) since 12:00:01Z"``);
        empty from a daemon older than this field.
    peer_port : int
        The daemon's peer port (reads between nodes, on the host of the URL); 0: none.
    """

    status: str
    node: str
    version: str
    data_plane: str = ""
    peer_port: int = 0


class GcRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Body of ``POST /v1/admin/gc`` (JSON or msgpack): what to collect.

    Strict: an unknown field is refused (400), never dropped, since GC removes data. Fields
    at their defaults are not encoded: a request that uses no new field is one an older
    daemon takes.

    Attributes
    ----------
    run : str, optional
        With ``through_step``: collect the steps ``<= through_step`` of this run (the
        training step watermark). Both or neither.
    through_step : int, optional
        The watermark, inclusive.
    ttl_s : float, optional
        Also collect, across this node's runs, every step whose files are all older than
        this many seconds, of runs not appended to or read for as long. Default: the
        daemon's ``ttl_s`` setting. 0: no age rule in this call.
    dry_run : bool, default False
        Report what would be removed; remove nothing.
    node : str, optional
        Collect this node's prefix of a shared payload root instead of the daemon's own:
        the watermark, and the age rule only when ``ttl_s`` is given (by the files' ages
        alone); no orphans. One of the two is needed. Default: the daemon's own node.
    before_step : int, optional
        The watermark's former name: refused (400) naming ``through_step``, since the
        watermark always included its step.

    Every call on the daemon's own node also removes orphans (files an earlier daemon
    created that hold no byte, so no append was acknowledged from them) and empty
    directories of this node.
    """

    run: str | None = None
    through_step: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    ttl_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    dry_run: bool = False
    node: str | None = None
    before_step: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None


class GcCount(msgspec.Struct):
    """Files and bytes (the files' sizes) removed for one reason."""

    files: int = 0
    bytes: int = 0


class GcReport(msgspec.Struct):
    """Answer of ``POST /v1/admin/gc`` and ``DELETE /v1/admin/runs/{run}``.

    Attributes
    ----------
    dry_run : bool
        Nothing was removed: the counts say what would have been.
    files, bytes, dirs : int
        Files removed, the sum of their sizes (bytes), directories removed (steps, runs).
    by_reason : dict of str to GcCount
        ``watermark``, ``run``, ``ttl``, ``orphan``: what each rule removed.
    in_use : int
        Files a rule matched but still being appended to (kept; a later GC gets them).
    steps : list of [run, step]
        The steps collected, in order (their reads now answer 410 Gone).
    note : str
        A run asked for that is not on the node, and the closest name there; or empty.
    """

    dry_run: bool
    files: int = 0
    bytes: int = 0
    dirs: int = 0
    by_reason: dict[str, GcCount] = msgspec.field(default_factory=dict)
    in_use: int = 0
    steps: list[tuple[str, int]] = msgspec.field(default_factory=list)
    note: str = ""


class FieldSpec(msgspec.Struct, forbid_unknown_fields=False):
    """What one field takes.

    Attributes
    ----------
    dtypes : list of str
        numpy dtype names an append of this field may carry, all integer or all float.
    fill : int or float
        The value for positions no segment covers (the ``fill`` to pass to ``read_field``).
    max_width : int
        Largest last dimension of a row (e.g. a sampling mask's width); 0: no limit.
    read_dtype : str
        dtype ``read_field`` returns: ``int32`` for an integer field, ``float32`` for a float.
    ragged : bool or None
        Whether the last row dimension may differ from append to append (a sampling
        mask's width, up to ``max_width``); every other dimension, and the number of
        dimensions, is fixed for a run by the field's first append in it. ``False``:
        every dimension is fixed (router-replay ids: ``[layers, top_k]``). ``None`` (a
        table entry that does not say, a daemon older than this field): ragged when
        ``max_width`` is set. See `payload_client.protocol.is_ragged`.
    """

    dtypes: list[str]
    fill: int | float = 0
    max_width: int = 0
    read_dtype: str = "int32"
    ragged: bool | None = None


class FieldsTable(msgspec.Struct, forbid_unknown_fields=False):
    """Body of ``GET /v1/fields``: the daemon's fields, and whether it takes others
    (``unknown_fields``: ``allow`` or ``refuse``)."""

    fields: dict[str, FieldSpec]
    unknown_fields: Literal["allow", "refuse"] = "allow"


class StepUsage(msgspec.Struct):
    """One step directory of the daemon's node, ``<root>/<node>/<run>/<step>``.

    Attributes
    ----------
    step : int
        The step.
    files : int
        Regular files in the directory (data files).
    bytes : int
        Sum of their apparent sizes (``st_size``, holes included), in bytes.
    disk_bytes : int
        Sum of the space they use (``st_blocks * 512``), in bytes.
    mtime : float
        Newest modification time of those files, seconds since the epoch; 0.0 when the
        directory holds none.
    """

    step: int
    files: int
    bytes: int
    disk_bytes: int
    mtime: float


class RunUsage(msgspec.Struct):
    """One run of the daemon's node: totals over all its steps, and the steps listed.

    Attributes
    ----------
    run : str
        The run.
    files, bytes, disk_bytes, mtime
        As in `StepUsage`, over every step of the run (listed or not).
    steps : list of StepUsage
        Its steps listed, in ascending order (the answer lists at most ``max_steps`` steps
        in all).
    more_steps : int
        Its steps on disk that are not listed.
    """

    run: str
    files: int
    bytes: int
    disk_bytes: int
    mtime: float
    steps: list[StepUsage]
    more_steps: int = 0


class GcEntry(msgspec.Struct):
    """One collection of the node's GC ledger.

    Attributes
    ----------
    at : float
        When, seconds since the epoch.
    reason : str
        The rule: ``watermark``, ``run`` or ``ttl``.
    run : str
        The run collected.
    steps : list of int
        Its steps collected, ascending.
    files : int
        Files the collection listed for removal.
    bytes : int or None
        Sum of their sizes when planned, in bytes; ``None`` for lines of a daemon that did
        not record it.
    """

    at: float
    reason: str
    run: str
    steps: list[int]
    files: int
    bytes: int | None = None


class Usage(msgspec.Struct):
    """Answer of ``GET /v1/admin/usage``: what this daemon's node holds on disk, per run and
    step, its disk limits, and the last collections of its GC ledger. Bytes in bytes, times
    in seconds since the epoch.

    Attributes
    ----------
    node, root : str
        The daemon's node prefix and payload root.
    now : float
        The daemon's clock when it walked the node's directory (ages are ``now - mtime``).
    files, bytes, disk_bytes : int
        Totals over every step directory of the node (`StepUsage`).
    steps : int
        Step directories on disk.
    runs : list of RunUsage
        Runs in name order, at most ``max_steps`` of them, with at most ``max_steps``
        steps listed in all (runs in order, steps ascending).
    more_runs, more_steps : int
        Runs and steps on disk that are not listed.
    root_bytes, max_root_bytes, free_bytes, min_free_bytes : int
        As in `Stats`: the bytes counted against the cap and the cap (0: none), the root's
        free space and the floor (0: none).
    ledger : list of GcEntry
        The last collections of the node's GC ledger, oldest first (at most ``ledger``).
    ledger_entries : int
        Collections in the ledger in all.
    ledger_bytes : int
        Size of the ledger file.
    """

    node: str
    root: str
    now: float
    files: int
    bytes: int
    disk_bytes: int
    steps: int
    runs: list[RunUsage]
    more_runs: int
    more_steps: int
    root_bytes: int
    max_root_bytes: int
    free_bytes: int
    min_free_bytes: int
    ledger: list[GcEntry]
    ledger_entries: int
    ledger_bytes: int


class ErrorBody(msgspec.Struct):
    """Body of every 4xx/5xx answer: the error class name (see `STATUS_BY_ERROR`) and a message."""

    error: str
    message: str
