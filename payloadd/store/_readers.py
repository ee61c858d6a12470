"""The read side of the storage core: checked opens, cached descriptors, extent reads.

A data file is opened only strictly inside the payload root (no ``..``, no symlink out of
it, regular files only), only where data files lie (``<node>/<run>/<step>/<name>``, never
the daemon's own ``@`` files such as the GC ledger), and only when it is at least as long as
the segment says. A missing file answers `FileMissingError` (404), or `FileGoneError` (410)
when its node's GC ledger says its step was collected (`payloadd.store._ledger`).

Another node's file (a shared root) is read by the rules of the root's file system
(`payloadd.store._fs_kind.RootPolicy`): its node's ledger is consulted before every read,
so a collected step answers 410 even where this node still sees its files (a distributed
file system's caches, a descriptor kept open); and a segment past the end this node sees is
waited for, opening the file anew, for up to ``foreign_wait_s``: this node's view of the
file's size may lag the writer's.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from payload_client import (
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadTooLargeError,
    SegmentFileError,
)
from payload_client.protocol import Extent, check_relative_path
from payloadd.store._budget import READ_CACHE, out_of_descriptors
from payloadd.store._counts import HTTP, PEER
from payloadd.store._fs_kind import LOCAL_POLICY, RootPolicy
from payloadd.store._ledger import LEDGER_NAME, Ledger
from payloadd.store._records import os_errors
from payloadd.store._short_reads import NO_SENDFILE, ShortRead, copy_out

__all__ = ["ExtentReader", "Readers"]

SHORT_READ_WAIT_S = 2.0
"""Longest wait for another node's file checked long enough that a pread then finds
shorter: on GlusterFS it was seen to last over 0.5 s, under FUSE's 1 s attribute cache."""
_GONE_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ESTALE)
"""An open that fails so found no file: ``ESTALE`` is what a FUSE or NFS client answers for
a name it still caches whose file another node removed."""


class _ShortFileError(SegmentFileError):
    """The file is shorter than a segment says (raised as `SegmentFileError`)."""


