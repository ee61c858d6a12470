"""Where the clients meet httpx: its errors translated once, and what a failed call means.

An idempotent call (a read, stats, health) is retried once when its connection drops. Any
other call (an append) is never re-sent; when its connection fails, the error says whether
it was provably not stored (its body never fully left) or may have been.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from ._errors import (
    AppendInDoubtError,
    ConnectError,
    ConnectionLostError,
    ProtocolError,
    TimeoutError,
    TransportError,
)

__all__ = ["Body", "dropped", "translate"]

_DROPPED = (httpx.ReadError, httpx.WriteError, httpx.CloseError, httpx.RemoteProtocolError)
"""The connection broke: reset, closed by the daemon before its whole answer (it stopped,
restarted, or closed an idle connection just as a request went out)."""

_NOT_STORED = (
    "nothing was stored: the append never fully reached the daemon; appending again is safe"
)


def dropped(exc: httpx.HTTPError) -> bool:
    """Whether ``exc`` means the connection broke (worth one retry of an idempotent call)."""
    return isinstance(exc, _DROPPED)


class Body:
    """A request body's chunks, and whether all of them were sent.

    httpcore asks for the next chunk only after it has written the previous one, and writes
    the end of the message (nothing, with ``Content-Length``) without a further send: once
    the iterator is exhausted, every byte was handed to the kernel. Before that, the daemon
    cannot have received the whole body, so it cannot have acted on it.
    """

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.sent = not chunks  # no body: sent with the request line, as far as anyone knows

    def sync(self) -> Iterator[Any] | None:
        """The chunks for a sync request (``None`` without a body)."""
        return self._sync() if self.chunks else None

    def _sync(self) -> Iterator[Any]:
        yield from self.chunks
        self.sent = True

    def async_(self) -> AsyncIterator[Any] | None:
        """The chunks for an async request (``None`` without a body)."""
        return self._async() if self.chunks else None

    async def _async(self) -> AsyncIterator[Any]:
        for chunk in self.chunks:
            yield chunk
        self.sent = True


def translate(
    exc: httpx.HTTPError, where: str, *, idempotent: bool, sent: bool, retried: bool
) -> TransportError:
    """The `TransportError` an httpx error stands for.

    Parameters
    ----------
    exc : httpx.HTTPError
        What httpx raised.
    where : str
        The daemon's socket or URL, for the message.
    idempotent : bool
        Whether the call may run twice with the same effect (then it was retried once if
        ``retried``); if not, it is an append and the error says whether it may be stored.
    sent : bool
        Whether the whole request body had been sent (see `Body`).
    retried : bool
        Whether this was the second attempt.

    Returns
    -------
    TransportError
        `ConnectError`, `TimeoutError`, `ConnectionLostError`, `AppendInDoubtError`,
        `ProtocolError`, or `TransportError` itself for anything else.
    """
    in_doubt = not idempotent and sent
    fate = "" if idempotent else f"; {_NOT_STORED}"
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(f"cannot connect to {where}: {exc}{fate}")
    if in_doubt and isinstance(exc, (httpx.ReadTimeout, *_DROPPED)):
        what = "timed out waiting for" if isinstance(exc, httpx.ReadTimeout) else "lost"
        return AppendInDoubtError(
            f"{what} the answer to an append from {where} ({exc!r}): the append may or may "
            "not have been stored; it is not re-sent, and appending the rows again may store "
            "them twice"
        )
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError(f"timed out talking to {where}: {exc!r}{fate}")
    if isinstance(exc, _DROPPED):
        again = " (also on the one retry, on a new connection)" if retried else ""
        return ConnectionLostError(
            f"connection to {where} dropped before the whole answer came{again}: {exc!r}{fate}"
        )
    if isinstance(exc, httpx.DecodingError):
        return ProtocolError(f"malformed answer from {where}: {exc}")
    return TransportError(f"transport error talking to {where}: {exc!r}")
