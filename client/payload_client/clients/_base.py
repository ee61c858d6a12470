"""The I/O-free half of the clients: building calls, choosing their transport, deciding retries.

`PayloadClient` and `AsyncPayloadClient` only move the bytes a `Call` describes, through
the transport `BaseClient._route` names; everything that decides what to send, which way
it goes, whether it goes again and what an answer means lives here, once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

import httpx
import msgspec
import numpy as np

from .._errors import InvalidRequestError, PayloadError, ProtocolError
from ..reads._layout import ReadLayout
from ..reads._windows import ReadResult, WindowLike, WindowPlan, plan_window
from ..segments._segment import (
    INT64_MAX,
    PayloadSegment,
    check_int,
    check_name,
)
from ..transports import (
    AppendCall,
    AttemptError,
    Call,
    DataPlaneDownError,
    FieldsCall,
    ReadCall,
    Target,
)
from ..transports._timeout import DEFAULT_TIMEOUT_S, Timeout
from ..wire._dataplane import DATA_SOCKET_SUFFIX
from ..wire._frames import FRAME_PREFIX
from ..wire._http import (
    APPEND_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
    Extent,
    FieldsTable,
    GcReport,
    GcRequest,
    Health,
    Prefetched,
    ReadRequest,
    Stats,
    Usage,
)
from ..wire._rows import name_once, rows_for_wire
from ._plans import Planned, window_of
from ._shells import Send

__all__ = ["DEFAULT_SOCKET", "BaseClient", "fields_table_steps", "read_planned_steps"]

log = logging.getLogger("payload_client")

DEFAULT_SOCKET = "/run/payloadd/payloadd.sock"
"""Socket path used when neither ``socket_path``, ``base_url`` nor ``PAYLOADD_SOCKET`` is given."""

T = TypeVar("T")
Items = Sequence[tuple[str, np.ndarray, int]]
"""The items of an append: ``(field, rows, pos)``."""
Segments = list[list[PayloadSegment]]
"""The segments of each item of an append."""
HTTPT = TypeVar("HTTPT")
"""The client's HTTP transport (`HTTPTransport` or `AsyncHTTPTransport`)."""
DataPlaneT = TypeVar("DataPlaneT")
"""The client's data plane transport (`SyncDataPlane` or `AsyncDataPlane`)."""
PeerT = TypeVar("PeerT")
"""The client's peer port transport (`SyncPeerTransport` or `AsyncPeerTransport`)."""

PEER_RETRY_S = 30.0
"""After its peer port failed, a daemon's reads go over HTTP for this many seconds."""
HTTP_CHUNK = 256 << 10
"""Row bytes go to the HTTP stack in memoryview slices of at most this many bytes."""

_encoder = msgspec.msgpack.Encoder()
_append_response = msgspec.msgpack.Decoder(AppendResponse)