class Readers:
    """Opens and reads the data files of a payload root; thread-safe.

    Parameters
    ----------
    root, node
        As `payloadd.store._files.FileTable`'s.
    max_read_bytes : int
        Largest total of one `read_extents` call.
    touch : callable
        Called with the run of every read under this node's prefix (so the GC age rule
        spares runs being read).
    policy : RootPolicy
        How other nodes' files are read on this root's file system: ``foreign_reads``
        (``reopen``: opened anew for every read, never kept, `keeps`), ``foreign_wait_s``
        (how long a segment past the end this node sees is waited for), and whether
        data-plane clients may keep their descriptors (`client_keeps`).

    count : callable
        Called with the extents of each read answered in full and its transport
        (`Counts.read`).
    """

    def __init__(
        self,
        root: Path,
        node: str,
        max_read_bytes: int,
        touch: Callable[[str], None],
        policy: RootPolicy = LOCAL_POLICY,
        cache_size: int = READ_CACHE,
        count: Callable[[Sequence[Extent], str], None] = lambda extents, transport: None,
    ) -> None:
        self.root, self.node, self.max_read_bytes = root, node, max_read_bytes
        self.cache_size = cache_size
        self.policy = policy
        self._root_prefix = str(root) + os.sep
        self._touch = touch
        self._lock = threading.Lock()
        self._readers: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._ledgers: dict[str, Ledger] = {}
        self._count = count

    def open_for_read(self, rel: str, end: int, deadline: float | None = None) -> int:
        """Open a data file for reading after checking it against a segment's end.

        Parameters
        ----------
        rel : str
            Path relative to the root.
        end : int
            Byte offset just past the segment: the file must be at least that long.
        deadline : float, optional
            Monotonic time until which another node's file that is missing or too short is
            waited for (one deadline for all the files of a request, `deadline`); default:
            ``foreign_wait_s`` from now.

        Returns
        -------
        int
            A read-only file descriptor of its own; the caller closes it.

        Raises
        ------
        InvalidSegmentError
            ``rel`` is not a normalised relative path.
        FileMissingError
            The file does not exist, or is none of the data files (the daemon's own ``@``
            files, or a path not shaped ``<node>/<run>/<step>/<file>`` once resolved).
        FileGoneError
            It does not exist and its node's GC ledger says its step was collected.
        SegmentFileError
            It resolves outside the root, is not a regular file, or is shorter than ``end``.

        Notes
        -----
        Descriptors of recently read files are kept open (``cache_size`` of them). A cached
        one is used only while ``rel`` still names the same file (one ``stat``), so a removed
        or replaced file is never served from the cache. A file this daemon does not keep
        descriptors of (`keeps`) is opened anew. Threads that open the same new file at once
        (trainer ranks released onto a new step) each get a descriptor; the cache keeps one.
        """
        node, _, rest = rel.partition("/")
        if node == self.node:  # a run being read is in use (the TTL rule spares it)
            self._touch(rest.partition("/")[0])
            try:
                return self._open(rel, end)
            except _ShortFileError as exc:
                raise SegmentFileError(str(exc)) from None
        self._raise_if_collected(rel)  # where this node may still see a collected file
        if deadline is None:
            deadline = self.deadline()
        waits = self._may_appear(rel)
        pause = 0.002
        while True:
            try:
                return self._open(rel, end)
            except (_ShortFileError, FileMissingError) as exc:
                # this node's view of another node's file may lag: a new file not listed
                # yet, or an older size; a fresh open (on NFS) or time (FUSE's attribute
                # cache) brings it up to date
                late = isinstance(exc, _ShortFileError) or waits
                if (
                    isinstance(exc, FileGoneError)
                    or not late
                    or time.monotonic() + pause > deadline
                ):
                    if isinstance(exc, _ShortFileError):
                        raise SegmentFileError(str(exc)) from None
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def deadline(self) -> float:
        """Monotonic time until which a read starting now waits for other nodes' files."""
        return time.monotonic() + self.policy.foreign_wait_s

    def _may_appear(self, rel: str) -> bool:
        """Whether a missing ``rel`` of another node may still appear (this node's listing
        lags): a data file's path, under a node prefix that exists. A path no data file can
        have, or a node nobody writes, is answered at once."""
        parts = rel.split("/")
        if len(parts) != 4 or parts[-1].startswith("@") or "" in parts:
            return False
        return os.path.isdir(self.root / parts[0])

    def short_read_wait(self, rel: str) -> float:
        """Longest wait for a checked file that a pread finds shorter: another node's, on a
        root whose policy waits for them (`may_wait`); else none."""
        if self.policy.foreign_wait_s <= 0 or rel.startswith(self.node + "/"):
            return 0.0
        return SHORT_READ_WAIT_S

    def may_wait(self, extents: Sequence[Extent]) -> bool:
        """Whether a read of ``extents`` may wait for another node's files (`open_for_read`):
        then it must not run on an event loop."""
        if self.policy.foreign_wait_s <= 0:
            return False
        mine = self.node + "/"
        return any(not e.file.startswith(mine) for e in extents)

    def _open(self, rel: str, end: int) -> int:
        """`open_for_read` once: a descriptor from the cache or a checked open; a file
        shorter than ``end`` raises `_ShortFileError`."""
        if not self.keeps(rel):
            return self._open_checked(rel, end)
        with self._lock:
            hit = self._readers.get(rel)
            if hit is not None:
                self._readers.move_to_end(rel)
                fd = _dup(hit[0])
        if hit is not None:
            try:
                st = os.stat(self.root / rel)
                same = (st.st_dev, st.st_ino) == hit[1:]
            except OSError:
                same = False
            if same and st.st_size >= end:
                return fd
            os.close(fd)
            self.drop(rel)  # replaced, or shorter than the segment: a fresh open decides
        fd = self._open_checked(rel, end)
        try:
            st = os.fstat(fd)
            kept = os.dup(fd)
        except OSError:  # no descriptor for the cache (EMFILE): this read goes on uncached
            return fd
        closing: list[int] = []
        with self._lock:
            old = self._readers.get(rel)
            if old is not None and old[1:] == (st.st_dev, st.st_ino):
                closing.append(kept)  # another thread cached this file first: keep its entry
                self._readers.move_to_end(rel)
            else:
                if old is not None:  # a file replaced since: its entry goes
                    closing.append(old[0])
                self._readers[rel] = (kept, st.st_dev, st.st_ino)
                self._readers.move_to_end(rel)
                while len(self._readers) > self.cache_size:
                    closing.append(self._readers.popitem(last=False)[1][0])
        for c in closing:
            os.close(c)
        return fd

    def keeps(self, rel: str) -> bool:
        """Whether the daemon may keep a descriptor of ``rel`` for later reads: always, except
        for a file under another node's prefix under ``foreign_reads="reopen"``."""
        return self.policy.foreign_reads == "cached" or rel.partition("/")[0] == self.node

    def client_keeps(self, rel: str) -> bool:
        """Whether a data-plane client may keep the descriptor of ``rel`` it is passed: this
        node's files always; another node's only where the policy allows
        (`RootPolicy.client_keeps_foreign`: never on a distributed file system, where only
        the daemon's check of that node's ledger tells a collected file)."""
        return rel.partition("/")[0] == self.node or self.policy.client_keeps_foreign

    def drop(self, rel: str) -> None:
        """Close the cached descriptor of ``rel``, if any (its file was removed)."""
        with self._lock:
            hit = self._readers.pop(rel, None)
        if hit is not None:
            os.close(hit[0])

    def drop_removed(self) -> int:
        """Close every cached descriptor whose file is gone (removed by another node's
        daemon on a shared root, or by hand), so that its space is freed; return how many.

        The daemon's own garbage collection drops what it removes at once (`drop`); this
        catches the rest, from the background sweep.
        """
        with self._lock:
            entries = list(self._readers.items())
        gone = []
        for rel, (fd, _, _) in entries:
            try:
                if os.fstat(fd).st_nlink == 0:
                    gone.append((rel, fd))
            except OSError:
                gone.append((rel, fd))
        closing = []
        with self._lock:
            for rel, fd in gone:
                hit = self._readers.get(rel)
                if hit is not None and hit[0] == fd:
                    del self._readers[rel]
                    closing.append(fd)
        for fd in closing:
            os.close(fd)
        return len(closing)

    def _open_checked(self, rel: str, end: int) -> int:
        try:
            check_relative_path(rel)
        except ValueError as exc:
            raise InvalidSegmentError(f"file {exc}", field="file") from None
        real = os.path.realpath(self.root / rel)
        if not real.startswith(self._root_prefix):
            raise SegmentFileError(f"payload file {rel!r} resolves outside the payload root")
        parts = real[len(self._root_prefix) :].split(os.sep)
        if len(parts) != 4 or parts[-1].startswith("@"):  # the GC ledger, a node's own files
            raise FileMissingError(
                f"payload file {rel!r} is no data file: they lie at <node>/<run>/<step>/<file>"
            )
        try:
            fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno in _GONE_ERRNOS:
                self._raise_if_collected(rel)
                raise FileMissingError(f"payload file {rel!r} does not exist") from None
            busy = out_of_descriptors(exc)
            if busy is not None:
                raise busy from None
            raise SegmentFileError(f"payload file {rel!r} cannot be opened: {exc}") from None
        try:
            try:
                st = os.fstat(fd)
            except OSError as exc:
                if exc.errno not in _GONE_ERRNOS:
                    raise
                self._raise_if_collected(rel)  # another node removed it meanwhile
                raise FileMissingError(f"payload file {rel!r} does not exist") from None
            if not stat.S_ISREG(st.st_mode):
                raise SegmentFileError(f"payload file {rel!r} is not a regular file")
            if st.st_size < end:
                raise _ShortFileError(
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
                led = Ledger(self.root / node / LEDGER_NAME)
                if node == self.node or led.path.is_file():  # none kept for made-up nodes
                    self._ledgers[node] = led
        return led

    def _raise_if_collected(self, rel: str) -> None:
        """Raise `FileGoneError` when the ledger of its node lists missing file ``rel``."""
        parts = rel.split("/")
        if len(parts) != 4:
            return
        node, run, step = parts[0], parts[1], parts[2]
        c = self.ledger(node).find(rel)
        if c is not None:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c.at))
            raise FileGoneError(
                f"payload file {rel!r} is gone: step {step} of run {run!r} was "
                f"garbage-collected ({c.reason}, {when})"
            )

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
        deadline = self.deadline()  # one wait for the whole read, whatever its files
        try:
            for e in extents:  # check every file before reading anything
                if e.file not in fds:
                    fds[e.file] = self.open_for_read(e.file, e.end, deadline)
                elif e.end > _size_of(fds[e.file]):
                    os.close(self.open_for_read(e.file, e.end, deadline))  # the size error
                    # (or the file grew meanwhile: its first descriptor reads the rest too)
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

    def cached(self) -> int:
        """Read descriptors held in the cache now."""
        with self._lock:
            return len(self._readers)

    def close(self) -> None:
        """Close every cached descriptor (at shutdown)."""
        with self._lock:
            for fd, _, _ in self._readers.values():
                os.close(fd)
            self._readers.clear()


