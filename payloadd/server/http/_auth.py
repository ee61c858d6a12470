"""The ASGI middleware that demands the admin token over HTTP (`TokenGuard`).

Over the Unix socket, whoever may connect (the socket's file mode and group) may call every
endpoint, except those under ``/v1/admin`` when a token is configured: they need it. Over
TCP every endpoint needs it, ``/healthz`` and ``/openapi.json`` included. The token travels
as ``Authorization: Bearer <token>`` and is compared in constant time (`Tokens`, loaded by
`payloadd.server._tokens.load_admin_token`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from payload_client.protocol import STATUS_BY_ERROR, ErrorBody, UnauthorizedError
from payloadd.server._tokens import Tokens

__all__ = ["ADMIN_PREFIX", "TokenGuard", "bearer", "remote_host"]

ADMIN_PREFIX = "/v1/admin"
"""Every path starting with this is an admin call."""


def _over_network(scope: Scope) -> bool:
    """True unless the request came over a Unix socket (whose local address has no port)."""
    server = scope.get("server")
    return server is not None and server[1] is not None


def remote_host(scope: Scope) -> str | None:
    """The address of the host a request came from over TCP; ``None`` over the Unix socket
    (what the request holds then counts against the network's shares, `InFlight`)."""
    if not _over_network(scope):
        return None
    client = scope.get("client")
    return str(client[0]) if client else "?"


class TokenGuard:
    """ASGI middleware: answers 401 to calls that need the admin token and lack it.

    Parameters
    ----------
    app : ASGI app
        The app it guards.
    token : Tokens or None
        The admin tokens; ``None``: admin calls over the Unix socket are open, and calls
        over TCP (which the daemon never serves without a token) are refused.
    """

    def __init__(self, app: ASGIApp, token: Tokens | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (there are no websocket routes)
            await self.app(scope, receive, send)
            return
        network = _over_network(scope)
        if not network and (self.token is None or not scope["path"].startswith(ADMIN_PREFIX)):
            await self.app(scope, receive, send)
            return
        sent = bearer(scope["headers"])
        if sent is not None and self.token is not None and self.token.accepts(sent):
            await self.app(scope, receive, send)
            return
        what = "calls over TCP" if network else "admin calls"
        if sent is None:
            message = (
                f"{what} need the admin token: send 'Authorization: Bearer <token>' "
                "(PayloadClient(..., token=...); the --token-file flag of payloadd gc, stat and "
                "inspect, or "
                "$PAYLOADD_ADMIN_TOKEN)"
            )
            challenge = b'Bearer realm="payloadd"'
        else:
            message = f"{what} need the admin token; the token sent is not it"
            challenge = b'Bearer realm="payloadd", error="invalid_token"'
        await _refuse(send, message, challenge)


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of a request's ``Authorization: Bearer`` header (``None``: none)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


async def _refuse(send: Send, message: str, challenge: bytes) -> None:
    body = msgspec.json.encode(ErrorBody(UnauthorizedError.__name__, message))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", challenge),
    ]
    status = STATUS_BY_ERROR[UnauthorizedError]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
