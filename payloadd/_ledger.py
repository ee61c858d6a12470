"""The GC ledger: which steps of which runs garbage collection removed, kept on disk.

A read of a file that does not exist answers 404 (`FileMissingError`) unless the ledger of
the file's node says its step was collected: then 410 (`FileGoneError`) naming the run and
the step. One JSON line per collection, appended and fsync'd *before* any file is removed,
so the answer survives restarts and a crash in the middle of a GC:

    {"run": "r1", "first": 0, "last": 3, "reason": "watermark", "at": 1764412800.0}

``last`` is ``null`` for a whole run. The file is ``<root>/<node>/@gc-ledger.jsonl``: ``@``
is outside the run-name alphabet, so no run directory can ever have its name. A torn last
line (a crash while writing it) is skipped when the ledger is loaded.
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
    """One collection: steps ``[first, last]`` of ``run`` (``last`` None: every step).

    Attributes
    ----------
    run : str
        The run.
    first, last : int
        Inclusive range of steps; ``last`` is ``None`` for the whole run.
    reason : str
        ``watermark``, ``run`` or ``ttl``.
    at : float
        When, in seconds since the epoch.
    """

    run: str
    first: int
    last: int | None
    reason: str
    at: float

    def covers(self, step: int) -> bool:
        """Whether ``step`` lies in this collection's range."""
        return self.first <= step and (self.last is None or step <= self.last)


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
        self._by_run: dict[str, list[Collected]] = {}
        self._stamp: tuple[int, int] | None = None  # (size, mtime_ns) last loaded

    def _load(self) -> None:
        """Reload when the file changed (another node's daemon may append to its own)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._by_run, self._stamp = {}, None
            return
        stamp = (st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        by_run: dict[str, list[Collected]] = {}
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    c = _decoder.decode(line)
                except msgspec.DecodeError:
                    continue  # a torn last line
                by_run.setdefault(c.run, []).append(c)
        self._by_run, self._stamp = by_run, stamp

    def record(self, run: str, first: int, last: int | None, reason: str) -> Collected:
        """Append one collection and fsync it; return it.

        Raises
        ------
        OSError
            When the ledger cannot be written (the caller then removes nothing).
        """
        c = Collected(run, first, last, reason, time.time())
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

    def find(self, run: str, step: int) -> Collected | None:
        """The latest collection that covers ``step`` of ``run``, or ``None``."""
        with self._lock:
            self._load()
            for c in reversed(self._by_run.get(run, ())):
                if c.covers(step):
                    return c
        return None