class ExtentReader:
    """The open files of one checked read (`Store.open_extents`): reads its ranges in order.

    Attributes
    ----------
    total : int
        Bytes the read gives in all.
    """

    def __init__(
        self, readers: Readers, extents: list[Extent], fds: dict[str, int], total: int
    ) -> None:
        self._readers, self._extents, self._fds, self.total = readers, extents, fds, total
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
        self._readers._count(self._extents, HTTP)

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
        if self.total == 0:
            self._readers._count(self._extents, HTTP)
        for start in range(0, self.total, size):
            chunk = bytearray(min(size, self.total - start))
            self._fill(pieces, memoryview(chunk), current)
            if start + size >= self.total:  # counted before the last chunk goes out
                self._readers._count(self._extents, HTTP)
            yield chunk

    def _fill(
        self, pieces: Iterator[tuple[int, int, int, str]], view: memoryview, current: list[Any]
    ) -> None:
        """pread the next ``len(view)`` bytes of ``pieces`` into ``view``; ``current[0]`` keeps
        the rest of a piece that did not fit, for the next call."""
        at = 0
        with os_errors(self._readers.root):
            while at < view.nbytes:
                if current[0] is None:
                    current[0] = next(pieces)
                fd, offset, nbytes, file = current[0]
                k = min(nbytes, view.nbytes - at)
                got, short = 0, ShortRead(self._readers, file)
                while got < k:
                    try:
                        n = os.preadv(fd, [view[at + got : at + k]], offset + got)
                    except OSError as exc:
                        if exc.errno != errno.ESTALE:
                            raise
                        n = -1  # another node removed it meanwhile (FUSE, NFS)
                    if n > 0:
                        got += n
                    elif short.again(fd, n):
                        continue
                at += k
                current[0] = None if k == nbytes else (fd, offset + k, nbytes - k, file)

    def send_to(self, out: int, wait: Callable[[], None]) -> None:
        """Send the read's bytes in order to the non-blocking socket ``out`` with
        ``os.sendfile`` (no copy through this process), calling ``wait()`` whenever the
        socket takes no more for now (it raises to give up on a peer that stopped reading).

        Raises
        ------
        SegmentFileError, InsufficientStorageError, ServerError
            As `read_into`; the bytes sent so far are not taken back.
        OSError
            The socket's (its peer went away), and what ``wait`` raises.
        """
        copy: memoryview | None = None  # where sendfile does not serve this file system
        for fd, offset, nbytes, file in self._pieces():
            got, short = 0, ShortRead(self._readers, file)
            while got < nbytes:
                try:
                    if copy is None:
                        n = os.sendfile(out, fd, offset + got, nbytes - got)
                    else:
                        n = copy_out(out, fd, offset + got, nbytes - got, copy, wait)
                except BlockingIOError:
                    wait()
                    continue
                except OSError as exc:
                    if copy is None and got == 0 and exc.errno in NO_SENDFILE:
                        copy = memoryview(bytearray(1 << 20))  # pread + send instead
                        continue
                    if exc.errno != errno.ESTALE:
                        raise
                    n = -1
                if n > 0:
                    got += n
                else:
                    with os_errors(self._readers.root):
                        short.again(fd, n)
        self._readers._count(self._extents, PEER)

    def close(self) -> None:
        """Close the read's descriptors (again: nothing)."""
        self._closer()


def _size_of(fd: int) -> int:
    """The size of an open file; -1 when its file is gone (``ESTALE``: another node
    removed it), so that a fresh open answers for it."""
    try:
        return os.fstat(fd).st_size
    except OSError as exc:
        if exc.errno not in _GONE_ERRNOS:
            raise
        return -1


def _dup(fd: int) -> int:
    """``os.dup``, out of descriptors a `BusyError`."""
    try:
        return os.dup(fd)
    except OSError as exc:
        busy = out_of_descriptors(exc)
        if busy is not None:
            raise busy from None
        raise


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
