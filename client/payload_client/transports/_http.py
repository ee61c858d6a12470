"""The HTTP transports (`HTTPTransport`, `AsyncHTTPTransport`): where the clients meet httpx.

Each makes one attempt at a `Call` over the daemon's Unix socket (or a TCP URL) and streams
the answer into the call's sink. An httpx error leaves as an `AttemptError` that knows
whether the connection dropped and whether the whole body was sent; the client retries an
idempotent call (a read, stats, health) once when its connection drops, and never re-sends
any other call (an append). httpx errors are translated once, by `translate`: the error of a
failed append says whether it was provably not stored (its body never fully left) or may
have been.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Generic, TypeVar

import httpx

from .._errors import (
    NO_DAEMON,
    AppendInDoubtError,
    ConnectError,
    ConnectionLostError,
    ProtocolError,
    TimeoutError,
    TransportError,
    nobody_listens,
)
from ._base import AsyncTransport, AttemptError, Transport
from ._call import Call
from ._timeout import Timeout

__all__ = [
    "AsyncHTTPTransport",
    "Body",
    "HTTPAttemptError",
    "HTTPTransport",
    "dropped",
    "translate",
]

T = TypeVar("T")
PoolT = TypeVar("PoolT", httpx.Client, httpx.AsyncClient)

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
        `ConnectError` (`NO_DAEMON`'s message when nothing listens at ``where``),
        `TimeoutError`, `ConnectionLostError`, `AppendInDoubtError`, `ProtocolError`, or
        `TransportError` itself for anything else.
    """
    in_doubt = not idempotent and sent
    fate = "" if idempotent else f"; {_NOT_STORED}"
    if isinstance(exc, httpx.ConnectError):
        if nobody_listens(exc):
            return ConnectError(
                NO_DAEMON.format(where=where) + ("" if idempotent else f" ({_NOT_STORED})")
            )
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


class HTTPAttemptError(AttemptError):
    """An httpx error of one attempt, with what `translate` needs to name it.

    Parameters
    ----------
    cause : httpx.HTTPError
        What httpx raised.
    where : str
        The daemon's socket or URL.
    idempotent : bool
        Whether the call may run twice with the same effect.
    sent : bool
        Whether the whole request body had been sent when it failed (see `Body`).
    """

    def __init__(self, cause: httpx.HTTPError, where: str, *, idempotent: bool, sent: bool):
        super().__init__(cause, dropped=dropped(cause))
        self.http_error = cause
        self.where = where
        self.idempotent = idempotent
        self.sent = sent

    def error(self, *, retried: bool) -> TransportError:
        """The translated error (`translate`)."""
        return translate(
            self.http_error, self.where, idempotent=self.idempotent, sent=self.sent, retried=retried
        )


def _peer_port(r: httpx.Response) -> int:
    """The peer port an answer names (`PEER_PORT_HEADER`), 0 when none."""
    value = r.headers.get("payloadd-peer-port", "")
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else 0


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The TLS context every HTTP pool of this process shares: httpx's default (certifi's CA
    bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``, read once: when the first client is
    made). httpx would make one a client, 18 ms and 0.8 MiB each (the bundle loaded again),
    though the daemon speaks plain HTTP (a ``https://`` base URL, through a proxy of yours,
    is verified with it): a cluster client of 1,024 nodes spent 19 s and 0.8 GiB on them."""
    return httpx.create_ssl_context()


def _limits(client: httpx.Client | httpx.AsyncClient, cap: float | None) -> Any:
    """The time limits of a request: the client's, none longer than ``cap`` seconds
    (`Call.timeout`); ``None``: the client's as they are."""
    if cap is None:
        return httpx.USE_CLIENT_DEFAULT
    own = client.timeout
    limits = [own.connect, own.read, own.write, own.pool]
    connect, read, write, pool = (cap if t is None else min(t, cap) for t in limits)
    return httpx.Timeout(connect=connect, read=read, write=write, pool=pool)


