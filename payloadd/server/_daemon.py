"""The daemon's lifetime beside the HTTP routes: `Daemon`, in uvicorn's steps.

`Daemon.load` builds what the routes and the data plane use (the descriptor shares, the
`Store`, the GC collector); `Daemon.start` starts what runs in the background (the flusher,
the data-plane server, the store's gauges, the GC sweeper); `Daemon.serve` is the lifetime
itself, load and start, then the serving, then `Daemon.shutdown`, which stops all of it in
the reverse order. The HTTP app's lifespan is `Daemon.serve` (`create_app`), so the data
plane lives exactly as long as the HTTP routes, but belongs to neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.concurrency import run_in_threadpool

from payload_client.protocol import DATA_SOCKET_SUFFIX
from payloadd._version import __version__
from payloadd.server._metrics import Metrics, StoreMetrics
from payloadd.server._sockets import StartError, bind_tcp_socket, check_peer_host
from payloadd.server._tokens import load_admin_token
from payloadd.server.framed._dataplane_server import DataPlaneServer
from payloadd.server.framed._peer_server import PeerServer
from payloadd.settings._settings import Settings
from payloadd.store._budget import Descriptors, InFlight
from payloadd.store._durability import Flusher
from payloadd.store._fs_kind import RootPolicy, detect
from payloadd.store._gc import GarbageCollector
from payloadd.store._store import Store

__all__ = ["Daemon", "descriptor_shares"]

log = logging.getLogger("payloadd")


def descriptor_shares(s: Settings) -> Descriptors:
    """The shares of this process's ``RLIMIT_NOFILE`` for what ``s`` serves."""
    return Descriptors.of_process(
        max_connections=s.max_connections,
        max_data_connections=s.max_data_connections if s.data_plane else 0,
        max_peer_connections=s.max_peer_connections if s.peer_port is not None else 0,
        max_tcp_connections=s.max_tcp_connections if s.tcp_port is not None else 0,
    )


