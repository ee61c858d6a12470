"""How a call reaches the daemon: one interface (`Transport`, `AsyncTransport`), two ways.

- `HTTPTransport` / `AsyncHTTPTransport` (`._http`): the HTTP control plane, over the Unix
  socket or TCP.
- `SyncDataPlane` / `AsyncDataPlane` (`.dataplane`): row bytes through file descriptors the
  daemon passes over ``<socket>.data``; their operations are I/O-free steps, their
  descriptor caches and leases kept beside them.
- `SyncPeerTransport` / `AsyncPeerTransport` (`._peer`): reads from another node's daemon
  over its peer port (TCP, no HTTP), the bytes received straight into the outputs.

A `Call` (`._call`) describes one exchange for either. Which transport a call takes, and what
is retried, is decided by `payload_client.clients._base.BaseClient`, not here.
"""

from ._base import (
    AsyncTransport,
    AttemptError,
    DataPlaneDownError,
    Transport,
    drive,
    drive_async,
)
from ._call import AppendCall, Call, FieldsCall, ReadCall, Target
from ._http import AsyncHTTPTransport, HTTPTransport
from ._peer import AsyncPeerTransport, SyncPeerTransport
from .dataplane._appends import append_steps
from .dataplane._descriptors import LEASE_ALONG, LEASES
from .dataplane._steps import MAX_FDS, note_steps, read_steps, table_steps
from .dataplane._transport import AsyncDataPlane, SyncDataPlane

__all__ = [
    "LEASES",
    "LEASE_ALONG",
    "MAX_FDS",
    "AsyncDataPlane",
    "AsyncHTTPTransport",
    "AsyncPeerTransport",
    "AsyncTransport",
    "AppendCall",
    "AttemptError",
    "Call",
    "DataPlaneDownError",
    "FieldsCall",
    "HTTPTransport",
    "ReadCall",
    "SyncDataPlane",
    "SyncPeerTransport",
    "Target",
    "Transport",
    "append_steps",
    "drive",
    "drive_async",
    "note_steps",
    "read_steps",
    "table_steps",
]
