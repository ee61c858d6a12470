"""Calls: one exchange with the daemon, fully described, and how its answer is received.

The I/O-free client (`payload_client.clients._base.BaseClient`) builds a call; a transport
(`payload_client.transports`) carries it. Every call is an HTTP exchange (`Call`: its
request line, headers and body; its answer received into a `Call.new_sink`). Three kinds of
call can also go another way, and say so by their type, not by a hook per transport: an
`AppendCall` (its items and rows: the data plane places them in its leases), a `ReadCall`
(its plans and outputs: the data plane reads them through descriptors; its extents: the
peer port sends them) and a `FieldsCall` (the data plane's connection has the table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec

from .._errors import ProtocolError, error_from_wire
from ..reads._windows import ReadResult, WindowPlan
from ..segments._segment import PayloadSegment
from ..wire._http import AppendItem, ErrorBody, Extent, FieldsTable

__all__ = ["AppendCall", "Call", "FieldsCall", "ReadCall", "Target"]

T = TypeVar("T")
_error_json = msgspec.json.Decoder(ErrorBody)


@dataclass
class Call(Generic[T]):
    """One exchange, fully described: what to send and how to read the answer.

    Attributes
    ----------
    method, path : str
        Request line.
    headers : dict
        Extra request headers.
    body : callable, optional
        Builds the body (bytes-like chunks, sent in order without joining) when the call
        goes over HTTP; ``Content-Length`` is set from them.
    local : bool
        True when the answer is known without asking the daemon (``decode(b"")`` is it).
    expected : int or None
        Exact length of a successful answer's body when known in advance; the body is then
        received into one preallocated buffer.
    targets : callable, optional
        With ``expected``: gives the buffers the body is received into, in order, instead
        (``(bytes view, called once it is full or None)``; their sizes add up to
        ``expected``), e.g. the output arrays themselves.
    decode : callable
        Turns the successful answer's body into the result.
    idempotent : bool
        True when sending the call twice has the effect of sending it once (a read, stats,
        health): it is retried once, on a new connection, when its connection drops. Other
        calls (an append) are never re-sent by the client.
    timeout : float, optional
        Over HTTP, at most this many seconds for connecting, each read and write and
        waiting for a pooled connection, where the client's own limits are longer (a
        deadline of the caller's, as `PayloadClient.wait_ready` has); ``None``: the client's.
    """

    method: str
    path: str
    decode: Callable[[Any], T]
    headers: dict[str, str] = field(default_factory=dict)
    body: Callable[[], list[Any]] | None = None
    expected: int | None = None
    local: bool = False
    targets: Callable[[], list[Target]] | None = None
    idempotent: bool = False
    timeout: float | None = None

    def http_body(self) -> tuple[dict[str, str], list[Any]]:
        """The request headers and body chunks for HTTP (built only when HTTP is used)."""
        chunks = self.body() if self.body is not None else []
        headers = dict(self.headers)
        if chunks:
            headers["Content-Length"] = str(sum(memoryview(c).nbytes for c in chunks))
        return headers, chunks

    def new_sink(self) -> _Sink:
        """Return a buffer to receive the answer's body into."""
        return _Sink(self.expected, self.targets() if self.targets is not None else None)

    def raise_for_answer(self, status: int, body: bytes) -> None:
        """Raise the `PayloadError` a 4xx/5xx answer stands for."""
        if status < 400:
            return
        try:
            err = _error_json.decode(body)
            raise error_from_wire(status, err.error, err.message)
        except msgspec.DecodeError:
            text = body[:200].decode("utf-8", "replace")
            raise error_from_wire(status, None, text or f"HTTP {status}") from None


@dataclass
class AppendCall(Call[list[list[PayloadSegment]]]):
    """An append: over HTTP its framed body, on the data plane its ``items`` placed in the
    connection's leases (`payload_client.transports.dataplane._appends.append_steps`).

    Attributes
    ----------
    items : list of AppendItem
        Each block of rows: its run, step, field, position, row count, dtype and shape.
    bodies : list of memoryview
        Each block's rows in their wire form, ``bytes [rows * row size]``.
    """

    items: list[AppendItem] = field(default_factory=list)
    bodies: list[memoryview] = field(default_factory=list)


@dataclass
class ReadCall(Call[list[ReadResult]]):
    """A read of planned windows: over HTTP (and the peer port) the bytes of ``extents``
    received into ``targets``, on the data plane the ``plans`` read into ``outs`` through
    descriptors; the result is ``results`` (filled in place).

    Attributes
    ----------
    plans : list of WindowPlan or None
        Each window's plan (`payload_client.clients._plans.Planned`).
    outs : list of numpy.ndarray or None
        Each window's output.
    results : list
        Each window's result.
    extents : callable
        The extents whose bytes the answer is, in order, each with its file's end
        (`ReadRequest.extents`).
    """

    plans: list[WindowPlan | None] = field(default_factory=list)
    outs: list[Any] = field(default_factory=list)
    results: list[ReadResult] = field(default_factory=list)
    extents: Callable[[], list[Extent]] = list


@dataclass
class FieldsCall(Call[FieldsTable]):
    """The daemon's fields table: ``GET /v1/fields``, or the one the data plane's connection
    fetched."""


Target = tuple[memoryview, Callable[[], None] | None]
"""A buffer an answer's body is received into, and what to do once it is full."""


class _Sink:
    """Receives a body chunk by chunk: into one preallocated buffer when its size is known,
    or straight into the given targets."""

    def __init__(self, expected: int | None, targets: list[Target] | None = None):
        self.expected = expected
        self.at = 0
        self.parts: list[bytes] = []
        if targets is None:
            self.buf = bytearray(expected) if expected else None
            targets = [(memoryview(self.buf), None)] if self.buf is not None else []
        else:
            self.buf = None
        self.targets = [(view, done) for view, done in targets if view.nbytes or done]
        self.keep = expected is None
        self.i = 0  # current target
        self.t_at = 0  # bytes of it received
        self._advance()

    def _advance(self) -> None:  # pass and finish targets that are full
        while self.i < len(self.targets) and self.t_at == self.targets[self.i][0].nbytes:
            done = self.targets[self.i][1]
            if done is not None:
                done()
            self.i, self.t_at = self.i + 1, 0

    def write(self, chunk: bytes) -> None:
        n = len(chunk)
        if self.keep:
            self.parts.append(chunk)
            self.at += n
            return
        if self.at + n > (self.expected or 0):
            raise ProtocolError(f"answer longer than the {self.expected} bytes expected")
        data = memoryview(chunk)
        while data.nbytes:
            view = self.targets[self.i][0]
            k = min(view.nbytes - self.t_at, data.nbytes)
            view[self.t_at : self.t_at + k] = data[:k]
            self.t_at += k
            data = data[k:]
            self._advance()
        self.at += n

    def result(self) -> Any:
        if self.expected is not None:
            if self.at != self.expected:
                raise ProtocolError(f"answer has {self.at} bytes, expected {self.expected}")
            return self.buf if self.buf is not None else b""
        return b"".join(self.parts)
