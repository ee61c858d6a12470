"""``payloadd health``: does a daemon answer ``GET /healthz`` on its Unix socket?

For container health checks and Kubernetes exec probes (an ``httpGet`` probe cannot reach a
Unix socket), and for scripts that start a daemon and wait for it (``--wait``). Exit status 0
when the daemon answers ``{"status": "ok", ...}``, 1 with a one-line reason otherwise, 2 for
bad flags.

Probes run it every few seconds, often with a timeout of a second or so, so it imports only
the standard library: no numpy, httpx, pydantic or FastAPI (``import payload_client`` alone
takes about a third of a second on a small VM, the daemon's modules about a second).
`payloadd.cli._main.main` hands ``payloadd health`` to it before importing anything else.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import stat
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "DEFAULT_SOCKET",
    "DEFAULT_TIMEOUT_S",
    "DESCRIPTION",
    "NO_DAEMON",
    "HealthError",
    "add_health_flags",
    "check_health",
    "main",
    "run_health",
    "wait_health",
]

DEFAULT_SOCKET = "/run/payloadd/payloadd.sock"
"""The daemon's default socket (the same as `payload_client.DEFAULT_SOCKET` and the default of
``Settings.socket``; a test keeps them equal). Not imported from there: that costs the imports
this module avoids."""
DEFAULT_TIMEOUT_S = 3.0
"""Seconds the whole check may take by default: connect, send, and receive the answer."""
MAX_TIMEOUT_S = 86400.0
"""Longest ``--timeout`` and ``--wait`` (a day)."""
NO_DAEMON = "no payloadd listening on {where}: is `payloadd serve` running?"
"""What it says when nothing listens on the socket (the same as the client's `ConnectError`,
``payload_client._errors.NO_DAEMON``; a test keeps them equal)."""
FIRST_PAUSE_S = 0.05
"""With ``--wait``: seconds between the first check and the second; each pause after is twice
the last, up to `MAX_PAUSE_S`."""
MAX_PAUSE_S = 0.5
"""With ``--wait``: longest pause between two checks."""
MIN_CHECK_S = 0.5
"""With ``--wait``: each check may take the time left (within ``--timeout``), and at least this:
the last one is made when the time is up."""
MAX_ANSWER_BYTES = 64 << 10
"""Largest ``/healthz`` answer body read (the daemon's is about 50 bytes)."""
DESCRIPTION = (
    "Check that a daemon answers GET /healthz on its Unix socket, for container health checks "
    "and Kubernetes exec probes; with --wait, keep asking until it does (a script that has just "
    "started one). Exit status 0: healthy (one line on stdout); 1: not healthy "
    "(no daemon, not a daemon, a wrong answer, no answer in time; one line on stderr); 2: bad "
    "flags. Needs no admin token: the Unix socket serves /healthz to whoever may connect."
)


class HealthError(Exception):
    """The daemon is not healthy, or not there; the message says why, in one line.

    Parameters
    ----------
    message : str
        Why.
    again : bool, default False
        Whether asking again may succeed (`wait_health`): nothing listens yet, no answer in
        time, a status other than ``"ok"``, a busy daemon (503). Not for a path that is not a
        socket, a denied permission, or an answer that is not payloadd's.
    """

    def __init__(self, message: str, *, again: bool = False) -> None:
        super().__init__(message)
        self.again = again


class _DeadlineSocket(socket.socket):
    """A Unix stream socket whose every receive waits only until ``deadline`` (monotonic s)."""

    deadline: float = math.inf

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(self._remaining())
        return super().recv_into(buffer, nbytes, flags)


class _UnixConnection(http.client.HTTPConnection):
    """`http.client.HTTPConnection` over a Unix socket, bounded by one deadline."""

    def __init__(self, socket_path: str, deadline: float) -> None:
        super().__init__("payloadd", timeout=max(deadline - time.monotonic(), 1e-3))
        self._socket_path = socket_path
        self._deadline = deadline

    def connect(self) -> None:
        sock = _DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.deadline = self._deadline
        try:
            sock.settimeout(sock._remaining())
            sock.connect(self._socket_path)
            sock.settimeout(sock._remaining())  # for sending the request
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _refused(socket_path: str) -> HealthError:
    try:
        mode = os.stat(socket_path).st_mode
    except OSError:
        mode = stat.S_IFSOCK  # gone meanwhile
    if not stat.S_ISSOCK(mode):
        return HealthError(f"{socket_path} is not a socket")
    return HealthError(NO_DAEMON.format(where=socket_path), again=True)  # a stale socket


def check_health(socket_path: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the daemon on ``socket_path`` for ``GET /healthz``; return its answer.

    Parameters
    ----------
    socket_path : str
        The daemon's Unix socket (its ``--socket``).
    timeout : float
        Seconds the whole check may take: connect, send the request, receive the answer.

    Returns
    -------
    dict
        The daemon's answer: ``status`` (``"ok"``), ``node`` and ``version``.

    Raises
    ------
    HealthError
        Nothing listens there (no such file, a stale socket: `NO_DAEMON`'s message; not a
        socket), permission to connect is denied, no complete answer within ``timeout``, the
        answer is not HTTP, not 200, not a JSON object, or its ``status`` is not ``"ok"``.
    """
    deadline = time.monotonic() + timeout
    conn = _UnixConnection(socket_path, deadline)
    try:
        conn.request("GET", "/healthz", headers={"Accept": "application/json"})
        response = conn.getresponse()
        body = response.read(MAX_ANSWER_BYTES)
    except FileNotFoundError:
        raise HealthError(NO_DAEMON.format(where=socket_path), again=True) from None
    except ConnectionRefusedError:
        raise _refused(socket_path) from None
    except PermissionError:
        raise HealthError(
            f"permission denied connecting to {socket_path}: this user needs the socket's "
            "group (and to traverse its directory)"
        ) from None
    except TimeoutError:
        raise HealthError(
            # a check cut to the time left is said to the hundredth: 0.999999 s is 1 s
            f"no answer from {socket_path} within {round(timeout, 2):g} s",
            again=True,
        ) from None
    except http.client.HTTPException as exc:
        raise HealthError(
            f"{socket_path} did not answer as HTTP ({type(exc).__name__}): not a payloadd socket?"
        ) from None
    except OSError as exc:
        raise HealthError(f"cannot reach {socket_path}: {exc.strerror or exc}") from None
    finally:
        conn.close()
    if response.status != 200:
        raise HealthError(
            f"{socket_path} answered HTTP {response.status} to GET /healthz, not 200",
            again=response.status == 503,
        )
    try:
        answer = json.loads(body)
    except ValueError:
        raise HealthError(f"{socket_path} answered GET /healthz with something not JSON") from None
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        status = answer.get("status") if isinstance(answer, dict) else None
        why = answer.get("data_plane") if isinstance(answer, dict) else None
        detail = f" (data plane: {why})" if isinstance(why, str) and why else ""
        raise HealthError(
            f"{socket_path} answered GET /healthz with status {status!r}, not 'ok'{detail}",
            again=isinstance(status, str),
        )
    return answer


def wait_health(
    socket_path: str, wait: float, timeout: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """`check_health` until the daemon is healthy or ``wait`` seconds are up.

    For a script that has just started a daemon (it takes seconds to answer on a loaded
    machine). Asked again: nothing listens yet, no answer in time, a status other than
    ``"ok"``, HTTP 503; after pauses of `FIRST_PAUSE_S` growing to `MAX_PAUSE_S`. The last
    check is made when the time is up.

    Parameters
    ----------
    socket_path : str
        The daemon's Unix socket.
    wait : float
        Seconds to keep asking (0: once).
    timeout : float
        Seconds one check may take at most; never more than the time left (at least
        `MIN_CHECK_S`).

    Returns
    -------
    dict
        The daemon's answer, as `check_health` returns it.

    Raises
    ------
    HealthError
        The last check's error when the time is up, ``(waited N s)`` added to its message
        (`NO_DAEMON`'s when nothing ever listened); at once, an error that asking again would
        not change (not a socket, permission denied, not payloadd's answer).
    """
    if wait <= 0:
        return check_health(socket_path, timeout)
    deadline = time.monotonic() + wait
    pause = FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        try:
            return check_health(socket_path, min(timeout, max(left, MIN_CHECK_S)))
        except HealthError as exc:
            left = deadline - time.monotonic()
            if not exc.again:
                raise
            if left <= 0:
                raise HealthError(f"{exc} (waited {wait:g} s)") from None
        time.sleep(min(pause, left))
        pause = min(2 * pause, MAX_PAUSE_S)


def _seconds(text: str, *, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    positive = value >= 0 if zero else value > 0
    if not (positive and value <= MAX_TIMEOUT_S):  # socket timeouts overflow far beyond
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds {'>=' if zero else '>'} 0 and <= {MAX_TIMEOUT_S:g}, "
            f"got {text}"
        )
    return value


def _wait_seconds(text: str) -> float:
    return _seconds(text, zero=True)


def add_health_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``payloadd health`` to ``parser``."""
    parser.add_argument(
        "--socket",
        help=f"the daemon's Unix socket [default: $PAYLOADD_SOCKET or {DEFAULT_SOCKET}]",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds the whole check may take: connect, ask, get the answer; at most "
        f"{MAX_TIMEOUT_S:g} [default: {DEFAULT_TIMEOUT_S:g}]",
    )
    parser.add_argument(
        "--wait",
        type=_wait_seconds,
        default=0.0,
        metavar="SECONDS",
        help="keep checking for up to this many seconds until the daemon is healthy, for a "
        "script that has just started one (nothing listening yet, no answer yet, not 'ok' "
        "yet); each check within --timeout and the time left [default: 0, one check]",
    )


def run_health(args: argparse.Namespace) -> int:
    """Run ``payloadd health`` with parsed flags; return the exit status (0 healthy, 1 not)."""
    socket_path = args.socket or os.environ.get("PAYLOADD_SOCKET") or DEFAULT_SOCKET
    try:
        answer = wait_health(socket_path, args.wait, args.timeout)
    except HealthError as exc:
        print(f"payloadd health: {exc}", file=sys.stderr)
        return 1
    print(
        f"payloadd health: ok: node {answer.get('node')}, payloadd {answer.get('version')}, "
        f"on {socket_path}"
    )
    return 0


def main(argv: Sequence[str]) -> int:
    """Parse the flags of ``payloadd health`` (``argv`` without the command) and run it.

    Returns
    -------
    int
        0 healthy, 1 not healthy.

    Raises
    ------
    SystemExit
        Status 2 on bad flags (argparse prints the error), 0 after ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog="payloadd health", description=DESCRIPTION, allow_abbrev=False
    )
    add_health_flags(parser)
    return run_health(parser.parse_args(argv))
