"""Read-ahead of the windows a client will read next (``POST /v1/prefetch``).

A trainer rank that knows its next micro batches asks the daemon to warm their byte ranges
while it computes: the daemon checks the extents as a read would (`Readers.open_for_read`:
a collected step answers 410), tells the kernel (``posix_fadvise(POSIX_FADV_WILLNEED)``),
and reads the ranges once in a background thread of its own, into a scratch buffer it
throws away, so that the pages are in this node's page cache when the read comes. The
read-ahead is needed where the advice does nothing: measured on GlusterFS's FUSE client
here, ``WILLNEED`` returned at once and the next read was as cold as before
(docs/deployment.md).

A hint only: what is beyond ``max_pending_bytes`` or ``max_pending_files`` queued at once is
left out (the answer says how much was queued), a file shorter than its extents is read
ahead as far as it goes, and an error of the read-ahead is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Sequence

from payload_client import InvalidRequestError, PayloadError
from payload_client.protocol import Extent, merge_ranges
from payloadd.store._counts import Counts
from payloadd.store._readers import Readers

__all__ = ["PREFETCH_CHUNK", "PREFETCH_FILES", "Prefetcher"]

PREFETCH_CHUNK = 4 << 20
"""Bytes the read-ahead reads at a time."""
PREFETCH_FILES = 16
"""Files queued at once by default."""


class Prefetcher:
    """Queues byte ranges of data files and reads them ahead in a thread of its own.

    Parameters
    ----------
    reads : Readers
        Opens the files (the checks of a read).
    counts : Counts
        Counts the calls that queued something (``prefetches``) and the bytes read ahead
        (``bytes_prefetched``).
    max_pending_bytes : int
        Most bytes queued and not yet read ahead.
    max_pending_files : int
        Most files queued.
    """

    def __init__(
        self,
        reads: Readers,
        counts: Counts,
        max_pending_bytes: int = 1 << 30,
        max_pending_files: int = PREFETCH_FILES,
    ) -> None:
        self.reads, self.counts = reads, counts
        self.max_pending_bytes, self.max_pending_files = max_pending_bytes, max_pending_files
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[str, list[tuple[int, int]], int]] = collections.deque()
        self._pending_bytes = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, extents: Sequence[Extent]) -> tuple[int, int]:
        """Queue ``extents`` for read-ahead into this node's page cache; return ``(files,
        bytes)`` queued.

        Ranges of one file are merged where they touch or overlap. Only the files that fit
        the queue are checked (opened and closed again, one at a time: a prefetch holds no
        descriptor while it waits, and at most one while it reads ahead).

        Raises
        ------
        InvalidRequestError
            An extent reaches past its segment's end.
        FileMissingError, FileGoneError, SegmentFileError, InvalidSegmentError, BusyError
            As `Readers.open_for_read`, for a file that fits the queue (nothing is queued
            then).
        """
        by_file: dict[str, list[tuple[int, int]]] = {}
        for i, e in enumerate(extents):
            if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > e.end:
                raise InvalidRequestError(
                    f"extent {i}: offset {e.offset} + nbytes {e.nbytes} is not within end {e.end}"
                )
            if e.nbytes:
                by_file.setdefault(e.file, []).append((e.offset, e.offset + e.nbytes))
        with self._cv:
            files_room = self.max_pending_files - len(self._queue)
            bytes_room = self.max_pending_bytes - self._pending_bytes
        chosen: list[tuple[str, list[tuple[int, int]], int]] = []
        for rel, ranges in by_file.items():
            merged = merge_ranges(ranges)
            n = sum(hi - lo for lo, hi in merged)
            if len(chosen) < files_room and n <= bytes_room:
                chosen.append((rel, merged, n))
                bytes_room -= n
        for rel, merged, _ in chosen:  # checked as a read checks them, before any is queued
            fd = self.reads.open_for_read(rel, 0)  # a hint: the size is not waited for
            try:
                for lo, hi in merged:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        files = nbytes = 0
        with self._cv:
            for rel, merged, n in chosen:
                if self._closed or len(self._queue) >= self.max_pending_files:
                    break  # filled meanwhile by another call: the rest is left out
                self._queue.append((rel, merged, n))
                self._pending_bytes += n
                files, nbytes = files + 1, nbytes + n
            if files and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="payloadd-prefetch", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        if files:
            self.counts.add("prefetches")
        return files, nbytes

    def pending(self) -> int:
        """Bytes queued and not read ahead yet."""
        with self._cv:
            return self._pending_bytes

    def _run(self) -> None:
        buf = bytearray(PREFETCH_CHUNK)
        view = memoryview(buf)
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                rel, ranges, n = self._queue.popleft()
            done = 0
            try:
                fd = self.reads.open_for_read(rel, 0)
            except (PayloadError, OSError):  # collected or gone since: nothing to warm
                fd = -1
            try:
                for lo, hi in ranges if fd >= 0 else ():
                    at = lo
                    with contextlib.suppress(OSError):
                        while at < hi:
                            got = os.preadv(fd, [view[: min(PREFETCH_CHUNK, hi - at)]], at)
                            if got <= 0:
                                break
                            at += got
                    done += at - lo
            finally:
                if fd >= 0:
                    os.close(fd)
                with self._cv:
                    self._pending_bytes -= n
                self.counts.add("bytes_prefetched", done)

    def close(self) -> None:
        """Drop what is queued and stop the thread (at shutdown)."""
        with self._cv:
            self._closed = True
            self._pending_bytes -= sum(n for _, _, n in self._queue)  # one being read goes on
            self._queue.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(10)
