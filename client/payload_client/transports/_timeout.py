"""`Timeout`: the client's time limits as one immutable value."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import httpx

from .._errors import InvalidRequestError

__all__ = ["DEFAULT_TIMEOUT_S", "KEEPALIVE_S", "Timeout"]

DEFAULT_TIMEOUT_S = 60.0
"""Seconds of every limit a client is not given."""
KEEPALIVE_S = 2.0
"""Seconds a pooled connection may idle before the client closes it instead of reusing it:
below the daemon's default ``keep_alive_s`` (5), so the client never sends on a connection
the daemon is closing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeout:
    """Time limits of a client, in seconds; ``None`` waits forever.

    Pass one as ``timeout=`` to `PayloadClient` or `AsyncPayloadClient`; a plain number
    sets ``connect``, ``read``, ``write`` and ``pool`` at once.

    Parameters
    ----------
    connect : float or None, default 60.0
        Connecting to the daemon (the HTTP socket or URL, and the data socket).
    read : float or None, default 60.0
        Waiting for each part of an answer, over HTTP and on the data plane.
    write : float or None, default 60.0
        Sending each part of a request, over HTTP and on the data plane.
    pool : float or None, default 60.0
        Waiting for a free connection when every pooled one is busy.
    keepalive : float, default 2.0
        A pooled connection idle longer than this is closed, not reused (``0``: a new
        connection for every call). Keep it below the daemon's ``keep_alive_s`` (default 5).

    Raises
    ------
    InvalidRequestError
        A limit that is not a positive finite number (or ``None``), or a negative or
        infinite ``keepalive``.

    Examples
    --------
    >>> Timeout(read=5.0).connect
    60.0
    """

    connect: float | None = DEFAULT_TIMEOUT_S
    read: float | None = DEFAULT_TIMEOUT_S
    write: float | None = DEFAULT_TIMEOUT_S
    pool: float | None = DEFAULT_TIMEOUT_S
    keepalive: float = KEEPALIVE_S

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name != "keepalive":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequestError(
                    f"timeout {f.name} must be a number of seconds, got {value!r}"
                )
            floor_ok = value >= 0 if f.name == "keepalive" else value > 0
            if not floor_ok or not math.isfinite(value):
                least = ">= 0" if f.name == "keepalive" else "> 0"
                raise InvalidRequestError(
                    f"timeout {f.name} must be finite and {least} seconds, got {value!r}"
                )

    @classmethod
    def of(cls, value: Any) -> Timeout:
        """The `Timeout` a client's ``timeout=`` argument stands for.

        Parameters
        ----------
        value : float, Timeout or httpx.Timeout
            Seconds for connect, read, write and pool; or a value object.

        Raises
        ------
        InvalidRequestError
            Anything else, or seconds that are not positive and finite.
        """
        if isinstance(value, Timeout):
            return value
        if isinstance(value, httpx.Timeout):
            return cls(connect=value.connect, read=value.read, write=value.write, pool=value.pool)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(
                f"timeout must be seconds or a Timeout, got {type(value).__name__}"
            )
        return cls(connect=value, read=value, write=value, pool=value)

    def for_httpx(self) -> tuple[httpx.Timeout, httpx.Limits]:
        """The httpx timeout and pool limits standing for this value."""
        timeout = httpx.Timeout(
            connect=self.connect, read=self.read, write=self.write, pool=self.pool
        )
        return timeout, httpx.Limits(
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=self.keepalive
        )
