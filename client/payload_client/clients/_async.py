"""The async client: `AsyncPayloadClient`, the awaitable twin of
`payload_client.clients._sync.PayloadClient` (same arguments, same methods, same errors).

It only does I/O: its methods are the operations of `Operations`, whose effects it runs on
the event loop (`Awaiting`: `drive_async`), through `AsyncHTTPTransport`, `AsyncDataPlane`
and `AsyncPeerTransport`.
"""

from __future__ import annotations

from ..transports import AsyncDataPlane, AsyncHTTPTransport, AsyncPeerTransport
from ._ops import Operations
from ._shells import Awaiting

__all__ = ["AsyncPayloadClient"]


class AsyncPayloadClient(
    Operations[AsyncHTTPTransport, AsyncDataPlane, AsyncPeerTransport], Awaiting
):
    """Asyncio client of a payloadd daemon: `PayloadClient`'s methods, awaitable; async with.

    Its parameters, the errors its constructor raises and its retry rules are those of
    `PayloadClient` (see there).
    """

    _http_type = AsyncHTTPTransport
    _data_plane_type = AsyncDataPlane
    _peer_type = AsyncPeerTransport
