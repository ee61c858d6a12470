"""The GC ledger: which files garbage collection removed, and why, kept on disk.

A read of a file that does not exist answers 404 (`FileMissingError`) unless the ledger of
the file's node lists it as collected: then 410 (`FileGoneError`) naming its run and step.
One JSON line per collection, appended and fsync'd *before* any of its files is removed, so
the answer survives restarts and a crash in the middle of a GC:

    {"run": "r1", "reason": "watermark", "at": 1764412800.0,
     "files": ["node0/r1/3/routed_experts-1a2b3c4d-000007.bin", ...], "bytes": 1536}

A file is listed only when the collection removes it (a file that never existed stays 404,
even in a collected step). The file is ``<root>/<node>/@gc-ledger.jsonl``: ``@`` is outside
the run-name alphabet, so no run directory can ever have its name. A torn last line (a crash
while writing it) is skipped when the ledger is loaded. Each collected file costs one path
(about 60 bytes) on disk and in memory.

Beside it, ``@gc-reserve`` holds `RESERVE_BYTES` of spare space: when the file system is
full (another program filled it), a collection removes it to write its line, so GC still
frees space when it is needed most. Collections make it again once there is room.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from pathlib import Path

import msgspec

__all__ = ["LEDGER_NAME", "RESERVE_BYTES", "RESERVE_NAME", "Collected", "Ledger"]

LEDGER_NAME = "@gc-ledger.jsonl"
RESERVE_NAME = "@gc-reserve"
RESERVE_BYTES = 64 << 10
"""Size of the spare file kept beside the ledger: on a full file system it is removed, so
that the ledger line of the collection that makes room can still be written."""

log = logging.getLogger("payloadd.gc")


class Collected(msgspec.Struct, forbid_unknown_fields=False):
    """One collection: the files of ``run`` it removed.

    Attributes
    ----------
    run : str
        The run.
    reason : str
        ``watermark``, ``run`` or ``ttl``.
    at : float
        When, in seconds since the epoch.
    files : list of str
        The removed files, relative to the root.
    bytes : int or None
        Sum of their sizes when the collection was planned, in bytes; ``None`` in lines
        written before this was recorded.
    """

    run: str
    reason: str
    at: float
    files: list[str]
    bytes: int | None = None


_decoder = msgspec.json.Decoder(Collected)
_encoder = msgspec.json.Encoder()


class Ledger:
    """The collections of one node, loaded from and appended to its ledger file.

    Parameters
    ----------
    path : pathlib.Path
        The ledger file; missing means nothing was collected.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reserve = path.with_name(RESERVE_NAME)
        self._lock = threading.Lock()
        self._gone: dict[str, Collected] = {}  # file -> its collection
        self._entries: list[Collected] = []  # every collection, in file order
        self._stamp: tuple[int, int] | None = None  # (size, mtime_ns) last loaded

    def _load(self) -> None:
        """Reload when the file changed (another node's daemon may append to its own).

        The file is opened, not only looked at: on NFS an open revalidates the file's
        attributes and cached pages with the server (close-to-open consistency), where a
        ``stat`` may answer from the client's attribute cache. A node prefix that does not
        exist, or is not a directory, has no ledger.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self._gone, self._entries, self._stamp = {}, [], None
            return
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            stamp = (st.st_size, st.st_mtime_ns)
            if stamp == self._stamp:
                return
            gone: dict[str, Collected] = {}
            entries: list[Collected] = []
            for line in f:
                try:
                    c = _decoder.decode(line)
                except msgspec.DecodeError:
                    continue  # a torn last line
                gone.update(dict.fromkeys(c.files, c))
                entries.append(c)
        self._gone, self._entries, self._stamp = gone, entries, stamp

    def record(
        self, run: str, reason: str, files: list[str], nbytes: int | None = None
    ) -> Collected:
        """Append one collection of ``files`` (relative paths, ``nbytes`` bytes in all) and
        fsync it; return it.

        On a full file system the spare file (`keep_reserve`) is removed to make room.

        Raises
        ------
        OSError
            When the ledger cannot be written (the caller then removes nothing).
        """
        c = Collected(run, reason, time.time(), files, nbytes)
        line = _encoder.encode(c) + b"\n"
        with self._lock:
            try:
                self._append(line)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not self._spend_reserve():
                    raise
                self._append(line)
            self._load()
        return c

    def _mkdir(self) -> None:
        """Create the node's directory if missing, mode 0750 whatever the umask (as the
        store creates it)."""
        try:
            os.mkdir(self.path.parent, 0o750)
        except FileExistsError:
            return
        os.chmod(self.path.parent, 0o750)

    def _append(self, line: bytes) -> None:
        self._mkdir()
        new = not os.path.lexists(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            os.fchmod(fd, 0o640)  # whatever the umask
            end = os.fstat(fd).st_size
            if end and os.pread(fd, 1, end - 1) != b"\n":
                line = b"\n" + line  # after a torn line: never glued to it
            view = memoryview(line)
            while view.nbytes:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:  # the ledger's own name must survive a node crash too
            dfd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _spend_reserve(self) -> bool:
        try:
            os.unlink(self.reserve)
        except FileNotFoundError:
            return False
        log.warning("payload root full: spare file %s removed to write the GC ledger", self.reserve)
        return True

    def keep_reserve(self) -> None:
        """Create the spare file beside the ledger if it is missing; quietly nothing when
        there is no room for it (the next collection tries again)."""
        if os.path.lexists(self.reserve):
            return
        tmp = self.reserve.with_name(f"{RESERVE_NAME}.tmp")
        try:
            self._mkdir()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
            try:
                view = memoryview(os.urandom(RESERVE_BYTES))  # written: really allocated
                while view.nbytes:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.chmod(tmp, 0o640)  # whatever the umask
            os.replace(tmp, self.reserve)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def recent(self, n: int) -> tuple[list[Collected], int]:
        """The last ``n`` collections, oldest first, and the number of collections in all."""
        with self._lock:
            self._load()
            return (self._entries[-n:] if n > 0 else []), len(self._entries)

    def find(self, rel: str) -> Collected | None:
        """The collection that removed file ``rel``, or ``None``."""
        with self._lock:
            self._load()
            return self._gone.get(rel)
