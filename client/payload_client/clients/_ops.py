"""The operations of a client of one daemon, each written once, for both kinds of client.

`Operations` is `BaseClient` with every public method of `PayloadClient` and
`AsyncPayloadClient` as an I/O-free operation (`payload_client.clients._shells`): it
decides and yields effects, the blocking client runs them here and now, the async one on the
event loop. Their docstrings are `PayloadClient`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic

import numpy as np

from ..reads._cp import Spans
from ..reads._windows import ReadResult, WindowLike
from ..segments._segment import PayloadSegment
from ..transports import Call
from ..transports._base import nest
from ..wire._http import FieldsTable, GcReport, Health, Prefetched, Stats, Usage
from ._base import (
    HTTPT,
    BaseClient,
    DataPlaneT,
    Items,
    PeerT,
    Segments,
    fields_table_steps,
    read_planned_steps,
)
from ._plans import plan_reads
from ._reads import Reads
from ._ready import ready_steps
from ._shells import Close, Dual, Effects, TellCounters, awaitable, blocking, op

__all__ = ["Operations"]

_AWAIT_READY = """Awaitable `PayloadClient.wait_ready`: wait for a starting daemon to answer ``"ok"``
(the same ``timeout_s``, answer, pauses and errors: see there)."""
_AWAIT_CLOSE = """Close the connection pool, the data plane and its cached descriptors (as
`PayloadClient.close`)."""


class Operations(Reads, BaseClient[HTTPT, DataPlaneT, PeerT], Generic[HTTPT, DataPlaneT, PeerT]):
    """`BaseClient` with the public methods of the clients of one daemon, each an operation
    run by the blocking or the async client (`Blocking`, `Awaiting`)."""

    def _append(self, items: Items, run: str, step: int) -> Effects[Segments]:
        """An append, at once in the data plane's leases if it can (``append_now``: up to
        1 MiB of rows, the same for both kinds of client), else as a call."""
        headers, bodies = self._append_items(items, run, step)
        dp: Any = self._data_plane_first()
        done: Segments | None = dp.append_now(headers, bodies) if dp is not None else None
        if done is not None:
            return done
        return (yield from self._route(self._append_call_of(headers, bodies)))

    def _read(
        self, windows: Sequence[WindowLike | Spans], cover: bool | None = None
    ) -> Effects[list[ReadResult]]:
        table = self._table
        if table is None:  # the checks that need no table come first
            plan_reads(windows, cover)
            table = yield from fields_table_steps(self)
        return (yield from read_planned_steps(self, plan_reads(windows, cover, table)))

    @op
    def append(
        self, field: str, rows: np.ndarray, pos: int, *, run: str, step: int
    ) -> Effects[list[PayloadSegment]]:
        """Append rows of one field and return the segments that now hold them.

        Parameters
        ----------
        field : str
            Field name, ``[A-Za-z0-9._-]{1,128}`` (``"routed_experts"``, ``"sampling_mask"``).
        rows : numpy.ndarray
            ``[n, *row_shape]`` of a supported dtype (``uint8``, ``int8``, ``uint16``,
            ``int16``, ``int32``, ``float16``, ``float32``); any byte order or layout
            (stored little-endian, C order).
        pos : int
            Token position of the first row; the rows cover ``[pos, pos + n)``.
        run : str
            Run name, ``[A-Za-z0-9._-]{1,128}``, not ``.`` or ``..``.
        step : int
            Training step (>= 0); GC frees whole steps.

        Returns
        -------
        list of PayloadSegment
            Covering ``[pos, pos + n)`` in order; exactly one when the rows fit in the
            daemon's file rotation size. Returned only once the bytes are written.

        Raises
        ------
        InvalidRequestError
            Bad field, run, step, position or rows (checked before anything is sent).
        PayloadTooLargeError
            The body is above the daemon's request size limit.
        StorageFullError
            The payload root is full (nothing was stored).
        AppendInDoubtError
            The connection failed after the whole append was sent: it may or may not be
            stored. Never re-sent by the client; appending again may store the rows twice.
        TransportError
            The daemon cannot be reached or answered badly (`ConnectError`,
            `TimeoutError`, `ConnectionLostError`: nothing was stored).
        """
        return (yield from self._append([(field, rows, pos)], run, step))[0]

    @op
    def append_many(
        self, items: Sequence[tuple[str, np.ndarray, int]], *, run: str, step: int
    ) -> Effects[list[list[PayloadSegment]]]:
        """Append several blocks of rows (any fields, requests) in one round trip.

        Parameters
        ----------
        items : sequence of (field, rows, pos)
            As the arguments of `append`.
        run, step
            As in `append`, shared by all items.

        Returns
        -------
        list of list of PayloadSegment
            The segments of each item, in item order.

        Raises
        ------
        InvalidRequestError, PayloadTooLargeError, AppendInDoubtError, TransportError
            As `append`; nothing is written when any item is invalid.
        """
        return (yield from self._append(items, run, step))

    read_cp = Dual(blocking(Reads._read_cp), awaitable(Reads._read_cp))  # type: ignore[arg-type]

    @op
    def prefetch(self, windows: Sequence[WindowLike]) -> Effects[Prefetched]:
        """Ask the daemon to read ahead the bytes of ``windows``, and return at once: a rank
        warms its next micro batches while it computes, so that their reads find the bytes
        in this node's page cache (on a distributed file system, a cold read is several
        times slower; docs/deployment.md).

        Parameters
        ----------
        windows : sequence of Window or (segments, field, lo, hi, fill[, ...])
            As `read_many` takes them (``out``, ``dtype`` and ``coverage`` are ignored).

        Returns
        -------
        Prefetched
            The files and bytes the daemon queued; fewer than asked when its read-ahead
            queue is full (a hint: nothing else is lost).

        Raises
        ------
        InvalidSegmentError, InvalidRequestError
            A window is malformed (as `read_field`).
        FileMissingError, FileGoneError
            A file does not exist, or its step was collected.
        """
        return (yield from self._route(self._prefetch_call(windows)))

    @op
    def gc(
        self,
        run: str | None = None,
        through_step: int | None = None,
        *,
        ttl_s: float | None = None,
        dry_run: bool = False,
        node: str | None = None,
        before_step: int | None = None,
    ) -> Effects[GcReport]:
        """Garbage-collect on the daemon's node, or on another node's prefix: an admin call.

        Parameters
        ----------
        run : str, optional
            With ``through_step``: remove the steps ``<= through_step`` of this run (the
            training watermark). Both or neither.
        through_step : int, optional
            The watermark step, inclusive.
        ttl_s : float, optional
            Also remove every step whose files are all older than this (seconds), of runs
            not appended to or read for as long. Default: the daemon's ``ttl_s`` setting;
            0: no age rule in this call.
        dry_run : bool, default False
            Report what would go; remove nothing.
        node : str, optional
            On a payload root shared by several nodes: collect this node's prefix instead
            of the daemon's own (e.g. a node that is gone). Only the rules asked for apply:
            the watermark, and the age rule when ``ttl_s`` is given (by the files' ages
            alone); no orphans. The daemon does not see that node's appends in flight: see
            docs/deployment.md. A daemon older than this option refuses it (400).
        before_step : int, optional
            The watermark's former name: refused with `InvalidRequestError` naming
            ``through_step`` (it always included its step).

        Returns
        -------
        GcReport
            Files, bytes (the files' sizes), directories removed, per reason, and the steps
            collected. Orphans (empty files of an earlier daemon) and empty directories are
            removed by every call on the daemon's own node.

        Raises
        ------
        InvalidRequestError
            ``run`` without ``through_step`` (or the reverse), a bad run name, node name or
            step, or another ``node`` with neither a watermark nor ``ttl_s``; ``before_step``.
        UnauthorizedError
            The daemon wants an admin token and this client has none, or a wrong one.

        Notes
        -----
        Reads of a collected segment then raise `FileGoneError` (410), naming its run and
        step; a file a pending append writes to is kept (``GcReport.in_use``). See docs/contract.md, "Garbage collection".
        """
        call = self._gc_call(run, through_step, ttl_s, dry_run, node, before_step)
        return (yield from self._route(call))

    @op
    def delete_run(
        self, run: str, *, dry_run: bool = False, node: str | None = None
    ) -> Effects[GcReport]:
        """Remove every step of ``run`` on the daemon's node, or of ``node``'s prefix (as in
        `gc`): an admin call.

        Raises
        ------
        InvalidRequestError
            A bad run or node name; with ``node``, a daemon older than that option
            (``Not Found (HTTP 404)``: it removes nothing).
        UnauthorizedError
            As `gc`.
        """
        return (yield from self._route(self._delete_run_call(run, dry_run, node)))

    @op
    def fields(self) -> Effects[FieldsTable]:
        """Return the daemon's fields table: the dtypes, fill and maximum width of each field,
        and whether it takes fields not in the table (`FieldsTable`)."""
        return (yield from self._route(self._fields_call()))

    @op
    def stats(self) -> Effects[Stats]:
        """Return the daemon's counters (`Stats`), this client's appends included."""
        if self._data_plane is not None and not self._closed:
            yield TellCounters(self._data_plane, ack=True)
        return (yield from self._route(self._stats_call()))

    @op
    def usage(
        self, *, max_steps: int | None = None, ledger: int | None = None, run: str | None = None
    ) -> Effects[Usage]:
        """What the daemon's node holds on disk, per run and step: an admin call.

        The daemon walks its node's directory (one ``lstat`` per file) in a worker thread.

        Parameters
        ----------
        max_steps : int, optional
            Most steps listed, and most runs listed (0 to 100000; default: the daemon's,
            1000). Totals always cover every step.
        ledger : int, optional
            Most GC ledger entries returned, the last ones (0 to 100000; default 20).
        run : str, optional
            List this run only (the others still count in the totals and ``more_runs``).

        Returns
        -------
        Usage
            Files, bytes (apparent and on disk) and newest modification time per run and
            step, totals, the disk limits, and the last collections of the GC ledger.

        Raises
        ------
        InvalidRequestError
            ``max_steps`` or ``ledger`` not an integer >= 0 (or above 100000: from the
            daemon, HTTP 400).
        UnauthorizedError
            As `gc`.
        """
        return (yield from self._route(self._usage_call(max_steps, ledger, run)))

    @op
    def health(self) -> Effects[Health]:
        """Return the daemon's health answer; raises `TransportError` when it is down."""
        return (yield from self._route(self._health_call()))

    def _wait_ready(self, timeout_s: float = 30.0) -> Effects[Health]:
        """Wait for a daemon that is starting: ask for its health until it answers ``"ok"``.

        For a process that starts the daemon and then talks to it (a daemon takes seconds to
        answer on a loaded machine): nothing listening yet, no answer yet, a restart, a
        daemon at a limit for now or one answering ``"degraded"`` are asked again, after
        pauses of 0.05 s growing to 0.5 s, until ``timeout_s`` is up.

        Parameters
        ----------
        timeout_s : float, default 30.0
            Seconds to keep asking, >= 0 (0: once). Each attempt may take the time left (at
            least 0.5 s), within the client's own timeouts.

        Returns
        -------
        Health
            The daemon's first answer with ``status == "ok"``.

        Raises
        ------
        InvalidRequestError
            ``timeout_s`` is not a finite number >= 0; the client is closed.
        ConnectError
            Nothing listened on the socket or URL until the time was up: ``no payloadd
            listening on <socket>: is `payloadd serve` running? (waited N s)``; or, at once,
            it cannot be connected to for another reason (permission denied).
        TimeoutError, ConnectionLostError
            The last attempt's error when the time was up.
        BusyError
            The daemon answered, but was at a limit or not ``"ok"`` until the time was up.
        PayloadError
            Any other error, at once (`UnauthorizedError` over TCP without the token, an
            answer that is not payloadd's: `ProtocolError`).
        """
        steps = ready_steps(self._health_call, self.where, timeout_s)
        return (yield from nest(steps, self._ready_effects))

    wait_ready = op(_wait_ready).documented(async_=_AWAIT_READY)

    def _ready_effects(self, effect: Call[Health] | float) -> Effects[Health | None]:
        """The effects of one effect of `ready_steps`: its call sent, or its pause."""
        if isinstance(effect, Call):
            return (yield from self._route(effect))
        yield effect
        return None

    def _close(self) -> Effects[None]:
        """Close the connection pool, the data plane and its cached descriptors; the client
        takes no call after it (`InvalidRequestError`). Closing it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._data_plane is not None:
            yield TellCounters(self._data_plane)
            yield Close(self._data_plane)
        if self._peer is not None:
            yield Close(self._peer)
        yield Close(self._http)

    close = op(_close).documented(async_=_AWAIT_CLOSE)
