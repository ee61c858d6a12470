"""How the clients run their operations: here and now (`Blocking`), or awaited (`Awaiting`).

An operation of a client (`append`, `read_field`, `close`, ...) is written once, as a generator
of effects (`Effects`) that decides everything and does no I/O: it yields what to do, a
`Send` of a call through a transport (`BaseClient._route` yields these), a `TellCounters` to
the data plane, a `Close` of a transport, or a number of seconds to sleep, and receives each
one's result or has its error thrown in. A blocking client runs it with `drive` and `perform`,
an async one with `drive_async` and `perform_async`: the only code that differs between them.

`op` makes the two methods of an operation, one for each kind of client (`blocking`,
`awaitable`), and `Dual` gives a client the one of its kind: mypy sees
``PayloadClient.append`` return the segments, ``AsyncPayloadClient.append`` an awaitable of
them. An overloaded operation is made as ``Dual(blocking(op), awaitable(op))``: mypy keeps the
overloads of a function passed alone to a decorator.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import MethodType, TracebackType
from typing import Any, Concatenate, Generic, NamedTuple, ParamSpec, Self, TypeVar, overload

from ..transports import Call
from ..transports._base import NOT_BEGUN, begun, drive, drive_async

__all__ = [
    "Awaiting",
    "Blocking",
    "Close",
    "Dual",
    "Effect",
    "Effects",
    "Send",
    "TellCounters",
    "awaitable",
    "bind_operations",
    "blocking",
    "op",
    "perform",
    "perform_async",
]

T = TypeVar("T")
P = ParamSpec("P")
SyncT = TypeVar("SyncT", bound=Callable[..., Any])
AsyncT = TypeVar("AsyncT", bound=Callable[..., Any])


class Send(NamedTuple):
    """Make one attempt at ``call`` through ``transport`` (a `Transport` or an
    `AsyncTransport`); its result is the call's."""

    transport: Any
    call: Call[Any]


class TellCounters(NamedTuple):
    """Tell the daemon the counters of ``data_plane``; with ``ack``, wait for its answer."""

    data_plane: Any
    ack: bool = False


class Close(NamedTuple):
    """Close ``transport`` (its connections, and what the daemon handed out on them)."""

    transport: Any


Effect = Send | TellCounters | Close | float
"""What an operation asks its client to do; a float: sleep that many seconds."""
Effects = Generator[Any, Any, T]
"""An operation: yields `Effect` (the cluster clients' also their own), returns its result."""


def perform(effect: Effect) -> Any:
    """Perform one effect with blocking I/O; return its result."""
    if isinstance(effect, Send):
        return effect.transport.handle_call(effect.call)
    if isinstance(effect, TellCounters):
        return effect.data_plane.tell_counters(ack=effect.ack)
    if isinstance(effect, Close):
        return effect.transport.close()
    time.sleep(effect)
    return None


async def perform_async(effect: Effect) -> Any:
    """Awaitable `perform`, on the event loop."""
    if isinstance(effect, Send):
        return await effect.transport.handle_async_call(effect.call)
    if isinstance(effect, TellCounters):
        return await effect.data_plane.tell_counters(ack=effect.ack)
    if isinstance(effect, Close):
        return await effect.transport.aclose()
    await asyncio.sleep(effect)
    return None


