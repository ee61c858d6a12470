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

from ._errors import STATUS_BY_ERROR, UnauthorizedError, status_of
from ._sizes import format_size
from .clients._base import DEFAULT_SOCKET
from .reads._few import merge_ranges
from .reads._windows import PAGE, page_matched
from .segments._segment import INT64_MAX, check_name, check_relative_path
from .transports import LEASE_ALONG, LEASES, MAX_FDS
from .wire import _dataplane, _frames, _http, _peer
from .wire._dataplane import *  # noqa: F403  (every Struct of the data plane)
from .wire._fields import (
    DECLARE,
    DEFAULT_FIELDS,
    check_field,
    check_item,
    is_ragged,
    pattern_text,
    row_pattern,
    shape_mismatch,
)
from .wire._frames import *  # noqa: F403  (the frame codec)
from .wire._http import *  # noqa: F403  (every Struct of HTTP)
from .wire._peer import *  # noqa: F403  (every Struct of the peer port)

__all__ = [
    "DECLARE",
    "DEFAULT_FIELDS",
    "DEFAULT_SOCKET",
    "INT64_MAX",
    "LEASES",
    "LEASE_ALONG",
    "MAX_FDS",
    "PAGE",
    "STATUS_BY_ERROR",
    "UnauthorizedError",
    "check_field",
    "check_item",
    "check_name",
    "check_relative_path",
    "is_ragged",
    "merge_ranges",
    "format_size",
    "page_matched",
    "pattern_text",
    "row_pattern",
    "shape_mismatch",
    "status_of",
]
__all__ += _dataplane.__all__ + _frames.__all__ + _http.__all__ + _peer.__all__