class _HTTP(Generic[PoolT]):
    """What both HTTP transports share: their httpx pool, and a call's request and answer
    (all but the I/O, which is blocking or awaited).

    Attributes
    ----------
    client : httpx.Client or httpx.AsyncClient
        The connection pool.
    peer_port : int
        The daemon's peer port, as its last answer named it (`PEER_PORT_HEADER`); 0: none.
    """

    _pool_type: Callable[..., PoolT]
    """`httpx.Client` or `httpx.AsyncClient`."""
    _socket_type: Callable[..., httpx.BaseTransport | httpx.AsyncBaseTransport]
    """`httpx.HTTPTransport` or `httpx.AsyncHTTPTransport`: the pool's way to a Unix socket."""

    def __init__(
        self,
        socket_path: str | None,
        base_url: str,
        headers: dict[str, str],
        timeout: Timeout,
        where: str,
    ) -> None:
        httpx_timeout, limits = timeout.for_httpx()
        transport = (
            self._socket_type(uds=socket_path, limits=limits, verify=tls_context())
            if socket_path
            else None
        )
        self.client: PoolT = self._pool_type(
            transport=transport, base_url=base_url, headers=headers, timeout=httpx_timeout,
            limits=limits, verify=tls_context(),
        )  # fmt: skip
        self.where = where
        self.peer_port = 0  # as the last answer named it

    def _request(self, call: Call[Any]) -> tuple[Body, dict[str, Any]]:
        """The body of ``call`` and the arguments of its ``stream`` (but the content)."""
        headers, chunks = call.http_body()
        limits = _limits(self.client, call.timeout)
        return Body(chunks), {"headers": headers, "timeout": limits}

    def _answered(self, r: httpx.Response) -> bool:
        """Note the peer port the answer names; whether it is a success (else an error)."""
        self.peer_port = _peer_port(r)
        return r.status_code < 400

    def _failed(self, exc: httpx.HTTPError, call: Call[Any], body: Body) -> HTTPAttemptError:
        return HTTPAttemptError(exc, self.where, idempotent=call.idempotent, sent=body.sent)


class HTTPTransport(_HTTP[httpx.Client], Transport):
    """Carries calls over HTTP with a blocking httpx client (a connection pool).

    Parameters
    ----------
    socket_path : str or None
        The daemon's Unix socket; ``None``: ``base_url`` over TCP.
    base_url : str
        ``http://host:port``, or the placeholder host of a socket.
    headers : dict
        Headers of every request (user agent, accept, authorisation).
    timeout : Timeout
        Time limits, and how long a pooled connection may idle.
    where : str
        The daemon's socket or URL, for error messages.
    """

    _pool_type = httpx.Client
    _socket_type = httpx.HTTPTransport

    def handle_call(self, call: Call[T]) -> T:
        """Send ``call`` once and decode its answer.

        Raises
        ------
        HTTPAttemptError
            httpx failed (cannot connect, timed out, connection dropped).
        PayloadError
            The daemon's error answer (4xx/5xx), or a malformed answer (`ProtocolError`).
        """
        body, request = self._request(call)
        try:
            with self.client.stream(call.method, call.path, content=body.sync(), **request) as r:
                if not self._answered(r):
                    call.raise_for_answer(r.status_code, r.read())
                sink = call.new_sink()
                for chunk in r.iter_raw():
                    sink.write(chunk)
        except httpx.HTTPError as exc:
            raise self._failed(exc, call, body) from exc
        return call.decode(sink.result())

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()


class AsyncHTTPTransport(_HTTP[httpx.AsyncClient], AsyncTransport):
    """Carries calls over HTTP with an async httpx client: `HTTPTransport`, awaitable.

    Parameters
    ----------
    socket_path, base_url, headers, timeout, where
        As `HTTPTransport`.
    """

    _pool_type = httpx.AsyncClient
    _socket_type = httpx.AsyncHTTPTransport

    async def handle_async_call(self, call: Call[T]) -> T:
        """Awaitable `HTTPTransport.handle_call`."""
        body, request = self._request(call)
        try:
            content = body.async_()
            async with self.client.stream(call.method, call.path, content=content, **request) as r:
                if not self._answered(r):
                    call.raise_for_answer(r.status_code, await r.aread())
                sink = call.new_sink()
                async for chunk in r.aiter_raw():
                    sink.write(chunk)
        except httpx.HTTPError as exc:
            raise self._failed(exc, call, body) from exc
        return call.decode(sink.result())

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()
