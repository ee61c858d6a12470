"""Reads over the segments of many nodes (docs/contract.md, "Reads across nodes"): `ClusterClient`, `AsyncClusterClient`.

A packed micro batch holds segments written on several inference nodes; a segment's node is
the first component of its ``file``. A cluster client plans a call's windows once, over
every segment, exactly as `PayloadClient` does (docs/contract.md, "Reading a window": checks, later wins by list
order, widest row, fill, coverage, ``out=``, ``dtype=``), then splits each window's plan by
node (`WindowPlan.of_node`: the pieces are disjoint in output rows, so each node's part
writes its own rows of the one output) and sends one read to each node that holds a part,
the nodes in parallel, each through a `PayloadClient` of its own: the data plane for this
node's Unix socket, the peer port (or HTTP) for another node's daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, NamedTuple, TypeVar

import httpx

from .._errors import (
    BusyError,
    InvalidRequestError,
    PayloadError,
    TransportError,
    UnauthorizedError,
)
from ..reads._cp import Spans
from ..reads._plan import list_columns
from ..reads._windows import ReadResult, Window, WindowLike, node_of
from ..segments._segment import check_name
from ..transports._base import drive, drive_async
from ..transports._timeout import DEFAULT_TIMEOUT_S, Timeout
from ..wire._http import FieldsTable
from ._async import AsyncPayloadClient
from ._base import fields_table_steps, read_planned_steps
from ._plans import Planned, plan_reads
from ._reads import Reads
from ._shells import Awaiting, Blocking, Dual, Effects, awaitable, blocking, perform, perform_async
from ._sync import PayloadClient

__all__ = ["NODES_ENV", "AsyncClusterClient", "ClusterClient", "load_nodes"]

NODES_ENV = "PAYLOADD_NODES"
"""Environment variable with the node map when none is given: a JSON object, or the path
of a file holding one."""

C = TypeVar("C", PayloadClient, AsyncPayloadClient)


def load_nodes(nodes: Mapping[str, str] | str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The node map of a cluster client: node name -> daemon address.

    Parameters
    ----------
    nodes : mapping, str, os.PathLike or None
        The map itself; or the path of a JSON file holding it; ``None``: `NODES_ENV`, a
        JSON object or the path of a JSON file (what a trainer launcher sets).

    Returns
    -------
    dict of str to str
        Node names (``[A-Za-z0-9._-]{1,128}``) to ``unix:///path/of/payloadd.sock`` (a
        daemon on this node) or ``http://host:port`` (another node's daemon, over TCP).

    Raises
    ------
    InvalidRequestError
        No map, a file that cannot be read or is not JSON, an empty map, a bad node name,
        or an address of another form (naming the node).
    """
    if nodes is None:
        text = os.environ.get(NODES_ENV, "").strip()
        if not text:
            raise InvalidRequestError(f"no nodes given, and {NODES_ENV} is not set")
        nodes = _json(text, NODES_ENV) if text.startswith("{") else text
    if isinstance(nodes, str | os.PathLike):
        path = os.fspath(nodes)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the node map {path}: {exc.strerror}") from None
        nodes = _json(text, path)
    if not isinstance(nodes, Mapping) or not nodes:
        raise InvalidRequestError("nodes must be a non-empty map of node name to address")
    out: dict[str, str] = {}
    for name, address in nodes.items():
        check_name(name, "node name")
        _address(name, address)
        out[name] = address
    return out


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"the node map in {where} is not JSON: {exc}") from None


def _address(node: str, address: Any) -> tuple[str | None, str | None]:
    """``(socket path, None)`` of a ``unix://`` address, ``(None, base URL)`` of an
    ``http://`` one."""
    if isinstance(address, str):
        if address.startswith("unix://") and address[7:].startswith("/"):
            return address[7:], None
        if address.startswith("http://") and address.isprintable() and " " not in address:
            with contextlib.suppress(ValueError, httpx.InvalidURL):  # a port not a number
                url = urllib.parse.urlsplit(address)
                httpx.URL(address)  # what the node's client will be made with
                if url.hostname and url.port:  # 80 too (httpx.URL drops a default port)
                    return None, address.rstrip("/")
    raise InvalidRequestError(
        f"node {node!r}: address must be unix:///path/of/payloadd.sock or "
        f"http://host:port, got {address!r}"
    )


_CLOSED = "this cluster client is closed: make a new one (closing it is for good)"

_READ_FIELD = """Read ``field`` over ``[lo, hi)`` from segments of any nodes: `PayloadClient.read_field`'s
parameters, result and errors, and `InvalidRequestError` for a segment whose node is
not in the map (before any I/O)."""
_READ_MANY = """Read several windows, one request a node: `PayloadClient.read_many` over segments
of any nodes."""


class NodeReads(NamedTuple):
    """The effect of a cluster read: each node's part read, the nodes in parallel; an error
    of any node raised once every node's read has ended."""

    parts: list[tuple[str, Effects[Any]]]
    """``(node, the operation of its part)``, in the order the call's files name them."""


