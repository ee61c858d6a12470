"""The payload exception tree: every error the client or the daemon raises.

::

    PayloadError                      base; never raised itself
    ├── InvalidSegmentError           segment metadata breaks the segment model 422
    ├── InvalidRequestError           bad argument, window, name or body        400
    │   ├── PayloadTooLargeError      body or item above a configured limit     413
    │   ├── RequestTimeoutError       a request's body stalled mid-way          408
    │   └── StepCollectedError        an append into a step at or below its     400
    │                                 run's collected watermark: nothing stored
    ├── UnauthorizedError             admin token missing or wrong              401
    ├── FileMissingError              a segment's file does not exist           404
    ├── FileGoneError                 a segment's file was garbage-collected    410
    ├── SegmentFileError              file not a regular file in the root, or   409
    │                                 shorter than the segment says
    ├── StorageFullError              the payload root is full                  507
    ├── BusyError                     the daemon is at a limit for now          503
    │                                 (descriptors, connections, bytes in
    │                                 flight): nothing was done; retry later
    ├── ServerError                   the daemon failed (a bug)                 500
    └── TransportError                no usable answer from the daemon (client side)
        ├── ConnectError              cannot reach the socket or URL
        ├── TimeoutError              the configured timeout elapsed
        ├── ProtocolError             the answer is malformed
        ├── ConnectionLostError       the connection dropped before the whole answer came
        └── AppendInDoubtError        an append's connection failed after the daemon may
                                      have received all of it: stored or not, unknown

`STATUS_BY_ERROR` is the one table mapping error classes to HTTP status codes: the
daemon answers with it, the client inverts it (the error body also names the class).
Foreign errors (httpx, msgspec, OSError) are translated once, at the boundary that
meets them, with ``raise ... from``.
"""

from __future__ import annotations

import builtins
import errno

__all__ = [
    "STATUS_BY_ERROR",
    "AppendInDoubtError",
    "BusyError",
    "ConnectError",
    "ConnectionLostError",
    "FileGoneError",
    "FileMissingError",
    "InvalidRequestError",
    "InvalidSegmentError",
    "NO_DAEMON",
    "PayloadError",
    "PayloadTooLargeError",
    "ProtocolError",
    "RequestTimeoutError",
    "SegmentFileError",
    "ServerError",
    "StepCollectedError",
    "StorageFullError",
    "TimeoutError",
    "TransportError",
    "UnauthorizedError",
    "error_from_wire",
    "nobody_listens",
]


class PayloadError(Exception):
    """Base class of every payload error."""


class InvalidSegmentError(PayloadError, ValueError):
    """A segment's metadata breaks the segment contract (docs/contract.md, "The segment model").

    Attributes
    ----------
    index : int or None
        Position of the bad segment in the list it came from, when known.
    field : str or None
        Name of the offending struct field (``"offset"``, ``"dtype"``, ...).
    """

    def __init__(self, message: str, *, index: int | None = None, field: str | None = None):
        where = f"segment {index}: " if index is not None else ""
        super().__init__(f"{where}{message}")
        self.index = index
        self.field = field


class InvalidRequestError(PayloadError, ValueError):
    """An argument, window, run name, step or request body is not acceptable."""


class PayloadTooLargeError(InvalidRequestError):
    """A request body, item or row count exceeds a configured limit."""


class RequestTimeoutError(InvalidRequestError):
    """A request's body (or a data-plane frame) stopped arriving mid-way for longer than the
    daemon's ``request_timeout_s``; the daemon dropped it and released what it held."""


class StepCollectedError(InvalidRequestError):
    """An append into a step at or below its run's collected watermark (``gc(run=...,
    through_step=N)`` on any node of the payload root): the step is gone, so its rows would
    be read by nobody; nothing was stored. A writer drops such late rows (in asynchronous
    RL, a straggler of a step already trained on)."""


class UnauthorizedError(PayloadError):
    """The call needs the daemon's admin token and none, or another, was sent.

    Admin calls need it when the daemon has one configured; calls over TCP always do. Pass
    it as ``PayloadClient(..., token=...)``.
    """


class FileMissingError(PayloadError, LookupError):
    """The file a segment points to does not exist (and was never collected)."""


class FileGoneError(PayloadError, LookupError):
    """The file a segment points to was removed by garbage collection."""


class SegmentFileError(PayloadError):
    """A segment's file is not a regular file inside the root, or is shorter than the segment."""


class StorageFullError(PayloadError, OSError):
    """The payload root has no room for the append (nothing was written)."""


