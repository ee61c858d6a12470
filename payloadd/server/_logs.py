"""Logging of the daemon: text or JSON lines on stderr, each carrying its request's id.

`configure_logging` sets up the root logger once per process (``payloadd serve``); uvicorn's
own loggers (``uvicorn.error``, ``uvicorn.access``) propagate to it, so they follow the same
format. The id of the HTTP request being served (`REQUEST_ID`, set by the request middleware
in `payloadd.server.http._access`) is added to every record logged while serving it, in the
event loop or in a worker thread (Starlette's thread pool copies the context).
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

__all__ = ["REQUEST_ID", "TEXT_FORMAT", "configure_logging"]

REQUEST_ID: ContextVar[str | None] = ContextVar("payloadd_request_id", default=None)
"""The id of the HTTP request being served in this context (``None`` outside requests)."""

TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s%(request_tag)s"
"""Text lines: ``ERROR payloadd: ... [request 5f0c9a1e2b3d4c6f]``."""

JSON_FIELDS = ("levelname", "name", "message")
"""JSON lines: ``time``, then these (renamed ``level``, ``logger``, ``message``), then
``request_id`` when there is one, extra fields of the record, and ``exception``."""

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
"""uvicorn's loggers (``color_message``, an extra of theirs, is left out of JSON lines)."""


class _TextTag(logging.Filter):
    """Adds ``request_tag`` (`` [request <id>]`` or nothing) for the text format."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_tag = f" [request {rid}]" if rid else ""
        return True


class _JsonTag(logging.Filter):
    """Adds ``request_id`` to records logged during a request, for the JSON format."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.request_id = rid
        return True


def configure_logging(
    level: str, log_format: Literal["text", "json"] = "text", *, stream: object = None
) -> logging.Handler:
    """Send every log record of this process to stderr, one line each, in ``log_format``.

    Replaces the root logger's handlers; uvicorn's loggers lose theirs and propagate to the
    root, so their lines have the same format (start uvicorn with ``log_config=None``).

    Parameters
    ----------
    level : str
        ``critical``, ``error``, ``warning``, ``info`` or ``debug``.
    log_format : {"text", "json"}
        ``text``: ``LEVEL logger: message [request <id>]``; ``json``: one JSON object a line
        with ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``request_id``
        (during a request) and ``exception`` (a traceback, when one is logged).
    stream : file, optional
        Where lines go (default: ``sys.stderr``).

    Returns
    -------
    logging.Handler
        The handler installed on the root logger.

    Raises
    ------
    ValueError
        ``log_format`` is neither ``text`` nor ``json``.
    """
    if log_format not in ("text", "json"):
        raise ValueError(f'log_format must be "text" or "json", got {log_format!r}')
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    if log_format == "json":
        handler.setFormatter(
            JsonFormatter(
                list(JSON_FIELDS),
                rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception"},
                timestamp="time",
                reserved_attrs=[*RESERVED_ATTRS, "color_message", "request_tag"],
            )
        )
        handler.addFilter(_JsonTag())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
        handler.addFilter(_TextTag())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
    return handler