class Blocking:
    """A client that runs its operations here and now; a context manager.

    A client class lists its operations' class before this one (its ``close`` is theirs);
    each `Dual` it inherits becomes its blocking method (`bind_operations`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bind_operations(cls, awaited=False)

    _perform: Callable[[Any], Any] = staticmethod(perform)
    """Performs one effect of an operation (a cluster client's, its own too)."""

    def _run(self, effects: Effects[T], first: Any = NOT_BEGUN) -> T:
        return drive(effects, self._perform, first)

    def close(self) -> None:
        """Close the client."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Awaiting:
    """A client that runs its operations on the event loop: `Blocking`, awaitable; async with."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        bind_operations(cls, awaited=True)

    _perform: Callable[[Any], Awaitable[Any]] = staticmethod(perform_async)
    """Awaitable `Blocking._perform`."""

    async def _run(self, effects: Effects[T], first: Any = NOT_BEGUN) -> T:
        return await drive_async(effects, self._perform, first)

    async def close(self) -> None:
        """Close the client."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def bind_operations(cls: type, *, awaited: bool) -> None:
    """Give the client class ``cls`` the method of its kind of each `Dual` it has, as a plain
    function: what `Dual.__get__` would give, without its work at every call."""
    names = {
        name for klass in cls.__mro__ for name, v in vars(klass).items() if isinstance(v, Dual)
    }
    for name in names:
        found = next(vars(klass)[name] for klass in cls.__mro__ if name in vars(klass))
        if isinstance(found, Dual):  # not overridden by a plain method
            setattr(cls, name, found.async_ if awaited else found.sync)


def _as_method(method: Callable[..., Any], operation: Callable[..., Any]) -> None:
    """Give ``method`` the signature and annotations of ``operation``, returning what its
    effects return (`inspect.signature`, `typing.get_type_hints` read them)."""
    sig = inspect.signature(operation)
    returns = sig.return_annotation  # a string: annotations are postponed
    if isinstance(returns, str) and returns.startswith("Effects["):
        sig = sig.replace(return_annotation=returns[len("Effects[") : -1])
    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__annotations__ = {**operation.__annotations__, "return": sig.return_annotation}


def blocking(operation: Callable[Concatenate[Any, P], Effects[T]]) -> Callable[P, T]:
    """The blocking method of ``operation``: its effects run here and now (`Blocking`); the
    operation's docstring. Typed as the method once bound (`Dual` binds it)."""

    @functools.wraps(operation)
    def method(self: Blocking, /, *args: Any, **kwargs: Any) -> Any:
        effects = operation(self, *args, **kwargs)
        done, value = begun(effects)  # served at once (cached reads, leased appends): no loop
        return value if done else self._run(effects, value)

    _as_method(method, operation)
    return method  # type: ignore[return-value]  # typed as once bound


def awaitable(
    operation: Callable[Concatenate[Any, P], Effects[T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """The async method of ``operation``: its effects run on the event loop (`Awaiting`);
    docstring ``Awaitable `PayloadClient.<name>`.``."""

    @functools.wraps(operation)
    async def method(self: Awaiting, /, *args: Any, **kwargs: Any) -> Any:
        effects = operation(self, *args, **kwargs)
        done, value = begun(effects)
        return value if done else await self._run(effects, value)

    _as_method(method, operation)
    method.__doc__ = f"Awaitable `PayloadClient.{operation.__name__.lstrip('_')}`."
    return method  # type: ignore[return-value]  # typed as once bound


class Dual(Generic[SyncT, AsyncT]):
    """One operation as a method of both kinds of client (a descriptor): ``sync`` on a
    `Blocking` one, ``async_`` on an `Awaiting` one.

    Parameters
    ----------
    sync, async_ : callable
        The two methods (`blocking`, `awaitable`), each typed as once bound.

    Notes
    -----
    mypy reports ``Argument 1 to "Dual" has incompatible type overloaded function; expected
    overloaded function`` for ``Dual(blocking(op), awaitable(op))`` of an overloaded ``op``
    although it infers the right type (its methods keep every overload): a false error of
    an overloaded function mapped by a decorator and passed straight on, ignored where made.
    """

    def __init__(self, sync: SyncT, async_: AsyncT) -> None:
        self.sync = sync
        self.async_ = async_

    def __set_name__(self, owner: type, name: str) -> None:
        for method in (self.sync, self.async_):
            method.__name__ = name
            method.__qualname__ = f"{owner.__qualname__}.{name}"

    def documented(self, sync: str | None = None, async_: str | None = None) -> Self:
        """These methods, with other docstrings (``None``: as they are)."""
        self.sync.__doc__ = sync or self.sync.__doc__
        self.async_.__doc__ = async_ or self.async_.__doc__
        return self

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...

    @overload
    def __get__(self, obj: Blocking, owner: type) -> SyncT: ...

    @overload
    def __get__(self, obj: Awaiting, owner: type) -> AsyncT: ...

    def __get__(self, obj: object, owner: type) -> Any:
        method = self.async_ if issubclass(owner, Awaiting) else self.sync
        return method if obj is None else MethodType(method, obj)


def op(
    operation: Callable[Concatenate[Any, P], Effects[T]],
) -> Dual[Callable[P, T], Callable[P, Coroutine[Any, Any, T]]]:
    """Decorator: the methods of an operation that is not overloaded (`Dual`)."""
    return Dual(blocking(operation), awaitable(operation))
