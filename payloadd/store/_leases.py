"""Leases: private byte ranges of data files that data-plane clients write themselves.

`Leases` places each data-plane connection's leases in files of its own (the `FileTable`'s
``leased`` files of ``(run, step, field, owner)``), seals them when the connection is done
with a key or ends, and removes those it never wrote into. `payloadd.store._store.Store`
owns one and answers its lease methods with it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

from payload_client import PayloadTooLargeError
from payload_client.protocol import FieldsTable, check_field, check_name
from payloadd.store._appends import LeasedRange
from payloadd.store._files import FileTable
from payloadd.store._records import AppendFile, os_errors
from payloadd.store._shapes import RunShapes
from payloadd.store._watermarks import Watermarks

__all__ = ["AHEAD_ROOM", "ROOM_SHARE", "Leases"]

AHEAD_ROOM = 8
"""A lease taken ahead of need (`Leases.lease` with ``ahead``) is granted only while the
room under the disk limits holds this many whole leases: never near a limit, where it would
take room from appends that need it."""
ROOM_SHARE = 8
"""A lease takes at most this share of the room left under the disk limits (and never less
than it needs): near a limit, leases shrink instead of one client's reservation refusing
everybody else's appends."""


class Leases:
    """The leases of a store's data-plane connections, under the lock of its file table.

    Parameters
    ----------
    table : FileTable
        The files open for appends (its lock, disk budget, durability marks).
    fields : FieldsTable
        What each field takes (a lease of a refused field is refused).
    max_file_bytes : int
        The rotation size: no lease crosses it.
    last_used : dict
        Run -> monotonic time of its last use (a lease is one).
    shapes : RunShapes
        The row shapes fixed per run (a lease's rows are checked, and fix the first).
    watermarks : Watermarks
        The collected watermarks (no lease at or below one).
    """

    def __init__(
        self,
        table: FileTable,
        fields: FieldsTable,
        max_file_bytes: int,
        last_used: dict[str, float],
        shapes: RunShapes,
        watermarks: Watermarks,
    ) -> None:
        self.table, self.fields, self.max_file_bytes = table, fields, max_file_bytes
        self.last_used = last_used
        self.shapes, self.watermarks = shapes, watermarks

    def lease(
        self,
        key: tuple[str, int, str],
        nbytes: int,
        size: int,
        owner: int,
        *,
        ahead: bool = False,
        shape: Sequence[int] | None = None,
    ) -> LeasedRange | None:
        """`payloadd.store._store.Store.lease` of ``key``, ``(run, step, field)``; with
        ``ahead``, ``None`` (nothing reserved) unless the disk limits leave `AHEAD_ROOM`
        leases of ``size`` bytes, the step is not collected and ``shape`` is the one the run
        took. The watermarks are refreshed first when due; the watermark, the room and the
        shape are checked under the lock a collection plans under: a lease either comes
        before the collection (its file is planned with the step) or is refused."""
        self.watermarks.refresh_if_due()  # I/O: before the lock
        run, step, field = key
        check_name(run, "run")
        check_name(field, "field")
        check_field(self.fields, field)
        cap = self.max_file_bytes
        if nbytes > cap:
            raise PayloadTooLargeError(f"lease of {nbytes} bytes is above the rotation size {cap}")
        if ahead:
            nbytes = max(nbytes, 1)
        t = self.table
        with t.lock, os_errors(t.root):
            if ahead:
                mark = self.watermarks.mark(run)
                room = t.budget.spare()
                if (mark is not None and step <= mark) or room < AHEAD_ROOM * max(size, nbytes):
                    return None
            else:
                self.watermarks.check([(run, step)])
                room = t.budget.room(nbytes)
            if shape is not None and not self.shapes.lease(run, field, shape, fix=not ahead):
                return None  # ahead of need, of a shape the run has not taken
            f = self._file(key, owner, nbytes)
            granted = max(nbytes, min(size, cap - f.size, room // ROOM_SHARE))
            offset = f.size
            f.size += granted
            f.users += 1
            f.leases += 1
            self.last_used[run] = time.monotonic()
            t.budget.reserve(granted)
            if t.dirty is not None:
                t.dirty.leased(f.rel)
        return LeasedRange(t, f, offset, granted)

    def _file(self, key: tuple[str, int, str], owner: int, nbytes: int) -> AppendFile:
        """The lease file of ``key`` private to ``owner``, with room for ``nbytes`` more: a
        new one when there is none, it was removed or is full (the old one sealed). Lock
        held."""
        t = self.table
        f = t.leased.get((*key, owner))
        if f is None or t.removed(f) or (f.size + nbytes > self.max_file_bytes and f.size > 0):
            f = t.new_file(*key, owner)  # its descriptor: for the client
            old = t.leased.pop((*key, owner), None)
            if old is not None:
                t.seal(old)
            t.leased[(*key, owner)] = f
        return f

    def seal_lease(self, owner: int, key: tuple[str, int, str]) -> None:
        """`payloadd.store._store.Store.seal_lease`."""
        t = self.table
        with t.lock:
            f = t.leased.pop((*key, owner), None)
            if f is not None:
                t.seal(f)

    def end_owner(self, owner: int) -> None:
        """`payloadd.store._store.Store.end_owner`."""
        t = self.table
        with t.lock:
            for key in [k for k in t.leased if k[3] == owner]:
                f = t.leased.pop(key)
                t.seal(f)
                if f.users == 0 and not f.open:
                    with contextlib.suppress(OSError):
                        st = os.stat(t.root / f.rel)
                        if st.st_size == 0 and (st.st_dev, st.st_ino) == f.ino:
                            t.discard(f)
