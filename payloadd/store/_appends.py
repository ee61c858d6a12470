"""The append side of the storage core: validated items, reserved ranges, leases.

`Store.begin_append` reserves byte ranges (`PendingAppend`), the caller writes the rows with
``os.pwrite`` outside the store's lock, and `PendingAppend.commit` returns the segments once
every byte is written; `Store.lease` hands a data-plane client a private range
(`LeasedRange`). Both deal with the files they hold through an `AppendOwner` (the store's
`payloadd.store._files.FileTable`), and count through `payloadd.store._counts.Counts`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from payload_client import SUPPORTED_DTYPES, InvalidRequestError, PayloadSegment
from payload_client.protocol import INT64_MAX, AppendItem, check_name
from payloadd.store._counts import HTTP, Counts
from payloadd.store._records import AppendFile, Placement, os_errors

__all__ = ["AppendOwner", "LeasedRange", "PendingAppend", "item_nbytes"]


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


class AppendOwner(Protocol):
    """What a pending append or a leased range needs from the files it holds (the store's
    `payloadd.store._files.FileTable`)."""

    @property
    def root(self) -> Path:
        """The payload root (for the errors of its files)."""
        ...

    def committed(self, files: Sequence[AppendFile]) -> None:
        """Rows were written to ``files``: fsync them, or mark them for the next flush,
        as the durability policy says."""
        ...

    def release(self, files: Sequence[AppendFile]) -> None:
        """The caller is done with ``files``; a sealed one nobody uses any more closes."""
        ...

    def give_up(
        self, placements: Sequence[Placement], files: Sequence[AppendFile], private: bool
    ) -> None:
        """An append ends without a commit: give its reservation back."""
        ...

    def lease_ended(self, f: AppendFile, end: int, used: int | None) -> None:
        """A lease of ``f`` ended (its client wrote ``f`` unseen), and is released."""
        ...

    def end_lease(self, f: AppendFile, end: int, used: int) -> None:
        """A lease of ``f`` ends at ``used`` (its tail taken back), and stays held."""
        ...

    def hand_over(self, f: AppendFile) -> int:
        """The owner's write descriptor of ``f``, now the caller's; -1 if it has none."""
        ...


class PendingAppend:
    """Reserved byte ranges waiting for their rows; fill with `write`, finish with `commit`.

    The rows arrive as one byte stream: item 0's rows, then item 1's, ... in any chunking.
    The files stay open (the store's descriptors) until `commit` or `close`. An append placed
    in files of its own (``private``) that ends without `commit` takes them away with it:
    nothing in them was acknowledged, so they are removed and their bytes stop counting.
    A commit counts in ``counts`` as an append over ``transport``.
    """

    def __init__(
        self,
        owner: AppendOwner,
        counts: Counts,
        items: Sequence[AppendItem],
        placements: list[Placement],
        files: list[AppendFile],
        private: bool = False,
        transport: str = HTTP,
    ) -> None:
        self._owner = owner
        self._counts = counts
        self._items = items
        self._placements = placements
        self._files = files
        self.private = private
        self.transport = transport
        self._cursor = 0  # index into placements
        self._done = 0  # bytes of placements[cursor] written
        self.remaining = sum(e.nbytes for e in placements)
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
        with os_errors(self._owner.root):
            self._write(view)

    def _write(self, view: memoryview) -> None:
        if view.nbytes > self.remaining:
            raise InvalidRequestError(
                f"body carries more row bytes than its items announce ({self.remaining} left)"
            )
        while view.nbytes:
            ext = self._placements[self._cursor]
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
        return [(e.file.rel, e.offset, e.nbytes) for e in self._placements]

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
        self._owner.committed(self._files)
        self._committed = True
        self.close()
        out: list[list[PayloadSegment]] = [[] for _ in self._items]
        for e in self._placements:
            it = self._items[e.item]
            out[e.item].append(
                PayloadSegment(
                    it.field, e.file.rel, e.offset, e.pos, e.rows, it.dtype, list(it.shape)
                )
            )
        self._counts.appended(self._items, self.transport)
        return out

    def close(self) -> None:
        """Let go of the files. Without `commit`, the reservation is given back: files of
        its own are removed; in shared files, ranges at a file's end are taken back (others
        stay unreferenced bytes)."""
        if not self._closed:
            self._closed = True
            if self._committed:
                self._owner.release(self._files)
            else:
                self._owner.give_up(self._placements, self._files, self.private)


class LeasedRange:
    """A private byte range of a data file, handed to one client; see `Store.lease`.

    Attributes
    ----------
    file : str
        The file, relative to the root.
    offset, nbytes : int
        Where the range starts in it, and its length.
    """

    def __init__(self, owner: AppendOwner, f: AppendFile, offset: int, nbytes: int) -> None:
        self._owner, self._file = owner, f
        self.file, self.offset, self.nbytes = f.rel, offset, nbytes
        self._released = False

    def writer(self) -> int:
        """The store's write descriptor of the range's file, now the caller's (to pass to
        the client and close): a file the lease created keeps the one it was created with
        until then. -1 when there is none (a file leased before, or handed over): the
        caller opens one."""
        return self._owner.hand_over(self._file)

    def release(self, used: int | None = None) -> None:
        """The client is done with the range. ``used``: the client said it wrote nothing of
        it from that file offset on (``offset <= used <= offset + nbytes``): that tail is
        taken back when nothing was placed after it, so the file goes on there; else (and
        without ``used``) the tail stays reserved until the file closes."""
        if not self._released:
            self._released = True
            self._owner.lease_ended(self._file, self.offset + self.nbytes, used)

    def end(self, used: int) -> None:
        """The client writes nothing of the range from ``used`` on, as with `release`, but
        rows of its below ``used`` are still on their way (other threads of the client are
        writing them): the tail is taken back now, and the range stays held, so its file
        stays open and counts up to ``used``, until `release` (once the client says they
        are in place). The file's size on disk decides what it counts only when it closes:
        a file closed before them would never count them."""
        if not self._released:
            self._owner.end_lease(self._file, self.offset + self.nbytes, used)
