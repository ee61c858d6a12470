"""The transport interface: one call carried one way, sync (`Transport`) or async
(`AsyncTransport`), as httpx's ``BaseTransport.handle_request`` and its async twin.

A transport makes one attempt at a `Call` and gives its result or raises. Which transport a
call takes, and whether a failed attempt is made again, is the client's choice
(`payload_client.clients._base.BaseClient`); a transport only tells it what happened:
`DataPlaneDownError` (this transport cannot be used now, nothing of the call reached a file)
or `AttemptError` (the attempt failed below the client's error tree: the client decides
whether to try again and which `TransportError` to raise).

`drive` and `drive_async` run a generator of effects (the client's route, the data plane's
steps) to its result: the one loop both the sync and the async side use (`nest` runs one
inside another generator of effects, each effect expanded into effects of its own).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

from .._errors import TransportError
from ._call import Call

__all__ = [
    "AsyncTransport",
    "NOT_BEGUN",
    "AttemptError",
    "DataPlaneDownError",
    "Transport",
    "begun",
    "drive",
    "drive_async",
    "nest",
]

T = TypeVar("T")
E = TypeVar("E")
F = TypeVar("F")
NOT_BEGUN: Any = object()
"""`drive`'s ``first`` when its generator has not been started."""


class DataPlaneDownError(Exception):
    """The data plane (or the peer port) cannot be used for this call; the caller falls back
    to HTTP.

    It leaves the steps only while nothing of the call reached a file: once an append's rows
    are written, a failing exchange ends in the segments (a lease append: the note is only
    counters) or in `AppendInDoubtError` (a reservation whose commit was lost), never in the
    rows being sent again over HTTP.

    Parameters
    ----------
    message : str
        What happened.
    down : bool, default True
        Whether the way itself failed (the next calls take HTTP for a while too), or only
        declined this call (a read beyond the peer port's limits, an answer cut short).
    """

    def __init__(self, message: str = "", *, down: bool = True) -> None:
        super().__init__(message)
        self.down = down


class AttemptError(Exception):
    """One attempt at a call failed below the client's error tree.

    Parameters
    ----------
    cause : Exception
        What the transport's library raised.
    dropped : bool
        Whether the connection broke (reset, or closed before the whole answer): an
        idempotent call is worth one more attempt, on a new connection.
    """

    def __init__(self, cause: Exception, *, dropped: bool) -> None:
        super().__init__(cause)
        self.cause = cause
        self.dropped = dropped

    def error(self, *, retried: bool) -> TransportError:
        """The `TransportError` to raise for this failure.

        Parameters
        ----------
        retried : bool
            Whether this was the call's second attempt.
        """
        raise NotImplementedError


class Transport(abc.ABC):
    """Carries a call with blocking I/O."""

    @abc.abstractmethod
    def handle_call(self, call: Call[T]) -> T:
        """Make one attempt at ``call``; return its result.

        Raises
        ------
        DataPlaneDownError, AttemptError
            As this module says; any `PayloadError` as the daemon answered it.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connections and whatever the daemon handed out on them."""


class AsyncTransport(abc.ABC):
    """Carries a call on the event loop: `Transport`, awaitable."""

    @abc.abstractmethod
    async def handle_async_call(self, call: Call[T]) -> T:
        """Awaitable `Transport.handle_call`."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Awaitable `Transport.close`."""


class _Run(Generic[E, T]):
    """A generator of effects being run: its next effect, given how the last one ended (the
    one loop of `drive`, `drive_async` and `nest`; slots: it runs every step of every call)."""

    __slots__ = ("_effects", "_failed", "_first", "effect", "result", "value")

    def __init__(self, effects: Generator[E, Any, T], first: Any = NOT_BEGUN) -> None:
        self._effects = effects
        self._failed = False
        self._first = first is not NOT_BEGUN  # its first effect, yielded already (`begun`)
        self.value: Any = None  # what the last effect gave (or raised): `next` sends it in
        self.effect: E = first
        self.result: T

    def next(self) -> bool:
        """Resume the generator: ``True`` with its next `effect`, ``False`` with its `result`."""
        if self._first:
            self._first = False
            return True
        try:
            if self._failed:
                self._failed = False
                self.effect = self._effects.throw(self.value)
            else:
                self.effect = self._effects.send(self.value)
        except StopIteration as stop:
            self.result = stop.value
            return False
        return True

    def failed(self, exc: Exception) -> None:
        """The effect raised ``exc``: `next` throws it into the generator."""
        self.value, self._failed = exc, True


def begun(effects: Generator[E, Any, T]) -> tuple[bool, Any]:
    """Start ``effects``: ``(True, its result)`` when it needed no effect (a call served at
    once: no loop to run), else ``(False, its first effect)`` for `drive`'s ``first``."""
    try:
        return False, effects.send(None)
    except StopIteration as done:
        return True, done.value


def drive(effects: Generator[E, Any, T], perform: Callable[[E], Any], first: Any = NOT_BEGUN) -> T:
    """Run ``effects`` to its result, performing each effect it yields.

    Parameters
    ----------
    effects : generator
        Yields effects; receives each one's result, or has its `Exception` thrown in.
    perform : callable
        Performs one effect (the I/O), returns its result.
    first : object, optional
        The effect ``effects`` yielded already (`begun`); `NOT_BEGUN`: not started.

    Returns
    -------
    object
        What ``effects`` returns.
    """
    run = _Run(effects, first)
    while run.next():
        try:
            run.value = perform(run.effect)
        except Exception as exc:
            run.failed(exc)
    return run.result


async def drive_async(
    effects: Generator[E, Any, T], perform: Callable[[E], Awaitable[Any]], first: Any = NOT_BEGUN
) -> T:
    """Awaitable `drive`: ``perform`` gives an awaitable."""
    run = _Run(effects, first)
    while run.next():
        try:
            run.value = await perform(run.effect)
        except Exception as exc:
            run.failed(exc)
    return run.result


def nest(
    effects: Generator[E, Any, T], expand: Callable[[E], Generator[F, Any, Any]]
) -> Generator[F, Any, T]:
    """``effects`` with each of its effects replaced by the effects of ``expand(effect)``.

    Parameters
    ----------
    effects : generator
        Yields effects; receives each one's result, or has its `Exception` thrown in.
    expand : callable
        The generator of one effect of ``effects``: what it returns is that effect's result,
        what it raises is thrown into ``effects``.

    Returns
    -------
    generator
        Yields the effects of the expansions; returns what ``effects`` returns.
    """
    run = _Run(effects)
    while run.next():
        try:
            run.value = yield from expand(run.effect)
        except Exception as exc:
            run.failed(exc)
    return run.result
