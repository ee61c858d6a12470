"""The wire protocol of payloadd, public: what a daemon (or another implementation of one)
needs to speak to these clients.

The daemon imports its wire types, error table, limits and name rules from here and from
`payload_client` only, never from the private ``_*`` modules, so that the client package can
rearrange its insides without breaking the daemon. Wire types are msgspec Structs; they evolve
by appending fields with defaults.

- **HTTP control plane** (Unix socket, optional TCP): `AppendRequest` / `AppendItem` /
  `AppendResponse` (msgpack, or `APPEND_CONTENT_TYPE` framed with `FRAME_PREFIX`),
  `ReadRequest` (also the body of a prefetch, answered `Prefetched`), `Stats`, `Health`,
  `GcRequest` / `GcReport`, `Usage`, `FieldsTable`,
  errors as `ErrorBody` with the status of `STATUS_BY_ERROR` (`status_of`).
- **Data plane** (``<socket>`` + `DATA_SOCKET_SUFFIX`): frames of `FRAME_PREFIX` + msgpack,
  requests `DataRequest`, replies `DataReply` (errors as `ErrorReply`), up to `MAX_FDS`
  descriptors a reply, `LEASES` leases a client keeps. A client declares the row shapes
  of its leased appends first (`ShapesRequest`): the daemon never sees those rows.
- **Peer port** (TCP, between nodes): frames as on the data plane, a `PeerHello` with the
  token first (at most `HELLO_BYTES`), answered `PeerWelcome`; then `PeerRead` requests,
  each answered `PeerBytes` and the raw bytes, or `ErrorReply` (`PeerRequest`, `PeerReply`).
- **Rules both sides check**: `check_name` (run, step, field names), `check_relative_path`
  (segment paths), `check_field` / `check_item` against `DEFAULT_FIELDS` or a table,
  row shapes fixed per run (`row_pattern`, `is_ragged`),
  `INT64_MAX`, reads in pages of `PAGE` bytes (`page_matched`).
- **Sizes in messages**: `format_size` writes every size a person reads (``1.5 GiB``), in the
  daemon's errors and its command line alike.
"""

from __future__ import annotations

from ._base import DEFAULT_SOCKET
from ._dataplane_wire import (
    DATA_SOCKET_SUFFIX,
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
from ._errors import STATUS_BY_ERROR, UnauthorizedError, status_of
from ._fields import (
    DECLARE,
    DEFAULT_FIELDS,
    check_field,
    check_item,
    is_ragged,
    pattern_text,
    row_pattern,
    shape_mismatch,
)
from ._peer_wire import (
    HELLO_BYTES,
    PEER_PORT_HEADER,
    PEER_VERSION,
    PeerBytes,
    PeerHello,
    PeerRead,
    PeerReply,
    PeerRequest,
    PeerWelcome,
)
from ._segment import INT64_MAX, check_name, check_relative_path
from ._sizes import format_size
from ._transports import LEASES, MAX_FDS
from ._windows import PAGE, page_matched
from ._wire import (
    APPEND_CONTENT_TYPE,
    FRAME_PREFIX,
    MSGPACK_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
    ErrorBody,
    Extent,
    FieldSpec,
    FieldsTable,
    GcCount,
    GcEntry,
    GcReport,
    GcRequest,
    Health,
    Prefetched,
    ReadRequest,
    RunUsage,
    Stats,
    StepUsage,
    Usage,
)

__all__ = [
    "APPEND_CONTENT_TYPE",
    "DATA_SOCKET_SUFFIX",
    "DECLARE",
    "DEFAULT_FIELDS",
    "DEFAULT_SOCKET",
    "FRAME_PREFIX",
    "HELLO_BYTES",
    "PEER_PORT_HEADER",
    "PEER_VERSION",
    "INT64_MAX",
    "LEASES",
    "MAX_FDS",
    "MSGPACK_CONTENT_TYPE",
    "PAGE",
    "STATUS_BY_ERROR",
    "AbortRequest",
    "AppendItem",
    "AppendRequest",
    "AppendResponse",
    "CommitReply",
    "CommitRequest",
    "DataReply",
    "DataRequest",
    "ErrorBody",
    "ErrorReply",
    "Extent",
    "FieldSpec",
    "FieldsReply",
    "FieldsRequest",
    "FieldsTable",
    "GcCount",
    "GcEntry",
    "GcReport",
    "GcRequest",
    "Health",
    "LeaseGrant",
    "LeaseReply",
    "LeaseRequest",
    "NoteRequest",
    "OpenReply",
    "OpenRequest",
    "PeerBytes",
    "PeerHello",
    "PeerRead",
    "PeerReply",
    "PeerRequest",
    "PeerWelcome",
    "Prefetched",
    "ReadRequest",
    "ReserveReply",
    "ReserveRequest",
    "ReservedExtent",
    "RunUsage",
    "ShapesRequest",
    "Stats",
    "StepUsage",
    "UnauthorizedError",
    "Usage",
    "check_field",
    "check_item",
    "check_name",
    "check_relative_path",
    "is_ragged",
    "format_size",
    "page_matched",
    "pattern_text",
    "row_pattern",
    "shape_mismatch",
    "status_of",
]
