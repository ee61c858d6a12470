"""uvicorn's httptools protocol with the limits a long-running daemon needs on its HTTP side.

uvicorn bounds neither the connections it holds nor the time before a connection's first
request: every idle connection keeps a descriptor for as long as its client likes, until
the daemon runs out. `limited_protocol` gives a protocol class that counts connections in
shares of their own, so that nothing arriving over TCP can refuse the node's own clients::

    Unix socket  (local: the node's clients, the health probe)   max_connections
    TCP          (every call needs the admin token)               max_tcp_connections
      of which, not yet shown the token                           an eighth (at least 2),
                                                                   a quarter of that a host

- A connection beyond its share is answered 503 (`BusyError`, ``Retry-After: 1``) at once
  and closed a moment later: whatever it sends is dropped unparsed, so no request of it is
  ever routed (the 503 says nothing was done, and nothing is).
- A TCP connection is *unauthenticated* until a request head with an admin token the daemon
  accepts has come (the token guard, `payloadd.server.http._auth`, answers a head without
  one 401 and the connection closes after it). It must send that head within `HEAD_S` seconds
  of connecting; every other connection sends a complete request head within
  ``request_timeout`` seconds of being opened, or of the first byte of a later request
  (between requests, an idle connection is closed by uvicorn's keep-alive timer,
  ``keep_alive_s``; the rest of a body after an early answer is not a head). A stranger
  therefore holds no more than a head's buffer, for no more than `HEAD_S` seconds, in a
  share of its own.

The rest is uvicorn's (keep-alive, pipelining, flow control). A request body that stalls is
the routes' business (they answer 408, `payloadd.server.http._io`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from payload_client.protocol import ErrorBody
from payloadd.server._tokens import Tokens
from payloadd.server.http._auth import bearer

__all__ = [
    "HEAD_S",
    "REFUSED_CLOSE_S",
    "HttpShares",
    "LimitedHttpToolsProtocol",
    "limited_protocol",
]

log = logging.getLogger("payloadd")

REFUSED_CLOSE_S = 1.0
"""Seconds a refused connection stays open after its 503 (its write side shut), so that a
client still sending its request reads the answer instead of a reset."""
HEAD_S = 5.0
"""Seconds a TCP connection has to send a request head with the admin token (at most
``request_timeout_s``)."""


@dataclass
class HttpShares:
    """The HTTP connections one server holds, by share, and how many each share takes.

    Parameters
    ----------
    local : int
        Connections over the Unix socket at once (``max_connections``' share).
    tcp : int
        Connections over TCP at once (``max_tcp_connections``' share; 0: no TCP listener).
    """

    local: int
    tcp: int
    open_local: int = 0
    open_tcp: int = 0
    lingering: int = 0  # refused connections waiting to close
    strangers: Counter[str] = field(default_factory=Counter)  # unauthenticated, by host

    @property
    def unauthenticated(self) -> int:
        """TCP connections that have not shown the token, at most, of all hosts."""
        return min(self.tcp, max(2, self.tcp // 8))

    @property
    def per_host(self) -> int:
        """Of them, at most from one host."""
        return max(1, self.unauthenticated // 4)

    def admit(self, host: str | None) -> str | None:
        """Count a new connection (``host``: its address over TCP; ``None``: the Unix
        socket); the reason it is refused instead, ``None`` when it is admitted."""
        if host is None:
            if self.open_local >= self.local:
                return f"{self.local} HTTP connections are open on the Unix socket, its share "
            self.open_local += 1
            return None
        if self.open_tcp >= self.tcp:
            return f"{self.tcp} HTTP connections are open over TCP, their share "
        if sum(self.strangers.values()) >= self.unauthenticated:
            return f"{self.unauthenticated} TCP connections wait to show the token, their share "
        if self.strangers[host] >= self.per_host:
            return f"{self.per_host} TCP connections of {host} wait to show the token, a host's "
        self.open_tcp += 1
        self.strangers[host] += 1
        return None

    def trusted(self, host: str) -> None:
        """A connection of ``host`` has shown the token: it is no stranger any more."""
        self.strangers[host] -= 1
        if self.strangers[host] <= 0:
            del self.strangers[host]

    def closed(self, host: str | None, stranger: bool) -> None:
        """An admitted connection has ended."""
        if host is None:
            self.open_local -= 1
            return
        self.open_tcp -= 1
        if stranger:
            self.trusted(host)


def _busy_answer(reason: str) -> bytes:
    body = msgspec.json.encode(
        ErrorBody(
            "BusyError",
            f"daemon busy: {reason}of file descriptors (max_connections, max_tcp_connections); "
            "try again",
        )
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


@dataclass(frozen=True)
class _Limits:
    """What one server's protocol class applies (`limited_protocol`'s arguments)."""

    shares: HttpShares
    request_timeout: float
    tokens: Tokens | None
    on_refused: Callable[[str], None] | None

    @property
    def head_s(self) -> float:
        """Seconds a TCP connection has to show the token (`HEAD_S`, at most the timeout)."""
        return min(HEAD_S, self.request_timeout)

    def refused(self, reason: str) -> None:
        """Count a connection refused or closed, for ``reason``."""
        if self.on_refused is not None:
            self.on_refused(reason)


def limited_protocol(
    shares: HttpShares,
    request_timeout: float,
    tokens: Tokens | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> type[HttpToolsProtocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits.

    Parameters
    ----------
    shares : HttpShares
        The connection shares (counted in it, for this server).
    request_timeout : float
        Seconds a connection may take to send a complete request head.
    tokens : Tokens, optional
        The admin tokens, that make a TCP connection trusted (none: no TCP listener).
    on_refused : callable, optional
        Called with a reason (``"connections"``, ``"stalled"``) for each connection refused
        or closed (metrics).
    """

    class Limited(LimitedHttpToolsProtocol):
        limits = _Limits(shares, request_timeout, tokens, on_refused)

    Limited.__name__ = LimitedHttpToolsProtocol.__name__
    Limited.__qualname__ = f"LimitedHttpToolsProtocol[{shares.local}, {shares.tcp}]"
    return Limited


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol within the `_Limits` of its class (`limited_protocol`
    makes one class a server): shares of connections, a deadline for each request head, the
    admin token before anything else over TCP."""

    limits: ClassVar[_Limits]
    _head_deadline: asyncio.TimerHandle | None = None
    _refused = False  # answered 503: nothing it sends is parsed, let alone routed
    _admitted = False
    _host: str | None = None  # its address, over TCP
    _stranger = False  # over TCP, and no head with the token yet

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.server is not None and self.server[1] is not None:
            self._host = self.client[0] if self.client else "?"
        refused = self.limits.shares.admit(self._host)
        if refused is not None:
            self._refuse(transport, refused)
            return
        self._admitted = True
        self._stranger = self._host is not None
        self._expect_head()

    def _refuse(self, transport: asyncio.Transport, reason: str) -> None:
        """Answer 503 without reading the request. The connection is closed a moment
        later, so that its client reads the answer rather than a reset; at once when
        as many refused connections linger as the Unix socket serves (a storm must not
        take every descriptor)."""
        shares = self.limits.shares
        self._refused = True
        self.connections.discard(self)  # not served: it does not count
        transport.pause_reading()  # (a transport may deliver what it read already)
        transport.write(_busy_answer(reason))
        self.limits.refused("connections")
        if shares.lingering >= shares.local:
            transport.close()
            return
        transport.write_eof()
        shares.lingering += 1

        def close() -> None:
            shares.lingering -= 1
            transport.close()

        self.loop.call_later(REFUSED_CLOSE_S, close)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # the 503 said nothing was done: nothing is
            return
        super().data_received(data)

    def _expect_head(self) -> None:
        """Close the connection unless a request head is complete in time: `HEAD_S` for a
        stranger, ``request_timeout`` for every other."""
        self._cancel_head()
        seconds = self.limits.head_s if self._stranger else self.limits.request_timeout
        self._head_deadline = self.loop.call_later(seconds, self._head_timed_out)

    def _cancel_head(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.limits.refused("stalled")
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_deadline is None:  # a later request's head: within the timeout
            self._expect_head()

    def on_headers_complete(self) -> None:
        self._cancel_head()
        if self._stranger:
            sent = bearer(self.headers)
            tokens = self.limits.tokens
            if sent is not None and tokens is not None and tokens.accepts(sent):
                self._stranger = False
                self.limits.shares.trusted(self._host or "?")
        super().on_headers_complete()
        if self._stranger and self.cycle is not None:  # its 401 ends the connection
            self.cycle.keep_alive = False

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        if self._admitted:
            self._admitted = False
            self.limits.shares.closed(self._host, self._stranger)
        super().connection_lost(exc)
