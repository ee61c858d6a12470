"""The GC ledger: which files garbage collection removed, and why, kept on disk.

A read of a file that does not exist answers 404 (`FileMissingError`) unless the ledger of
the file's node lists it as collected: then 410 (`FileGoneError`) naming its run and step.
One JSON line per collection, appended and fsync'd *before* any of its files is removed, so
the answer survives restarts and a crash in the middle of a GC:

    {"run": "r1", "reason": "watermark", "at": 1764412800.0,
     "files": ["node0/r1/3/routed_experts-1a2b3c4d-000007.bin", ...]}

A file is listed only when the collection removes it (a file that never existed stays 404,
even in a collected step). The file is ``<root>/<node>/@gc-ledger.jsonl``: ``@`` is outside
the run-name alphabet, so no run directory can ever have its name. A torn last line (a crash
while writing it) is skipped when the ledger is loaded. Each collected file costs one path
(about 60 bytes) on disk and in memory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec

__all__ = ["LEDGER_NAME", "Collected", "Ledger"]

LEDGER_NAME = "@gc-ledger.jsonl"


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
    """

    run: str
    reason: str
    at: float
    files: list[str]


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
        self._lock = threading.Lock()
        self._gone: dict[str, Collected] = {}  # file -> its collection
        self._stamp: tuple[int, int] | None = None  # (size, mtime_ns) last loaded

    def _load(self) -> None:
        """Reload when the file changed (another node's daemon may append to its own)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._gone, self._stamp = {}, None
            return
        stamp = (st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        gone: dict[str, Collected] = {}
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    c = _decoder.decode(line)
                except msgspec.DecodeError:
                    continue  # a torn last line
                gone.update(dict.fromkeys(c.files, c))
        self._gone, self._stamp = gone, stamp

    def record(self, run: str, reason: str, files: list[str]) -> Collected:
        """Append one collection of ``files`` (relative paths) and fsync it; return it.

        Raises
        ------
        OSError
            When the ledger cannot be written (the caller then removes nothing).
        """
        c = Collected(run, reason, time.time(), files)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                os.write(fd, _encoder.encode(c) + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            self._load()
        return c

    def find(self, rel: str) -> Collected | None:
        """The collection that removed file ``rel``, or ``None``."""
        with self._lock:
            self._load()
            return self._gone.get(rel)
