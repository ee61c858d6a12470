"""The append side of the storage core: validated items, reserved ranges, leases.

`Store.begin_append` reserves byte ranges (`PendingAppend`), the caller writes the rows with
``os.pwrite`` outside the store's lock, and `PendingAppend.commit` returns the segments once
every byte is written; `Store.lease` hands a data-plane client a private range (`Lease`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from payload_client import (
    SUPPORTED_DTYPES,
    InvalidRequestError,
    PayloadError,
    PayloadSegment,
    ServerError,
    StorageFullError,
)
from payload_client.protocol import INT64_MAX, AppendItem, check_name
from payloadd.store._budget import out_of_descriptors

if TYPE_CHECKING:
    from payloadd.store._store import Store

__all__ = ["Lease", "PendingAppend", "item_nbytes", "os_errors"]


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
    """Translate OS errors of the payload root: a full disk or quota is 507, no descriptor left
    503, others 500."""
    try:
        yield
    except PayloadError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(f"payload root {root} is full: {exc.strerror}") from exc
        busy = out_of_descriptors(exc)
        if busy is not None:
            raise busy from exc
        raise ServerError(f"I/O error under the payload root {root}: {exc}") from exc


@dataclass(eq=False)
class _File:
    """A data file open for appends. ``size`` is the end of what has been reserved.

    ``owner`` 0: a shared file, written only by the daemon (HTTP appends). Otherwise the file
    is private to one data-plane connection (its leases) or to one pending append (its own
    fresh files): nobody else's rows are ever placed in it, so the descriptors handed out for
    it can only damage what their holder wrote. ``fd`` is the daemon's descriptor (-1 for a
    lease file: its client writes it through a descriptor of its own). ``open`` while its
    reserved bytes count against the cap; it ends once the file is sealed and unused.
    ``users`` counts pending appends and leases, ``leases`` the leases among them (GC may
    remove a leased file: the client checks after writing, see `Store.remove_step`)."""

    rel: str
    size: int
    fd: int
    key: tuple[str, int, str]
    owner: int = 0
    ino: tuple[int, int] = (0, 0)
    users: int = 0
    leases: int = 0
    sealed: bool = False
    open: bool = True


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
    The files stay open (the store's descriptors) until `commit` or `close`. An append placed
    in files of its own (``private``) that ends without `commit` takes them away with it:
    nothing in them was acknowledged, so they are removed and their bytes stop counting.
    """

    def __init__(
        self,
        store: Store,
        items: Sequence[AppendItem],
        extents: list[_Extent],
        files: list[_File],
        private: bool = False,
    ) -> None:
        self._store = store
        self._items = items
        self._extents = extents
        self._files = files
        self.private = private
        self._cursor = 0  # index into extents
        self._done = 0  # bytes of extents[cursor] written
        self.remaining = sum(e.nbytes for e in extents)
        self._committed = False
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
    def files(self) -> list[str]:
        """The files written to, relative to the root."""
        return [f.rel for f in self._files]

    @property
    def extents(self) -> list[tuple[str, int, int]]:
        """The reserved ranges in row-stream order: ``(file, offset, nbytes)``."""
        return [(e.file.rel, e.offset, e.nbytes) for e in self._extents]

    @property
    def items(self) -> Sequence[AppendItem]:
        """The items of this append, in order."""
        return self._items

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
        if self._closed:
            raise InvalidRequestError("this append was already given up")
        if self._store.fsync == "always":
            with os_errors(self._store.root):
                for f in self._files:
                    os.fsync(f.fd)
        elif self._store._dirty is not None:
            self._store._dirty.wrote(f.rel for f in self._files)
        self._committed = True
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
        """Let go of the files. Without `commit`, the reservation is given back: files of
        its own are removed; in shared files, ranges at a file's end are taken back (others
        stay unreferenced bytes)."""
        if not self._closed:
            self._closed = True
            if self._committed:
                self._store._release(self._files)
            else:
                self._store._give_up(self._extents, self._files, self.private)


class Lease:
    """A private byte range of a data file, handed to one client; see `Store.lease`."""

    def __init__(self, store: Store, f: _File, offset: int, nbytes: int) -> None:
        self._store, self._file = store, f
        self.file, self.offset, self.nbytes = f.rel, offset, nbytes
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
