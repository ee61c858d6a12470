"""Waiting for a daemon that is starting: what `PayloadClient.wait_ready` and its awaitable twin
decide, without I/O.

`ready_steps` yields what to do next, a ``GET /healthz`` `Call` to send (its time limit the
time left) or a number of seconds to sleep, and is given each call's answer or has its error
thrown in. The clients' ``wait_ready`` sends each call by its route (`nest`) and sleeps each pause.

A daemon is ready once it answers ``status: "ok"``. Until then the daemon may not be there
yet (nothing listens on its socket or port: `ConnectError` with `NO_DAEMON`'s message), be
slow to answer (`TimeoutError`), restart (`ConnectionLostError`), be at a limit for now
(`BusyError`) or answer ``"degraded"``: all of that is asked again, after a pause growing
from `FIRST_PAUSE_S` to `MAX_PAUSE_S`, until the time is up. Any other error (a socket that
refuses this user, a wrong token, an answer that is not payloadd's) is raised at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from typing import Any

from .._errors import (
    BusyError,
    ConnectError,
    ConnectionLostError,
    InvalidRequestError,
    PayloadError,
    TimeoutError,
    nobody_listens,
)
from ..transports import Call
from ..wire._http import Health

__all__ = ["FIRST_PAUSE_S", "MAX_PAUSE_S", "MIN_ATTEMPT_S", "ReadySteps", "ready_steps"]

FIRST_PAUSE_S = 0.05
"""Seconds between the first attempt and the second; each pause after is twice the last."""
MAX_PAUSE_S = 0.5
"""Longest pause between two attempts."""
MIN_ATTEMPT_S = 0.5
"""Each attempt may take the time left, and at least this (the last one is made at the
deadline): ``wait_ready`` returns or raises at most about this long after its time is up."""

ReadySteps = Generator[Call[Health] | float, Any, Health]
"""The effects of `ready_steps`: a call to send (its answer sent back), or seconds to sleep."""

_AGAIN = (ConnectError, TimeoutError, ConnectionLostError, BusyError)


def _seconds(timeout_s: object) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise InvalidRequestError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    value = float(timeout_s)
    if not 0 <= value < math.inf:
        raise InvalidRequestError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
    return value


def _gave_up(last: Health | PayloadError, where: str, timeout_s: float) -> PayloadError:
    """The error of a wait whose time is up, ``last`` the last attempt's answer or error."""
    waited = f"waited {timeout_s:g} s"
    if isinstance(last, Health):
        why = f" (data plane: {last.data_plane})" if last.data_plane else ""
        return BusyError(f"{where} answered status {last.status!r}, not 'ok'{why}; {waited}")
    return type(last)(f"{last} ({waited})")


def ready_steps(
    health_call: Callable[[], Call[Health]],
    where: str,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> ReadySteps:
    """Ask for the daemon's health until it answers ``"ok"`` or ``timeout_s`` is up.

    Parameters
    ----------
    health_call : callable
        Makes the ``GET /healthz`` call of the client (a new one each attempt).
    where : str
        The daemon's socket or URL, for messages.
    timeout_s : float
        Seconds to keep asking, >= 0 (0: one attempt).
    clock : callable, default time.monotonic
        Seconds now, for the deadline.

    Yields
    ------
    Call or float
        A call to send, whose answer (`Health`) is sent back or whose error is thrown in; or
        seconds to sleep.

    Returns
    -------
    Health
        The first answer with ``status == "ok"``.

    Raises
    ------
    InvalidRequestError
        ``timeout_s`` is not a finite number >= 0.
    ConnectError, TimeoutError, ConnectionLostError
        The last attempt's error when the time is up, ``(waited N s)`` added to its message:
        with nothing listening, `NO_DAEMON`'s.
    BusyError
        The daemon was at a limit for now, or answered a status other than ``"ok"``, until
        the time was up.
    PayloadError
        Any other error, at once (`ConnectError` of a socket this user may not connect to,
        `UnauthorizedError`, `ProtocolError`, ...).
    """
    timeout = _seconds(timeout_s)
    deadline = clock() + timeout
    pause = FIRST_PAUSE_S
    while True:
        call = health_call()
        call.timeout = max(deadline - clock(), MIN_ATTEMPT_S)
        last: Health | PayloadError
        try:
            health: Health = yield call
        except _AGAIN as exc:
            if isinstance(exc, ConnectError) and not nobody_listens(exc):
                raise
            last = exc
        else:
            if health.status == "ok":
                return health
            last = health
        left = deadline - clock()
        if left <= 0:
            raise _gave_up(last, where, timeout) from (
                last if isinstance(last, PayloadError) else None
            )
        yield min(pause, left)
        pause = min(2 * pause, MAX_PAUSE_S)
