"""The blocking shell over `BaseClient`: `PayloadClient` (the async one, `AsyncPayloadClient`,
is in `payload_client._async_client`).

They only do I/O: each runs the effects of `BaseClient._route` (which transport a call takes,
what is retried) with `drive` or `drive_async`, through its HTTP transport
(`HTTPTransport`, `AsyncHTTPTransport`) and its data plane (`SyncDataPlane`,
`AsyncDataPlane`). `BaseClient` builds every call, decodes every answer, and holds the one
constructor both share; httpx errors are translated once, in `payload_client._transports._http`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import numpy as np

from ._base import BaseClient, Items, Planned, Segments
from ._cp import Spans, cp_read
from ._ready import ready_steps
from ._segment import PayloadSegment
from ._transports import (
    Call,
    HTTPTransport,
    SyncDataPlane,
    SyncPeerTransport,
    drive,
)
from ._windows import CoveredRead, ReadResult, Window, WindowLike
from ._wire import FieldsTable, GcReport, Health, Prefetched, Stats, Usage

__all__ = ["PayloadClient"]

T = TypeVar("T")
OutT = TypeVar("OutT")


class PayloadClient(BaseClient[HTTPTransport, SyncDataPlane, SyncPeerTransport]):
    """Blocking client of a payloadd daemon; also a context manager.

    Parameters
    ----------
    socket_path : str or os.PathLike, optional
        The daemon's Unix socket. Default: ``$PAYLOADD_SOCKET``, else
        ``/run/payloadd/payloadd.sock``.
    base_url : str, optional
        ``http://host:port`` of a daemon's TCP listener, instead of a socket.
    token : str, optional
        Token sent as ``Authorization: Bearer`` (admin calls; every call over TCP).
    timeout : float, Timeout or httpx.Timeout, default 60.0
        Seconds allowed for connecting, each read and write (over HTTP and on the data
        plane), and waiting for a pooled connection; a `Timeout` sets each apart, and how
        long a pooled connection may idle before it is closed rather than reused (2 s, below
        the daemon's ``keep_alive_s``).
    data_plane : bool, default True
        Move row bytes the fast way when the daemon offers it: through file descriptors
        it passes over ``<socket>.data`` (same node), or, for reads over TCP with a
        ``token``, over its peer port (another node, no HTTP: see `ClusterClient`);
        else over HTTP.

    Raises
    ------
    InvalidRequestError
        Both ``socket_path`` and ``base_url``, or a ``timeout`` that is not valid.

    Notes
    -----
    A read, `stats` or `health` whose connection drops (the daemon restarted, or closed the
    connection just as the call went out) is retried once on a new connection; then
    `ConnectionLostError`. An append is never re-sent: if its connection fails before its
    whole body was sent, the error (`ConnectError`, `TimeoutError`, `ConnectionLostError`)
    says it was not stored; after that, `AppendInDoubtError`: it may or may not be stored.
    On the data plane, an append whose rows were written is never sent again over HTTP.
    """

    def _open_http(self) -> HTTPTransport:
        return HTTPTransport(
            self.socket_path, self.base_url, self.headers, self.timeout, self.where
        )

    def _open_data_plane(self, path: str) -> SyncDataPlane:
        return SyncDataPlane(path, self.timeout.read, self.timeout.connect)

    def _open_peer(self, host: str, port: int, token: str) -> SyncPeerTransport:
        return SyncPeerTransport(host, port, token, self.timeout, self.where)

    def _send(self, call: Call[T]) -> T:
        return drive(self._route(call), lambda effect: effect[0].handle_call(effect[1]))

    def _append(self, items: Items, run: str, step: int) -> Segments:
        """An append, at once in the data plane's leases if it can (``append_now``)."""
        headers, bodies = self._append_items(items, run, step)
        done = dp.append_now(headers, bodies) if (dp := self._data_plane_first()) else None
        return done if done is not None else self._send(self._append_call_of(headers, bodies))

    def _read(self, windows: Sequence[WindowLike | Spans], cover: bool | None = None) -> list[ReadResult]:  # fmt: skip
        if self._table is None:  # the checks that need no table come first
            self._read_plans(windows, cover)
        return self._read_planned(self._read_plans(windows, cover, self._fields_table()))

    def _fields_table(self) -> FieldsTable:
        """The daemon's fields table, fetched by the first read (`fields`) and kept."""
        if self._table is None:
            self._table = self.fields()
        return self._table

    def _read_planned(self, planned: Planned) -> list[ReadResult]:
        """A planned read, at once from cached descriptors if it can (``read_now``)."""
        if planned[4] and (dp := self._data_plane_first()) and dp.read_now(*planned[:2]):
            return planned[2]
        return self._send(self._read_call_of(planned))

    def append(
        self, field: str, rows: np.ndarray, pos: int, *, run: str, step: int
    ) -> list[PayloadSegment]:
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
        return self._append([(field, rows, pos)], run, step)[0]

    def append_many(
        self, items: Sequence[tuple[str, np.ndarray, int]], *, run: str, step: int
    ) -> list[list[PayloadSegment]]:
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
        return self._append(items, run, step)

    @overload
    def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: None = None,
                   dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> np.ndarray | None: ...  # fmt: skip

    @overload
    def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,  # type: ignore[overload-overlap]
                   hi: int, fill: int | float, *, out: OutT,
                   dtype: Any = None, required: bool = False, coverage: Literal[False] = False) -> OutT | None: ...  # fmt: skip

    @overload
    def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: Any = None,
                   dtype: Any = None, required: bool = False, coverage: Literal[True]) -> CoveredRead: ...  # fmt: skip

    @overload
    def read_field(self, segments: Sequence[PayloadSegment], field: str, lo: int,
                   hi: int, fill: int | float, *, out: Any = None,
                   dtype: Any = None, required: bool = False, coverage: bool) -> ReadResult: ...  # fmt: skip

    def read_field(
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
        """Read ``field`` over token positions ``[lo, hi)`` (docs/contract.md, "Reading a window").

        Parameters
        ----------
        segments : sequence of PayloadSegment
            Segments of any fields; only ``field``'s count, later ones win row by row.
        field : str
            Field to read.
        lo, hi : int
            Window of token positions, ``0 <= lo <= hi``, end exclusive.
        fill : int or float
            Value of entries no row covers; must fit the output dtype.
        out : numpy.ndarray or torch.Tensor, optional
            Array to read into instead of a new one, e.g. a view of a pinned buffer reused
            every step: shape ``[hi - lo, *dims]`` with ``dims`` at least the row shape
            (entries beyond it are set to ``fill``), dtype that of the read. A CPU
            ``torch.Tensor`` (pinned or not; not one that requires grad) is read into
            through its numpy view (the same memory) and returned itself.
        dtype : numpy dtype, optional
            Output dtype instead of ``int32``/``float32``: any integer or float dtype that
            holds every stored dtype of the field without loss, e.g. the stored ``uint8``
            (compact transfer to the GPU) or ``int64`` (indexing). Default: ``out.dtype``
            when ``out`` is given.
        required : bool, default False
            Raise `InvalidRequestError` when no segment of the list has ``field``, instead
            of returning ``None`` (a typo in a field name, a writer that never wrote it).
        coverage : bool, default False
            Also return which positions hold real rows rather than fill (e.g. to keep
            padding, replayed as expert 0, out of a router's load).

        Returns
        -------
        numpy.ndarray, torch.Tensor or None
            Without ``coverage``: ``out``, or a fresh C-contiguous ``[hi - lo, *row_shape]``
            array, ``int32`` (``float32`` for float fields) unless ``dtype`` says otherwise;
            ``None`` when no segment has ``field``.
        CoveredRead
            With ``coverage=True``: ``(array, covered)``, ``array`` as above and ``covered``
            a fresh ``bool`` ``[hi - lo]`` array, ``True`` where some segment of ``field``
            has a row; all ``False`` when ``array`` is ``None``. Computed from the segments
            alone, the same on both transports.

        Raises
        ------
        InvalidRequestError
            ``lo > hi``, ``lo < 0``; a ``fill``, ``dtype`` or ``out`` that does not fit;
            a torch ``out`` on another device than the CPU, or one that requires grad; a
            ``coverage`` that is not a bool; with ``required``, no segment of ``field``.
        InvalidSegmentError
            Any invalid segment in the list.
        FileMissingError, FileGoneError, SegmentFileError
            A segment intersecting the window points to a missing or collected file, one
            outside the root, or one shorter than the segment.
        TimeoutError
            The daemon did not answer within the read timeout.
        ConnectionLostError
            The connection dropped, and again on the one retry.
        TransportError
            The daemon cannot be reached or answered badly.
        """
        window = Window(segments, field, lo, hi, fill, out, dtype, coverage, required)
        return self._read([window])[0]

    @overload
    def read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[False] = False) -> list[np.ndarray | None]: ...  # fmt: skip

    @overload
    def read_many(self, windows: Sequence[WindowLike], *, coverage: Literal[True]) -> list[CoveredRead]: ...  # fmt: skip

    @overload
    def read_many(self, windows: Sequence[WindowLike], *, coverage: None) -> list[ReadResult]: ...  # fmt: skip

    def read_many(
        self, windows: Sequence[WindowLike], *, coverage: bool | None = False
    ) -> list[Any]:
        """Read several windows in one round trip (e.g. a rank's routing and mask windows).

        Parameters
        ----------
        windows : sequence of Window or (segments, field, lo, hi, fill[, out, dtype, coverage])
            As the arguments of `read_field`.
        coverage : bool or None, default False
            ``False``: each result is the array or ``None`` (a window that asks for
            coverage itself is refused, so that the results are what the type says);
            ``True``: each result is a `CoveredRead`; ``None``: each window as it asks
            (`Window.coverage`), a list of both kinds.

        Returns
        -------
        list of numpy.ndarray or None, list of CoveredRead, or a list of both
            One per window, as `read_field` returns it.

        Raises
        ------
        As `read_field`, errors of one window naming its index; `InvalidRequestError` for a
        window with ``coverage=True`` when ``coverage`` is ``False``.
        """
        return self._read(windows, coverage)

    @overload
    def read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                load_balanced: bool = False, out: None = None, dtype: Any = None) -> np.ndarray | None: ...  # fmt: skip

    @overload
    def read_cp(self, segments: Sequence[PayloadSegment], field: str, length: int,
                cp_size: int, rank: int, fill: int | float, *, labels: bool = False,
                load_balanced: bool = False, out: OutT, dtype: Any = None) -> OutT | None: ...  # fmt: skip

    def read_cp(
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
        """Read ``field`` at a context-parallel rank's positions into one array, in one round
        trip (docs/contract.md, "Context-parallel windows").

        The rank's ranges are `cp_chunks` ``(length, cp_size, rank, load_balanced)``, in that
        order; with ``labels`` each ``[a, b)`` is read at ``[a + 1, b + 1)``: the inline mask
        shifted left by one (fill last) and cut to the rank's chunks, bit for bit, once both
        have the same width. Contiguous, it is `read_field` of ``[lo, hi)`` (``labels``:
        ``[lo + 1, hi + 1)``).

        Parameters
        ----------
        segments, field, fill, dtype
            As `read_field` (``segments``: the micro batch's, packed with `shift_segments`).
        length : int
            ``L``, the micro batch's token positions, padded to a multiple of ``cp_size``
            (of ``2 * cp_size`` when ``load_balanced``).
        cp_size : int
            Ranks of the CP group, >= 1.
        rank : int
            This rank within its CP group, in ``[0, cp_size)``.
        labels : bool, default False
            Read at label positions (one later): ``True`` for sampling masks.
        load_balanced : bool, default False
            The load-balanced layout of Megatron-LM / Transformer Engine (chunks ``rank`` and
            ``2 * cp_size - 1 - rank`` of ``2 * cp_size``); else the contiguous one.
        out : numpy.ndarray or torch.Tensor, optional
            ``[length // cp_size, *dims]`` to read into, as `read_field`'s ``out`` (a CPU
            torch tensor too): each chunk goes into its consecutive rows.

        Returns
        -------
        numpy.ndarray, torch.Tensor or None
            ``out`` itself, or a fresh ``[length // cp_size, *row_shape]`` array, with
            ``row_shape`` the element-wise maximum of its chunks' row shapes (each that of a
            window: `read_field`'s rule), of `read_field`'s dtype. ``None`` when no segment
            has ``field`` (``out`` is not touched).

        Raises
        ------
        InvalidRequestError
            What `cp_chunks` refuses (``length`` not a multiple of ``cp_size``, or of ``2 *
            cp_size``; ``rank`` outside ``[0, cp_size)``, ...); an ``out`` of another number of
            rows; `read_field`'s errors (``out``: for the widest row of the rank's chunks).
        InvalidSegmentError, FileMissingError, FileGoneError, SegmentFileError, TransportError
            As `read_field`.
        """
        cp = cp_read(segments, field, length, cp_size, rank, fill, labels=labels,
                     load_balanced=load_balanced, out=out, dtype=dtype)  # fmt: skip
        return cp.result(self._read(cp.windows))

    def prefetch(self, windows: Sequence[WindowLike]) -> Prefetched:
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
        return self._send(self._prefetch_call(windows))

    def gc(
        self,
        run: str | None = None,
        through_step: int | None = None,
        *,
        ttl_s: float | None = None,
        dry_run: bool = False,
        node: str | None = None,
        before_step: int | None = None,
    ) -> GcReport:
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
        return self._send(self._gc_call(run, through_step, ttl_s, dry_run, node, before_step))

    def delete_run(self, run: str, *, dry_run: bool = False, node: str | None = None) -> GcReport:
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
        return self._send(self._delete_run_call(run, dry_run, node))

    def fields(self) -> FieldsTable:
        """Return the daemon's fields table: the dtypes, fill and maximum width of each field,
        and whether it takes fields not in the table (`FieldsTable`)."""
        return self._send(self._fields_call())

    def stats(self) -> Stats:
        """Return the daemon's counters (`Stats`), this client's appends included."""
        if self._data_plane is not None and not self._closed:
            self._data_plane.tell_counters(ack=True)
        return self._send(self._stats_call())

    def usage(
        self, *, max_steps: int | None = None, ledger: int | None = None, run: str | None = None
    ) -> Usage:
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
        return self._send(self._usage_call(max_steps, ledger, run))

    def health(self) -> Health:
        """Return the daemon's health answer; raises `TransportError` when it is down."""
        return self._send(self._health_call())

    def wait_ready(self, timeout_s: float = 30.0) -> Health:
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
        return drive(ready_steps(self._health_call, self.where, timeout_s), self._ready_effect)

    def _ready_effect(self, effect: Call[Health] | float) -> Health | None:
        """One effect of `ready_steps`: send the call, or sleep."""
        if isinstance(effect, Call):
            return self._send(effect)
        time.sleep(effect)
        return None

    def close(self) -> None:
        """Close the connection pool, the data plane and its cached descriptors; the client
        takes no call after it (`InvalidRequestError`). Closing it again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._data_plane is not None:
            self._data_plane.tell_counters()
            self._data_plane.close()
        if self._peer is not None:
            self._peer.close()
        self._http.close()

    def __enter__(self) -> PayloadClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
