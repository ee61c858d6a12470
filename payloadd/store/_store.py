"""The storage core: append-only data files under the payload root; sync, no HTTP.

Layout: ``<root>/<node>/<run>/<step>/<field>-<instance>-<seq>.bin``. ``instance`` is new at
every start, so a restarted daemon never appends to a file an earlier one wrote.

Appends are two-phase so that many writers can share a file: `Store.begin_append` reserves
byte ranges under one lock (placement and rotation), the caller writes the rows with
``os.pwrite`` outside the lock (`PendingAppend.write`), and `PendingAppend.commit` returns the
segments once every byte is written (and fsync'd under ``fsync="always"``; under
``fsync="interval"`` the files are marked for the next flush, `Store.flush`).

Every reservation is checked against the disk limits first (`payloadd.store._disk_limits`): an append
or lease that does not fit under ``max_root_bytes`` or above ``min_free_bytes`` fails with
`StorageFullError` before anything is reserved.

Its parts: the files open for appends (`FileTable`, whose lock is the store's), the read side
(`Readers`), removals (`Removals`) and the counters (`Counts`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any, Literal

from payload_client import InvalidRequestError, PayloadSegment, PayloadTooLargeError
from payload_client.protocol import (
    AppendItem,
    Extent,
    FieldsTable,
    Stats,
    check_item,
    check_name,
)
from payloadd.store._appends import LeasedRange, PendingAppend, item_nbytes
from payloadd.store._budget import APPEND_FILES, READ_CACHE
from payloadd.store._counts import HTTP, Counts
from payloadd.store._disk_limits import DiskBudget, tree_sizes
from payloadd.store._files import FileTable, check_root, unwritten
from payloadd.store._fs_kind import RootPolicy, detect
from payloadd.store._generation import GenerationPage
from payloadd.store._leases import Leases
from payloadd.store._ledger import Ledger
from payloadd.store._placing import Placing, files_needed
from payloadd.store._prefetch import Prefetcher
from payloadd.store._readers import ExtentReader, Readers
from payloadd.store._records import AppendFile, Removal, os_errors
from payloadd.store._removal import Removals
from payloadd.store._shapes import SHAPES_NAME, RunShapes
from payloadd.store._watermarks import Watermarks

__all__ = ["Store"]

log = logging.getLogger("payloadd.store")


class Store:
    """Owns the payload root: places, writes and reads rows; sync and thread-safe.

    Parameters
    ----------
    root : path
        Payload root; created with mode 0750 if missing.
    node : str
        This daemon's node prefix (a path component).
    max_file_bytes : int
        Rotation size: a file is not grown past it, except by a single row larger than it.
    fsync : {"never", "interval", "always"}
        ``always``: `PendingAppend.commit` fsyncs before returning segments (and new files'
        directories are fsync'd when created); ``interval``: what was written is marked for
        `flush`, which the daemon calls every ``fsync_interval_s``; ``never``: neither.
    max_read_bytes : int
        Largest total of one `read_extents` call.
    max_append_bytes : int
        Largest total of the rows of one `begin_append` call.
    max_append_items : int
        Most items in one `begin_append` call.
    max_root_bytes : int
        Cap on the bytes of the files under ``<root>/<node>``; 0 for none. Counted as the
        files' apparent sizes plus reserved bytes (see `payloadd.store._disk_limits`).
    min_free_bytes : int
        Free-space floor of the root's file system; 0 for none.
    fields : FieldsTable, optional
        What each field takes (`check_item`); default: any field, any supported dtype.
    policy : RootPolicy, optional
        How other nodes' files are read and shared files written on the root's file system
        (`payloadd.store._fs_kind`); default: the defaults of the kind `detect` finds.
    append_files : int
        Shared files kept open for appends (one per run, step and field); the least
        recently appended to is sealed beyond that, and later appends of its key start a
        new file (the daemon's share of ``RLIMIT_NOFILE``, `payloadd.store._budget`).
    read_cache : int
        Read-only descriptors kept for later reads (`Readers`).

    Attributes
    ----------
    counts : Counts
        The counters of appends, leases and data-plane requests (`stats`, and the
        server's Prometheus metrics at scrape time).
    last_used : dict
        Run of this node -> monotonic time it was last appended to or read.
    reads : Readers
        The read side.
    removals : Removals
        The removals of data files and directories (garbage collection's hands).
    prefetcher : Prefetcher
        The read-ahead of windows clients will read next.
    policy : RootPolicy
        How it is treated.
    generation : GenerationPage or None
        The removal generation, which every removal of a data file moves; data-plane clients
        map it (``None`` without memfd sealing: clients check after every write).
    shapes : RunShapes
        The row shape fixed for each run and field of this node (its first append).
    watermarks : Watermarks
        The collected watermark of each run, over every node's GC ledger: appends at or
        below it are refused.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        node: str,
        *,
        max_file_bytes: int = 1 << 30,
        fsync: Literal["never", "interval", "always"] = "never",
        max_read_bytes: int = 4 << 30,
        max_append_bytes: int = 4 << 30,
        max_append_items: int = 65536,
        max_root_bytes: int = 0,
        min_free_bytes: int = 0,
        fields: FieldsTable | None = None,
        policy: RootPolicy | None = None,
        append_files: int = APPEND_FILES,
        read_cache: int = READ_CACHE,
    ) -> None:
        self.node = check_name(node, "node")
        self.root = self.check_root(root, self.node)
        self.max_file_bytes = max_file_bytes
        self.max_append_bytes = max_append_bytes
        self.max_append_items = max_append_items
        self.max_read_bytes, self.append_files = max_read_bytes, append_files
        self.fsync = fsync
        self.fields = fields if fields is not None else FieldsTable({})
        self.instance = secrets.token_hex(4)
        self.started = time.monotonic()
        budget = DiskBudget(self.root, self.root / node, max_root_bytes, min_free_bytes)
        self.policy = policy if policy is not None else RootPolicy.for_kind(detect(self.root))
        self.generation = GenerationPage.create()
        self._table = FileTable(
            self.root, self.node, self.instance, fsync, max_file_bytes, append_files, budget,
            self.generation,
        )  # fmt: skip
        self._table.one_writer = self.policy.one_writer
        self._owners = itertools.count(1)
        self.last_used: dict[str, float] = {}
        self.counts = Counts(self.fields.fields)
        self.reads = Readers(
            self.root, self.node, max_read_bytes, self.touch, self.policy, read_cache,
            self.counts.read,
        )  # fmt: skip
        self.removals = Removals(self._table, self.reads, self._last_use)
        # the GC's two halves, as `Removals` has them
        self.plan_step, self.remove_planned = self.removals.plan_step, self.removals.remove_planned
        self.prefetcher = Prefetcher(self.reads, self.counts, max_read_bytes)
        self.shapes = RunShapes(self.root / node / SHAPES_NAME, self.fields)
        self.watermarks = Watermarks(self.reads)
        self._leases = Leases(
            self._table, self.fields, max_file_bytes, self.last_used, self.shapes,
            self.watermarks,
        )  # fmt: skip

    check_root = staticmethod(check_root)

    # -- appends ------------------------------------------------------------------------

    def placing_lock(self) -> threading.Lock:
        """The lock appends and leases are placed (and their watermark checked) under."""
        return self._table.lock

    def new_owner(self) -> int:
        """A new owner id for files private to one client (a data-plane connection)."""
        with self._table.lock:
            return next(self._owners)

    def files_needed(self, items: Sequence[AppendItem]) -> int:
        """`payloadd.store._placing.files_needed` at this store's rotation size."""
        return files_needed(items, self.max_file_bytes)

    def begin_append(
        self, items: Sequence[AppendItem], private: bool = False, *, transport: str = HTTP
    ) -> PendingAppend:
        """Validate ``items`` and reserve room for their rows.

        Parameters
        ----------
        items : sequence of AppendItem
            Headers of the blocks of rows that will follow, in order.
        private : bool
            Place the rows in new files of this append's own, sealed once it ends, instead
            of the shared current files: for an append whose rows take long to arrive (a
            large HTTP body) or that a client writes itself (a data-plane reservation).
            Given up without a commit, such an append leaves nothing behind.
        transport : {"http", "data_plane"}
            What its commit counts as (`Counts.appended`).

        Returns
        -------
        PendingAppend
            To receive the row bytes (`PendingAppend.write`) and return the segments.

        Raises
        ------
        InvalidRequestError
            An item names a bad field, run, dtype or shape, or overflows int64, or does not
            fit the fields table (`check_item`), or its row shape is not the one its run's
            first append of the field fixed (`RunShapes`); nothing is reserved then.
        StepCollectedError
            An item's step is at or below its run's collected watermark; nothing is
            reserved.
        PayloadTooLargeError
            More items or row bytes than the limits; nothing is reserved.
        StorageFullError
            The rows do not fit under ``max_root_bytes`` or above ``min_free_bytes`` (nothing
            is reserved then), or the file system has no room for a new file or directory.
        BusyError
            No descriptor is left for a new file (``EMFILE``); nothing is left behind.
        """
        sizes = self._checked(items)
        self.watermarks.refresh_if_due()  # I/O: before the lock
        total = sum(n for _, n in sizes)
        if total > self.max_append_bytes:
            raise PayloadTooLargeError(
                f"append of {total} row bytes is above the limit of {self.max_append_bytes}"
            )
        t = self._table
        placing = Placing(t, private)
        with t.lock, os_errors(self.root):  # a collection plans under this lock too
            self._reserve(items, [row_nb for row_nb, _ in sizes], total, placing)
        files = list(placing.held.values())
        return PendingAppend(t, self.counts, items, placing.placements, files, private, transport)

    def _checked(self, items: Sequence[AppendItem]) -> list[tuple[int, int]]:
        """Check ``items`` against the limit on their number, then each (`item_nbytes`,
        `check_item`); return each one's ``(row_nbytes, nbytes)``."""
        if not items:
            raise InvalidRequestError("an append needs at least one item")
        if len(items) > self.max_append_items:
            raise PayloadTooLargeError(
                f"append of {len(items)} items is above the limit of {self.max_append_items}"
            )
        sizes = [item_nbytes(item, i) for i, item in enumerate(items)]
        for i, item in enumerate(items):
            check_item(self.fields, item, i)
        return sizes

    def _reserve(
        self, items: Sequence[AppendItem], row_nbytes: list[int], total: int, placing: Placing
    ) -> None:
        """Check the watermarks, the room for ``total`` bytes and the row shapes of
        ``items``, then place their rows and count them reserved. Lock held."""
        self.watermarks.check((it.run, it.step) for it in items)
        self._table.budget.room(total)
        self.shapes.take((i, it.run, it.field, it.shape) for i, it in enumerate(items))
        placing.place_all(items, row_nbytes)
        now = time.monotonic()
        for it in items:
            self.last_used[it.run] = now
        self._table.budget.reserve(total)

    def lease(
        self,
        run: str,
        step: int,
        field: str,
        nbytes: int,
        size: int,
        owner: int,
        shape: Sequence[int] | None = None,
    ) -> LeasedRange:
        """Reserve a byte range of the file of ``(run, step, field)`` private to ``owner``.

        The range is at least ``nbytes`` and at most ``max(nbytes, size)`` bytes; it never
        crosses the rotation size. Only ``owner``'s leases are ever placed in that file (a
        new one when there is none yet, it was removed or is full), so the descriptor its
        client gets can only reach its own rows (a new file's is kept for it:
        `LeasedRange.writer`). The file stays open (and counts as appended to) until the
        lease is released; it is sealed by `end_owner`. Whoever hands the lease to a client
        counts it (`Counts.leased`).

        Raises
        ------
        InvalidRequestError
            A bad run or field name, or a field the fields table refuses.
        PayloadTooLargeError
            ``nbytes`` is above the rotation size (use `begin_append`, which splits).
        StorageFullError
            ``nbytes`` does not fit under ``max_root_bytes`` or above ``min_free_bytes``;
            nothing is reserved. Near a limit, the range shrinks to what fits (at least
            ``nbytes``). The whole range counts against the cap from now on, until its file
            is closed (then an unused tail at the file's end stops counting).
        StepCollectedError
            ``step`` is at or below the run's collected watermark.

        ``shape``: the row shape of the rows the client places in the lease (a data-plane
        client's), checked and fixed where first as an append's (`RunShapes.lease`), once
        every other check passed; ``None``: not checked (a client older than it).
        """
        got = self._leases.lease((run, step, field), nbytes, size, owner, shape=shape)
        assert got is not None
        return got

    def lease_ahead(
        self,
        run: str,
        step: int,
        field: str,
        nbytes: int,
        size: int,
        owner: int,
        shape: Sequence[int] | None = None,
    ) -> LeasedRange | None:
        """`lease`, for a key a client has not appended to yet (it asks ahead, to save a
        round trip later): ``None``, nothing reserved, unless the disk limits leave room for
        `payloadd.store._leases.AHEAD_ROOM` such leases, ``step`` is not collected, and the
        run took ``shape`` for ``field`` already (a lease ahead fixes no shape)."""
        key = (run, step, field)
        return self._leases.lease(key, nbytes, size, owner, ahead=True, shape=shape)

    def declare_shapes(self, shapes: Sequence[tuple[str, str, list[int]]]) -> None:
        """Check (and fix, where first) the row shapes ``(run, field, shape)`` a data-plane
        client will append in its leases (`RunShapes.take`).

        Raises
        ------
        InvalidRequestError
            A bad run or field name, a field the table refuses, or a shape other than the
            one fixed for its run and field (naming both).
        """
        with os_errors(self.root):
            self.shapes.declare(shapes)

    def forget_shapes(self, run: str, node: str | None = None) -> None:
        """Forget the row shapes ``run`` fixed on this node, or on ``node``'s prefix (whose
        daemon reads them at its next start), as its deletion begins: under the lock leases
        are granted under, so that a lease granted after fixes its shape anew. An error of
        the file is logged: the shapes then stay fixed (a new run of the name takes them)."""
        shapes = self.shapes
        if node is not None and node != self.node:
            shapes = RunShapes(self.root / node / SHAPES_NAME, self.fields)
        try:
            with self._table.lock:
                shapes.forget(run)
        except OSError as exc:
            log.warning("the row shapes of deleted run %r stay fixed: %s", run, exc)

    def syncs_together(self) -> contextlib.AbstractContextManager[None]:
        """A block whose new files' directories are fsync'd once each at its end, under
        ``fsync="always"`` (`FileTable.syncs_together`): several leases at once."""
        return self._table.syncs_together()

    def seal_lease(self, owner: int, key: tuple[str, int, str]) -> None:
        """``owner``'s connection is done with ``key`` (its oldest lease ended): seal its
        lease file of that key, which closes once no lease uses it."""
        self._leases.seal_lease(owner, key)

    def end_owner(self, owner: int) -> None:
        """``owner``'s connection ended: seal its lease files (each closes once its last
        lease is released, and the unused tail stops counting). One it never wrote a byte
        into is removed: no row of it was acknowledged (a client that writes after all
        finds the file removed, and places its rows again, as after garbage collection)."""
        self._leases.end_owner(owner)

    def append(self, items: Sequence[AppendItem], data: Any) -> list[list[PayloadSegment]]:
        """Append ``items`` whose rows are ``data`` (concatenated); return their segments."""
        pending = self.begin_append(items)
        try:
            pending.write(data)
            return pending.commit()
        finally:
            pending.close()

    # -- reads (see payloadd.store._readers) ---------------------------------------------------

    def touch(self, run: str) -> None:
        """Mark ``run`` of this node as in use now (the GC age rule spares it); a name that
        is no run directory is ignored (`last_used` stays as small as the runs on disk)."""
        if run in self.last_used or (
            _NAME.fullmatch(run) and os.path.isdir(self.root / self.node / run)
        ):
            self.last_used[run] = time.monotonic()

    def open_for_read(self, rel: str, end: int, deadline: float | None = None) -> int:
        """`Readers.open_for_read` of this store."""
        return self.reads.open_for_read(rel, end, deadline)

    def open_extents(self, extents: Sequence[Extent]) -> ExtentReader:
        """`Readers.open_extents` of this store."""
        return self.reads.open_extents(extents)

    def read_extents(self, extents: Sequence[Extent]) -> bytearray:
        """`Readers.read_extents` of this store."""
        return self.reads.read_extents(extents)

    def ledger(self, node: str | None = None) -> Ledger:
        """The GC ledger of ``node`` (default: this daemon's)."""
        return self.reads.ledger(node)

    # -- removal (see payloadd.store._removal) -------------------------------------------

    def _last_use(self, run: str) -> float:
        """When ``run`` of this node was last appended to or read (monotonic; its start for a
        run not used since)."""
        return self.last_used.get(run, self.started)

    def runs(self, node: str | None = None) -> dict[str, list[int]]:
        """`Removals.runs` of this store."""
        return self.removals.runs(node)

    def step_files(self, run: str, step: int, node: str | None = None) -> list[str]:
        """`Removals.step_files` of this store."""
        return self.removals.step_files(run, step, node)

    def remove_step(self, run: str, step: int, files: Collection[str]) -> Removal:
        """`Removals.plan_step`, then `Removals.remove_planned`: no ledger line, no grace
        (GC's are between)."""
        return self.removals.remove_planned(run, step, self.removals.plan_step(run, step, files))

    def remove_run_dir(self, run: str, node: str | None = None) -> int:
        """`Removals.remove_run_dir` of this store."""
        return self.removals.remove_run_dir(run, node)

    def remove_orphans(self, *, dry_run: bool = False) -> Removal:
        """`Removals.remove_orphans` of this store."""
        return self.removals.remove_orphans(dry_run=dry_run)

    def forget_unused_runs(self) -> None:
        """Drop the last use of runs that have no directory any more."""
        for run in list(self.last_used):
            if not os.path.isdir(self.root / self.node / run):
                self.last_used.pop(run, None)

    # -- shutdown and state -------------------------------------------------------------

    def close(self) -> None:
        """Close every descriptor the store holds (at shutdown)."""
        self.prefetcher.close()
        self._table.close()
        self.reads.close()
        if self.generation is not None:
            self.generation.close()

    def count(self, name: str, n: int = 1) -> None:
        """`Counts.add` of this store: add ``n`` to the counter ``name`` of `Stats`; it stops
        at ``INT64_MAX``."""
        self.counts.add(name, n)

    def stats(self) -> Stats:
        """Counters since start, durability and disk limits (bytes in bytes, uptime in
        seconds)."""
        try:
            st = os.statvfs(self.root)  # outside the lock: on a network file system, a round trip
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        c: dict[str, int] = self.counts.totals()
        t = self._table
        with t.lock:
            open_files = len(t.shared) + len(t.leased) + sum(map(len, t.spares.values()))
            b = t.budget
            disk = {"root_bytes": b.used, "max_root_bytes": b.max_root_bytes}
            disk |= {"free_bytes": free, "min_free_bytes": b.min_free_bytes}
            disk |= {"appends_refused": b.refused}
            reserved = [(f"{self.root}/{f.rel}", f.size, f.ino) for f in t.open_files.values()]
        disk["reserved_bytes"] = sum(map(unwritten, reserved))  # outside the lock: stats
        d = t.dirty
        flushed = {"flushes": 0, "files_flushed": 0, "files_dirty": 0, "flush_errors": 0}
        if d is not None:
            flushed = {"flushes": d.flushes, "files_flushed": d.files_flushed}
            flushed |= {"files_dirty": d.pending(), "flush_errors": d.flush_errors}
        return Stats(
            node=self.node,
            root=str(self.root),
            uptime_s=time.monotonic() - self.started,
            files_open_for_append=open_files,
            max_file_bytes=self.max_file_bytes,
            fsync=self.fsync,
            **c,
            **flushed,
            **disk,
        )

    def open_descriptors(self) -> tuple[int, int, int]:
        """``(data files open for appends, cached read descriptors, leases held)``: the
        daemon's write descriptors (current shared files, and files a pending append still
        uses), its read cache, and the data-plane leases not yet ended (their files are
        written through the clients' own descriptors)."""
        t = self._table
        with t.lock:
            append_fds = sum(1 for f in t.open_files.values() if f.fd >= 0)
            leases = sum(f.leases for f in t.open_files.values())
        return append_fds, self.reads.cached(), leases

    # -- durability and disk limits -----------------------------------------------------

    def flush(self) -> list[str]:
        """fsync what was written since the last flush (``fsync="interval"``).

        Every data file an append committed to, every file with a data-plane lease (the
        client writes it unseen), every file whose lease ended since, and every directory
        that got a new entry. A file closed in the meantime is flushed by path; one removed
        in the meantime is skipped.

        Returns
        -------
        list of str
            The data files fsync'd, relative to the root; empty under another policy.
        """
        d = self._table.dirty
        return [] if d is None else d.flush()

    def forget_bytes(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` against ``max_root_bytes``: call it after removing files
        under this node's prefix (garbage collection), with the sum of their apparent sizes
        (``st_size``) as seen just before removal. Cheap; never below zero.
        """
        with self._table.lock:
            self._table.budget.forget(nbytes)

    def recount(self) -> int:
        """Count this node's bytes anew by scanning ``<root>/<node>``; return the count.

        The apparent sizes of its files, plus bytes reserved but not written yet in the files
        open for appends. O(files): for after a large removal, or to correct drift (files
        removed by hand). Appends go on during the scan; a file sealed during it may be
        counted at the size the scan saw.
        """
        sizes = tree_sizes(self.root / self.node)
        t = self._table
        with t.lock:
            used = sum(sizes.values())
            for f in t.open_files.values():
                used += max(0, f.size - sizes.get(self.root / f.rel, 0))
            t.budget.used = used
        return used

    @property
    def root_bytes(self) -> int:
        """Bytes counted against ``max_root_bytes`` now (see `recount`)."""
        with self._table.lock:
            return self._table.budget.used

    @property
    def _open(self) -> dict[str, AppendFile]:
        """Every file whose reserved bytes count, by path (`FileTable.open_files`)."""
        return self._table.open_files


_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
