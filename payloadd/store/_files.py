"""The data files of one node open for appends, under one lock: the store's file table.

`FileTable` creates the data files (``<root>/<node>/<run>/<step>/<field>-<instance>-<seq>.bin``,
mode 0640, their directories 0750), keeps the shared current file of every
``(run, step, field)`` and each data-plane connection's lease files (an append's rows are
placed in them by `payloadd.store._placing.Placing`), and seals, closes and discards them;
it counts what they reserve against the disk limits (`payloadd.store._disk_limits.DiskBudget`) and marks what the next
flush must fsync (`payloadd.store._durability.DirtyFiles`). It is the `AppendOwner` of the
pending appends and leased ranges of `payloadd.store._store.Store`. It removes data files
only inside `FileTable.removing` (the removal generation moves,
`payloadd.store._generation.GenerationPage`), as every removal of the store does.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from payloadd.store._disk_limits import DiskBudget
from payloadd.store._durability import DirtyFiles
from payloadd.store._generation import GenerationPage
from payloadd.store._records import AppendFile, Placement, os_errors

__all__ = ["DIR_MODE", "FILE_MODE", "FileTable", "check_root", "unwritten"]

DIR_MODE = 0o750
FILE_MODE = 0o640
SPARES = 16
"""Idle shared files kept per ``(run, step, field)`` under ``one_writer`` (`take_idle`)."""
MADE = 1024
"""Step directories a file table remembers it made (`FileTable.new_file`)."""


class _Recent:
    """The latest ``size`` strings added (a set that forgets the oldest)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: dict[str, None] = {}

    def __contains__(self, item: str) -> bool:
        return item in self.items

    def add(self, item: str) -> None:
        self.items[item] = None
        if len(self.items) > self.size:
            del self.items[next(iter(self.items))]


