"""The storage core: append-only data files under the payload root; sync, no HTTP.

Layout: ``<root>/<node>/<run>/<step>/<field>-<instance>-<seq>.bin``. ``instance`` is new at
every start, so a restarted daemon never appends to a file an earlier one wrote.

Appends are two-phase so that many writers can share a file: `Store.begin_append` reserves
byte ranges under one lock (placement and rotation), the caller writes the rows with
``os.pwrite`` outside the lock (`PendingAppend.write`), and `PendingAppend.commit` returns the
segments once every byte is written (and fsync'd under ``fsync="always"``; under
``fsync="interval"`` the files are marked for the next flush, `Store.flush`).

Every reservation is checked against the disk limits first (`payloadd._limits`): an append
or lease that does not fit under ``max_root_bytes`` or above ``min_free_bytes`` fails with
`StorageFullError` before anything is reserved.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from payload_client import (
    SUPPORTED_DTYPES,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadError,
    PayloadSegment,
    PayloadTooLargeError,
    SegmentFileError,
    ServerError,
    StorageFullError,
)
from payload_client._segment import INT64_MAX, check_name, check_relative_path
from payload_client._wire import AppendItem, Extent, Stats

from ._durability import DirtyFiles
from ._ledger import LEDGER_NAME, Ledger
from ._limits import DiskBudget, tree_sizes

__all__ = ["ExtentReader", "Lease", "PendingAppend", "Removal", "Store"]

DIR_MODE = 0o750
FILE_MODE = 0o640
READ_CACHE = 256
"""Read-only descriptors the store keeps open, least recently used closed first."""
OPEN_FOR_APPEND = 256
"""Files kept open for appends (one per run, step and field); the least recently used is
sealed beyond that: later appends of its key start a new file."""


def item_nbytes(item: AppendItem, index: int = 0) -> tuple[int, int]:
    """Validate an append item; return ``(row_nbytes, nbytes)`` of its rows.

    Raises
    ------
    InvalidRequestError
        Naming the item and the bad field.
    """
    where = f"item {index}"
    check_name(item.field, f"{where} field")
    check_name(item.run, f"{where} run")
    if item.dtype not in SUPPORTED_DTYPES:
        raise InvalidRequestError(
            f"{where} dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {item.dtype!r}"
        )
    if not item.shape or any(d <= 0 for d in item.shape):
        raise InvalidRequestError(f"{where} shape must be non-empty with entries > 0")
    row_nb = np.dtype(item.dtype).itemsize
    for d in item.shape:
        row_nb *= d
        if row_nb > INT64_MAX:
            raise InvalidRequestError(f"{where} row size overflows int64")
    if item.pos + item.rows > INT64_MAX:
        raise InvalidRequestError(f"{where} pos + rows overflows int64")
    if row_nb * item.rows > INT64_MAX:
        raise InvalidRequestError(f"{where} rows * row size overflows int64")
    return row_nb, row_nb * item.rows


@contextlib.contextmanager
def os_errors(root: Path) -> Iterator[None]:
    """Translate OS errors of the payload root: a full disk or quota is 507, others 500."""
    try:
        yield
    except PayloadError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(f"payload root {root} is full: {exc.strerror}") from exc
        raise ServerError(f"I/O error under the payload root {root}: {exc}") from exc


@dataclass(eq=False)
class _File:
    """A data file open for appends. ``size`` is the end of what has been reserved; ``fd``
    stays open while the file takes appends or a pending append or lease still uses it.
    ``users`` counts both; ``leases`` the leases among them (GC may remove a leased file:
    the client checks after writing, see `Store.remove_step`)."""

    rel: str
    size: int
    fd: int
    key: tuple[str, int, str]
    users: int = 0
    leases: int = 0
    sealed: bool = False


@dataclass(frozen=True)
class _Extent:
    """A reserved byte range of one file for rows ``[pos, pos + rows)`` of one item."""

    item: int
    file: _File
    offset: int
    pos: int
    rows: int
    nbytes: int


class PendingAppend:
    """Reserved byte ranges waiting for their rows; fill with `write`, finish with `commit`.

    The rows arrive as one byte stream: item 0's rows, then item 1's, ... in any chunking.
    The files stay open (the store's descriptors) until `commit` or `close`.
    """

    def __init__(
        self, store: Store, items: Sequence[AppendItem], extents: list[_Extent], files: list[_File]
    ) -> None:
        self._store = store
        self._items = items
        self._extents = extents
        self._files = files
        self._cursor = 0  # index into extents
        self._done = 0  # bytes of extents[cursor] written
        self.remaining = sum(e.nbytes for e in extents)
        self._closed = False

    def write(self, data: Any) -> None:
        """Write the next bytes of the row stream (pwrite into the reserved ranges).

        Raises
        ------
        InvalidRequestError
            If more bytes arrive than the items announce.
        """
        view = memoryview(data).cast("B")
        with os_errors(self._store.root):
            self._write(view)

    def _write(self, view: memoryview) -> None:
        if view.nbytes > self.remaining:
            raise InvalidRequestError(
                f"body carries more row bytes than its items announce ({self.remaining} left)"
            )
        while view.nbytes:
            ext = self._extents[self._cursor]
            take = min(ext.nbytes - self._done, view.nbytes)
            at = 0
            while at < take:
                at += os.pwrite(ext.file.fd, view[at:take], ext.offset + self._done + at)
            view = view[take:]
            self._done += take
            self.remaining -= take
            if self._done == ext.nbytes:
                self._cursor += 1
                self._done = 0

    @property
    def files(self) -> list[tuple[str, int]]:
        """The files written to, with the store's descriptors: ``(file, fd)`` (borrowed)."""
        return [(f.rel, f.fd) for f in self._files]

    @property
    def extents(self) -> list[tuple[str, int, int]]:
        """The reserved ranges in row-stream order: ``(file, offset, nbytes)``."""
        return [(e.file.rel, e.offset, e.nbytes) for e in self._extents]

    def written_elsewhere(self) -> None:
        """Declare every reserved byte written by the client (data plane) and not here."""
        self.remaining = 0

    def commit(self) -> list[list[PayloadSegment]]:
        """Return the segments of every item, once all their bytes are written.

        Raises
        ------
        InvalidRequestError
            If fewer bytes were written than the items announce.
        """
        if self.remaining:
            raise InvalidRequestError(f"body ended {self.remaining} row bytes early")
        try:
            if self._store.fsync == "always":
                with os_errors(self._store.root):
                    for f in self._files:
                        os.fsync(f.fd)
            elif self._store._dirty is not None:
                self._store._dirty.wrote(f.rel for f in self._files)
        finally:
            self.close()
        out: list[list[PayloadSegment]] = [[] for _ in self._items]
        for e in self._extents:
            it = self._items[e.item]
            out[e.item].append(
                PayloadSegment(
                    it.field, e.file.rel, e.offset, e.pos, e.rows, it.dtype, list(it.shape)
                )
            )
        self._store._count_append(self._items)
        return out

    def close(self) -> None:
        """Let go of the files (an uncommitted append leaves unreferenced bytes)."""
        if not self._closed:
            self._closed = True
            self._store._release(self._files)


class Lease:
    """A private byte range of a data file, handed to one client; see `Store.lease`."""

    def __init__(self, store: Store, f: _File, offset: int, nbytes: int) -> None:
        self._store, self._file = store, f
        self.file, self.fd, self.offset, self.nbytes = f.rel, f.fd, offset, nbytes
        self._released = False

    def release(self) -> None:
        """The client is done with the range (its unused tail stays a hole)."""
        if not self._released:
            self._released = True
            with self._store._lock:
                self._file.leases -= 1
            if self._store._dirty is not None:
                self._store._dirty.released(self.file)
            self._store._release([self._file])


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
        files' apparent sizes plus reserved bytes (see `payloadd._limits`).
    min_free_bytes : int
        Free-space floor of the root's file system; 0 for none.
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
    ) -> None:
        self.node = check_name(node, "node")
        self.root = self.check_root(root)
        self._root_prefix = str(self.root) + os.sep
        self.max_file_bytes = max_file_bytes
        self.max_read_bytes = max_read_bytes
        self.max_append_bytes = max_append_bytes
        self.max_append_items = max_append_items
        self.fsync = fsync
        self._dirty = DirtyFiles(self.root) if fsync == "interval" else None
        self._budget = DiskBudget(self.root, self.root / node, max_root_bytes, min_free_bytes)
        self.instance = secrets.token_hex(4)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, int, str], _File] = OrderedDict()
        self._open: dict[str, _File] = {}  # every file whose descriptor is open, by path
        self.last_used: dict[str, float] = {}  # run of this node -> monotonic time
        self._ledgers: dict[str, Ledger] = {}
        self._readers: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._seq = 0
        self._counts = {"appends": 0, "rows_appended": 0, "bytes_appended": 0}
        self._counts |= {"reads": 0, "bytes_read": 0, "data_plane_requests": 0}
        self._counts |= {"data_plane_fds": 0, "leases": 0, "leased_bytes": 0}

    @staticmethod
    def check_root(root: str | os.PathLike[str]) -> Path:
        """Create the payload root (mode 0750) if missing; return its real path.

        Raises
        ------
        OSError
            When it cannot be created, is not a directory, or is not writable.
        """
        if os.path.lexists(root) and not os.path.isdir(root):
            raise NotADirectoryError(f"payload root {root} exists and is not a directory")
        if not os.path.lexists(root):
            os.makedirs(root, mode=DIR_MODE, exist_ok=True)
            os.chmod(root, DIR_MODE)  # a root we create is 0750; an existing one keeps its mode
        real = Path(os.path.realpath(root))
        if not os.access(real, os.W_OK | os.X_OK):
            raise PermissionError(f"payload root {root} is not writable by this user")
        return real

    # -- appends ------------------------------------------------------------------------

    def _seal(self, f: _File) -> None:
        """No more appends to ``f``; close it once no pending append uses it. Lock held."""
        f.sealed = True
        if f.users == 0 and f.fd >= 0:
            self._close_file(f)

    def _close_file(self, f: _File) -> None:
        """Close ``f``'s descriptor; reserved bytes past its end were never written, and stop
        counting against the cap. Lock held."""
        with contextlib.suppress(OSError):
            self._budget.forget(max(0, f.size - os.fstat(f.fd).st_size))
        os.close(f.fd)
        f.fd = -1
        self._open.pop(f.rel, None)

    def _current(self, key: tuple[str, int, str]) -> _File:
        """The file ``key`` appends to now (a new one if none, or it was removed). Lock held."""
        f = self._files.get(key)
        if f is None or os.fstat(f.fd).st_nlink == 0:
            return self._new_file(*key)
        self._files.move_to_end(key)
        return f

    @staticmethod
    def _hold(f: _File, held: dict[int, _File]) -> None:
        if id(f) not in held:
            held[id(f)] = f
            f.users += 1

    def _release(self, files: list[_File]) -> None:
        with self._lock:
            for f in files:
                f.users -= 1
                if f.sealed and f.users == 0 and f.fd >= 0:
                    self._close_file(f)

    def _mkdirs(self, rel_dir: str) -> list[str]:
        """Create ``rel_dir`` and its parents under the root, each with mode 0750; return the
        directories that got a new entry (relative, ``"."`` for the root)."""
        path, parent = self.root, "."
        grown: list[str] = []
        for part in rel_dir.split("/"):
            path = path / part
            rel = part if parent == "." else f"{parent}/{part}"
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                parent = rel
                continue
            os.chmod(path, DIR_MODE)  # exact mode, whatever the umask
            grown.append(parent)
            parent = rel
        return grown

    def _new_file(self, run: str, step: int, field: str) -> _File:
        """Create the next data file of ``(run, step, field)``; caller holds the lock."""
        d = f"{self.node}/{run}/{step}"
        grown = [*self._mkdirs(d), d]  # directories with a new entry: parents first
        self._seq += 1
        rel = f"{d}/{field}-{self.instance}-{self._seq:06d}.bin"
        fd = os.open(
            self.root / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE
        )
        if self.fsync == "always":
            for g in reversed(grown):  # the file's entry first, up to the root's
                dfd = os.open(self.root / g, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        elif self._dirty is not None:
            self._dirty.created(grown)
        key = (run, step, field)
        old = self._files.pop(key, None)
        if old is not None:
            self._seal(old)
        f = _File(rel, 0, fd, key)
        self._files[key] = f
        self._open[rel] = f
        while len(self._files) > OPEN_FOR_APPEND:  # the least recently appended to rests
            self._seal(self._files.popitem(last=False)[1])
        return f

    def _place(
        self, index: int, item: AppendItem, row_nb: int, held: dict[int, _File]
    ) -> list[_Extent]:
        """Reserve room for one item's rows; caller holds the lock."""
        key = (item.run, item.step, item.field)
        out: list[_Extent] = []
        rows, pos = item.rows, item.pos
        f = self._current(key)
        while True:
            nbytes = rows * row_nb
            fits = f.size + nbytes <= self.max_file_bytes
            if fits or rows == 0 or (f.size == 0 and rows == 1):
                self._hold(f, held)
                out.append(_Extent(index, f, f.size, pos, rows, nbytes))
                f.size += nbytes
                return out
            if f.size > 0:
                f = self._new_file(*key)
                continue
            # an empty file and more rows than fit: fill it, then go on in the next one
            take = max(1, self.max_file_bytes // row_nb)
            self._hold(f, held)
            out.append(_Extent(index, f, 0, pos, take, take * row_nb))
            f.size = take * row_nb
            rows, pos = rows - take, pos + take

    def begin_append(self, items: Sequence[AppendItem]) -> PendingAppend:
        """Validate ``items`` and reserve room for their rows.

        Parameters
        ----------
        items : sequence of AppendItem
            Headers of the blocks of rows that will follow, in order.

        Returns
        -------
        PendingAppend
            To receive the row bytes (`PendingAppend.write`) and return the segments.

        Raises
        ------
        InvalidRequestError
            An item names a bad field, run, dtype or shape, or overflows int64; nothing is
            reserved then.
        PayloadTooLargeError
            More items or row bytes than the limits; nothing is reserved.
        StorageFullError
            The rows do not fit under ``max_root_bytes`` or above ``min_free_bytes`` (nothing
            is reserved then), or the file system has no room for a new file or directory.
        """
        if not items:
            raise InvalidRequestError("an append needs at least one item")
        if len(items) > self.max_append_items:
            raise PayloadTooLargeError(
                f"append of {len(items)} items is above the limit of {self.max_append_items}"
            )
        sizes = [item_nbytes(item, i) for i, item in enumerate(items)]
        total = sum(n for _, n in sizes)
        if total > self.max_append_bytes:
            raise PayloadTooLargeError(
                f"append of {total} row bytes is above the limit of {self.max_append_bytes}"
            )
        held: dict[int, _File] = {}  # files this append writes to, kept open until it is done
        with self._lock, os_errors(self.root):
            self._budget.room(total, f"append of {total} bytes")
            extents = [
                e for i, it in enumerate(items) for e in self._place(i, it, sizes[i][0], held)
            ]
            now = time.monotonic()
            for it in items:
                self.last_used[it.run] = now
            self._budget.reserve(total)
        return PendingAppend(self, items, extents, list(held.values()))

    def lease(self, run: str, step: int, field: str, nbytes: int, size: int) -> Lease:
        """Reserve a private byte range of the current file of ``(run, step, field)``.

        The range is at least ``nbytes`` and at most ``max(nbytes, size)`` bytes; it never
        crosses the rotation size. The file stays open (and counts as appended to) until the
        lease is released.

        Raises
        ------
        InvalidRequestError
            A bad run or field name.
        PayloadTooLargeError
            ``nbytes`` is above the rotation size (use `begin_append`, which splits).
        StorageFullError
            ``nbytes`` does not fit under ``max_root_bytes`` or above ``min_free_bytes``;
            nothing is reserved. Near a limit, the range shrinks to what fits (at least
            ``nbytes``). The whole range counts against the cap from now on, until its file
            is closed (then an unused tail at the file's end stops counting).
        """
        check_name(run, "run")
        check_name(field, "field")
        if nbytes > self.max_file_bytes:
            raise PayloadTooLargeError(
                f"lease of {nbytes} bytes is above the rotation size {self.max_file_bytes}"
            )
        key = (run, step, field)
        with self._lock, os_errors(self.root):
            room = self._budget.room(nbytes, f"lease of {nbytes} bytes")
            f = self._current(key)
            if f.size + nbytes > self.max_file_bytes and f.size > 0:
                f = self._new_file(*key)
            granted = max(nbytes, min(size, self.max_file_bytes - f.size, room))
            offset = f.size
            f.size += granted
            f.users += 1
            f.leases += 1
            self.last_used[run] = time.monotonic()
            self._budget.reserve(granted)
            if self._dirty is not None:
                self._dirty.leased(f.rel)
            self._counts["leases"] += 1
            self._counts["leased_bytes"] += granted
        return Lease(self, f, offset, granted)

    def append(self, items: Sequence[AppendItem], data: Any) -> list[list[PayloadSegment]]:
        """Append ``items`` whose rows are ``data`` (concatenated); return their segments."""
        pending = self.begin_append(items)
        try:
            pending.write(data)
            return pending.commit()
        finally:
            pending.close()

    def _count_append(self, items: Sequence[AppendItem]) -> None:
        with self._lock:
            self._counts["appends"] += 1
            self._counts["rows_appended"] += sum(it.rows for it in items)
            self._counts["bytes_appended"] += sum(item_nbytes(it)[1] for it in items)

    # -- reads --------------------------------------------------------------------------

    def open_for_read(self, rel: str, end: int) -> int:
        """Open a data file for reading after checking it against a segment's end.

        Parameters
        ----------
        rel : str
            Path relative to the root.
        end : int
            Byte offset just past the segment: the file must be at least that long.

        Returns
        -------
        int
            A read-only file descriptor of its own; the caller closes it.

        Raises
        ------
        InvalidSegmentError
            ``rel`` is not a normalised relative path.
        FileMissingError
            The file does not exist.
        SegmentFileError
            It resolves outside the root, is not a regular file, or is shorter than ``end``.

        Notes
        -----
        Descriptors of recently read files are kept open (`READ_CACHE` of them). A cached one
        is used only while ``rel`` still names the same file (one ``stat``), so a removed or
        replaced file is never served from the cache.
        """
        node, _, rest = rel.partition("/")
        with self._lock:
            if node == self.node:  # a run being read is in use (the TTL rule spares it)
                self.last_used[rest.partition("/")[0]] = time.monotonic()
            hit = self._readers.get(rel)
            if hit is not None:
                self._readers.move_to_end(rel)
                fd = os.dup(hit[0])
        if hit is not None:
            try:
                st = os.stat(self.root / rel)
                same = (st.st_dev, st.st_ino) == hit[1:]
            except OSError:
                same = False
            if same:
                if st.st_size < end:
                    os.close(fd)
                    raise SegmentFileError(
                        f"payload file {rel!r} has {st.st_size} bytes but a segment ends at "
                        f"byte {end}"
                    )
                return fd
            os.close(fd)
            self._drop_reader(rel)
        fd = self._open_checked(rel, end)
        st = os.fstat(fd)
        with self._lock:
            self._readers[rel] = (os.dup(fd), st.st_dev, st.st_ino)
            while len(self._readers) > READ_CACHE:
                os.close(self._readers.popitem(last=False)[1][0])
        return fd

    def _drop_reader(self, rel: str) -> None:
        with self._lock:
            hit = self._readers.pop(rel, None)
        if hit is not None:
            os.close(hit[0])

    def _open_checked(self, rel: str, end: int) -> int:
        try:
            check_relative_path(rel)
        except ValueError as exc:
            raise InvalidSegmentError(f"file {exc}", field="file") from None
        real = os.path.realpath(self.root / rel)
        if not real.startswith(self._root_prefix):
            raise SegmentFileError(f"payload file {rel!r} resolves outside the payload root")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            self._raise_if_collected(rel)
            raise FileMissingError(f"payload file {rel!r} does not exist") from None
        except OSError as exc:
            raise SegmentFileError(f"payload file {rel!r} cannot be opened: {exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentFileError(f"payload file {rel!r} is not a regular file")
            if st.st_size < end:
                raise SegmentFileError(
                    f"payload file {rel!r} has {st.st_size} bytes but a segment ends at byte {end}"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def ledger(self, node: str | None = None) -> Ledger:
        """The GC ledger of ``node`` (default: this daemon's), loaded on first use."""
        node = node or self.node
        with self._lock:
            led = self._ledgers.get(node)
            if led is None:
                led = self._ledgers[node] = Ledger(self.root / node / LEDGER_NAME)
        return led

    def _raise_if_collected(self, rel: str) -> None:
        """Raise `FileGoneError` when the ledger says the step of missing file ``rel`` was
        collected."""
        parts = rel.split("/")
        step = _step_of(parts[2]) if len(parts) == 4 else None
        if step is None:
            return
        node, run = parts[0], parts[1]
        c = self.ledger(node).find(run, step)
        if c is not None:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.at))
            raise FileGoneError(
                f"payload file {rel!r} is gone: step {step} of run {run!r} was "
                f"garbage-collected ({c.reason}, {when})"
            )

    # -- removal (garbage collection; the rules are in _gc.py) ---------------------------

    def runs(self) -> dict[str, list[int]]:
        """This node's runs and their steps on disk, both sorted."""
        out: dict[str, list[int]] = {}
        base = self.root / self.node
        for run in sorted(_dir_names(base)):
            steps = (_step_of(name) for name in _dir_names(base / run))
            out[run] = sorted(step for step in steps if step is not None)
        return out

    def remove_step(
        self, run: str, step: int, *, dry_run: bool = False, idle_since: float | None = None
    ) -> Removal:
        """Remove the data files of one step of this node, then its directory if empty.

        Files a pending append still writes to are kept (`Removal.in_use`). A leased file is
        removed: the data-plane client checks its file after writing and places the rows
        again in a new lease when it is gone, so no acknowledged append is lost. The
        daemon's cached read descriptor of a removed file is closed; a client's (or a read
        in progress) keeps the file's blocks until closed.

        Parameters
        ----------
        run, step : str, int
            The step directory ``<root>/<node>/<run>/<step>``.
        dry_run : bool
            Count, remove nothing.
        idle_since : float, optional
            Monotonic time: remove nothing when the run was appended to or read after it
            (checked under the lock that appends take).

        Returns
        -------
        Removal
            What was (or would be) removed.
        """
        rel_dir = f"{self.node}/{run}/{step}"
        out = Removal()
        with self._lock, os_errors(self.root):
            if idle_since is not None and self.last_used.get(run, self.started) > idle_since:
                return out
            for name in _file_names(self.root / rel_dir):
                rel = f"{rel_dir}/{name}"
                f = self._open.get(rel)
                if f is not None and f.users > f.leases:
                    out.in_use += 1
                    continue
                try:
                    size = os.lstat(self.root / rel).st_size
                except FileNotFoundError:
                    continue
                out.files.append((rel, size))
                if dry_run:
                    continue
                if f is not None:
                    if self._files.get(f.key) is f:
                        del self._files[f.key]
                    f.sealed = True
                    if f.fd >= 0:  # leases write through their own descriptors: this one
                        self._close_file(f)  # would only hold the space
                os.unlink(self.root / rel)
                self._budget.forget(size)
                hit = self._readers.pop(rel, None)
                if hit is not None:
                    os.close(hit[0])
            if not dry_run:
                out.dirs += _rmdir_if_empty(self.root / rel_dir)
        return out

    def remove_run_dir(self, run: str) -> int:
        """Remove the directory of ``run`` of this node if it is empty; 1 if removed."""
        with self._lock:
            return _rmdir_if_empty(self.root / self.node / run)

    def remove_orphans(self, *, dry_run: bool = False) -> Removal:
        """Remove this node's empty data files of earlier daemons, and empty directories.

        An earlier daemon's file of 0 bytes never took a row, so no append was acknowledged
        from it (a crash between creating a file and writing it leaves one). Files of this
        daemon and non-empty files are never orphans: bytes written by an append in flight at
        a crash (a torn tail) sit in files that also hold acknowledged segments and are
        reclaimed with their step.
        """
        out = Removal()
        base = self.root / self.node
        for run, steps in self.runs().items():
            for step in steps:
                rel_dir = f"{self.node}/{run}/{step}"
                with self._lock, os_errors(self.root):
                    for name in _file_names(self.root / rel_dir):
                        if f"-{self.instance}-" in name:
                            continue
                        rel = f"{rel_dir}/{name}"
                        try:
                            if os.lstat(self.root / rel).st_size:
                                continue
                        except FileNotFoundError:
                            continue
                        out.files.append((rel, 0))
                        if not dry_run:
                            os.unlink(self.root / rel)
                    if not dry_run:
                        out.dirs += _rmdir_if_empty(self.root / rel_dir)
            if not dry_run:
                with self._lock, os_errors(self.root):
                    out.dirs += _rmdir_if_empty(base / run)
        return out

    def open_extents(self, extents: Sequence[Extent]) -> ExtentReader:
        """Check a read of byte ranges and open its files; nothing is read yet.

        Every check that can fail before a byte is sent happens here, so that an HTTP answer
        can still be an error.

        Returns
        -------
        ExtentReader
            Reads the ranges in order (`ExtentReader.chunks`); close it when done.

        Raises
        ------
        InvalidRequestError
            An extent reaches past its segment's end (``offset + nbytes > end``).
        PayloadTooLargeError
            The total is above ``max_read_bytes``.
        FileMissingError, SegmentFileError, InvalidSegmentError
            See `open_for_read`.
        """
        total = 0
        for i, e in enumerate(extents):
            if e.offset + e.nbytes > e.end:
                raise InvalidRequestError(
                    f"extent {i}: offset + nbytes = {e.offset + e.nbytes} is past end {e.end}"
                )
            total += e.nbytes
        if total > self.max_read_bytes:
            raise PayloadTooLargeError(
                f"read of {total} bytes is above the limit of {self.max_read_bytes}"
            )
        fds: dict[str, int] = {}
        try:
            for e in extents:  # check every file before reading anything
                if e.file not in fds:
                    fds[e.file] = self.open_for_read(e.file, e.end)
                elif e.end > os.fstat(fds[e.file]).st_size:
                    self.open_for_read(e.file, e.end)  # raises the size error
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return ExtentReader(self, list(extents), fds, total)

    def read_extents(self, extents: Sequence[Extent]) -> bytearray:
        """Read byte ranges with pread; return them concatenated in order.

        Raises
        ------
        InvalidRequestError, PayloadTooLargeError, FileMissingError, SegmentFileError,
        InvalidSegmentError
            See `open_extents`; nothing is returned then.
        """
        reader = self.open_extents(extents)
        try:
            out = bytearray(reader.total)  # bounded by the files' sizes now
            reader.read_into(memoryview(out))
        finally:
            reader.close()
        return out

    def _count_read(self, nbytes: int) -> None:
        with self._lock:
            self._counts["reads"] += 1
            self._counts["bytes_read"] += nbytes

    def close(self) -> None:
        """Close every descriptor the store holds (at shutdown)."""
        with self._lock:
            for f in self._files.values():
                if f.fd >= 0:
                    self._close_file(f)
            self._files.clear()
            self._open.clear()
            for fd, _, _ in self._readers.values():
                os.close(fd)
            self._readers.clear()

    # -- state --------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` of `Stats`."""
        with self._lock:
            self._counts[name] += n

    def stats(self) -> Stats:
        """Counters since start, durability and disk limits (bytes in bytes, uptime in
        seconds)."""
        try:
            st = os.statvfs(self.root)  # outside the lock: on a network file system, a round trip
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        with self._lock:
            c = dict(self._counts)
            open_files = len(self._files)
            b = self._budget
            disk = {"root_bytes": b.used, "max_root_bytes": b.max_root_bytes}
            disk |= {"free_bytes": free, "min_free_bytes": b.min_free_bytes}
            disk |= {"appends_refused": b.refused}
        d = self._dirty
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
        return [] if self._dirty is None else self._dirty.flush()

    def forget_bytes(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` against ``max_root_bytes``: call it after removing files
        under this node's prefix (garbage collection), with the sum of their apparent sizes
        (``st_size``) as seen just before removal. Cheap; never below zero.
        """
        with self._lock:
            self._budget.forget(nbytes)

    def recount(self) -> int:
        """Count this node's bytes anew by scanning ``<root>/<node>``; return the count.

        The apparent sizes of its files, plus bytes reserved but not written yet in the files
        open for appends. O(files): for after a large removal, or to correct drift (files
        removed by hand). Appends go on during the scan; a file sealed during it may be
        counted at the size the scan saw.
        """
        sizes = tree_sizes(self.root / self.node)
        with self._lock:
            used = sum(sizes.values())
            for f in self._files.values():
                used += max(0, f.size - sizes.get(self.root / f.rel, 0))
            self._budget.used = used
        return used

    @property
    def root_bytes(self) -> int:
        """Bytes counted against ``max_root_bytes`` now (see `recount`)."""
        with self._lock:
            return self._budget.used


class ExtentReader:
    """The open files of one checked read (`Store.open_extents`): reads its ranges in order.

    Attributes
    ----------
    total : int
        Bytes the read gives in all.
    """

    def __init__(
        self, store: Store, extents: list[Extent], fds: dict[str, int], total: int
    ) -> None:
        self._store, self._extents, self._fds, self.total = store, extents, fds, total
        # closed exactly once: by `close`, or when the reader is dropped unread (an HTTP
        # client that went away before its answer started)
        self._closer = weakref.finalize(self, _close_all, list(fds.values()))

    def _pieces(self) -> Iterator[tuple[int, int, int, str]]:
        """``(descriptor, file offset, bytes, file)`` of each extent, in order."""
        for e in self._extents:
            if e.nbytes:
                yield self._fds[e.file], e.offset, e.nbytes, e.file

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (``total`` bytes) with the read's bytes.

        Raises
        ------
        SegmentFileError
            A file shrank during the read.
        InsufficientStorageError, ServerError
            An I/O error (see `os_errors`).
        """
        self._fill(self._pieces(), view, [None])
        self._store._count_read(self.total)

    def chunks(self, size: int) -> Iterator[bytearray]:
        """The read's bytes in order, ``size`` bytes a chunk (the last one shorter); each
        extent is visited once, whatever the number of chunks.

        Raises
        ------
        SegmentFileError, InsufficientStorageError, ServerError
            As `read_into`, from the chunk being read.
        """
        pieces = self._pieces()
        current: list[Any] = [None]  # the piece being read, carried from chunk to chunk
        for start in range(0, self.total, size):
            chunk = bytearray(min(size, self.total - start))
            self._fill(pieces, memoryview(chunk), current)
            yield chunk
        self._store._count_read(self.total)

    def _fill(
        self, pieces: Iterator[tuple[int, int, int, str]], view: memoryview, current: list[Any]
    ) -> None:
        """pread the next ``len(view)`` bytes of ``pieces`` into ``view``; ``current[0]`` keeps
        the rest of a piece that did not fit, for the next call."""
        at = 0
        with os_errors(self._store.root):
            while at < view.nbytes:
                if current[0] is None:
                    current[0] = next(pieces)
                fd, offset, nbytes, file = current[0]
                k = min(nbytes, view.nbytes - at)
                got = 0
                while got < k:
                    n = os.preadv(fd, [view[at + got : at + k]], offset + got)
                    if n == 0:
                        raise SegmentFileError(f"payload file {file!r} shrank during the read")
                    got += n
                at += k
                current[0] = None if k == nbytes else (fd, offset + k, nbytes - k, file)

    def close(self) -> None:
        """Close the read's descriptors (again: nothing)."""
        self._closer()


@dataclass
class Removal:
    """What one removal took (or would take): files as ``(path, size in bytes)``, the
    directories removed, and files kept because an append was writing to them."""

    files: list[tuple[str, int]] = field(default_factory=list)
    dirs: int = 0
    in_use: int = 0


_DATA_FILE = re.compile(r".+-[0-9a-f]{8}-[0-9]{6,}\.bin")


def _step_of(name: str) -> int | None:
    """The step a directory named ``name`` holds (named as the store names them: ``str(step)``),
    or ``None`` for any other name (``"007"``, ``"²"``, ``"x"``)."""
    if not (name.isascii() and name.isdigit() and len(name) <= 19):
        return None
    step = int(name)
    return step if str(step) == name and step <= INT64_MAX else None


def _dir_names(path: Path) -> list[str]:
    """Names of the sub-directories of ``path`` (none when it is missing)."""
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _file_names(path: Path) -> list[str]:
    """Names of the data files in ``path`` (regular files named as the store names them)."""
    try:
        with os.scandir(path) as it:
            return sorted(
                e.name
                for e in it
                if e.is_file(follow_symlinks=False) and _DATA_FILE.fullmatch(e.name)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _rmdir_if_empty(path: Path) -> int:
    """Remove ``path`` if it is an empty directory; return 1 if removed, else 0."""
    try:
        os.rmdir(path)
    except OSError:  # not empty, missing
        return 0
    return 1


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