class _Cluster(Reads, Generic[C]):
    """What both cluster clients share: the node map, a client a node, planning and
    splitting a read by node, the reads as operations (no I/O)."""

    _client_type: type[C]

    def __init__(
        self,
        nodes: Mapping[str, str] | str | os.PathLike[str] | None = None,
        *,
        token: str | None = None,
        timeout: float | Timeout | httpx.Timeout = DEFAULT_TIMEOUT_S,
        data_plane: bool = True,
    ) -> None:
        self.nodes = load_nodes(nodes)
        self._addresses = {name: _address(name, a) for name, a in self.nodes.items()}
        if token is not None and not (token.isascii() and token.isprintable()):
            raise InvalidRequestError("the token must be printable ASCII (it goes in a header)")
        self._options: dict[str, Any] = {"token": token, "timeout": Timeout.of(timeout),
                                         "data_plane": data_plane}  # fmt: skip
        self.clients: dict[str, C] = {}
        """The nodes' clients made so far: this node's (a socket) at once, another node's on
        the first read of it."""
        self._made = threading.Lock()
        self._closed = False
        for node, (socket_path, _) in self._addresses.items():
            if socket_path is not None:
                self._client(node)

    _table: FieldsTable | None = None

    def _client(self, node: str) -> C:
        """``node``'s client, made on first use (of a cluster of 1,024 nodes, a rank makes
        those its windows touch)."""
        client = self.clients.get(node)
        if client is None:
            with self._made:  # threads sharing this client make one a node
                if self._closed:
                    raise InvalidRequestError(_CLOSED)
                client = self.clients.get(node)
                if client is None:
                    socket_path, base_url = self._addresses[node]
                    client = self._client_type(socket_path, base_url=base_url, **self._options)
                    self.clients[node] = client
        return client

    def _order(self) -> list[str]:
        """The nodes, this node's (a socket) first: whom to ask for the fields table."""
        return sorted(self.nodes, key=lambda n: self._addresses[n][0] is None)

    read_field = Dual(
        blocking(Reads._read_field),  # type: ignore[arg-type]  # (see Dual)
        awaitable(Reads._read_field),  # type: ignore[arg-type]
    ).documented(_READ_FIELD, "Awaitable `ClusterClient.read_field`.")
    read_many = Dual(
        blocking(Reads._read_many),  # type: ignore[arg-type]  # (see Dual)
        awaitable(Reads._read_many),  # type: ignore[arg-type]
    ).documented(_READ_MANY, "Awaitable `ClusterClient.read_many`.")

    def _fields_table(self) -> Effects[FieldsTable]:
        """The fields table of the first node that answers, this node's first; kept (the
        nodes of one cluster share their settings)."""
        if self._table is None:
            errors: list[PayloadError] = []
            for node in self._order():
                try:
                    self._table = yield from fields_table_steps(self._client(node))
                    break
                except (TransportError, UnauthorizedError, BusyError) as exc:
                    errors.append(self._named(node, exc))
            else:
                raise errors[0]
        return self._table

    def _read(
        self, windows: Sequence[WindowLike | Spans], cover: bool | None = None
    ) -> Effects[list[ReadResult]]:
        if self._table is None:  # the checks that need no table come first
            self._split(windows, cover, None)
        planned, parts = self._split(windows, cover, (yield from self._fields_table()))
        if parts:
            yield NodeReads([(node, self._one(node, part)) for node, part in parts.items()])
        return planned.results

    def _one(self, node: str, part: Planned) -> Effects[None]:
        """Read ``node``'s part of a call, through its client."""
        try:
            yield from read_planned_steps(self._client(node), part)
        except (TransportError, UnauthorizedError, BusyError) as exc:
            raise self._named(node, exc) from exc

    def _split(
        self,
        windows: Sequence[WindowLike | Spans],
        cover: bool | None,
        table: FieldsTable | None,
    ) -> tuple[Planned, dict[str, Planned]]:
        """The call planned (checked, outputs prepared), and its part on each node that
        holds a file it needs.

        Raises
        ------
        InvalidRequestError
            As `PayloadClient.read_many`, or a segment on a node not in the map.
        """
        planned = plan_reads(windows, cover, table)
        self._check_nodes(windows)
        involved: dict[str, None] = {}
        for plan in planned.plans:
            if plan is not None:
                for f in plan.ends:
                    involved.setdefault(node_of(f))
        parts: dict[str, Planned] = {}
        for node in involved:
            sub = [None if p is None else p.of_node(node) for p in planned.plans]
            total = sum(p.nbytes for p in sub if p is not None)
            parts[node] = planned._replace(plans=sub, nbytes=total, files=True)
        return planned, parts

    def _check_nodes(self, windows: Sequence[WindowLike | Spans]) -> None:
        seen: set[int] = set()
        for i, w in enumerate(windows):
            segments = w.segments if isinstance(w, Window) else w[0]
            if id(segments) in seen:
                continue
            seen.add(id(segments))
            # a long list's distinct files are in its columns, kept since it was planned
            files = (
                list_columns(segments).files if len(segments) > 8 else (s.file for s in segments)
            )
            nodes = {node_of(f) for f in files}
            missing = nodes.difference(self.nodes)
            if missing:
                node = sorted(missing)[0]
                at = next(j for j, s in enumerate(segments) if node_of(s.file) == node)
                where = f"window {i}: " if len(windows) > 1 else ""
                raise InvalidRequestError(
                    f"{where}segment {at} is on node {node!r}, which is not in the node map "
                    f"({', '.join(sorted(self.nodes))})"
                )

    def _closing(self) -> list[C]:
        """The clients made, no more to be made."""
        with self._made:
            self._closed = True
            return list(self.clients.values())

    def _named(self, node: str, exc: PayloadError) -> PayloadError:
        """``exc``, its message naming the node and its address."""
        return type(exc)(f"node {node!r} at {self.nodes[node]}: {exc}")


