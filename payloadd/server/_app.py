"""The HTTP control plane: `create_app` builds the FastAPI app; routes stay thin.

Each route decodes a msgspec Struct, calls the `Store` (or the GC collector), and encodes the
answer. The store lives on the lifespan state (``request.state.store``), which `Daemon.serve`
yields: the daemon's start-up and shutdown, the data plane's included, are `Daemon`'s; there
are no module globals. Errors become answers in one handler, through `wire_error`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from payload_client import InvalidRequestError, PayloadError, RequestTimeoutError
from payload_client.protocol import (
    APPEND_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    AppendRequest,
    AppendResponse,
    ErrorBody,
    FieldsTable,
    GcReport,
    GcRequest,
    Health,
    Prefetched,
    ReadRequest,
    Stats,
    Usage,
)
from payloadd._version import __version__
from payloadd.server._access import ERROR_CLASS, AccessMiddleware
from payloadd.server._auth import TokenGuard, load_admin_token, remote_host
from payloadd.server._daemon import Daemon
from payloadd.server._dataplane_server import DataPlaneServer
from payloadd.server._errors import WireError, refusal, wire_error
from payloadd.server._http_io import (
    Buffered,
    content_length,
    media_type,
    read_append_header,
    read_body,
    read_response,
    stream_append,
)
from payloadd.server._metrics import Metrics
from payloadd.server._openapi import install_openapi, metrics_operation, operation
from payloadd.server._peer_server import PeerServer
from payloadd.settings._settings import Settings
from payloadd.store._appends import item_nbytes
from payloadd.store._budget import Descriptors
from payloadd.store._counts import HTTP
from payloadd.store._gc import GarbageCollector
from payloadd.store._store import Store
from payloadd.store._usage import DEFAULT_LEDGER, DEFAULT_MAX_STEPS, LIMIT, node_usage

__all__ = ["create_app"]

_msgpack = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()
_append_header = msgspec.msgpack.Decoder(AppendRequest)
_read_msgpack = msgspec.msgpack.Decoder(ReadRequest)
_read_json = msgspec.json.Decoder(ReadRequest)
_gc_msgpack = msgspec.msgpack.Decoder(GcRequest)
_gc_json = msgspec.json.Decoder(GcRequest)

_ERRORS: tuple[type[Exception], ...] = (
    PayloadError,
    RequestValidationError,
    HTTPException,
    ClientDisconnect,
    Exception,  # Starlette's error middleware: answered, then raised on (to uvicorn)
)
"""What the one error handler answers (`wire_error`)."""


def _answer(request: Request, obj: Any, status: int = 200) -> Response:
    """Encode ``obj`` as msgpack when the client accepts it, else as JSON."""
    if MSGPACK_CONTENT_TYPE in request.headers.get("accept", ""):
        return Response(_msgpack.encode(obj), status, media_type=MSGPACK_CONTENT_TYPE)
    return Response(_json.encode(obj), status, media_type="application/json")


def _decode(decoder: Callable[[bytes], Any], body: Any, what: str) -> Any:
    """``body`` decoded, or `InvalidRequestError` naming ``what``."""
    try:
        return decoder(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"bad {what}: {exc}") from None


def _install_error_handler(app: FastAPI, metrics: Metrics) -> None:
    """Answer every error of the app with its `ErrorBody` (`wire_error`), counting refusals;
    the access middleware counts the error class."""

    async def answer_error(request: Request, exc: Exception) -> Response:
        wire: WireError = wire_error(exc, f"{request.method} {request.url.path}")
        reason = refusal(exc)
        if reason is not None:
            metrics.refused_one(HTTP, reason)
        # the rest of a stalled body may still come; uvicorn drops the connection after an
        # unhandled error: say so, so that no client reuses it
        close = wire.unexpected or isinstance(exc, RequestTimeoutError)
        setattr(request.state, ERROR_CLASS, wire.error)  # counted by AccessMiddleware
        return Response(
            _json.encode(ErrorBody(wire.error, wire.message)),
            wire.status,
            headers={"Connection": "close"} if close else None,
            media_type="application/json",
        )

    for cls in _ERRORS:
        app.add_exception_handler(cls, answer_error)


def create_app(
    settings: Settings,
    data_listener: socket.socket | None = None,
    fds: Descriptors | None = None,
    peer_listener: socket.socket | None = None,
) -> FastAPI:
    """Build the daemon's ASGI app for ``settings``.

    Its lifespan is `Daemon.serve`: the `Store` over ``settings.root`` (and the flusher,
    the data plane, the GC sweeper) start when it starts and stop when it ends; the store
    is on the lifespan state.

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
    peer_listener : socket.socket, optional
        The peer port's listening socket, already bound (``peer_port``); bound at start-up
        when not given.

    Returns
    -------
    fastapi.FastAPI
        Routes ``GET /healthz``, ``GET /v1/stats``, ``GET /metrics``, ``GET /v1/fields``,
        ``POST /v1/append``, ``POST /v1/read``, ``POST /v1/admin/gc``,
        ``DELETE /v1/admin/runs/{run}``, ``DELETE /v1/admin/nodes/{node}/runs/{run}``,
        ``GET /v1/admin/usage`` and ``GET /openapi.json``; behind `TokenGuard` (the
        admin token, if configured, on ``/v1/admin``; on every call that does not come over a
        Unix socket), all inside `AccessMiddleware` (request ids, metrics, the access log).
        The metrics (`Metrics`) are in a registry of this app's own.

    Raises
    ------
    StartError
        The admin token settings are unusable (see `load_admin_token`).
    """
    token = load_admin_token(settings, warn=False)  # serve() warned already
    daemon = Daemon(settings, data_listener, fds, peer_listener)
    metrics, inflight = daemon.metrics, daemon.inflight
    timeout = settings.request_timeout_s

    app = FastAPI(
        title="payloadd",
        version=__version__,
        summary="Per-node daemon for per-token side data of LLM RL, passed by handle.",
        lifespan=daemon.lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.metrics = metrics  # for what counts outside the routes (the HTTP protocol)
    _install_error_handler(app, metrics)

    @app.get("/healthz", **operation(200, Health, "Liveness and readiness."))
    async def healthz(request: Request) -> Response:
        store: Store = request.state.store
        data_plane: DataPlaneServer | None = request.state.data_plane
        state = "off" if data_plane is None else data_plane.state()
        peer: PeerServer | None = request.state.peer
        peer_state = "off" if peer is None else peer.state()
        ok = state in ("off", "serving") and peer_state in ("off", "serving")
        port = 0 if peer is None or peer_state != "serving" else peer.port
        health = Health("ok" if ok else "degraded", store.node, __version__, state, port)
        return _answer(request, health)

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
        ctype = media_type(request)
        if ctype != APPEND_CONTENT_TYPE:
            raise InvalidRequestError(
                f"Content-Type must be {APPEND_CONTENT_TYPE}, got {ctype or 'none'}"
            )
        length = content_length(request, settings.max_request_bytes)
        chunks = request.stream().__aiter__()
        host = remote_host(request.scope)
        with Buffered(inflight, host) as buffered:  # the header, counted in flight until decoded
            frame, rows = await read_append_header(
                chunks, settings.max_control_bytes, buffered, timeout
            )
            header = _decode(_append_header.decode, frame.body(), "append header")
            items = header.items
            announced = frame.size + sum(item_nbytes(it, i)[1] for i, it in enumerate(items))
            if length != announced:  # checked before anything is reserved
                raise InvalidRequestError(
                    f"body is {length} bytes but its header announces {announced}"
                )
        store: Store = request.state.store
        nbytes = length - frame.size
        del frame
        segments = await stream_append(
            store, request.state.fds, items, nbytes, rows, chunks, timeout, host is not None
        )
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
        json = media_type(request) == "application/json"
        decoder = _read_json.decode if json else _read_msgpack.decode
        host = remote_host(request.scope)
        with Buffered(inflight, host) as buffered:  # the body, counted until decoded
            body = await read_body(
                request, settings.max_control_bytes, buffered, timeout, "read request"
            )
            req: ReadRequest = _decode(decoder, body, "read request")
            del body
        store: Store = request.state.store
        fds = request.state.fds
        return await read_response(store, fds, req.extents, timeout, host is not None)

    @app.post(
        "/v1/prefetch",
        **operation(
            200,
            Prefetched,
            "Read ahead byte extents (a hint): the daemon checks them as a read would, "
            "queues them and answers at once.",
            body=(MSGPACK_CONTENT_TYPE, ReadRequest),
            errors=(400, 404, 409, 410, 413, 422, 500, 503),
        ),
    )
    async def prefetch(request: Request) -> Response:
        json = media_type(request) == "application/json"
        decoder = _read_json.decode if json else _read_msgpack.decode
        with Buffered(inflight, remote_host(request.scope)) as buffered:
            body = await read_body(
                request, settings.max_control_bytes, buffered, timeout, "prefetch request"
            )
            req: ReadRequest = _decode(decoder, body, "prefetch request")
            del body
        store: Store = request.state.store
        files, nbytes = await run_in_threadpool(store.prefetcher.submit, req.extents)
        return _answer(request, Prefetched(files, nbytes))

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
            with Buffered(inflight, remote_host(request.scope)) as buffered:
                body = await read_body(
                    request, settings.max_control_bytes, buffered, timeout, "gc request"
                )
        if not body:
            req = GcRequest()
        elif media_type(request) == MSGPACK_CONTENT_TYPE:
            req = _decode(_gc_msgpack.decode, body, "gc request")
        else:
            req = _decode(_gc_json.decode, body, "gc request")
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
        run: Annotated[str | None, Query(pattern=r"^[A-Za-z0-9._-]{1,128}$")] = None,
    ) -> Response:
        store: Store = request.state.store
        answer = await run_in_threadpool(
            node_usage, store, max_steps=max_steps, ledger=ledger, run=run
        )
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
    app.build_middleware_stack = lambda: AccessMiddleware(  # type: ignore[method-assign]
        build(), metrics, app.routes, settings.access_log
    )
    return app
