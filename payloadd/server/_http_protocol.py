"""uvicorn's httptools protocol with the limits a long-running daemon needs on its HTTP side.

uvicorn bounds neither the connections it holds nor the time before a connection's first
request: every idle connection keeps a descriptor for as long as its client likes, until
the daemon runs out. `limited_protocol` gives a protocol class that

- answers a connection beyond the daemon's share with a 503 (`BusyError`, ``Retry-After:
  1``) at once, and closes it a moment later: whatever it sends is dropped unparsed, so no
  request of it is ever routed (the 503 says nothing was done, and nothing is);
- closes a connection that sends no complete request head within ``request_timeout``
  seconds of being opened, or of the first byte of a later request (between requests, an
  idle connection is closed by uvicorn's keep-alive timer, ``keep_alive_s``; the rest of a
  body after an early answer is not a head).

The rest is uvicorn's (keep-alive, pipelining, flow control). A request body that stalls is
the routes' business (they answer 408, `payloadd.server._app`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from payload_client.protocol import ErrorBody

__all__ = ["REFUSED_CLOSE_S", "limited_protocol"]

log = logging.getLogger("payloadd")

REFUSED_CLOSE_S = 1.0
"""Seconds a refused connection stays open after its 503 (its write side shut), so that a
client still sending its request reads the answer instead of a reset."""


def _busy_answer(limit: int) -> bytes:
    body = msgspec.json.encode(
        ErrorBody(
            "BusyError",
            f"daemon busy: {limit} HTTP connections are open, its share of file descriptors "
            "(max_connections); try again",
        )
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def limited_protocol(
    max_connections: int, request_timeout: float, on_refused: Any = None
) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits.

    Parameters
    ----------
    max_connections : int
        Connections served at once; one more is answered 503 and closed.
    request_timeout : float
        Seconds a connection may take to send a complete request head.
    on_refused : callable, optional
        Called with a reason (``"connections"``, ``"stalled"``) for each connection refused
        or closed (metrics).
    """
    busy = _busy_answer(max_connections)

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _refused = False  # answered 503: nothing it sends is parsed, let alone routed
        lingering = 0  # refused connections waiting to close, of this server

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(transport)
                return
            self._expect_head()  # a connection that sends nothing is closed too

        def _refuse(self, transport: asyncio.Transport) -> None:
            """Answer 503 without reading the request. The connection is closed a moment
            later, so that its client reads the answer rather than a reset; at once when
            as many refused connections linger as are served (a storm must not take every
            descriptor)."""
            cls = type(self)
            self._refused = True
            self.connections.discard(self)  # not served: it does not count
            transport.pause_reading()  # (a transport may deliver what it read already)
            transport.write(busy)
            if on_refused is not None:
                on_refused("connections")
            if cls.lingering >= max_connections:
                transport.close()
                return
            transport.write_eof()
            cls.lingering += 1

            def close() -> None:
                cls.lingering -= 1
                transport.close()

            self.loop.call_later(REFUSED_CLOSE_S, close)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # the 503 said nothing was done: nothing is
                return
            super().data_received(data)

        def _expect_head(self) -> None:
            """Close the connection unless a request head is complete within the timeout."""
            self._cancel_head()
            self._head_deadline = self.loop.call_later(request_timeout, self._head_timed_out)

        def _cancel_head(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if not self.transport.is_closing():
                if on_refused is not None:
                    on_refused("stalled")
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_deadline is None:  # a later request's head: within the timeout
                self._expect_head()

        def on_headers_complete(self) -> None:
            self._cancel_head()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head()
            super().connection_lost(exc)

    LimitedHttpToolsProtocol.__qualname__ = f"LimitedHttpToolsProtocol[{max_connections}]"
    return LimitedHttpToolsProtocol