class ClusterClient(_Cluster[PayloadClient], Blocking):
    """Blocking reads over segments of many nodes' daemons (docs/contract.md, "Reads across nodes"); a context manager.

    Parameters
    ----------
    nodes : mapping, str, os.PathLike or None
        Node name -> ``unix:///path`` (this node's daemon: the data plane) or
        ``http://host:port`` (another node's daemon: its peer port when it offers one,
        else HTTP); or the path of a JSON file of that map; default ``$PAYLOADD_NODES``
        (`load_nodes`).
    token : str, optional
        The daemons' admin token (every call over TCP needs it).
    timeout : float, Timeout or httpx.Timeout, default 60.0
        As `PayloadClient`'s, for each node.
    data_plane : bool, default True
        As `PayloadClient`'s: descriptors on this node, the peer port of other nodes.

    Raises
    ------
    InvalidRequestError
        A node map that cannot be had or is malformed (`load_nodes`), a bad ``timeout``, or
        a token that is not printable ASCII.

    Notes
    -----
    This node's client (a ``unix://`` address) is made at once; another node's on the first
    read of it (`clients` holds those made). After `close`, a read raises
    `InvalidRequestError`.

    One call sends one read to each node holding a file it needs (the nodes in parallel,
    in a pool of threads) and returns when all answered. An error of any node is raised
    once every node's read has ended; a node that cannot be reached raises the
    `TransportError` of `PayloadClient`, its message naming the node and its address.
    Appends and GC stay with `PayloadClient`: a writer writes on its own node.

    Examples
    --------
    >>> cc = ClusterClient({"node-a": "http://10.0.0.1:7070",
    ...                     "node-b": "unix:///run/payloadd/payloadd.sock"}, token="t" * 32)
    >>> sorted(cc.nodes)
    ['node-a', 'node-b']
    >>> cc.close()
    """

    _client_type = PayloadClient
    _pool: ThreadPoolExecutor | None = None

    def _perform(self, effect: Any) -> Any:
        """Perform one effect (`perform`); `NodeReads`: the nodes over TCP in a pool of
        threads, this node's here meanwhile, every read ended before an error is raised."""
        if not isinstance(effect, NodeReads):
            return perform(effect)
        # the nodes over TCP in the pool, this node's (a socket: no network) meanwhile here
        items = sorted(effect.parts, key=lambda it: self._addresses[it[0]][0] is None)
        items.reverse()
        if len(items) == 1:
            return drive(items[0][1], perform)
        with self._made:  # threads sharing this client make one pool; none once closed
            if self._closed:
                raise InvalidRequestError(_CLOSED)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(min(len(self.nodes), 32), "payload-cluster")
            pool = self._pool
        try:
            futures: list[Future[Any]] = [pool.submit(drive, o, perform) for _, o in items[:-1]]
        except RuntimeError:  # closed meanwhile: the pool takes no more
            raise InvalidRequestError(_CLOSED) from None
        errors: list[BaseException] = []
        try:
            drive(items[-1][1], perform)
        except Exception as exc:
            errors.append(exc)
        for f in futures:  # every node's read ends before this call does
            if (e := f.exception()) is not None:
                errors.append(e)
        if errors:
            raise errors[0]
        return None

    def close(self) -> None:
        """Close every node's client and the pool of threads."""
        clients = self._closing()  # first: no read starts on a pool or client closing
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for client in clients:
            client.close()


class AsyncClusterClient(_Cluster[AsyncPayloadClient], Awaiting):
    """Asyncio reads over segments of many nodes' daemons: `ClusterClient`, awaitable;
    ``async with``. The nodes are read in parallel on the event loop."""

    _client_type = AsyncPayloadClient

    async def _perform(self, effect: Any) -> Any:
        """Awaitable `ClusterClient._perform`: the nodes' reads in parallel on the event loop."""
        if not isinstance(effect, NodeReads):
            return await perform_async(effect)
        done = await asyncio.gather(
            *(drive_async(one, perform_async) for _, one in effect.parts), return_exceptions=True
        )
        for d in done:
            if isinstance(d, BaseException):
                raise d
        return None

    async def close(self) -> None:
        """Close every node's client."""
        for client in self._closing():
            await client.close()
