"""How a call reaches the daemon: one interface (`Transport`, `AsyncTransport`), two ways.

- `HTTPTransport` / `AsyncHTTPTransport` (`._http`): the HTTP control plane, over the Unix
  socket or TCP.
- `SyncDataPlane` / `AsyncDataPlane` (`._dataplane`): row bytes through file descriptors the
  daemon passes over ``<socket>.data``; their operations are the steps of
  `._dataplane_steps`, their descriptor caches and leases in `._descriptors`.
- `SyncPeerTransport` / `AsyncPeerTransport` (`._peer`): reads from another node's daemon
  over its peer port (TCP, no HTTP), the bytes received straight into the outputs.

A `Call` (`._call`) describes one exchange for either. Which transport a call takes, and what
is retried, is decided by `payload_client._base.BaseClient`, not here.
"""

from ._base import (
    AsyncTransport,
    AttemptError,
    DataPlaneDownError,
    Transport,
    drive,
    drive_async,
)
from ._call import Call, Target
from ._dataplane import AsyncDataPlane, SyncDataPlane
from ._dataplane_appends import append_steps
from ._dataplane_steps import MAX_FDS, note_steps, read_steps, table_steps
from ._descriptors import LEASES
from ._http import AsyncHTTPTransport, HTTPTransport
from ._peer import AsyncPeerTransport, SyncPeerTransport

__all__ = [
    "LEASES",
    "MAX_FDS",
    "AsyncDataPlane",
    "AsyncHTTPTransport",
    "AsyncPeerTransport",
    "AsyncTransport",
    "AttemptError",
    "Call",
    "DataPlaneDownError",
    "HTTPTransport",
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
