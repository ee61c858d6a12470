"""The blocking client: `PayloadClient` (the async one, `AsyncPayloadClient`, is in
`payload_client.clients._async`).

It only does I/O: its methods are the operations of `Operations`, written once for both
clients, whose effects it runs here and now (`Blocking`: `drive`), through its HTTP transport
(`HTTPTransport`), its data plane (`SyncDataPlane`) and its peer port transport
(`SyncPeerTransport`). `BaseClient` builds every call, decodes every answer, and holds the one
constructor both share; httpx errors are translated once, in `payload_client.transports._http`.
"""

from __future__ import annotations

from ..transports import HTTPTransport, SyncDataPlane, SyncPeerTransport
from ._ops import Operations
from ._shells import Blocking

__all__ = ["PayloadClient"]


class PayloadClient(Operations[HTTPTransport, SyncDataPlane, SyncPeerTransport], Blocking):
    """Blocking client of a payloadd daemon; also a context manager.

    Parameters
    ----------
    socket_path : str or os.PathLike, optional
        The daemon's Unix socket. Default: ``$PAYLOADD_SOCKET``, else
        ``/run/payloadd/payloadd.sock``.
    base_url : str, optional
        ``http://host:port`` of a daemon's TCP listener, instead of a socket.
    token : str, optional
        Token sent as ``Authorization: Bearer`` (admin calls; every call over TCP).
    timeout : float, Timeout or httpx.Timeout, default 60.0
        Seconds allowed for connecting, each read and write (over HTTP and on the data
        plane), and waiting for a pooled connection; a `Timeout` sets each apart, and how
        long a pooled connection may idle before it is closed rather than reused (2 s, below
        the daemon's ``keep_alive_s``).
    data_plane : bool, default True
        Move row bytes the fast way when the daemon offers it: through file descriptors
        it passes over ``<socket>.data`` (same node), or, for reads over TCP with a
        ``token``, over its peer port (another node, no HTTP: see `ClusterClient`);
        else over HTTP.

    Raises
    ------
    InvalidRequestError
        Both ``socket_path`` and ``base_url``, or a ``timeout`` that is not valid.

    Notes
    -----
    A read, `stats` or `health` whose connection drops (the daemon restarted, or closed the
    connection just as the call went out) is retried once on a new connection; then
    `ConnectionLostError`. An append is never re-sent: if its connection fails before its
    whole body was sent, the error (`ConnectError`, `TimeoutError`, `ConnectionLostError`)
    says it was not stored; after that, `AppendInDoubtError`: it may or may not be stored.
    On the data plane, an append whose rows were written is never sent again over HTTP.
    """

    _http_type = HTTPTransport
    _data_plane_type = SyncDataPlane
    _peer_type = SyncPeerTransport
