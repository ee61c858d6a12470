"""The outermost ASGI middleware: a request id, latency and error metrics, an access log.

A pure ASGI middleware (no ``BaseHTTPMiddleware``: the body is never buffered or copied).
It wraps the whole app, Starlette's own error middleware included, so it sees every answer:
401s of the token guard, 404s of unknown paths and the 500 of an unhandled error.

- **Request id**: a client's ``X-Request-ID`` when it is 1 to 64 characters of
  ``[A-Za-z0-9._:+/=-]``, else 16 random hex digits. It is echoed in the answer's
  ``X-Request-ID`` header and set in `REQUEST_ID` for the log records of the request.
- **Metrics**: the latency of the request by route template and status class; an error
  answer by error class. Routes and the exception handlers name the error class in
  ``request.state.error_class``; an answer of 4xx/5xx that names none (the token guard's
  401) counts under the class of its status in `STATUS_BY_ERROR`, else ``HTTPError``.
- **Access log** (``access_log`` setting): one ``payloadd.access`` line per request; the
  path's unprintable characters (a decoded ``%0A``...) are escaped in the message.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from payload_client import STATUS_BY_ERROR, PayloadError
from payload_client.protocol import PEER_PORT_HEADER
from payloadd.server._logs import REQUEST_ID
from payloadd.server._metrics import Metrics
from payloadd.store._counts import HTTP

__all__ = ["ERROR_CLASS", "REQUEST_ID_HEADER", "AccessMiddleware"]

access = logging.getLogger("payloadd.access")

REQUEST_ID_HEADER = b"x-request-id"
ERROR_CLASS = "error_class"
"""Key of ``request.state`` (``scope["state"]``) naming the error class of an error answer."""
_SANE_ID = re.compile(rb"[A-Za-z0-9._:+/=-]{1,64}")
_BY_STATUS = {status: cls.__name__ for cls, status in STATUS_BY_ERROR.items()}


def _request_id(headers: Sequence[tuple[bytes, bytes]], rng: random.Random) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            if _SANE_ID.fullmatch(value):
                return value.decode()
            break
    return f"{rng.getrandbits(64):016x}"  # an id, not a secret: no system call per request


def _printable(path: str) -> str:
    """``path`` with its unprintable characters escaped (``\\n``, ``\\x1b``, ``\\u2028``).

    The path is percent-decoded: ``%0A`` in a request line would otherwise end the access
    log line and start a forged one.
    """
    if path.isprintable():
        return path
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in path)


class AccessMiddleware:
    """ASGI middleware around the whole app: request id, metrics, access log; see the
    module's notes.

    Parameters
    ----------
    app : ASGI app
        The app with its error middleware (``FastAPI.build_middleware_stack()``).
    metrics : Metrics
        Where latencies and errors are counted.
    routes : sequence of BaseRoute
        The app's routes, to name the route of a request refused before routing.
    access_log : bool
        Log one line per request on ``payloadd.access`` (INFO).
    """

    def __init__(
        self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute], access_log: bool
    ) -> None:
        self.app, self.metrics, self.routes, self.access_log = app, metrics, routes, access_log
        self._rng = random.Random()  # seeded from the system's entropy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        rid = _request_id(scope["headers"], self._rng)
        REQUEST_ID.set(rid)  # this request's task only (each request runs in a task of its own)
        headers = [(REQUEST_ID_HEADER, rid.encode())]
        peer = (scope.get("state") or {}).get("peer")
        if peer is not None and peer.port:  # where other nodes read this one's files
            headers.append((PEER_PORT_HEADER, str(peer.port).encode()))
        status = 0
        sent = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), *headers]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        failure: str | None = None
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # answered 500 by the error middleware, or cut off mid-answer
            failure = type(exc).__name__ if isinstance(exc, PayloadError) else "ServerError"
            status = status or 500
            raise
        finally:
            self._account(scope, status, failure, time.perf_counter() - start, sent)

    def _account(
        self, scope: Scope, status: int, failure: str | None, seconds: float, sent: int
    ) -> None:
        route = self._route(scope)
        self.metrics.http_request(route, status, seconds)
        if failure is None and status >= 400:
            state: dict[str, Any] = scope.get("state") or {}
            failure = state.get(ERROR_CLASS) or _BY_STATUS.get(status, "HTTPError")
        if failure is not None:
            self.metrics.error(failure, HTTP)
        if self.access_log:
            access.info(
                "%s %s -> %d in %.3f ms, %d bytes sent",
                scope["method"], _printable(scope["path"]), status, seconds * 1e3, sent,
                extra={"method": scope["method"], "path": scope["path"], "route": route,
                       "status": status, "duration_s": seconds, "bytes_sent": sent},
            )  # fmt: skip

    def _route(self, scope: Scope) -> str:
        """The template of the route that served ``scope`` (``unmatched``: none)."""
        route = scope.get("route")
        if route is None:  # refused before routing (the token guard): match it here
            for r in self.routes:
                if r.matches(scope)[0] is not Match.NONE:
                    route = r
                    break
        path = getattr(route, "path", None)
        return path if isinstance(path, str) else "unmatched"
