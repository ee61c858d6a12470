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
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from payload_client import (
    InvalidRequestError,
    PayloadSegment,
    PayloadTooLargeError,
)
from payload_client.protocol import (
    INT64_MAX,
    AppendItem,
    Extent,
    FieldsTable,
    Stats,
    check_field,
    check_item,
    check_name,
)
from payloadd.store._appends import Lease, PendingAppend, _Extent, _File, item_nbytes, os_errors
from payloadd.store._budget import APPEND_FILES, READ_CACHE
from payloadd.store._disk_limits import DiskBudget, tree_sizes
from payloadd.store._durability import DirtyFiles
from payloadd.store._ledger import Ledger
from payloadd.store._readers import ExtentReader, Readers
from payloadd.store._removal import Removal, StoreRemovals

__all__ = ["Removal", "Store"]

DIR_MODE = 0o750
FILE_MODE = 0o640


class Store(StoreRemovals):
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
    foreign_reads : {"cached", "reopen"}
        Whether descriptors of files under other nodes' prefixes are kept (see `Readers`).
    append_files : int
        Shared files kept open for appends (one per run, step and field); the least
        recently appended to is sealed beyond that, and later appends of its key start a
        new file (the daemon's share of ``RLIMIT_NOFILE``, `payloadd.store._budget`).
    read_cache : int
        Read-only descriptors kept for later reads (`Readers`).
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
        foreign_reads: Literal["cached", "reopen"] = "cached",
        append_files: int = APPEND_FILES,
        read_cache: int = READ_CACHE,
    ) -> None:
        self.node = check_name(node, "node")
        self.root = self.check_root(root, self.node)
        self._root_prefix = str(self.root) + os.sep
        self.max_file_bytes = max_file_bytes
        self.max_read_bytes = max_read_bytes
        self.max_append_bytes = max_append_bytes
        self.max_append_items = max_append_items
        self.append_files = append_files
        self.fsync = fsync
        self.fields = fields if fields is not None else FieldsTable({})
        self._dirty = DirtyFiles(self.root) if fsync == "interval" else None
        self._budget = DiskBudget(self.root, self.root / node, max_root_bytes, min_free_bytes)
        self.instance = secrets.token_hex(4)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._files: OrderedDict[tuple[str, int, str], _File] = OrderedDict()  # shared, current
        self._leased: dict[tuple[str, int, str, int], _File] = {}  # an owner's current files
        self._open: dict[str, _File] = {}  # every file whose reserved bytes count, by path
        self._owners = itertools.count(1)
        self.last_used: dict[str, float] = {}  # run of this node -> monotonic time
        self.reads = Readers(
            self.root, self.node, max_read_bytes, self.touch, foreign_reads, read_cache
        )
        self._seq = 0
        self._counts = {"appends": 0, "rows_appended": 0, "bytes_appended": 0}
        self._counts |= {"data_plane_requests": 0}
        self._counts |= {"data_plane_fds": 0, "leases": 0, "leased_bytes": 0}

    @staticmethod
    def check_root(root: str | os.PathLike[str], node: str | None = None) -> Path:
        """Create the payload root (mode 0750) if missing; return its real path.

        With ``node``, also check the node prefix ``<root>/<node>``: when it exists it must
        be a directory, not a symlink (reads refuse files reached through a symlink, so the
        daemon would write rows it could not serve).

        Raises
        ------
        OSError
            When it cannot be created, is not a directory, or is not writable; when the node
            prefix is a symlink or not a directory.
        """
        if node is not None:
            prefix = os.path.join(root, node)
            if os.path.islink(prefix) or (os.path.lexists(prefix) and not os.path.isdir(prefix)):
                raise NotADirectoryError(
                    f"node prefix {prefix} is a symlink or not a directory: the daemon writes "
                    "only into a directory of the payload root"
                )
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

    def new_owner(self) -> int:
        """A new owner id for files private to one client (a data-plane connection)."""
        with self._lock:
            return next(self._owners)

    def _seal(self, f: _File) -> None:
        """No more appends to ``f``; close it once no pending append uses it. Lock held."""
        f.sealed = True
        if f.users == 0 and f.open:
            self._close_file(f)

    def _close_file(self, f: _File) -> None:
        """Close ``f``: reserved bytes past its end were never written, and stop counting
        against the cap. Lock held."""
        with contextlib.suppress(OSError):
            st = os.fstat(f.fd) if f.fd >= 0 else os.stat(self.root / f.rel)
            if f.fd >= 0 or (st.st_dev, st.st_ino) == f.ino:
                self._budget.forget(max(0, f.size - st.st_size))
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
        f.open = False
        self._open.pop(f.rel, None)

    def _discard(self, f: _File) -> None:
        """Remove ``f``, a private file none of whose rows were acknowledged, with its step
        and run directories if they are left empty; its bytes stop counting. Lock held."""
        if f.open:  # a closed file counts what it holds: nothing, when it is discarded
            self._budget.forget(f.size)
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
        f.open, f.sealed = False, True
        self._open.pop(f.rel, None)
        path = self.root / f.rel
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        for d in (path.parent, path.parent.parent):
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): the rest stays
                break

    def _removed(self, f: _File) -> bool:
        """Whether ``f`` was removed (garbage collection) since it was created. Lock held."""
        if f.fd >= 0:
            return os.fstat(f.fd).st_nlink == 0
        try:
            st = os.stat(self.root / f.rel)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != f.ino

    def _current(self, key: tuple[str, int, str]) -> _File:
        """The shared file ``key`` appends to now (a new one if none, or it was removed).
        Lock held."""
        f = self._files.get(key)
        if f is None or self._removed(f):
            return self._new_shared(key)
        self._files.move_to_end(key)
        return f

    @staticmethod
    def _hold(f: _File, held: dict[int, _File]) -> None:
        if id(f) not in held:
            held[id(f)] = f
            f.users += 1

    def _release(self, files: list[_File]) -> None:
        with self._lock:
            self._release_locked(files)

    def _release_locked(self, files: list[_File]) -> None:
        for f in files:
            f.users -= 1
            if f.sealed and f.users == 0 and f.open:
                self._close_file(f)

    def _give_up(self, extents: list[_Extent], files: list[_File], private: bool) -> None:
        """An append ends without a commit: give its reservation back (`PendingAppend.close`)."""
        with self._lock:
            if private:
                for f in files:
                    f.users -= 1
                    if f.users == 0 and f.open:
                        self._discard(f)
                return
            for e in reversed(extents):  # ranges at a file's end are taken back
                if e.file.size == e.offset + e.nbytes:
                    e.file.size = e.offset
                    self._budget.forget(e.nbytes)
            self._release_locked(files)

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

    def _new_file(
        self, run: str, step: int, field: str, owner: int = 0, keep_fd: bool = True
    ) -> _File:
        """Create the next data file of ``(run, step, field)``, registered as open but as
        nobody's current file; caller holds the lock."""
        d = f"{self.node}/{run}/{step}"
        grown = [*self._mkdirs(d), d]  # directories with a new entry: parents first
        self._seq += 1
        rel = f"{d}/{field}-{self.instance}-{self._seq:06d}.bin"
        fd = os.open(
            self.root / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE
        )
        try:
            if self.fsync == "always":
                for g in reversed(grown):  # the file's entry first, up to the root's
                    dfd = os.open(self.root / g, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
            elif self._dirty is not None:
                self._dirty.created(grown)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            os.unlink(self.root / rel)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        f = _File(rel, 0, fd, (run, step, field), owner=owner, ino=(st.st_dev, st.st_ino))
        self._open[rel] = f
        return f

    def _new_shared(self, key: tuple[str, int, str]) -> _File:
        """A new shared current file of ``key``; the least recently appended to rest beyond
        ``append_files``. Lock held."""
        f = self._new_file(*key)
        old = self._files.pop(key, None)
        if old is not None:
            self._seal(old)
        self._files[key] = f
        while len(self._files) > self.append_files:
            self._seal(self._files.popitem(last=False)[1])
        return f

    def _place(
        self,
        index: int,
        item: AppendItem,
        row_nb: int,
        held: dict[int, _File],
        out: list[_Extent],
        current: Callable[[tuple[str, int, str]], _File],
        new: Callable[[tuple[str, int, str]], _File],
    ) -> None:
        """Reserve room for one item's rows, adding its extents to ``out``; lock held.
        ``current(key)`` is the file the key appends to, ``new(key)`` starts the next one."""
        key = (item.run, item.step, item.field)
        rows, pos = item.rows, item.pos
        f = current(key)
        while True:
            nbytes = rows * row_nb
            fits = f.size + nbytes <= self.max_file_bytes
            if fits or rows == 0 or (f.size == 0 and rows == 1):
                self._hold(f, held)
                out.append(_Extent(index, f, f.size, pos, rows, nbytes))
                f.size += nbytes
                return
            if f.size > 0:
                f = new(key)
                continue
            # an empty file and more rows than fit: fill it, then go on in the next one
            take = max(1, self.max_file_bytes // row_nb)
            self._hold(f, held)
            out.append(_Extent(index, f, 0, pos, take, take * row_nb))
            f.size = take * row_nb
            rows, pos = rows - take, pos + take

    def files_needed(self, items: Sequence[AppendItem]) -> int:
        """At most how many data files an append of ``items`` holds open at once (for the
        descriptor budget, `payloadd.store._budget`): the files `_place` would fill for each
        (run, step, field), from an empty one, plus one (a current file partly full).

        Raises
        ------
        InvalidRequestError
            An item is invalid (`item_nbytes`).
        """
        state: dict[tuple[str, int, str], list[int]] = {}  # key -> [files, bytes in the last]
        cap = self.max_file_bytes
        for i, it in enumerate(items):
            row_nb = item_nbytes(it, i)[0]
            f = state.setdefault((it.run, it.step, it.field), [1, 0])
            rows = it.rows
            while True:  # as `_place` does
                if f[1] + rows * row_nb <= cap or rows == 0 or (f[1] == 0 and rows == 1):
                    f[1] += rows * row_nb
                    break
                if f[1] > 0:
                    f[0], f[1] = f[0] + 1, 0
                    continue
                take = max(1, cap // row_nb)
                f[1], rows = take * row_nb, rows - take
        return sum(files + 1 for files, _ in state.values())

    def begin_append(self, items: Sequence[AppendItem], private: bool = False) -> PendingAppend:
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

        Returns
        -------
        PendingAppend
            To receive the row bytes (`PendingAppend.write`) and return the segments.

        Raises
        ------
        InvalidRequestError
            An item names a bad field, run, dtype or shape, or overflows int64, or does not
            fit the fields table (`check_item`); nothing is reserved then.
        PayloadTooLargeError
            More items or row bytes than the limits; nothing is reserved.
        StorageFullError
            The rows do not fit under ``max_root_bytes`` or above ``min_free_bytes`` (nothing
            is reserved then), or the file system has no room for a new file or directory.
        BusyError
            No descriptor is left for a new file (``EMFILE``); nothing is left behind.
        """
        if not items:
            raise InvalidRequestError("an append needs at least one item")
        if len(items) > self.max_append_items:
            raise PayloadTooLargeError(
                f"append of {len(items)} items is above the limit of {self.max_append_items}"
            )
        sizes = [item_nbytes(item, i) for i, item in enumerate(items)]
        for i, item in enumerate(items):
            check_item(self.fields, item, i)
        total = sum(n for _, n in sizes)
        if total > self.max_append_bytes:
            raise PayloadTooLargeError(
                f"append of {total} row bytes is above the limit of {self.max_append_bytes}"
            )
        held: dict[int, _File] = {}  # files this append writes to, kept open until it is done
        extents: list[_Extent] = []
        created: list[_File] = []
        own: dict[tuple[str, int, str], _File] = {}

        def new(key: tuple[str, int, str]) -> _File:
            if private:
                f = self._new_file(*key)
                f.sealed = True  # nobody else's current file: it closes when this append ends
                own[key] = f
            else:
                f = self._new_shared(key)
            created.append(f)
            return f

        def current(key: tuple[str, int, str]) -> _File:
            if private:
                return own.get(key) or new(key)
            f = self._files.get(key)
            if f is None or self._removed(f):
                return new(key)
            self._files.move_to_end(key)
            return f

        with self._lock, os_errors(self.root):
            self._budget.room(total, f"append of {total} bytes")
            try:
                for i, it in enumerate(items):
                    self._place(i, it, sizes[i][0], held, extents, current, new)
            except BaseException:  # e.g. no room for a new file: give back what was placed
                self._undo_placement(items, extents, held, created)
                raise
            now = time.monotonic()
            for it in items:
                self.last_used[it.run] = now
            self._budget.reserve(total)
        return PendingAppend(self, items, extents, list(held.values()), private)

    def _undo_placement(
        self,
        items: Sequence[AppendItem],
        extents: list[_Extent],
        held: dict[int, _File],
        created: list[_File],
    ) -> None:
        """Give back a placement that failed half-way (`begin_append`), leaving no debris:
        the files it created (only its own rows were placed in them) are removed, and so
        are directories it leaves empty. Lock held."""
        for e in reversed(extents):
            if e.file.size == e.offset + e.nbytes:
                e.file.size = e.offset
        mine = {id(f) for f in created}
        for f in held.values():
            f.users -= 1
        for f in created:
            if self._files.get(f.key) is f:
                del self._files[f.key]
            if f.open:
                self._discard(f)
        for f in held.values():
            if id(f) not in mine and f.sealed and f.users == 0 and f.open:
                self._close_file(f)
        for run, step in {(it.run, it.step) for it in items}:  # made before a file failed
            for d in (self.root / self.node / run / str(step), self.root / self.node / run):
                try:
                    os.rmdir(d)
                except OSError:
                    break

    def lease(self, run: str, step: int, field: str, nbytes: int, size: int, owner: int) -> Lease:
        """Reserve a byte range of the file of ``(run, step, field)`` private to ``owner``.

        The range is at least ``nbytes`` and at most ``max(nbytes, size)`` bytes; it never
        crosses the rotation size. Only ``owner``'s leases are ever placed in that file (a
        new one when there is none yet, it was removed or is full), so the descriptor its
        client gets can only reach its own rows. The file stays open (and counts as
        appended to) until the lease is released; it is sealed by `end_owner`.

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
        """
        check_name(run, "run")
        check_name(field, "field")
        check_field(self.fields, field)
        if nbytes > self.max_file_bytes:
            raise PayloadTooLargeError(
                f"lease of {nbytes} bytes is above the rotation size {self.max_file_bytes}"
            )
        key = (run, step, field, owner)
        with self._lock, os_errors(self.root):
            room = self._budget.room(nbytes, f"lease of {nbytes} bytes")
            f = self._leased.get(key)
            if (
                f is None
                or self._removed(f)
                or (f.size + nbytes > self.max_file_bytes and f.size > 0)
            ):
                f = self._new_file(run, step, field, owner, keep_fd=False)
                old = self._leased.pop(key, None)
                if old is not None:
                    self._seal(old)
                self._leased[key] = f
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

    def seal_lease(self, owner: int, key: tuple[str, int, str]) -> None:
        """``owner``'s connection is done with ``key`` (its oldest lease ended): seal its
        lease file of that key, which closes once no lease uses it."""
        with self._lock:
            f = self._leased.pop((*key, owner), None)
            if f is not None:
                self._seal(f)

    def end_owner(self, owner: int) -> None:
        """``owner``'s connection ended: seal its lease files (each closes once its last
        lease is released, and the unused tail stops counting). One it never wrote a byte
        into is removed: no row of it was acknowledged (a client that writes after all
        finds the file removed, and places its rows again, as after garbage collection)."""
        with self._lock:
            for key in [k for k in self._leased if k[3] == owner]:
                f = self._leased.pop(key)
                self._seal(f)
                if f.users == 0 and not f.open:
                    with contextlib.suppress(OSError):
                        st = os.stat(self.root / f.rel)
                        if st.st_size == 0 and (st.st_dev, st.st_ino) == f.ino:
                            self._discard(f)

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

    # -- reads (see payloadd.store._readers) ---------------------------------------------------

    def touch(self, run: str) -> None:
        """Mark ``run`` of this node as in use now (the GC age rule spares it); a name that
        is no run directory is ignored (`last_used` stays as small as the runs on disk)."""
        if run in self.last_used or (
            _NAME.fullmatch(run) and os.path.isdir(self.root / self.node / run)
        ):
            self.last_used[run] = time.monotonic()

    def open_for_read(self, rel: str, end: int) -> int:
        """`Readers.open_for_read` of this store."""
        return self.reads.open_for_read(rel, end)

    def open_extents(self, extents: Sequence[Extent]) -> ExtentReader:
        """`Readers.open_extents` of this store."""
        return self.reads.open_extents(extents)

    def read_extents(self, extents: Sequence[Extent]) -> bytearray:
        """`Readers.read_extents` of this store."""
        return self.reads.read_extents(extents)

    def ledger(self, node: str | None = None) -> Ledger:
        """The GC ledger of ``node`` (default: this daemon's)."""
        return self.reads.ledger(node)

    # -- shutdown (removal: StoreRemovals, in _removal.py) -------------------------------

    def close(self) -> None:
        """Close every descriptor the store holds (at shutdown)."""
        with self._lock:
            for f in list(self._open.values()):
                self._close_file(f)
            self._files.clear()
            self._leased.clear()
        self.reads.close()

    # -- state --------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` of `Stats`; it stops at ``INT64_MAX``.

        Data-plane clients report their own appends (notes): a client that reports
        absurd counts must not push a counter past what ``GET /v1/stats`` can encode
        (msgpack: 64 bits) or its readers decode.
        """
        with self._lock:
            self._counts[name] = min(self._counts[name] + n, INT64_MAX)

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
            c |= {"reads": self.reads.reads, "bytes_read": self.reads.bytes_read}
            open_files = len(self._files) + len(self._leased)
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

    def open_descriptors(self) -> tuple[int, int, int]:
        """``(data files open for appends, cached read descriptors, leases held)``: the
        daemon's write descriptors (current shared files, and files a pending append still
        uses), its read cache, and the data-plane leases not yet ended (their files are
        written through the clients' own descriptors)."""
        with self._lock:
            append_fds = sum(1 for f in self._open.values() if f.fd >= 0)
            leases = sum(f.leases for f in self._open.values())
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
            for f in self._open.values():
                used += max(0, f.size - sizes.get(self.root / f.rel, 0))
            self._budget.used = used
        return used

    @property
    def root_bytes(self) -> int:
        """Bytes counted against ``max_root_bytes`` now (see `recount`)."""
        with self._lock:
            return self._budget.used


_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
