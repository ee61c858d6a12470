"""The async shell over `BaseClient`: `AsyncPayloadClient`, the awaitable twin of
`payload_client._clients.PayloadClient` (same arguments, same methods, same errors).

It only does I/O: it runs the effects of `BaseClient._route` with `drive_async`, through
`AsyncHTTPTransport`, `AsyncDataPlane` and `AsyncPeerTransport`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import numpy as np

from ._base import BaseClient, Items, Planned, Segments
from ._cp import Spans, cp_read
from ._ready import ready_steps
from ._segment import PayloadSegment
from ._transports import (
    AsyncDataPlane,
    AsyncHTTPTransport,
    AsyncPeerTransport,
    Call,
    drive_async,
)
from ._windows import CoveredRead, ReadResult, Window, WindowLike
from ._wire import FieldsTable, GcReport, Health, Prefetched, Stats, Usage

__all__ = ["AsyncPayloadClient"]

T = TypeVar("T")
OutT = TypeVar("OutT")


class AsyncPayloadClient(BaseClient[AsyncHTTPTransport, AsyncDataPlane, AsyncPeerTransport]):
    """Asyncio client of a payloadd daemon: `PayloadClient`'s methods, awaitable; async with.

    Its parameters, the errors its constructor raises and its retry rules are those of
    `PayloadClient` (see there).
    """

    def _open_http(self) -> AsyncHTTPTransport:
        return AsyncHTTPTransport(
            self.socket_path, self.base_url, self.headers, self.timeout, self.where
        )

    def _open_data_plane(self, path: str) -> AsyncDataPlane:
        return AsyncDataPlane(path, self.timeout.read, self.timeout.connect)

    def _open_peer(self, host: str, port: int, token: str) -> AsyncPeerTransport:
        return AsyncPeerTransport(host, port, token, self.timeout, self.where)

    async def _send(self, call: Call[T]) -> T:
        return await drive_async(
            self._route(call), lambda effect: effect[0].handle_async_call(effect[1])
        )

    async def _append(self, items: Items, run: str, step: int) -> Segments:
        """Awaitable `PayloadClient._append` (at once: up to 1 MiB of rows)."""
        headers, bodies = self._append_items(items, run, step)
        done = dp.append_now(headers, bodies) if (dp := self._data_plane_first()) else None
        return done if done is not None else await self._send(self._append_call_of(headers, bodies))

    async def _read(
        self, windows: Sequence[WindowLike | Spans], cover: bool | None = None
    ) -> list[ReadResult]:
        if self._table is None:  # the checks that need no table come first
            self._read_plans(windows, cover)
        table = await self._fields_table()
        return await self._read_planned(self._read_plans(windows, cover, table))

    async def _fields_table(self) -> FieldsTable:
        """Awaitable `PayloadClient._fields_table`."""
        if self._table is None:
            self._table = await self.fields()
        return self._table

    async def _read_planned(self, planned: Planned) -> list[ReadResult]:
        """Awaitable `PayloadClient._read_planned` (at once: up to 1 MiB of rows)."""
        if planned[4] and (dp := self._data_plane_first()) and dp.read_now(*planned[:2]):
            return planned[2]
        return await self._send(self._read_call_of(planned))

    async def append(
        self, field: str, rows: np.ndarray, pos: int, *, run: str, step: int
    ) -> list[PayloadSegment]:
        """Awaitable `PayloadClient.append`."""
        return (await self._append([(field, rows, pos)], run, step))[0]

    async def append_many(
        self, items: Sequence[tuple[str, np.ndarray, int]], *, run: str, step: int
    ) -> list[list[PayloadSegment]]:
        """Awaitable `PayloadClient.append_many`."""
        return await self._append(items, run, step)

    @overload
    async def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                         hi: int, fill: int | float, *, out: None = None,
                         dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> np.ndarray | None: ...  # fmt: skip

    @overload
    async def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,  # type: ignore[overload-overlap]
                         hi: int, fill: int | float, *, out: OutT,
                         dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> OutT | None: ...  # fmt: skip

    @overload
    async def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                         hi: int, fill: int | float, *, out: Any = None,
                         dtype: Any = None, required: bool = False, coverage: Literal[True]) -> CoveredRead: ...  # fmt: skip

    @overload
    async def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                         hi: int, fill: int | float, *, out: Any = None,
                         dtype: Any = None, required: bool = False, coverage: bool) -> ReadResult: ...  # fmt: skip

    async def read_field(
        self,
        segments: Sequence[PayloadSegment],
        field: str,
        lo: int,
        hi: int,
        fill: int | float,
        *,
        out: Any = None,
        dtype: Any = None,
        required: bool = False,
        coverage: bool = False,
    ) -> Any:
        """Awaitable `PayloadClient.read_field`."""
        window = Window(segments, field, lo, hi, fill, out, dtype, coverage, required)
        return (await self._read([window]))[0]

    @overload
    async def read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[False] = False) -> list[np.ndarray | None]: ...  # fmt: skip

    @overload
    async def read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[True]) -> list[CoveredRead]: ...  # fmt: skip

    @overload
    async def read_many(self, windows: Sequence[WindowLike], *, coverage: None) -> list[ReadResult]: ...  # fmt: skip

    async def read_many(
        self, windows: Sequence[WindowLike], *, coverage: bool | None = False
    ) -> list[Any]:
        """Awaitable `PayloadClient.read_many`."""
        return await self._read(windows, coverage)

    @overload
    async def read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                      cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                      load_balanced: bool = False, out: None = None, dtype: Any = None) -> np.ndarray | None: ...  # fmt: skip

    @overload
    async def read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                      cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                      load_balanced: bool = False, out: OutT, dtype: Any = None) -> OutT | None: ...  # fmt: skip

    async def read_cp(
        self,
        segments: Sequence[PayloadSegment],
        field: str,
        length: int,
        cp_size: int,
        rank: int,
        fill: int | float,
        *,
        labels: bool = False,
        load_balanced: bool = False,
        out: Any = None,
        dtype: Any = None,
    ) -> Any:
        """Awaitable `PayloadClient.read_cp`."""
        cp = cp_read(segments, field, length, cp_size, rank, fill, labels=labels,
                     load_balanced=load_balanced, out=out, dtype=dtype)  # fmt: skip
        return cp.result(await self._read(cp.windows))

    async def prefetch(self, windows: Sequence[WindowLike]) -> Prefetched:
        """Awaitable `PayloadClient.prefetch`."""
        return await self._send(self._prefetch_call(windows))

    async def gc(
        self,
        run: str | None = None,
        through_step: int | None = None,
        *,
        ttl_s: float | None = None,
        dry_run: bool = False,
        node: str | None = None,
        before_step: int | None = None,
    ) -> GcReport:
        """Awaitable `PayloadClient.gc`."""
        return await self._send(self._gc_call(run, through_step, ttl_s, dry_run, node, before_step))

    async def delete_run(
        self, run: str, *, dry_run: bool = False, node: str | None = None
    ) -> GcReport:
        """Awaitable `PayloadClient.delete_run`."""
        return await self._send(self._delete_run_call(run, dry_run, node))

    async def fields(self) -> FieldsTable:
        """Awaitable `PayloadClient.fields`."""
        return await self._send(self._fields_call())

    async def stats(self) -> Stats:
        """Awaitable `PayloadClient.stats`."""
        if self._data_plane is not None and not self._closed:
            await self._data_plane.tell_counters(ack=True)
        return await self._send(self._stats_call())

    async def usage(
        self, *, max_steps: int | None = None, ledger: int | None = None, run: str | None = None
    ) -> Usage:
        """Awaitable `PayloadClient.usage`."""
        return await self._send(self._usage_call(max_steps, ledger, run))

    async def health(self) -> Health:
        """Awaitable `PayloadClient.health`."""
        return await self._send(self._health_call())

    async def wait_ready(self, timeout_s: float = 30.0) -> Health:
        """Awaitable `PayloadClient.wait_ready`: wait for a starting daemon to answer ``"ok"``.

        Parameters
        ----------
        timeout_s : float, default 30.0
            Seconds to keep asking, >= 0 (0: once).

        Returns
        -------
        Health
            The daemon's first answer with ``status == "ok"``.

        Raises
        ------
        InvalidRequestError, ConnectError, TimeoutError, ConnectionLostError, BusyError
            As `PayloadClient.wait_ready`: ``no payloadd listening on <socket>: is
            `payloadd serve` running? (waited N s)`` when nothing listened in time.
        """
        steps = ready_steps(self._health_call, self.where, timeout_s)
        return await drive_async(steps, self._ready_effect)

    async def _ready_effect(self, effect: Call[Health] | float) -> Health | None:
        """One effect of `ready_steps`: send the call, or sleep."""
        if isinstance(effect, Call):
            return await self._send(effect)
        await asyncio.sleep(effect)
        return None

    async def close(self) -> None:
        """Close the connection pool, the data plane and its cached descriptors (as
        `PayloadClient.close`)."""
        if self._closed:
            return
        self._closed = True
        if self._data_plane is not None:
            await self._data_plane.tell_counters()
            await self._data_plane.aclose()
        if self._peer is not None:
            await self._peer.aclose()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncPayloadClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