class Daemon:
    """The store and what runs beside the routes, from `load` to `shutdown`.

    Parameters
    ----------
    settings : Settings
        Root, node, limits, durability policy, data plane and GC settings.
    data_listener : socket.socket, optional
        The data plane's listening socket, already bound to ``<socket>.data``; bound at
        `start` when not given.
    fds : Descriptors, optional
        The daemon's shares of ``RLIMIT_NOFILE``; computed at `load` when not given.
    peer_listener : socket.socket, optional
        The peer port's listening socket, already bound (``peer_port``); bound at `start`
        when not given.

    Attributes
    ----------
    metrics : Metrics
        The daemon's metrics, in a registry of their own (the routes count in them too).
    inflight : InFlight
        Bytes of requests held in memory at once, HTTP and data plane together.
    store, fds, collector, data_plane, peer
        Set by `load` and `start` (``data_plane`` and ``peer`` stay ``None`` when off).
    """

    def __init__(
        self,
        settings: Settings,
        data_listener: socket.socket | None = None,
        fds: Descriptors | None = None,
        peer_listener: socket.socket | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = Metrics(settings.node, __version__)
        self.inflight = InFlight(settings.max_inflight_bytes)
        self._data_listener = data_listener
        self._peer_listener = peer_listener
        self._given_fds = fds
        self.fds: Descriptors
        self.store: Store
        self.collector: GarbageCollector
        self.data_plane: DataPlaneServer | None = None
        self.peer: PeerServer | None = None
        self._flusher: Flusher | None = None
        self._gauges: StoreMetrics | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def load(self) -> None:
        """Build the descriptor shares, the `Store` and the GC collector; nothing runs yet."""
        # the shares of RLIMIT_NOFILE: serve() computes them once its sockets are bound
        self.fds = self._given_fds or descriptor_shares(self.settings)
        log.info("file descriptors: %s", self.fds.describe())
        # the storage core over the root, under the rules of the root's file system
        self.store = self._open_store(self._root_policy())
        log.info("payloadd %s: root %s, node %s", __version__, self.store.root, self.store.node)
        # the GC rules over the store (its ledger keeps room for a line on a full disk)
        self.collector = GarbageCollector(self.store, self.settings.ttl_s)  # grace: the policy's
        # a collection a crash cut is finished before anything is served: its line says
        # its files go, so none of them may be read again
        self.collector.finish_interrupted()

    def _open_store(self, policy: RootPolicy) -> Store:
        """The `Store` over the root, with the settings' limits and durability policy."""
        s, shares = self.settings, self.fds.shares
        return Store(
            s.root, s.node, max_file_bytes=s.max_file_bytes, fsync=s.fsync,
            max_read_bytes=s.max_request_bytes, max_append_bytes=s.max_request_bytes,
            max_append_items=s.max_append_items, max_root_bytes=s.max_root_bytes,
            min_free_bytes=s.min_free_bytes, fields=s.fields_table(), policy=policy,
            append_files=shares.append_files, read_cache=shares.read_cache,
        )  # fmt: skip

    def _root_policy(self) -> RootPolicy:
        """The rules for other nodes' files and shared appends on the root's file system:
        its kind's defaults (or the kind set), overridden by what is set; logged, with what
        they do not guarantee."""
        s = self.settings
        kind = detect(Store.check_root(s.root, s.node))
        if s.root_fs != "auto":
            kind = dataclasses.replace(kind, distributed=s.root_fs == "distributed")
        policy = RootPolicy.for_kind(kind, s.foreign_reads, s.foreign_wait_s, s.gc_grace_s)
        log.info("payload root on %s: %s", kind.name, policy.describe(kind))
        for line in policy.warnings(kind):
            log.warning("payload root on %s: %s", kind.name, line)
        return policy

    def start(self) -> None:
        """Start the flusher, the data plane, the peer port, the store's gauges and the GC
        sweeper (this needs the running event loop)."""
        s = self.settings
        # under fsync="interval", flushes every fsync_interval_s
        if s.fsync == "interval":
            self._flusher = Flusher(self.store.flush, s.fsync_interval_s)
            self._flusher.start()
        # descriptors over <socket>.data, in threads of its own
        if s.data_plane:
            self.data_plane = self._data_plane()
            self.data_plane.start(self._data_listener)
        # reads by other nodes over TCP, in threads of their own
        if s.peer_port is not None:
            self.peer = self._peer()
            listener = self._peer_listener
            if listener is None:  # an embedder's app binds it here (serve: in Service)
                check_peer_host(s.tcp_host, s.peer_host, s.tcp_port)
                listener = bind_tcp_socket(s.peer_address, s.peer_port, setting="peer_host")
            self.peer.start(listener)
        # the store's gauges, read at each scrape
        connections = self.data_plane.connections if self.data_plane else None
        peers = self.peer.connections if self.peer else None
        self._gauges = StoreMetrics(self.store, connections, self.fds, self.inflight, peers)
        self.metrics.registry.register(self._gauges)
        # the background GC, every gc_interval_s (the first at once)
        self._sweeper = asyncio.create_task(self._sweep_every(s.gc_interval_s))

    def _data_plane(self) -> DataPlaneServer:
        """The data plane's server over the store (not started)."""
        s = self.settings
        return DataPlaneServer(
            self.store, f"{s.socket}{DATA_SOCKET_SUFFIX}", s.socket_mode, s.lease_bytes,
            metrics=self.metrics, fds=self.fds, inflight=self.inflight,
            max_frame=s.max_control_bytes, request_timeout=s.request_timeout_s,
            reservation_timeout=s.reservation_timeout_s,
        )  # fmt: skip

    def _peer(self) -> PeerServer:
        """The peer port's server over the store (not started); it needs an admin token."""
        s = self.settings
        token = load_admin_token(s, warn=False)
        if token is None:
            raise StartError("the peer port (peer_port) needs an admin token")
        return PeerServer(
            self.store, token, self.fds, metrics=self.metrics,
            max_frame=s.max_control_bytes, max_per_host=s.max_peer_connections_per_host,
            request_timeout=s.request_timeout_s, idle_timeout=s.keep_alive_s,
            inflight=self.inflight,
        )  # fmt: skip

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[dict[str, Any]]:
        """The daemon's lifetime: `load`, `start`, then serve (what the routes reach, the
        lifespan state, is yielded), then `shutdown`."""
        self.load()
        self.start()
        try:
            yield {
                "store": self.store,
                "settings": self.settings,
                "collector": self.collector,
                "fds": self.fds,
                "data_plane": self.data_plane,
                "peer": self.peer,
            }
        finally:
            await self.shutdown()

    def lifespan(self, app: object) -> contextlib.AbstractAsyncContextManager[dict[str, Any]]:
        """`serve`, as an ASGI app's lifespan (``FastAPI(lifespan=...)``)."""
        return self.serve()

    async def shutdown(self) -> None:
        """Stop what `start` started, in the reverse order; a last flush, then close the
        store."""
        # the GC sweeper (a sweep under way ends in its thread)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        # the gauges
        if self._gauges is not None:
            self.metrics.registry.unregister(self._gauges)
            self._gauges = None
        # the peer port, then the data plane: no new connection, every connection ended;
        # then the flusher: a last flush, leased files included
        for part in ("peer", "data_plane", "_flusher"):
            running = getattr(self, part)
            if running is not None:
                running.stop()
                setattr(self, part, None)
        self.store.close()

    async def _sweep_every(self, seconds: float) -> None:
        """The background GC: the age rule, orphans and empty directories, every ``seconds``
        (the first at once); a failed sweep is logged and the next one still runs."""
        collector, metrics = self.collector, self.metrics
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
