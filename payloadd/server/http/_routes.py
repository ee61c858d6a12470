"""The HTTP control plane's routes, on one `router`; each stays thin.

A route decodes its request (a msgspec Struct), calls the `Store` (or the GC collector) and
encodes the answer (`answer`); what it raises is answered by the app's one error handler
(`install_error_handler`). Routes: ``GET /healthz``, ``GET /v1/stats``, ``GET /metrics``,
``GET /v1/fields``, ``POST /v1/append``, ``POST /v1/read``, ``POST /v1/prefetch``,
``POST /v1/admin/gc``, ``DELETE /v1/admin/runs/{run}``, ``GET /v1/admin/usage`` and
``DELETE /v1/admin/nodes/{node}/runs/{run}``.

What a route reaches is on two states, never in a module global: the daemon's own parts
(settings, metrics, the bytes in flight) on the app's (``request.app.state.daemon``, set by
`create_app`), and what the daemon's lifespan started (the store, the GC collector, the
descriptor shares, the data plane, the peer port) on the lifespan state (``request.state``,
yielded by `Daemon.serve`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from payload_client import InvalidRequestError
from payload_client.protocol import (
    APPEND_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
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
from payloadd.server._daemon import Daemon
from payloadd.server.framed._dataplane_server import DataPlaneServer
from payloadd.server.framed._peer_server import PeerServer
from payloadd.server.http._answers import answer, decode
from payloadd.server.http._auth import remote_host
from payloadd.server.http._io import (
    Buffered,
    content_length,
    media_type,
    read_append_header,
    read_body,
    read_response,
    stream_append,
)
from payloadd.server.http._openapi import metrics_operation, operation
from payloadd.store._appends import item_nbytes
from payloadd.store._gc import GarbageCollector
from payloadd.store._store import Store
from payloadd.store._usage import DEFAULT_LEDGER, DEFAULT_MAX_STEPS, LIMIT, node_usage

__all__ = ["router"]

router = APIRouter()
"""Every route of the app (`create_app` includes it)."""

_append_header = msgspec.msgpack.Decoder(AppendRequest)
_read_msgpack = msgspec.msgpack.Decoder(ReadRequest)
_read_json = msgspec.json.Decoder(ReadRequest)
_gc_msgpack = msgspec.msgpack.Decoder(GcRequest)
_gc_json = msgspec.json.Decoder(GcRequest)


def _daemon(request: Request) -> Daemon:
    """The daemon the app serves (``app.state.daemon``)."""
    daemon: Daemon = request.app.state.daemon
    return daemon


@router.get("/healthz", **operation(200, Health, "Liveness and readiness."))
async def healthz(request: Request) -> Response:
    store: Store = request.state.store
    data_plane: DataPlaneServer | None = request.state.data_plane
    state = "off" if data_plane is None else data_plane.state()
    peer: PeerServer | None = request.state.peer
    peer_state = "off" if peer is None else peer.state()
    ok = state in ("off", "serving") and peer_state in ("off", "serving")
    port = 0 if peer is None or peer_state != "serving" else peer.port
    health = Health("ok" if ok else "degraded", store.node, __version__, state, port)
    return answer(request, health)


@router.get("/v1/stats", **operation(200, Stats, "Counters since start."))
async def stats(request: Request) -> Response:
    return answer(request, request.state.store.stats())


@router.get("/metrics", **metrics_operation("Prometheus metrics (text exposition format)."))
async def prometheus(request: Request) -> Response:
    # statvfs of the root among them: a round trip on a network file system
    body = await run_in_threadpool(_daemon(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get(
    "/v1/fields",
    **operation(200, FieldsTable, "The fields table: what dtypes and widths each takes."),
)
async def fields(request: Request) -> Response:
    return answer(request, request.state.store.fields)


@router.post(
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
    daemon = _daemon(request)
    limits, timeout = daemon.settings, daemon.settings.request_timeout_s
    length = _append_length(request, limits.max_request_bytes)
    chunks = request.stream().__aiter__()
    host = remote_host(request.scope)
    with Buffered(daemon.inflight, host) as buffered:  # the header, counted until decoded
        frame, rows = await read_append_header(chunks, limits.max_control_bytes, buffered, timeout)
        items = decode(_append_header.decode, frame.body(), "append header").items
        _check_announced(length, frame.size, items)  # before anything is reserved
    nbytes = length - frame.size
    del frame
    segments = await stream_append(
        request.state.store, request.state.fds, items, nbytes, rows, chunks, timeout,
        host is not None,
    )  # fmt: skip
    return answer(request, AppendResponse(segments))


def _append_length(request: Request, limit: int) -> int:
    """The ``Content-Length`` of an append body (`content_length`), which must be of
    ``APPEND_CONTENT_TYPE``."""
    ctype = media_type(request)
    if ctype != APPEND_CONTENT_TYPE:
        raise InvalidRequestError(
            f"Content-Type must be {APPEND_CONTENT_TYPE}, got {ctype or 'none'}"
        )
    return content_length(request, limit)


def _check_announced(length: int, header: int, items: list[AppendItem]) -> None:
    """An append body is as long as its header (``header`` bytes) and the rows it announces."""
    announced = header + sum(item_nbytes(it, i)[1] for i, it in enumerate(items))
    if length != announced:
        raise InvalidRequestError(f"body is {length} bytes but its header announces {announced}")


@router.post(
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
    req = await _read_request(request, "read request")
    timeout = _daemon(request).settings.request_timeout_s
    remote = remote_host(request.scope) is not None
    store: Store = request.state.store
    return await read_response(store, request.state.fds, req.extents, timeout, remote)


@router.post(
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
    req = await _read_request(request, "prefetch request")
    store: Store = request.state.store
    files, nbytes = await run_in_threadpool(store.prefetcher.submit, req.extents)
    return answer(request, Prefetched(files, nbytes))


async def _read_request(request: Request, what: str) -> ReadRequest:
    """The body of a read or a prefetch (msgpack, or JSON), counted in flight until decoded."""
    daemon = _daemon(request)
    json = media_type(request) == "application/json"
    decoder = _read_json.decode if json else _read_msgpack.decode
    with Buffered(daemon.inflight, remote_host(request.scope)) as buffered:
        body = await read_body(
            request, daemon.settings.max_control_bytes, buffered,
            daemon.settings.request_timeout_s, what,
        )  # fmt: skip
        req: ReadRequest = decode(decoder, body, what)
        del body
    return req


@router.post(
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
    req = await _gc_request(request)
    collector: GarbageCollector = request.state.collector
    return answer(request, await _collect(request, collector.collect, req))


async def _gc_request(request: Request) -> GcRequest:
    """The body of a GC call (msgpack, or JSON); none: the default `GcRequest`."""
    body = b""
    if "content-length" in request.headers or "transfer-encoding" in request.headers:
        daemon = _daemon(request)
        with Buffered(daemon.inflight, remote_host(request.scope)) as buffered:
            body = await read_body(
                request, daemon.settings.max_control_bytes, buffered,
                daemon.settings.request_timeout_s, "gc request",
            )  # fmt: skip
    if not body:
        return GcRequest()
    msgpack = media_type(request) == MSGPACK_CONTENT_TYPE
    req: GcRequest = decode(_gc_msgpack.decode if msgpack else _gc_json.decode, body, "gc request")
    return req


@router.delete(
    "/v1/admin/runs/{run}",
    **operation(200, GcReport, "Remove every step of a run.", errors=(400, 500)),
)
async def delete_run(request: Request, run: str, dry_run: bool = False) -> Response:
    collector: GarbageCollector = request.state.collector
    report = await _collect(request, collector.delete_run, run, dry_run=dry_run)
    return answer(request, report)


async def _collect(
    request: Request, fn: Callable[..., GcReport], *args: Any, **kw: Any
) -> GcReport:
    """Run a GC call in the thread pool and count it (``trigger="call"``)."""
    metrics = _daemon(request).metrics
    try:
        report = await run_in_threadpool(fn, *args, **kw)
    except InvalidRequestError:
        raise  # nothing ran
    except Exception:
        metrics.gc_failed("call")
        raise
    metrics.collected(report, "call")
    return report


@router.get(
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
    report = await run_in_threadpool(node_usage, store, max_steps=max_steps, ledger=ledger, run=run)
    return answer(request, report)


@router.delete(
    "/v1/admin/nodes/{node}/runs/{run}",
    **operation(
        200,
        GcReport,
        "Remove every step of a run of another node's prefix (a shared payload root).",
        errors=(400, 500),
    ),
)
async def delete_node_run(request: Request, node: str, run: str, dry_run: bool = False) -> Response:
    collector: GarbageCollector = request.state.collector
    report = await _collect(request, collector.delete_run, run, dry_run=dry_run, node=node)
    return answer(request, report)