class BaseClient(Generic[HTTPT, DataPlaneT, PeerT]):
    """What the sync and async clients share: their constructor, call building, the choice
    of transport and of retries, answer decoding. It does no I/O.

    The parameters, errors and retry rules are those of `PayloadClient` (see there).
    A subclass names its transports' classes (`_http_type`, `_data_plane_type`,
    `_peer_type`: none does I/O before its first call) and runs the effects of `_route`
    (`payload_client.clients._shells`).
    """

    _http_type: Callable[[str | None, str, dict[str, str], Timeout, str], HTTPT]
    """The HTTP transport of a socket or URL: ``(socket_path, base_url, headers, timeout,
    where)``."""
    _data_plane_type: Callable[[str, float | None, float | None], DataPlaneT]
    """The data plane of a data socket: ``(path, read timeout, connect timeout)``."""
    _peer_type: Callable[[str, int, str, Timeout, str], PeerT]
    """The peer port transport of a daemon: ``(host, port, token, timeout, where)``."""

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
        if self.socket_path is not None and self.socket_path.endswith(DATA_SOCKET_SUFFIX):
            raise InvalidRequestError(
                f"{self.socket_path} is the data-plane socket; give the daemon's socket "
                f"{self.socket_path[: -len(DATA_SOCKET_SUFFIX)]} (the client finds the data "
                "plane beside it)"
            )
        self.base_url = base_url or "http://payloadd"
        self.timeout = Timeout.of(timeout)
        self.data_socket = (
            self.socket_path + DATA_SOCKET_SUFFIX if data_plane and self.socket_path else None
        )
        self.where = self.socket_path or self.base_url
        self.headers = {"User-Agent": "payload-client", "Accept": MSGPACK_CONTENT_TYPE}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._data_plane: DataPlaneT | None = None
        if self.data_socket:
            self._data_plane = self._data_plane_type(
                self.data_socket, self.timeout.read, self.timeout.connect
            )
        self._http: HTTPT = self._http_type(
            self.socket_path, self.base_url, self.headers, self.timeout, self.where
        )
        # over TCP with a token, reads take the daemon's peer port once an answer names it
        self._token = token if data_plane and base_url is not None and token else None
        self._peer: PeerT | None = None
        self._peer_lock = threading.Lock()
        self._closed = False  # set by close(): every call after it is refused
        self._table: FieldsTable | None = None  # the daemon's fields table, once fetched

    # -- route and retries --------------------------------------------------------------

    _retry_data_plane_at = 0.0
    DATA_PLANE_RETRY_S = 5.0
    """After the data plane fails, HTTP carries the bytes for this many seconds."""

    def _data_plane_due(self) -> bool:
        return time.monotonic() >= self._retry_data_plane_at

    def _data_plane_failed(self, seconds: float | None = None) -> None:
        self._retry_data_plane_at = time.monotonic() + (seconds or self.DATA_PLANE_RETRY_S)

    def _route(self, call: Call[T]) -> Generator[Send, Any, T]:
        """The transports ``call`` takes, attempt by attempt, as effects for `drive`.

        Yields `Send` ``(transport, call)``; receives the call's result through the transport, or
        has the attempt's exception thrown in. A call answered locally yields nothing. An
        append, a read or the fields table (`AppendCall`, `ReadCall`, `FieldsCall`) goes to
        the data plane when this client has one and it is due; a read of a client over TCP with a token goes to the daemon's peer port once an
        HTTP answer of the daemon named it (`PEER_PORT_HEADER`). If that way is down
        (`DataPlaneDownError`: nothing reached a file), HTTP carries the call, and the next
        ones for `DATA_PLANE_RETRY_S` (the peer port: `PEER_RETRY_S`); a read the peer
        port only declined (beyond its limits, an answer cut short) goes over HTTP alone. Over HTTP, an idempotent call whose connection drops
        is made once more (a new connection: httpx never reuses one that failed); any other
        failure (`AttemptError`) is raised as the `TransportError` it stands for. Every
        other error is the call's, raised as it is.
        """
        if self._closed:
            raise InvalidRequestError(
                f"this client of {self.where} is closed: make a new one (closing it is for good)"
            )
        if call.local:
            return call.decode(b"")
        fast: Any = None
        if isinstance(call, AppendCall | ReadCall | FieldsCall):
            fast = self._data_plane_first()
        if fast is None and isinstance(call, ReadCall) and self._token:
            fast = self._peer_for(call)
        if fast is not None:
            try:
                result: T = yield Send(fast, call)
                return result
            except DataPlaneDownError as exc:  # raised only before any row reached a file
                if fast is not self._peer:
                    self._data_plane_failed()
                elif exc.down:  # the port refused, dropped or hung: HTTP for a while
                    if self._forget_peer():  # said once, by the call that dropped it
                        log.warning("%s; its reads go over HTTP for %.0f s", exc, PEER_RETRY_S)
                    self._data_plane_failed(PEER_RETRY_S)
        for attempt in (1, 2):
            try:
                result = yield Send(self._http, call)
                return result
            except AttemptError as exc:
                if attempt == 1 and call.idempotent and exc.dropped:
                    continue
                raise exc.error(retried=attempt > 1) from exc.cause
        raise AssertionError("unreachable")

    def _peer_for(self, call: Call[Any]) -> Any:
        """The peer port transport for a read, once an HTTP answer of the daemon named its
        port, while it is due and takes the call; else ``None`` (HTTP)."""
        if not self._data_plane_due():
            return None
        if self._peer is None:
            port: int = getattr(self._http, "peer_port", 0)
            if not port:
                return None
            with self._peer_lock:  # threads sharing this client make one
                if self._peer is None:
                    host = httpx.URL(self.base_url).host
                    token = self._token or ""
                    self._peer = self._peer_type(host, port, token, self.timeout, self.where)
        peer: Any = self._peer
        return peer if peer is not None and peer.takes(call) else None

    def _forget_peer(self) -> bool:
        """Drop the peer port transport (its idle connections are closed); whether there
        was one (threads whose calls failed together drop it once)."""
        with self._peer_lock:
            peer: Any = self._peer
            self._peer = None
        if peer is not None:
            peer.close_idle()
        return peer is not None

    # -- append -------------------------------------------------------------------------

    def _data_plane_first(self) -> DataPlaneT | None:
        """The data plane, when a call that can take it goes there first now (`_route`)."""
        if self._data_plane is not None and self._data_plane_due() and not self._closed:
            return self._data_plane
        return None

    def _append_items(
        self, items: Sequence[tuple[str, np.ndarray, int]], run: str, step: int
    ) -> tuple[list[AppendItem], list[memoryview]]:
        """The items of an append, checked, and their rows as little-endian bytes.

        Raises
        ------
        InvalidRequestError
            Bad items, field, run, step, position or rows.
        """
        run = name_once(run, "run")
        step = check_int(step, "step")
        listed = type(items) is list or (
            not isinstance(items, tuple) and isinstance(items, Sequence)
        )
        if not listed or not items:
            raise InvalidRequestError("items must be a non-empty list of (field, rows, pos)")
        headers: list[AppendItem] = []
        bodies: list[memoryview] = []
        for i, item in enumerate(items):
            try:
                fld, rows, pos = item
            except (TypeError, ValueError):
                raise InvalidRequestError(f"item {i} must be (field, rows, pos)") from None
            fld = name_once(fld, f"item {i} field")
            arr, name = rows_for_wire(rows, fld)
            pos = check_int(pos, f"item {i} pos")
            n = len(arr)
            if pos + n > INT64_MAX:
                raise InvalidRequestError(f"item {i}: pos + rows overflows int64")
            headers.append(AppendItem(fld, name, list(arr.shape[1:]), n, pos, run, step))
            bodies.append(arr.data.cast("B") if arr.size else memoryview(b""))
        return headers, bodies

    def _append_call_of(self, headers: list[AppendItem], bodies: list[memoryview]) -> AppendCall:
        """The call of an append of `_append_items`."""

        def body() -> list[Any]:
            header = _encoder.encode(AppendRequest(headers))
            chunks: list[Any] = [FRAME_PREFIX.pack(len(header)), header]
            # bounded chunks: the HTTP stack copies what a send leaves over, per chunk
            step = HTTP_CHUNK
            return chunks + [b[i : i + step] for b in bodies for i in range(0, b.nbytes, step)]

        return AppendCall(
            "POST",
            "/v1/append",
            decode=lambda answer: self._decode_append(answer, len(headers)),
            headers={"Content-Type": APPEND_CONTENT_TYPE},
            body=body,
            items=headers,
            bodies=bodies,
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

    def _prefetch_call(self, windows: Sequence[WindowLike]) -> Call[Prefetched]:
        if isinstance(windows, tuple) or not isinstance(windows, Sequence):
            raise InvalidRequestError("windows must be a list of Window")
        plans: list[WindowPlan | None] = []
        for i, w in enumerate(windows):
            w = window_of(i, w)
            try:
                plans.append(plan_window(w.segments, w.field, w.lo, w.hi, w.fill, w.dtype))
            except PayloadError as exc:
                if len(windows) > 1:
                    exc.args = (f"window {i}: {exc}",)
                raise
        extents = [
            Extent(p.file, p.offset, p.nbytes, plan.ends[p.file])
            for plan in plans
            if plan is not None
            for p in plan.pieces
        ]
        if not extents:
            return Call("POST", "/v1/prefetch", decode=lambda _: Prefetched(0, 0), local=True)
        return self._json_call("/v1/prefetch", Prefetched, "POST", ReadRequest(extents))

    def _read_call_of(self, planned: Planned) -> ReadCall:
        plans, outs, results = planned.plans, planned.outs, planned.results
        box: list[ReadLayout] = []

        def layout() -> ReadLayout:  # over HTTP: the answer carries the pieces' bytes only
            if not box:
                box.append(ReadLayout(plans, outs, kernel=False, gap=0))
            return box[0]

        def body() -> list[Any]:
            return [_encoder.encode(ReadRequest(_extents(layout())))]

        def targets() -> list[Target]:
            # each piece's bytes straight into its output rows when they are the stored
            # bytes, else into the layout's stage, laid out when the answer is in
            return [(view, None) for bufs in layout().buffers for view in bufs]

        def decode(_: bytes) -> list[ReadResult]:
            layout().finish()
            return results

        return ReadCall(
            "POST",
            "/v1/read",
            decode=decode,
            headers={"Content-Type": MSGPACK_CONTENT_TYPE},
            body=body,
            targets=targets,
            expected=planned.nbytes,
            local=not planned.files,
            idempotent=True,
            plans=plans,
            outs=outs,
            results=results,
            extents=lambda: _extents(layout()),
        )

    # -- small calls --------------------------------------------------------------------

    @staticmethod
    def _json_call(
        path: str,
        typ: type[T],
        method: str = "GET",
        body: Any = None,
        kind: Callable[..., Call[T]] = Call,
    ) -> Call[T]:
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
        return kind(method, path, decode=decode, headers=headers, body=chunks, idempotent=True)

    def _gc_call(
        self,
        run: str | None,
        through_step: int | None,
        ttl_s: float | None,
        dry_run: bool,
        node: str | None = None,
        before_step: int | None = None,
    ) -> Call[GcReport]:
        if before_step is not None:
            raise InvalidRequestError(
                f"gc(before_step=...) is now gc(through_step=...): the watermark includes its "
                f"step (through_step={before_step!r} removes the steps <= {before_step!r})"
            )
        if (run is None) != (through_step is None):
            raise InvalidRequestError("run and through_step go together: give both or neither")
        if run is not None:
            check_name(run, "run")
        if through_step is not None:
            through_step = check_int(through_step, "through_step")
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
        req = GcRequest(run, through_step, ttl, bool(dry_run), node)
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
        """The daemon's fields table: on the data plane, as its connection fetched it."""
        return self._json_call("/v1/fields", FieldsTable, kind=FieldsCall)

    def _usage_call(
        self, max_steps: int | None, ledger: int | None, run: str | None = None
    ) -> Call[Usage]:
        query = []
        if run is not None:
            query.append(f"run={check_name(run, 'run')}")
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


def _extents(layout: ReadLayout) -> list[Extent]:
    """The extents of a read as the daemon takes them: each with its file's largest segment
    end, and a byte-less one for a file no piece reads (its rows all overwritten by later
    segments), which must still be there and long enough."""
    ends = layout.ends
    out = [Extent(f, o, n, ends[f]) for f, o, n in layout.extents]
    read = {f for f, _, _ in layout.extents}
    out += [Extent(f, 0, 0, e) for f, e in ends.items() if f not in read]
    return out


def fields_table_steps(client: BaseClient[Any, Any, Any]) -> Generator[Send, Any, FieldsTable]:
    """The daemon's fields table, fetched by ``client``'s first read (``GET /v1/fields``,
    or its data plane's) and kept: for the reads of the clients and of the cluster clients.

    Raises
    ------
    TransportError, UnauthorizedError, BusyError
        As `PayloadClient.fields`.
    """
    if client._table is None:
        client._table = yield from client._route(client._fields_call())
    return client._table


def read_planned_steps(
    client: BaseClient[Any, Any, Any], planned: Planned
) -> Generator[Send, Any, list[ReadResult]]:
    """A read planned by `plan_reads` (or a node's part of one: the cluster clients), made
    by ``client``: at once from its data plane's cached descriptors when it can
    (``read_now``), else as a call; returns the planned results, filled in place.
    """
    dp = client._data_plane_first() if planned.files else None
    if dp is not None and dp.read_now(planned.plans, planned.outs):
        return planned.results
    return (yield from client._route(client._read_call_of(planned)))
