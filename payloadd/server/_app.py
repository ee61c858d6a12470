"""The HTTP control plane: `create_app` builds the FastAPI app; routes stay thin.

Each route decodes a msgspec Struct, calls the `Store`, and encodes the answer. The store
lives on the lifespan state (``request.state.store``); there are no module globals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Send

from payload_client import (
    InvalidRequestError,
    PayloadError,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from payload_client.protocol import (
    APPEND_CONTENT_TYPE,
    DATA_SOCKET_SUFFIX,
    FRAME_PREFIX,
    MSGPACK_CONTENT_TYPE,
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
    status_of,
)
from payloadd import __version__
from payloadd.server._auth import TokenGuard, load_admin_token
from payloadd.server._dataplane_server import DataPlaneServer
from payloadd.server._metrics import HTTP, Metrics, StoreMetrics
from payloadd.server._observe import ERROR_CLASS, Observe
from payloadd.server._openapi import install_openapi, metrics_operation, operation
from payloadd.settings._settings import Settings
from payloadd.store._appends import item_nbytes
from payloadd.store._budget import Descriptors, InFlight
from payloadd.store._durability import Flusher
from payloadd.store._gc import GarbageCollector
from payloadd.store._readers import ExtentReader
from payloadd.store._store import Store
from payloadd.store._usage import DEFAULT_LEDGER, DEFAULT_MAX_STEPS, LIMIT, node_usage

__all__ = ["create_app"]

log = logging.getLogger("payloadd")

THREAD_BYTES = 1 << 20
"""Reads of more bytes than this run in the thread pool, so the event loop keeps serving."""
THREAD_PARTS = 64
"""So do reads of more extents and appends of more items than this."""
READ_CHUNK = 1 << 20
"""Bytes of a large read the daemon reads (in the thread pool) and sends at a time."""
SMALL_APPEND = 4 << 20
"""Rows of an append up to this size (4 MiB) go to the shared files, written as they arrive;
larger ones to files of the append's own, so that a reservation a client may keep waiting
long is never inside a shared file (given up, its files go; a small one given up leaves at
most this many unreferenced bytes, which count until its step is collected)."""


async def _chunks(
    reader: ExtentReader, extents: list[Extent], metrics: Metrics
) -> AsyncIterator[memoryview]:
    """The read's bytes, a chunk at a time, each read in the thread pool. The read counts in
    ``metrics`` once its last chunk is handed over."""
    chunks = reader.chunks(READ_CHUNK)
    while (chunk := await run_in_threadpool(next, chunks, None)) is not None:
        yield memoryview(chunk)
    metrics.read(extents)


class _ReadStream(StreamingResponse):
    """A large read's answer, streamed chunk by chunk from ``reader``, whose client must take
    each chunk within ``timeout`` seconds: one that stops reading is cut off (its connection
    closed). However it ends, even unstarted, the reader is closed and ``release`` called
    once (its per-request descriptors)."""

    def __init__(
        self,
        reader: ExtentReader,
        extents: list[Extent],
        metrics: Metrics,
        release: Callable[[], None],
        timeout: float,
    ) -> None:
        super().__init__(
            _chunks(reader, extents, metrics),
            media_type="application/octet-stream",
            headers={"Content-Length": str(reader.total)},
        )
        self.timeout = timeout
        self._done = weakref.finalize(self, _finish, reader, release)

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            async with asyncio.timeout(self.timeout):  # no task a chunk, as wait_for makes
                await send(message)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.warning("a client took no byte of a read answer for %g s (request_timeout_s); "
                        "its connection is closed", self.timeout)  # fmt: skip
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._done()


def _finish(reader: ExtentReader, release: Callable[[], None]) -> None:
    reader.close()
    release()


async def _next(
    chunks: AsyncIterator[bytes], timeout: float, what: str, deadline: float | None = None
) -> bytes | None:
    """The next chunk of a request body, ``None`` at its end.

    Raises
    ------
    RequestTimeoutError
        No byte of it came for ``timeout`` seconds, or (with ``deadline``, a time of the
        event loop's clock) it did not come whole by then.
    """
    at = asyncio.get_running_loop().time() + timeout
    if deadline is not None:
        at = min(at, deadline)
    try:
        async with asyncio.timeout_at(at):  # no task a chunk, as wait_for makes
            return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise RequestTimeoutError(
            f"{what} stalled: not received within {timeout:g} s (request_timeout_s); dropped"
        ) from None


async def _body(request: Request, length: int, timeout: float, what: str) -> bytes:
    """The whole body (``length`` bytes, as announced), within ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    chunks = request.stream().__aiter__()
    parts = bytearray()
    while (chunk := await _next(chunks, timeout, what, deadline)) is not None:
        parts += chunk
    if len(parts) != length:
        raise InvalidRequestError(f"{what} is {len(parts)} bytes, not the {length} announced")
    return bytes(parts)


class _Buffered:
    """Bytes of a request held in memory, counted against ``max_inflight_bytes`` (`InFlight`)
    until `release`."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight, self.nbytes = inflight, 0

    def add(self, n: int) -> None:
        """Count ``n`` more bytes, or raise `BusyError` (nothing more counted)."""
        self.inflight.try_acquire(n)
        self.nbytes += n

    def release(self) -> None:
        """Stop counting them (again: nothing)."""
        self.inflight.release(self.nbytes)
        self.nbytes = 0


_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()
_append_header = msgspec.msgpack.Decoder(AppendRequest)
_read_msgpack = msgspec.msgpack.Decoder(ReadRequest)
_read_json = msgspec.json.Decoder(ReadRequest)
_gc_msgpack = msgspec.msgpack.Decoder(GcRequest)
_gc_json = msgspec.json.Decoder(GcRequest)


async def _sweep_every(collector: GarbageCollector, seconds: float, metrics: Metrics) -> None:
    """The background GC: the age rule, orphans and empty directories, every ``seconds``
    (the first at once); a failed sweep is logged and the next one still runs."""
    while True:
        try:
            report = await run_in_threadpool(collector.sweep)
            await run_in_threadpool(collector.store.reads.drop_removed)
            metrics.collected(report, "sweep")
            if report.files or report.dirs:
                log.info("gc sweep: %d files, %d bytes, %d directories removed",
                         report.files, report.bytes, report.dirs)  # fmt: skip
        except Exception:
            metrics.gc_failed("sweep")
            log.exception("gc sweep failed")
        await asyncio.sleep(seconds)


def _answer(request: Request, obj: Any, status: int = 200) -> Response:
    """Encode ``obj`` as msgpack when the client accepts it, else as JSON."""
    if MSGPACK_CONTENT_TYPE in request.headers.get("accept", ""):
        return Response(_msgpack.encode(obj), status, media_type=MSGPACK_CONTENT_TYPE)
    return Response(_json.encode(obj), status, media_type="application/json")


def _error(
    request: Request, status: int, name: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    setattr(request.state, ERROR_CLASS, name)  # counted by the Observe middleware
    body = _json.encode(ErrorBody(name, message))
    return Response(body, status, headers=headers, media_type="application/json")


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _content_length(request: Request, limit: int) -> int:
    raw = request.headers.get("content-length")
    if raw is None or not raw.isdigit():
        raise InvalidRequestError("Content-Length is required")
    n = int(raw)
    if n > limit:
        raise PayloadTooLargeError(f"body of {n} bytes is above the limit of {limit}")
    return n


def create_app(
    settings: Settings,
    data_listener: socket.socket | None = None,
    fds: Descriptors | None = None,
) -> FastAPI:
    """Build the daemon's ASGI app for ``settings``.

    The `Store` over ``settings.root`` is created when the app's lifespan starts and put on
    the lifespan state.

    Parameters
    ----------
    settings : Settings
        Root, node, rotation size, limits, disk limits and durability policy (under
        ``fsync="interval"`` a `Flusher` runs for the lifespan and flushes once more at its
        end).
    data_listener : socket.socket, optional
        The data plane's listening socket, already bound to ``<socket>.data`` (so that
        `serve` reports a busy path before starting); bound at start-up when not given.
    fds : Descriptors, optional
        The daemon's shares of ``RLIMIT_NOFILE`` (`serve` computes them once its sockets
        are bound); computed at start-up when not given.

    Returns
    -------
    fastapi.FastAPI
        Routes ``GET /healthz``, ``GET /v1/stats``, ``GET /metrics``, ``GET /v1/fields``,
        ``POST /v1/append``, ``POST /v1/read``, ``POST /v1/admin/gc``,
        ``DELETE /v1/admin/runs/{run}``, ``DELETE /v1/admin/nodes/{node}/runs/{run}``,
        ``GET /v1/admin/usage`` and ``GET /openapi.json``; behind `TokenGuard` (the
        admin token, if configured, on ``/v1/admin``; on every call that does not come over a
        Unix socket), all inside `Observe` (request ids, metrics, the access log). The
        metrics (`Metrics`) are in a registry of this app's own.

    Raises
    ------
    StartError
        The admin token settings are unusable (see `load_admin_token`).
    """
    token = load_admin_token(settings, warn=False)  # serve() warned already
    metrics = Metrics(settings.fields, settings.node, __version__)

    inflight = InFlight(settings.max_inflight_bytes)
    timeout = settings.request_timeout_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        shares = fds or Descriptors.of_process(
            max_connections=settings.max_connections,
            max_data_connections=settings.max_data_connections if settings.data_plane else 0,
        )
        log.info("file descriptors: %s", shares.describe())
        store = Store(
            settings.root,
            settings.node,
            max_file_bytes=settings.max_file_bytes,
            fsync=settings.fsync,
            max_read_bytes=settings.max_request_bytes,
            max_append_bytes=settings.max_request_bytes,
            max_append_items=settings.max_append_items,
            max_root_bytes=settings.max_root_bytes,
            min_free_bytes=settings.min_free_bytes,
            fields=settings.fields_table(),
            foreign_reads=settings.foreign_reads,
            append_files=shares.shares.append_files,
            read_cache=shares.shares.read_cache,
        )
        log.info("payloadd %s: root %s, node %s", __version__, store.root, store.node)
        flusher = None
        if settings.fsync == "interval":
            flusher = Flusher(store.flush, settings.fsync_interval_s)
            flusher.start()
        data_plane = None
        if settings.data_plane:
            path = f"{settings.socket}{DATA_SOCKET_SUFFIX}"
            data_plane = DataPlaneServer(
                store,
                path,
                settings.socket_mode,
                settings.lease_bytes,
                metrics=metrics,
                fds=shares,
                inflight=inflight,
                max_frame=settings.max_control_bytes,
                request_timeout=timeout,
                reservation_timeout=settings.reservation_timeout_s,
            )
            data_plane.start(data_listener)
        gauges = StoreMetrics(
            store, data_plane.connections if data_plane else None, shares, inflight
        )
        metrics.registry.register(gauges)
        collector = GarbageCollector(store, settings.ttl_s)
        sweeper = asyncio.create_task(_sweep_every(collector, settings.gc_interval_s, metrics))
        try:
            yield {
                "store": store,
                "settings": settings,
                "collector": collector,
                "fds": shares,
                "data_plane": data_plane,
            }
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            metrics.registry.unregister(gauges)
            if data_plane is not None:
                data_plane.stop()
            if flusher is not None:
                flusher.stop()  # a last flush: leased files included
            store.close()

    app = FastAPI(
        title="payloadd",
        version=__version__,
        summary="Per-node daemon for per-token side data of LLM RL, passed by handle.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.metrics = metrics  # for what counts outside the routes (the HTTP protocol)

    @app.exception_handler(PayloadError)
    async def payload_error(request: Request, exc: PayloadError) -> Response:
        status = status_of(exc)
        if status >= 500 and status != 503:  # a full disk or an I/O error: the operator must see it
            log.error("%s %s: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        headers = None
        if isinstance(exc, RequestTimeoutError):  # the rest of its body may still come
            log.warning("%s %s: %s", request.method, request.url.path, exc)
            metrics.refused_one(HTTP, "stalled")
            headers = {"Connection": "close"}
        elif status == 503:
            reason = "inflight" if "max_inflight_bytes" in str(exc) else "descriptors"
            metrics.refused_one(HTTP, reason)
        return _error(request, status, type(exc).__name__, str(exc), headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        where = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
        )  # e.g. "query.dry_run: Input should be a valid boolean"
        return _error(request, 400, "InvalidRequestError", where)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return _error(request, exc.status_code, "HTTPError", str(exc.detail))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, exc: ClientDisconnect) -> Response:
        log.info(
            "client left during %s %s; nothing was acknowledged", request.method, request.url.path
        )
        return _error(request, 400, "InvalidRequestError", "client disconnected")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        # uvicorn drops the connection after an unhandled error: say so, so no client reuses it
        message = f"internal error: {type(exc).__name__}"
        return _error(request, 500, "ServerError", message, headers={"Connection": "close"})

    @app.get("/healthz", **operation(200, Health, "Liveness and readiness."))
    async def healthz(request: Request) -> Response:
        store: Store = request.state.store
        dp: DataPlaneServer | None = request.state.data_plane
        state = "off" if dp is None else dp.state()
        status = "ok" if state in ("off", "serving") else "degraded"
        return _answer(request, Health(status, store.node, __version__, state))

    @app.get("/v1/stats", **operation(200, Stats, "Counters since start."))
    async def stats(request: Request) -> Response:
        return _answer(request, request.state.store.stats())

    @app.get("/metrics", **metrics_operation("Prometheus metrics (text exposition format)."))
    async def prometheus(request: Request) -> Response:
        # statvfs of the root among them: a round trip on a network file system
        body = await run_in_threadpool(metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get(
        "/v1/fields",
        **operation(200, FieldsTable, "The fields table: what dtypes and widths each takes."),
    )
    async def fields(request: Request) -> Response:
        return _answer(request, request.state.store.fields)

    @app.post(
        "/v1/append",
        **operation(
            200,
            AppendResponse,
            "Append rows; answers with their segments.",
            body=(APPEND_CONTENT_TYPE, None),
            errors=(400, 413, 500, 507),
        ),
    )
    async def append(request: Request) -> Response:
        store: Store = request.state.store
        ctype = _media_type(request)
        if ctype != APPEND_CONTENT_TYPE:
            raise InvalidRequestError(
                f"Content-Type must be {APPEND_CONTENT_TYPE}, got {ctype or 'none'}"
            )
        length = _content_length(request, settings.max_request_bytes)
        chunks = request.stream().__aiter__()
        head = bytearray()
        need = FRAME_PREFIX.size
        deadline = asyncio.get_running_loop().time() + timeout  # for the header
        buffered = _Buffered(inflight)  # the header, counted in flight until decoded
        try:
            while len(head) < need:
                chunk = await _next(chunks, timeout, "append header", deadline)
                if chunk is None:
                    if len(head) < need:
                        raise InvalidRequestError("append body ends inside its header")
                    break
                head += chunk
                if len(head) >= FRAME_PREFIX.size and need == FRAME_PREFIX.size:
                    (hlen,) = FRAME_PREFIX.unpack_from(head)
                    if hlen > settings.max_control_bytes:
                        raise PayloadTooLargeError(
                            f"append header of {hlen} bytes is above the limit of "
                            f"{settings.max_control_bytes}"
                        )
                    need += hlen
                    buffered.add(need)
            try:
                header = _append_header.decode(memoryview(head)[FRAME_PREFIX.size : need])
            except msgspec.DecodeError as exc:
                raise InvalidRequestError(f"bad append header: {exc}") from None
            items = header.items
            announced = need + sum(item_nbytes(it, i)[1] for i, it in enumerate(items))
            if length != announced:  # checked before anything is reserved
                raise InvalidRequestError(
                    f"body is {length} bytes but its header announces {announced}"
                )
            buffered.release()
            private = length - need > SMALL_APPEND  # its reservation may wait long on the client
            files = store.files_needed(items)
            with request.state.fds.held(files, f"an append of {len(items)} items"):
                if len(items) > THREAD_PARTS:
                    pending = await run_in_threadpool(store.begin_append, items, private)
                else:
                    pending = store.begin_append(items, private=private)
                try:
                    pending.write(memoryview(head)[need:])
                    del head
                    while (chunk := await _next(chunks, timeout, "append body")) is not None:
                        pending.write(chunk)
                    segments = pending.commit()
                finally:
                    pending.close()
        finally:
            buffered.release()
        return _answer(request, AppendResponse(segments))

    @app.post(
        "/v1/read",
        **operation(
            200,
            None,
            "Read byte extents; answers with their bytes concatenated in order.",
            body=(MSGPACK_CONTENT_TYPE, ReadRequest),
            errors=(400, 404, 409, 410, 413, 422, 500),
        ),
    )
    async def read(request: Request) -> Response:
        store: Store = request.state.store
        fds: Descriptors = request.state.fds
        length = _content_length(request, settings.max_control_bytes)
        buffered = _Buffered(inflight)
        try:
            buffered.add(length)
            body = await _body(request, length, timeout, "read request")
            try:
                if _media_type(request) == "application/json":
                    req = _read_json.decode(body)
                else:
                    req = _read_msgpack.decode(body)
            except msgspec.DecodeError as exc:
                raise InvalidRequestError(f"bad read request: {exc}") from None
            del body
        finally:
            buffered.release()
        extents = req.extents
        files = len({e.file for e in extents})
        big = len(extents) > THREAD_PARTS or sum(e.nbytes for e in extents) > THREAD_BYTES
        if not big:
            with fds.held(files, f"a read of {files} files"):
                data = store.read_extents(extents)
            metrics.read(extents)
            return Response(memoryview(data), media_type="application/octet-stream")
        # checked and opened first (errors are still answers), then streamed chunk by chunk:
        # the daemon holds READ_CHUNK bytes of it at a time, and sending starts at once
        fds.take(files, f"a read of {files} files")
        try:
            reader = await run_in_threadpool(store.open_extents, extents)
        except BaseException:
            fds.give(files)
            raise
        return _ReadStream(reader, extents, metrics, functools.partial(fds.give, files), timeout)

    @app.post(
        "/v1/admin/gc",
        **operation(
            200,
            GcReport,
            "Garbage-collect: a run's steps up to a watermark, old steps, orphans.",
            body=(MSGPACK_CONTENT_TYPE, GcRequest),
            errors=(400, 413, 500),
        ),
    )
    async def gc(request: Request) -> Response:
        body = b""
        if "content-length" in request.headers or "transfer-encoding" in request.headers:
            length = _content_length(request, settings.max_control_bytes)
            buffered = _Buffered(inflight)
            try:
                buffered.add(length)
                body = await _body(request, length, timeout, "gc request")
            finally:
                buffered.release()
        try:
            if not body:
                req = GcRequest()
            elif _media_type(request) == MSGPACK_CONTENT_TYPE:
                req = _gc_msgpack.decode(body)
            else:
                req = _gc_json.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"bad gc request: {exc}") from None
        collector: GarbageCollector = request.state.collector
        return _answer(request, await _collect(collector.collect, req))

    @app.delete(
        "/v1/admin/runs/{run}",
        **operation(200, GcReport, "Remove every step of a run.", errors=(400, 500)),
    )
    async def delete_run(request: Request, run: str, dry_run: bool = False) -> Response:
        collector: GarbageCollector = request.state.collector
        report = await _collect(collector.delete_run, run, dry_run=dry_run)
        return _answer(request, report)

    async def _collect(fn: Callable[..., GcReport], *args: Any, **kw: Any) -> GcReport:
        """Run a GC call in the thread pool and count it (``trigger="call"``)."""
        try:
            report = await run_in_threadpool(fn, *args, **kw)
        except InvalidRequestError:
            raise  # nothing ran
        except Exception:
            metrics.gc_failed("call")
            raise
        metrics.collected(report, "call")
        return report

    @app.get(
        "/v1/admin/usage",
        **operation(
            200,
            Usage,
            "This node's files, bytes and ages per run and step; disk limits; recent GC.",
            errors=(400, 500),
        ),
    )
    async def usage(
        request: Request,
        max_steps: Annotated[int, Query(ge=0, le=LIMIT)] = DEFAULT_MAX_STEPS,
        ledger: Annotated[int, Query(ge=0, le=LIMIT)] = DEFAULT_LEDGER,
    ) -> Response:
        store: Store = request.state.store
        answer = await run_in_threadpool(node_usage, store, max_steps=max_steps, ledger=ledger)
        return _answer(request, answer)

    @app.delete(
        "/v1/admin/nodes/{node}/runs/{run}",
        **operation(
            200,
            GcReport,
            "Remove every step of a run of another node's prefix (a shared payload root).",
            errors=(400, 500),
        ),
    )
    async def delete_node_run(
        request: Request, node: str, run: str, dry_run: bool = False
    ) -> Response:
        collector: GarbageCollector = request.state.collector
        report = await _collect(collector.delete_run, run, dry_run=dry_run, node=node)
        return _answer(request, report)

    install_openapi(app)
    app.add_middleware(TokenGuard, token=token)
    # outermost, around Starlette's error middleware too: it sees every answer
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: Observe(  # type: ignore[method-assign]
        build(), metrics, app.routes, settings.access_log
    )
    return app
