"""What the routes answer with: a wire Struct encoded as the client accepts it (`answer`), a
body decoded into one (`decode`), and every error as its `ErrorBody`, through `wire_error`
(`install_error_handler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from payload_client import InvalidRequestError, PayloadError, RequestTimeoutError
from payload_client.protocol import MSGPACK_CONTENT_TYPE, ErrorBody
from payloadd.server._errors import WireError, refusal, wire_error
from payloadd.server._metrics import Metrics
from payloadd.server.http._access import ERROR_CLASS
from payloadd.store._counts import HTTP

__all__ = ["ERRORS", "answer", "decode", "install_error_handler"]

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()

ERRORS: tuple[type[Exception], ...] = (
    PayloadError,
    RequestValidationError,
    HTTPException,
    ClientDisconnect,
    Exception,  # Starlette's error middleware: answered, then raised on (to uvicorn)
)
"""What the one error handler answers (`wire_error`)."""


def answer(request: Request, obj: Any, status: int = 200) -> Response:
    """Encode ``obj`` as msgpack when the client accepts it, else as JSON."""
    if MSGPACK_CONTENT_TYPE in request.headers.get("accept", ""):
        return Response(_msgpack.encode(obj), status, media_type=MSGPACK_CONTENT_TYPE)
    return Response(_json.encode(obj), status, media_type="application/json")


def decode(decoder: Callable[[bytes], Any], body: Any, what: str) -> Any:
    """``body`` decoded, or `InvalidRequestError` naming ``what``."""
    try:
        return decoder(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"bad {what}: {exc}") from None


def install_error_handler(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of the app with its `ErrorBody` (`wire_error`), counting refusals;
    the access middleware counts the error class."""

    async def answer_error(request: Request, exc: Exception) -> Response:
        wire: WireError = wire_error(exc, f"{request.method} {request.url.path}")
        reason = refusal(exc)
        if reason is not None:
            metrics.refused_one(HTTP, reason)
        # the rest of a stalled body may still come; uvicorn drops the connection after an
        # unhandled error: say so, so that no client reuses it
        close = wire.unexpected or isinstance(exc, RequestTimeoutError)
        setattr(request.state, ERROR_CLASS, wire.error)  # counted by AccessMiddleware
        return Response(
            _json.encode(ErrorBody(wire.error, wire.message)),
            wire.status,
            headers={"Connection": "close"} if close else None,
            media_type="application/json",
        )

    for cls in ERRORS:
        app.add_exception_handler(cls, answer_error)
