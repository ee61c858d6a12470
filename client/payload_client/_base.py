"""The I/O-free half of the clients: building requests and decoding answers.

`PayloadClient` and `AsyncPayloadClient` only move the bytes a `Call` describes; everything
that decides what to send and what an answer means lives here, once.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import httpx
import msgspec
import numpy as np

from ._dataplane import Steps, append_steps, read_steps
from ._errors import InvalidRequestError, PayloadError, ProtocolError, error_from_wire
from ._read import WindowPlan, coverage, direct_view, place, plan_window, prepare_output
from ._segment import (
    INT64_MAX,
    SUPPORTED_DTYPES,
    PayloadSegment,
    check_int,
    check_name,
)
from ._timeout import DEFAULT_TIMEOUT_S, Timeout
from ._wire import (
    APPEND_CONTENT_TYPE,
    DATA_SOCKET_SUFFIX,
    FRAME_PREFIX,
    MSGPACK_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
    ErrorBody,
    Extent,
    FieldsTable,
    GcReport,
    GcRequest,
    Health,
    ReadRequest,
    Stats,
    Usage,
)

__all__ = [
    "DEFAULT_SOCKET",
    "BaseClient",
    "Call",
    "CoveredRead",
    "ReadResult",
    "Window",
    "WindowLike",
]

DEFAULT_SOCKET = "/run/payloadd/payloadd.sock"
"""Socket path used when neither ``socket_path``, ``base_url`` nor ``PAYLOADD_SOCKET`` is given."""

T = TypeVar("T")
HTTP_CHUNK = 256 << 10
"""Row bytes go to the HTTP stack in memoryview slices of at most this many bytes."""

_encoder = msgspec.msgpack.Encoder()
_DTYPE_NAMES = {np.dtype(name).newbyteorder("<"): name for name in SUPPORTED_DTYPES}
_append_response = msgspec.msgpack.Decoder(AppendResponse)
_error_json = msgspec.json.Decoder(ErrorBody)


class Window(NamedTuple):
    """One window to read in `PayloadClient.read_many`.

    Attributes
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields.
    field : str
        Field to read.
    lo, hi : int
        Token positions ``[lo, hi)`` (end exclusive).
    fill : int or float
        Value of entries no row covers.
    out : numpy.ndarray, optional
        Array to read into (see `PayloadClient.read_field`).
    dtype : numpy dtype, optional
        Output dtype (see `PayloadClient.read_field`).
    coverage : bool, default False
        Also say which rows are real: the window's result is then a `CoveredRead`
        ``(array, covered)`` instead of the bare array.
    """

    segments: Sequence[PayloadSegment]
    field: str
    lo: int
    hi: int
    fill: int | float
    out: np.ndarray | None = None
    dtype: Any = None
    coverage: bool = False


WindowLike = Window | tuple[Sequence[PayloadSegment], str, int, int, int | float]
"""A `Window` or a plain ``(segments, field, lo, hi, fill)`` tuple."""


class CoveredRead(NamedTuple):
    """A window read with its coverage (``coverage=True``): unpacks as ``(array, covered)``.

    Attributes
    ----------
    array : numpy.ndarray or None
        What the read returns without coverage: ``[hi - lo, *row_shape]``, or ``None``
        when no segment has the field.
    covered : numpy.ndarray
        ``bool`` ``[hi - lo]``, a fresh array: ``covered[i]`` is ``True`` when some segment
        of the field has a row at token position ``lo + i`` (so ``array[i]`` holds real
        values, padded with fill only beyond that row's own shape), ``False`` when
        ``array[i]`` is all fill. All ``False`` when ``array`` is ``None`` or the window is
        empty; placeholders (segments of no rows) cover nothing.
    """

    array: np.ndarray | None
    covered: np.ndarray


ReadResult = np.ndarray | CoveredRead | None
"""One window's result in `PayloadClient.read_many`: a `CoveredRead` for windows asking
for coverage, else the array or ``None``."""


@dataclass
class Call(Generic[T]):
    """One HTTP exchange, fully described: what to send and how to read the answer.

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
    fast : callable, optional
        The same exchange on the data plane: ``fast(data_plane)`` gives the steps whose
        result is the call's result.
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
    """

    method: str
    path: str
    decode: Callable[[Any], T]
    headers: dict[str, str] = field(default_factory=dict)
    body: Callable[[], list[Any]] | None = None
    expected: int | None = None
    local: bool = False
    fast: Callable[[Any], Steps[T]] | None = None
    targets: Callable[[], list[Target]] | None = None
    idempotent: bool = False

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


def _rows_for_wire(rows: Any) -> np.ndarray:
    if not isinstance(rows, np.ndarray):
        raise InvalidRequestError(f"rows must be a numpy.ndarray, got {type(rows).__name__}")
    if isinstance(rows, np.ma.MaskedArray):  # its mask would be dropped, its masked values kept
        raise InvalidRequestError("rows must not be a masked array: fill it first (rows.filled(v))")
    if rows.ndim < 2:
        raise InvalidRequestError(
            f"rows must have shape [n, *row_shape] with a non-empty row shape, got {rows.shape}"
        )
    little = rows.dtype.newbyteorder("<")
    if little not in _DTYPE_NAMES:
        raise InvalidRequestError(
            f"rows dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {rows.dtype}"
        )
    if any(d == 0 for d in rows.shape[1:]):
        raise InvalidRequestError(f"rows row shape entries must be > 0, got {rows.shape[1:]}")
    return np.ascontiguousarray(rows, dtype=little)


def _then(steps: Steps[None], result: T) -> Steps[T]:
    yield from steps
    return result


class BaseClient:
    """Request building and answer decoding shared by the sync and async clients.

    Parameters
    ----------
    socket_path : str or os.PathLike, optional
        Unix socket of the daemon. Default: ``$PAYLOADD_SOCKET`` or `DEFAULT_SOCKET`.
    base_url : str, optional
        ``http://host:port`` of a daemon's TCP listener instead of a socket.
    token : str, optional
        Admin/TCP token, sent as ``Authorization: Bearer``.
    timeout : float, Timeout or httpx.Timeout, default 60.0
        Seconds for connect, read, write and pool waits, or a `Timeout` setting each (and
        how long a pooled connection may idle).
    data_plane : bool, default True
        Move row bytes through file descriptors the daemon passes over ``<socket>.data``
        when it serves one (same node); else, and always over TCP, over HTTP.

    Raises
    ------
    InvalidRequestError
        If both ``socket_path`` and ``base_url`` are given, or ``timeout`` is not valid.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float | Timeout | httpx.Timeout = DEFAULT_TIMEOUT_S,
        data_plane: bool = True,
    ) -> None:
        if socket_path is not None and base_url is not None:
            raise InvalidRequestError("give socket_path or base_url, not both")
        if base_url is None:
            socket_path = socket_path or os.environ.get("PAYLOADD_SOCKET") or DEFAULT_SOCKET
        self.socket_path = os.fspath(socket_path) if socket_path is not None else None
        self.base_url = base_url or "http://payloadd"
        self.timeout = Timeout.of(timeout)
        self.data_socket = (
            self.socket_path + DATA_SOCKET_SUFFIX if data_plane and self.socket_path else None
        )
        self.where = self.socket_path or self.base_url
        self.headers = {"User-Agent": "payload-client", "Accept": MSGPACK_CONTENT_TYPE}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    # -- data plane ---------------------------------------------------------------------

    _retry_data_plane_at = 0.0
    DATA_PLANE_RETRY_S = 5.0
    """After the data plane fails, HTTP carries the bytes for this many seconds."""

    def _data_plane_due(self) -> bool:
        return time.monotonic() >= self._retry_data_plane_at

    def _data_plane_failed(self) -> None:
        self._retry_data_plane_at = time.monotonic() + self.DATA_PLANE_RETRY_S

    # -- append -------------------------------------------------------------------------

    def _append_call(
        self, items: Sequence[tuple[str, np.ndarray, int]], run: str, step: int
    ) -> Call[list[list[PayloadSegment]]]:
        run = check_name(run, "run")
        step = check_int(step, "step")
        if isinstance(items, tuple) or not isinstance(items, Sequence) or not items:
            raise InvalidRequestError("items must be a non-empty list of (field, rows, pos)")
        headers: list[AppendItem] = []
        bodies: list[memoryview] = []
        for i, item in enumerate(items):
            try:
                fld, rows, pos = item
            except (TypeError, ValueError):
                raise InvalidRequestError(f"item {i} must be (field, rows, pos)") from None
            fld = check_name(fld, f"item {i} field")
            arr = _rows_for_wire(rows)
            pos = check_int(pos, f"item {i} pos")
            if pos + len(arr) > INT64_MAX:
                raise InvalidRequestError(f"item {i}: pos + rows overflows int64")
            name = _DTYPE_NAMES[arr.dtype]
            headers.append(AppendItem(fld, name, list(arr.shape[1:]), len(arr), pos, run, step))
            bodies.append(arr.data.cast("B") if arr.size else memoryview(b""))

        def body() -> list[Any]:
            header = _encoder.encode(AppendRequest(headers))
            chunks: list[Any] = [FRAME_PREFIX.pack(len(header)), header]
            # bounded chunks: the HTTP stack copies what a send leaves over, per chunk
            step = HTTP_CHUNK
            return chunks + [b[i : i + step] for b in bodies for i in range(0, b.nbytes, step)]

        return Call(
            "POST",
            "/v1/append",
            decode=lambda answer: self._decode_append(answer, len(headers)),
            headers={"Content-Type": APPEND_CONTENT_TYPE},
            body=body,
            fast=lambda dp: append_steps(headers, bodies, dp.leases),
        )

    @staticmethod
    def _decode_append(body: bytes, n_items: int) -> list[list[PayloadSegment]]:
        try:
            segments = _append_response.decode(body).segments
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"malformed append answer: {exc}") from exc
        if len(segments) != n_items:
            raise ProtocolError(f"append answer has {len(segments)} items, sent {n_items}")
        return segments

    # -- read ---------------------------------------------------------------------------

    def _read_call(self, windows: Sequence[WindowLike]) -> Call[list[ReadResult]]:
        if isinstance(windows, tuple) or not isinstance(windows, Sequence):
            raise InvalidRequestError("windows must be a list of Window")
        plans: list[WindowPlan | None] = []
        outs: list[np.ndarray | None] = []
        results: list[ReadResult] = []  # the outs, filled in place by the I/O below
        for i, w in enumerate(windows):
            try:
                segments, fld, lo, hi, fill, *rest = w
                w = Window(segments, fld, lo, hi, fill, *rest)
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"window {i} must be (segments, field, lo, hi, fill[, out, dtype, coverage])"
                ) from None
            try:
                dtype = w.out.dtype if w.dtype is None and w.out is not None else w.dtype
                plan = plan_window(w.segments, w.field, w.lo, w.hi, w.fill, dtype)
                plans.append(plan)
                arr = None if plan is None else prepare_output(plan, w.out)  # before I/O
                outs.append(arr)
                if w.coverage is False:
                    results.append(arr)
                elif isinstance(w.coverage, bool | np.bool_):
                    covered = coverage(plan, w.lo, w.hi) if w.coverage else None
                    results.append(arr if covered is None else CoveredRead(arr, covered))
                else:
                    raise InvalidRequestError(
                        f"coverage must be True or False, got {type(w.coverage).__name__}"
                    )
            except PayloadError as exc:
                if len(windows) > 1:  # name the window, keep the error's class and attributes
                    exc.args = (f"window {i}: {exc}",)
                raise
        pieces = [p for plan in plans if plan is not None for p in plan.pieces]
        total = sum(p.nbytes for p in pieces)

        def body() -> list[Any]:
            extents = [Extent(p.file, p.offset, p.nbytes, p.end) for p in pieces]
            return [_encoder.encode(ReadRequest(extents))]

        def targets() -> list[Target]:
            # each piece's bytes straight into its output rows when they are the stored
            # bytes, else into a buffer converted as soon as it is full (pieces stay in order:
            # later ones overwrite earlier ones)
            out: list[Target] = []
            for plan, arr in zip(plans, outs, strict=True):
                if plan is None or arr is None:
                    continue
                for p in plan.pieces:
                    view = direct_view(plan, arr, p, kernel=False)
                    if view is not None:
                        out.append((view, None))
                    else:
                        staged = memoryview(bytearray(p.nbytes))
                        out.append((staged, functools.partial(place, plan, arr, p, staged)))
            return out

        return Call(
            "POST",
            "/v1/read",
            decode=lambda _: results,
            headers={"Content-Type": MSGPACK_CONTENT_TYPE},
            body=body,
            targets=targets,
            expected=total,
            local=not pieces,
            fast=lambda dp: _then(read_steps(plans, outs, dp.cache, dp.scratch), results),
            idempotent=True,
        )

    # -- small calls --------------------------------------------------------------------

    @staticmethod
    def _json_call(path: str, typ: type[T], method: str = "GET", body: Any = None) -> Call[T]:
        decoder = msgspec.json.Decoder(typ)

        def decode(answer: bytes) -> T:
            try:
                return decoder.decode(answer)
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"malformed answer from {path}: {exc}") from exc

        headers = {"Accept": "application/json"}
        chunks = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            encoded = msgspec.json.encode(body)
            chunks = lambda: [encoded]  # noqa: E731
        # every one is idempotent: a repeated GC removes nothing more
        return Call(method, path, decode=decode, headers=headers, body=chunks, idempotent=True)

    def _gc_call(
        self,
        run: str | None,
        before_step: int | None,
        ttl_s: float | None,
        dry_run: bool,
        node: str | None = None,
    ) -> Call[GcReport]:
        if (run is None) != (before_step is None):
            raise InvalidRequestError("run and before_step go together: give both or neither")
        if run is not None:
            check_name(run, "run")
        if before_step is not None:
            before_step = check_int(before_step, "before_step")
        ttl = None
        if ttl_s is not None:
            with contextlib.suppress(OverflowError):  # an int too large for a float
                ttl = float(ttl_s) if isinstance(ttl_s, int | float) else None
            # inf would go out as JSON null: the daemon's default
            if isinstance(ttl_s, bool) or ttl is None or not 0 <= ttl < math.inf:
                raise InvalidRequestError(
                    f"ttl_s must be a finite number of seconds >= 0, got {ttl_s!r}"
                )
        if node is not None:
            check_name(node, "node")
        req = GcRequest(run, before_step, ttl, bool(dry_run), node)
        return self._json_call("/v1/admin/gc", GcReport, "POST", req)

    def _delete_run_call(self, run: str, dry_run: bool, node: str | None = None) -> Call[GcReport]:
        check_name(run, "run")
        query = "?dry_run=true" if dry_run else ""
        if node is None:
            return self._json_call(f"/v1/admin/runs/{run}{query}", GcReport, "DELETE")
        check_name(node, "node")  # a route of its own: an older daemon answers 404
        path = f"/v1/admin/nodes/{node}/runs/{run}{query}"
        return self._json_call(path, GcReport, "DELETE")

    def _fields_call(self) -> Call[FieldsTable]:
        return self._json_call("/v1/fields", FieldsTable)

    def _usage_call(self, max_steps: int | None, ledger: int | None) -> Call[Usage]:
        query = []
        if max_steps is not None:
            query.append(f"max_steps={check_int(max_steps, 'max_steps')}")
        if ledger is not None:
            query.append(f"ledger={check_int(ledger, 'ledger')}")
        path = "/v1/admin/usage" + ("?" + "&".join(query) if query else "")
        return self._json_call(path, Usage)

    def _stats_call(self) -> Call[Stats]:
        return self._json_call("/v1/stats", Stats)

    def _health_call(self) -> Call[Health]:
        return self._json_call("/healthz", Health)