class FileTable:
    """The data files of ``<root>/<node>`` open for appends; `lock` guards them all.

    Parameters
    ----------
    root : pathlib.Path
        The payload root, a real path.
    node : str
        This daemon's node prefix.
    instance : str
        This daemon's start, in every name of the files it creates.
    fsync : {"never", "interval", "always"}
        The durability policy (see `payloadd.store._store.Store`).
    max_file_bytes : int
        Rotation size (`payloadd.store._placing.split_rows`).
    append_files : int
        Shared current files kept open; the least recently appended to is sealed beyond.
    budget : DiskBudget
        The disk limits the files' reserved bytes count against.
    generation : GenerationPage, optional
        The removal generation, which every removal of a data file moves (`removing`).

    Attributes
    ----------
    lock : threading.Lock
        Held for every change of the table (the store's lock: appends, leases, removals).
    shared : OrderedDict
        The shared current file of each ``(run, step, field)``, least recently used first.
    leased : dict
        The current lease file of each ``(run, step, field, owner)``.
    one_writer : bool
        At most one append writes a shared file at a time (`take_idle`), and a range an
        append gave up is not taken back (`give_up`): a distributed file system.
    spares : dict
        Under one writer a file: the shared files of each ``(run, step, field)`` set aside
        while an append wrote them (`take_idle`), the oldest first.
    open_files : dict
        Every file whose reserved bytes count against the cap, by path.
    dirty : DirtyFiles or None
        What the next flush fsyncs (``fsync="interval"`` only).
    """

    def __init__(
        self,
        root: Path,
        node: str,
        instance: str,
        fsync: Literal["never", "interval", "always"],
        max_file_bytes: int,
        append_files: int,
        budget: DiskBudget,
        generation: GenerationPage | None = None,
    ) -> None:
        self.root, self.node, self.instance, self.fsync = root, node, instance, fsync
        self.generation = generation
        self._root = str(root)
        self.max_file_bytes = max_file_bytes
        self.append_files = append_files
        self.budget = budget
        self.dirty = DirtyFiles(root) if fsync == "interval" else None
        self.lock = threading.Lock()
        self.shared: OrderedDict[tuple[str, int, str], AppendFile] = OrderedDict()
        self.leased: dict[tuple[str, int, str, int], AppendFile] = {}
        self.spares: dict[tuple[str, int, str], list[AppendFile]] = {}
        self.one_writer = False  # set by the store from its root's policy
        self.open_files: dict[str, AppendFile] = {}
        self._seq = 0
        self._made = _Recent(MADE)  # step directories made (a hint: they may be gone)
        self._later = threading.local()  # directories to fsync at the end of a block

    def removing(self) -> contextlib.AbstractContextManager[None]:
        """Remove data files in the block: the removal generation moves at its start and end
        (clients then check their leases' files after writing). Lock held."""
        if self.generation is None:
            return contextlib.nullcontext()
        return self.generation.removing()

    def seal(self, f: AppendFile) -> None:
        """No more appends to ``f``; close it once no pending append uses it. Lock held."""
        f.sealed = True
        if f.users == 0 and f.open:
            self.close_file(f)

    def close_file(self, f: AppendFile) -> None:
        """Close ``f``: reserved bytes past its end were never written, and stop counting
        against the cap. Lock held.

        Its size on disk decides, also after a client said where its rows end
        (`lease_ended`): rows it had claimed below that end may never be written (an append
        given up after the word was sent). So a lease file closes only once nothing of its
        client's is on its way into it: a lease stays held (a user of its file) until its
        client says its rows in it are in place (`end_lease`, then `lease_ended`), or its
        connection ends."""
        with contextlib.suppress(OSError):
            if f.fd >= 0:
                self.budget.forget(max(0, f.size - os.fstat(f.fd).st_size))
            elif ((st := os.stat(f"{self._root}/{f.rel}")).st_dev, st.st_ino) == f.ino:
                self.budget.forget(max(0, f.size - st.st_size))
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
        f.open = False
        self.open_files.pop(f.rel, None)

    def discard(self, f: AppendFile) -> None:
        """Remove ``f``, a private file none of whose rows were acknowledged, with its step
        and run directories if they are left empty; its bytes stop counting. Lock held."""
        if f.open:  # a closed file counts what it holds: nothing, when it is discarded
            self.budget.forget(f.size)
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
        f.open, f.sealed = False, True
        self.open_files.pop(f.rel, None)
        path = self.root / f.rel
        with self.removing(), contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        for d in (path.parent, path.parent.parent):
            try:
                os.rmdir(d)
            except OSError:  # not empty (or gone): the rest stays
                break

    def removed(self, f: AppendFile) -> bool:
        """Whether ``f`` was removed (garbage collection) since it was created. Lock held."""
        if f.fd >= 0:
            return os.fstat(f.fd).st_nlink == 0
        try:
            st = os.stat(f"{self._root}/{f.rel}")
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != f.ino

    def release(self, files: Sequence[AppendFile]) -> None:
        """The caller is done with ``files``; a sealed one nobody uses any more closes."""
        with self.lock:
            self.release_locked(files)

    def release_locked(self, files: Sequence[AppendFile]) -> None:
        """`release`, lock held."""
        for f in files:
            f.users -= 1
            if f.sealed and f.users == 0 and f.open:
                self.close_file(f)

    def give_up(
        self, placements: Sequence[Placement], files: Sequence[AppendFile], private: bool
    ) -> None:
        """An append ends without a commit: give its reservation back (`PendingAppend.close`):
        files of its own (``private``) are removed; in shared files, ranges at a file's end
        are taken back."""
        with self.lock:
            if private:
                for f in files:
                    f.users -= 1
                    if f.users == 0 and f.open:
                        self.discard(f)
                return
            for e in reversed(placements):  # ranges at a file's end are taken back
                if self.one_writer:  # but not where another node may have read (and
                    break  # cached) what this append wrote of it: they stay a hole
                if e.file.size == e.offset + e.nbytes:
                    e.file.size = e.offset
                    self.budget.forget(e.nbytes)
            self.release_locked(files)

    def _mkdirs(self, rel_dir: str) -> list[str]:
        """Create ``rel_dir`` and its missing parents under the root, each with mode 0750;
        return the directories that got a new entry (relative, ``"."`` for the root),
        parents first. The deepest is tried first: a new step of a run is one ``mkdir``."""
        grown: list[str] = []
        self._mkdir(rel_dir, grown)
        return grown

    def _mkdir(self, rel: str, grown: list[str]) -> None:
        parent = rel.rpartition("/")[0]
        path = f"{self._root}/{rel}"
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:  # its parent is missing too
            if not parent:
                raise
            self._mkdir(parent, grown)
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                return
        os.chmod(path, DIR_MODE)  # exact mode, whatever the umask
        grown.append(parent or ".")

    def new_file(
        self, run: str, step: int, field: str, owner: int = 0, keep_fd: bool = True
    ) -> AppendFile:
        """Create the next data file of ``(run, step, field)``, registered as open but as
        nobody's current file; caller holds the lock.

        The step directories this table made are remembered (the latest `MADE` of them):
        a file of one of those is created at once, its directories only when that fails
        (removed since); no system call for the directories of a step that has files.
        """
        d = f"{self.node}/{run}/{step}"
        self._seq += 1
        rel = f"{d}/{field}-{self.instance}-{self._seq:06d}.bin"
        path = f"{self._root}/{rel}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        grown = [d]  # directories with a new entry: parents first
        if d not in self._made:  # a new step, most likely: its directory first
            grown = [*self._mkdirs(d), d]
            self._made.add(d)
        try:
            fd = os.open(path, flags, FILE_MODE)
        except FileNotFoundError:  # made before, and removed since (garbage collection)
            grown = [*self._mkdirs(d), d]
            fd = os.open(path, flags, FILE_MODE)
        try:
            if self.fsync == "always":
                later = getattr(self._later, "dirs", None)
                if later is not None:  # at the end of `syncs_together`
                    later.update(dict.fromkeys(reversed(grown)))
                else:
                    self._sync_dirs(reversed(grown))  # the file's entry first, up to the root's
            elif self.dirty is not None:
                self.dirty.created(grown)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        f = AppendFile(rel, 0, fd, (run, step, field), owner=owner, ino=(st.st_dev, st.st_ino))
        self.open_files[rel] = f
        return f

    def _sync_dirs(self, dirs: Iterable[str]) -> None:
        for g in dirs:
            dfd = os.open(f"{self._root}/{g}", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @contextlib.contextmanager
    def syncs_together(self) -> Iterator[None]:
        """Under ``fsync="always"``, the directories that files created in the block (by
        this thread) got entries in are fsync'd once each, at its end, not once per file:
        hand none of the files out before. Call without the lock."""
        if self.fsync != "always":
            yield
            return
        self._later.dirs = dirs = dict[str, None]()
        try:
            yield
        finally:
            self._later.dirs = None
        with os_errors(self.root):
            self._sync_dirs(dirs)

    def new_shared(self, key: tuple[str, int, str]) -> AppendFile:
        """A new shared current file of ``key``; the least recently appended to rest beyond
        ``append_files``. Lock held."""
        f = self.new_file(*key)
        old = self.shared.pop(key, None)
        if old is not None:
            self.seal(old)
        self.shared[key] = f
        self._trim()
        return f

    def _trim(self) -> None:
        """Seal what is beyond ``append_files`` shared files, spares included: spares
        first, oldest first, then the least recently appended to current files (with their
        keys' spares). Lock held."""
        spares = sum(map(len, self.spares.values()))
        while len(self.shared) + spares > self.append_files:
            key = next((k for k, v in self.spares.items() if v), None)
            if key is not None:
                self.seal(self.spares[key].pop(0))
                spares -= 1
                continue
            self.seal(self.shared.popitem(last=False)[1])

    def take_idle(self, key: tuple[str, int, str], busy: AppendFile) -> AppendFile | None:
        """Set ``busy``, the current file of ``key`` that another append writes now, aside
        and make an idle one of its spares current instead; return it, or ``None`` when
        none is idle (``busy`` is then set aside all the same, for `new_shared`). Lock held.

        So that at most one append writes a shared file at a time (``one_writer``, a
        distributed file system): then every byte below a file's size is written, and no
        other node caches a page of it with a range still to come.
        """
        spares = self.spares.setdefault(key, [])
        for i, f in enumerate(spares):
            if f.users == 0 and not f.sealed and not self.removed(f):
                spares[i] = busy
                self.shared[key] = f
                self.shared.move_to_end(key)
                return f
        spares.append(busy)
        del self.shared[key]  # the next new_shared of key keeps it open, as a spare
        while len(spares) > SPARES:
            self.seal(spares.pop(0))
        self._trim()
        return None

    def committed(self, files: Sequence[AppendFile]) -> None:
        """Rows were written to ``files``: fsync them (``fsync="always"``), or mark them for
        the next flush (``"interval"``)."""
        if self.fsync == "always":
            with os_errors(self.root):
                for f in files:
                    os.fsync(f.fd)
        elif self.dirty is not None:
            self.dirty.wrote(f.rel for f in files)

    def hand_over(self, f: AppendFile) -> int:
        """The daemon's write descriptor of ``f``, now the caller's (to pass to a client and
        close): the one `payloadd.store._store.Store.lease` kept open when it created a
        lease file; -1 when there is none (the caller opens one of its own)."""
        with self.lock:
            fd, f.fd = f.fd, -1
        return fd

    def lease_ended(self, f: AppendFile, end: int, used: int | None) -> None:
        """A lease of ``f``, the range up to ``end``, ended: its client wrote ``f`` unseen
        (for the next flush), and ``f`` is released. ``used``: the client's word that it
        wrote nothing from there on; when nothing was placed after the range, the file's
        end moves back there (the next lease goes on at ``used``, no hole) and the rest
        stops counting against the cap."""
        with self.lock:
            f.leases -= 1
            if used is not None:
                self._end_at(f, end, used)
        if self.dirty is not None:
            self.dirty.released(f.rel)
        self.release([f])

    def end_lease(self, f: AppendFile, end: int, used: int) -> None:
        """A lease of ``f``, the range up to ``end``, ends at ``used`` (as `lease_ended`
        says) while its client still writes rows below ``used``: the tail is taken back,
        and the lease stays held (its file open, counting up to ``used``) until
        `lease_ended`."""
        with self.lock:
            self._end_at(f, end, used)

    def _end_at(self, f: AppendFile, end: int, used: int) -> None:
        """The tail ``[used, end)`` of a lease of ``f`` stops counting, and the file's end
        moves back to ``used``, when nothing was placed after it. Lock held."""
        if f.size == end and used <= end and f.open:
            self.budget.forget(end - used)
            f.size = used

    def forget_removed(self, f: AppendFile) -> None:
        """``f`` is being removed (garbage collection): no more appends to it, and its
        descriptor (which would only hold its space) is closed. Lock held."""
        if self.shared.get(f.key) is f:
            del self.shared[f.key]
        spares = self.spares.get(f.key)
        if spares is not None and f in spares:
            spares.remove(f)
        lease_key = (*f.key, f.owner)
        if self.leased.get(lease_key) is f:
            del self.leased[lease_key]
        f.sealed = True
        if f.open:  # leases write through their own descriptors: this one
            self.close_file(f)  # would only hold the space

    def close(self) -> None:
        """Close every file (at shutdown)."""
        with self.lock:
            for f in list(self.open_files.values()):
                self.close_file(f)
            self.shared.clear()
            self.spares.clear()
            self.leased.clear()


def unwritten(file: tuple[str, int, tuple[int, int]]) -> int:
    """Bytes reserved at the end of an open file ``(path, reserved end, (dev, ino))`` and
    not written yet (0 for a file gone or replaced since)."""
    path, size, ino = file
    try:
        st = os.stat(path)
    except OSError:
        return 0
    return max(0, size - st.st_size) if (st.st_dev, st.st_ino) == ino else 0


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