class BusyError(PayloadError):
    """The daemon is at one of its limits for now: file descriptors (its share of
    ``RLIMIT_NOFILE``), connections, or bytes of requests in flight.

    Nothing of the request was done; the same request may succeed a moment later. The
    message names the limit.

    Attributes
    ----------
    reason : str or None
        Which limit, where the daemon raised it: ``"descriptors"`` or ``"inflight"`` (what
        ``payloadd_refused_total`` counts it under); ``None`` for one rebuilt from an answer
        (the message says it).
    """

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class ServerError(PayloadError):
    """The daemon failed while handling a valid request."""


class TransportError(PayloadError):
    """No usable answer came back from the daemon."""


class ConnectError(TransportError, ConnectionError):
    """The daemon's socket or URL cannot be reached.

    When nothing listens there (no such socket, or a socket or port nobody listens on), the
    message is `NO_DAEMON`'s.
    """


class TimeoutError(TransportError, builtins.TimeoutError):
    """The configured client timeout elapsed."""


class ProtocolError(TransportError):
    """The daemon's answer does not follow the wire format."""


class ConnectionLostError(TransportError, ConnectionError):
    """The connection dropped before the daemon's whole answer came back (it stopped or
    restarted).

    Reads and other idempotent calls have already been retried once on a new connection when
    this is raised; an append raising it was provably not stored (its body never fully
    reached the daemon), so appending again is safe.
    """


class AppendInDoubtError(TransportError):
    """An append's connection failed (dropped, or timed out waiting for the answer) after the
    daemon may have received all of it.

    The rows may or may not be stored. The client never re-sends an append by itself:
    appending the rows again may store them twice (the copy whose segments were never
    returned stays unreferenced until GC removes its step).
    """


STATUS_BY_ERROR: dict[type[PayloadError], int] = {
    InvalidRequestError: 400,
    StepCollectedError: 400,
    UnauthorizedError: 401,
    RequestTimeoutError: 408,
    FileMissingError: 404,
    SegmentFileError: 409,
    FileGoneError: 410,
    PayloadTooLargeError: 413,
    InvalidSegmentError: 422,
    ServerError: 500,
    BusyError: 503,
    StorageFullError: 507,
}
"""HTTP status of each error class the daemon can answer with."""

_BY_NAME: dict[str, type[PayloadError]] = {cls.__name__: cls for cls in STATUS_BY_ERROR}
_BY_STATUS: dict[int, type[PayloadError]] = {}
for _cls, _code in STATUS_BY_ERROR.items():  # a status shared by a subclass: the base's
    _BY_STATUS.setdefault(_code, _cls)


def status_of(exc: PayloadError) -> int:
    """Return the HTTP status for ``exc``: its class's entry, or its nearest base's."""
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return 500


def error_from_wire(status: int, name: str | None, message: str) -> PayloadError:
    """Rebuild the exception a daemon answered with.

    Parameters
    ----------
    status : int
        HTTP status code of the answer; 0 for a data-plane reply.
    name : str or None
        Class name from the error body (``"FileMissingError"``), if any.
    message : str
        Human-readable message from the error body.

    Returns
    -------
    PayloadError
        An instance of the named class when the name is known; without a name, of the
        class the status maps to; otherwise `InvalidRequestError` for 4xx and
        `ServerError` for 5xx.
    """
    cls = _BY_NAME.get(name) if name else _BY_STATUS.get(status)
    if cls is None:  # an unknown name (e.g. "HTTPError" for an unknown route) or status
        cls = InvalidRequestError if 400 <= status < 500 else ServerError
    return cls(f"{message} (HTTP {status})" if status else message)


NO_DAEMON = "no payloadd listening on {where}: is `payloadd serve` running?"
"""The message of a `ConnectError` when nothing listens at ``where`` (a socket path, or a
``http://host:port``): the path does not exist, or nobody accepts connections there (a
socket a killed daemon left, a daemon not started yet). ``payloadd health`` says the same."""

_NOBODY = frozenset({errno.ENOENT, errno.ECONNREFUSED})


def nobody_listens(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from or while handling) says that nothing
    listens where a connection was tried: ``ENOENT`` (no such socket) or ``ECONNREFUSED``.

    Parameters
    ----------
    exc : BaseException
        A connection error as a library raised it (httpx, asyncio, the socket module), with
        its ``__cause__`` / ``__context__`` chain.

    Returns
    -------
    bool
        ``True`` when an `OSError` of that chain has one of those two ``errno`` values.
    """
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        if isinstance(at, OSError) and at.errno in _NOBODY:
            return True
        at = at.__cause__ or at.__context__
    return False
