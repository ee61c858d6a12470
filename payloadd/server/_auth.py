"""The admin token: loading it from the settings, and the ASGI middleware that demands it.

Over the Unix socket, whoever may connect (the socket's file mode and group) may call every
endpoint, except those under ``/v1/admin`` when a token is configured: they need it. Over
TCP every endpoint needs it, ``/healthz`` and ``/openapi.json`` included. The token travels
as ``Authorization: Bearer <token>`` and is compared in constant time. Its value never
appears in a log line, an error message, a ``repr`` or ``--help``.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from collections.abc import Iterable, Sequence

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from payload_client.protocol import STATUS_BY_ERROR, ErrorBody, UnauthorizedError
from payloadd.server._sockets import StartError
from payloadd.settings._settings import Settings

__all__ = [
    "ADMIN_PREFIX",
    "MAX_TOKENS",
    "MIN_TOKEN_CHARS",
    "TokenGuard",
    "Tokens",
    "bearer",
    "load_admin_token",
    "remote_host",
]

log = logging.getLogger("payloadd")

ADMIN_PREFIX = "/v1/admin"
"""Every path starting with this is an admin call."""
MIN_TOKEN_CHARS = 16
"""Shortest admin token accepted (e.g. ``openssl rand -hex 32`` gives 64)."""
MAX_TOKENS = 8
"""Most tokens a token file may hold (one a line: the new and the old one, while rotating)."""
_TOKEN = re.compile(rb"[\x21-\x7e]+")  # what an HTTP header can carry after "Bearer "


class Tokens:
    """The admin tokens a daemon accepts: one, or while one is rotated, several (the lines of
    the token file). `accepts` compares a sent token with each in constant time.

    Parameters
    ----------
    tokens : sequence of bytes
        The tokens, the one clients of the file send first.
    """

    def __init__(self, tokens: Sequence[bytes]) -> None:
        self._tokens = tuple(tokens)

    def accepts(self, sent: bytes) -> bool:
        """Whether ``sent`` is one of the tokens (every one is compared, whatever matched)."""
        ok = False
        for token in self._tokens:
            ok |= hmac.compare_digest(sent, token)
        return ok

    def __len__(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:  # never the values
        return f"Tokens({len(self._tokens)})"


def load_admin_token(settings: Settings, *, warn: bool = True) -> Tokens | None:
    """Return the configured admin tokens, or ``None`` when there are none; with ``warn``,
    log a warning when the token file is readable by every user.

    ``PAYLOADD_ADMIN_TOKEN`` holds one token; ``admin_token_file`` one a line (empty lines
    ignored), at most `MAX_TOKENS`: every one is accepted, so that a token is rotated without
    a refused call (docs/deployment.md, "Many nodes").

    Raises
    ------
    StartError
        Both ``admin_token`` and ``admin_token_file`` are set; the file cannot be read or
        holds no token, or too many; a token is shorter than `MIN_TOKEN_CHARS` or holds
        characters other than visible ASCII. Messages never include a token.
    """
    if settings.admin_token is not None and settings.admin_token_file is not None:
        raise StartError("give admin_token (PAYLOADD_ADMIN_TOKEN) or admin_token_file, not both")
    if settings.admin_token is not None:
        where = "PAYLOADD_ADMIN_TOKEN"
        tokens = [settings.admin_token.get_secret_value().strip().encode()]
    elif settings.admin_token_file is not None:
        path = settings.admin_token_file
        where = f"admin_token_file {path}"
        try:
            with open(path, "rb") as f:
                tokens = [line.strip() for line in f.read(64 << 10).splitlines() if line.strip()]
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise StartError(f"cannot read {where}: {exc.strerror}") from None
        if warn and mode & 0o004:
            log.warning("%s is readable by every user; make it 0600 or 0640", where)
        if len(tokens) > MAX_TOKENS:
            raise StartError(f"{where} holds {len(tokens)} tokens; at most {MAX_TOKENS}")
        tokens = tokens or [b""]
    else:
        return None
    for token in tokens:
        if len(token) < MIN_TOKEN_CHARS:
            raise StartError(
                f"the admin token in {where} is shorter than {MIN_TOKEN_CHARS} characters"
            )
        if not _TOKEN.fullmatch(token):
            raise StartError(
                f"the admin token in {where} must be visible ASCII characters only (no spaces)"
            )
    return Tokens(tokens)


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
