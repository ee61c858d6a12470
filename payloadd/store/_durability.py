"""``fsync="interval"``: the files and directories written since the last flush, and the
background thread that fsyncs them.

The store marks a data file dirty when an append into it commits (its bytes are written
then), and marks every file with a data-plane lease dirty for as long as the lease lasts
(the client pwrites through its own descriptor, unseen by the daemon) and until the flush
after the lease ends. Directories that got a new entry (a new file, or a new run or step
directory) are marked too. `DirtyFiles.flush` fsyncs them all by path, so a file the store
closed in the meantime (rotated, sealed) is flushed as well; a file removed in the
meantime has nothing left to keep.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["DirtyFiles", "Flusher"]

log = logging.getLogger("payloadd.flush")


class DirtyFiles:
    """What the next flush must fsync; thread-safe. Paths are relative to ``root``.

    Attributes
    ----------
    flushes : int
        Flushes that fsync'd at least one file or directory.
    files_flushed : int
        Data files fsync'd, in all flushes.
    flush_errors : int
        fsyncs that failed (each one logged as an error).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._files: set[str] = set()
        self._dirs: set[str] = set()
        self._leased: Counter[str] = Counter()
        self.flushes = 0
        self.files_flushed = 0
        self.flush_errors = 0

    def wrote(self, files: Iterable[str]) -> None:
        """Bytes of ``files`` were written (an append committed)."""
        with self._lock:
            self._files.update(files)

    def created(self, dirs: Iterable[str]) -> None:
        """Directories ``dirs`` got a new entry (a file or a directory)."""
        with self._lock:
            self._dirs.update(dirs)

    def leased(self, file: str) -> None:
        """A client may write ``file`` at any time from now on (a data-plane lease)."""
        with self._lock:
            self._leased[file] += 1

    def released(self, file: str) -> None:
        """A lease of ``file`` ended: it stays dirty until the next flush."""
        with self._lock:
            self._leased[file] -= 1
            if self._leased[file] <= 0:
                del self._leased[file]
            self._files.add(file)

    def pending(self) -> int:
        """Data files the next flush will fsync."""
        with self._lock:
            return len(self._files | self._leased.keys())

    def flush(self) -> list[str]:
        """fsync every dirty data file, then every dirty directory.

        Returns
        -------
        list of str
            The data files fsync'd (a file removed since it was written is skipped).

        Notes
        -----
        A failed fsync is logged and counted in ``flush_errors``, not raised: the flusher
        goes on with the other files, and so does the next flush.
        """
        with self._lock:
            files = sorted(self._files | self._leased.keys())
            dirs = sorted(self._dirs, key=lambda d: (-d.count("/"), d))  # deepest first
            self._files, self._dirs = set(), set()
        done = [rel for rel in files if self._fsync(rel, os.O_RDONLY | os.O_NOFOLLOW)]
        synced_dirs = sum(self._fsync(rel, os.O_RDONLY | os.O_DIRECTORY) for rel in dirs)
        with self._lock:
            self.files_flushed += len(done)
            self.flushes += bool(done or synced_dirs)
        return done

    def _fsync(self, rel: str, flags: int) -> bool:
        try:
            fd = os.open(self.root / rel, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            return False  # removed since: nothing to keep
        except OSError as exc:
            self._failed(rel, exc)
            return False
        try:
            os.fsync(fd)
            return True
        except OSError as exc:
            self._failed(rel, exc)
            return False
        finally:
            os.close(fd)

    def _failed(self, rel: str, exc: OSError) -> None:
        with self._lock:
            self.flush_errors += 1
        log.error("fsync of %s failed (its bytes may not survive a node crash): %s", rel, exc)


class Flusher:
    """Call ``flush`` every ``interval_s`` seconds in a background thread.

    Parameters
    ----------
    flush : callable
        One flush (`DirtyFiles.flush`), returning the files it fsync'd; an exception it
        raises is logged, and the flusher goes on.
    interval_s : float
        Seconds between the end of one flush and the start of the next (> 0).
    """

    def __init__(self, flush: Callable[[], list[str]], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"flush interval must be > 0 seconds, got {interval_s}")
        self._flush = flush
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start flushing in the background."""
        self._thread = threading.Thread(target=self._run, name="payloadd-flusher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._once()

    def _once(self) -> list[str]:
        try:
            return self._flush()
        except Exception:
            log.exception("flush failed")
            return []

    def stop(self) -> None:
        """Stop the thread, then flush one last time (at shutdown: nothing written is left
        unflushed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        done = self._once()
        log.info("last flush at shutdown: %d data files fsync'd", len(done))
