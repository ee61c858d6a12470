"""One mapping of an exception to the error the wire carries, for HTTP and the data plane.

`wire_error` gives an exception's status (`status_of` for a `PayloadError`), error class
name and message, the ``ErrorBody`` of an HTTP answer and the ``ErrorReply`` of a data-plane
reply alike, and logs what the operator must see, once:

- a `PayloadError` of status 500 or more but 503 (a full disk, an I/O error: refusals for
  being busy, 503, are counted in ``payloadd_refused_total`` instead), as an error;
- a stalled request body (`RequestTimeoutError`), as a warning;
- a client that left mid-request, as information;
- any other exception (a bug), with its traceback: answered ``ServerError``.

`refusal` names the ``payloadd_refused_total`` reason of an error that is a refusal.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from payload_client import PayloadError, RequestTimeoutError
from payload_client.protocol import status_of

__all__ = ["WireError", "refusal", "wire_error"]

log = logging.getLogger("payloadd")


class WireError(NamedTuple):
    """The error an answer carries.

    Attributes
    ----------
    status : int
        The HTTP status (a data-plane reply carries none: its client maps ``error``).
    error : str
        The error class name (``ErrorBody.error``, ``ErrorReply.error``).
    message : str
        What went wrong, for the client.
    unexpected : bool
        Not an error the daemon raises on purpose (a bug): answered ``ServerError``.
    """

    status: int
    error: str
    message: str
    unexpected: bool = False


def wire_error(exc: Exception, where: str, logger: logging.Logger = log) -> WireError:
    """The wire error for ``exc``, logged as the module's notes say.

    Parameters
    ----------
    exc : Exception
        What a request raised.
    where : str
        The request, for the log lines (``"POST /v1/append"``, ``"data plane"``).
    logger : logging.Logger
        Where the lines go (default ``payloadd``).

    Returns
    -------
    WireError
    """
    if isinstance(exc, PayloadError):
        status, name = status_of(exc), type(exc).__name__
        if status >= 500 and status != 503:  # a full disk or an I/O error: the operator must see it
            logger.error("%s: %s: %s", where, name, exc)
        elif isinstance(exc, RequestTimeoutError):  # a client, or its network, stalled
            logger.warning("%s: %s", where, exc)
        return WireError(status, name, str(exc))
    if isinstance(exc, RequestValidationError):
        fields = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
        )  # e.g. "query.dry_run: Input should be a valid boolean"
        return WireError(400, "InvalidRequestError", fields)
    if isinstance(exc, HTTPException):
        return WireError(exc.status_code, "HTTPError", str(exc.detail))
    if isinstance(exc, ClientDisconnect):
        logger.info("client left during %s; nothing was acknowledged", where)
        return WireError(400, "InvalidRequestError", "client disconnected")
    logger.exception("unhandled error on %s", where)
    return WireError(500, "ServerError", f"internal error: {type(exc).__name__}", True)


def refusal(exc: Exception) -> str | None:
    """The reason ``payloadd_refused_total`` counts ``exc`` under, ``None`` if it is no
    refusal: ``"stalled"`` (`RequestTimeoutError`), or a 503's `BusyError.reason`
    (``"inflight"``, ``"descriptors"``; ``"descriptors"`` when it names none)."""
    if not isinstance(exc, PayloadError):
        return None
    if isinstance(exc, RequestTimeoutError):
        return "stalled"
    if status_of(exc) == 503:
        return getattr(exc, "reason", None) or "descriptors"
    return None
