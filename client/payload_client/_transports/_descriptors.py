"""Descriptor caches of the data plane client: read descriptors by file, leases by key.

Both close what they evict only when no I/O is in flight, so a descriptor number is never
used after it was closed (and perhaps reused for another file).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from .._wire import AppendItem, FieldsTable, NoteRequest

__all__ = [
    "CACHE_FDS",
    "DROP_REMOVED_S",
    "TELL_USE_S",
    "KEPT_SCRATCH",
    "LEASES",
    "NOTE_EVERY",
    "LeaseCache",
    "LeasedRange",
    "ReadCache",
    "Scratch",
]

CACHE_FDS = 128
"""Read-only descriptors a client keeps open (least recently used ones are closed)."""
LEASES = 64
"""Leases (one per run, step and field) a client keeps; the daemon keeps as many per
connection."""
NOTE_EVERY = 64
"""Appends a client places in its leases before it tells the daemon's counters."""
KEPT_SCRATCH = 64 << 20
"""Largest scratch buffer a client keeps for the next read (it keeps at most four)."""
TELL_USE_S = 0.25
"""Seconds between two notes telling the daemon which runs the client used through
descriptors it held (reads and lease appends the daemon does not see; its GC age rule spares
runs in use)."""
DROP_REMOVED_S = 1.0
"""Seconds between two checks of every cached descriptor for files garbage collection
removed (at the start of a call): their space is freed once the client closes them."""

K = TypeVar("K")
V = TypeVar("V")


class _Cache(Generic[K, V]):
    """Descriptors (or leases holding one) by key, least recently used closed first.

    Thread-safe. A descriptor evicted while I/O is in flight (between `begin` and `end`)
    is closed when the last of it ends, so nobody ever uses a closed or reused number.
    """

    def __init__(self, size: int, fd_of: Callable[[V], int]) -> None:
        self.size = size
        self.fd_of = fd_of
        self.lock = threading.Lock()
        self.items: OrderedDict[K, V] = OrderedDict()
        self.inflight = 0
        self.retired: list[int] = []
        self.used: set[str] = set()  # files used since `take_used`

    def take_used(self) -> set[tuple[str, str]]:
        """``(node, run)`` of the files used since the last call."""
        with self.lock:
            used, self.used = self.used, set()
        return {(p[0], p[1]) for p in (rel.split("/", 2) for rel in used) if len(p) > 2}

    def get(self, key: K) -> V | None:
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self.lock:
            old = self.items.pop(key, None)
            if old is not None:
                self.retired.append(self.fd_of(old))
            self.items[key] = value
            while len(self.items) > self.size:
                self.retired.append(self.fd_of(self.items.popitem(last=False)[1]))
            self._sweep()

    def begin(self) -> None:
        with self.lock:
            self.inflight += 1

    def end(self) -> None:
        with self.lock:
            self.inflight -= 1
            self._sweep()

    def _sweep(self) -> None:  # lock held
        if self.inflight == 0:
            for fd in self.retired:
                os.close(fd)
            self.retired.clear()

    def drop_removed(self) -> int:
        """Forget every entry whose file was removed (link count 0), so that its descriptor
        closes and the file's space is freed; return how many."""
        with self.lock:
            gone = [k for k, v in self.items.items() if os.fstat(self.fd_of(v)).st_nlink == 0]
            for k in gone:
                self.retired.append(self.fd_of(self.items.pop(k)))
            self._sweep()
        return len(gone)

    def forget(self, key: K) -> None:
        """Forget one entry (its descriptor closes once no I/O uses it)."""
        with self.lock:
            value = self.items.pop(key, None)
            if value is not None:
                self.retired.append(self.fd_of(value))
                self._sweep()

    def clear(self) -> None:
        """Forget every entry (their descriptors close once no I/O uses them)."""
        with self.lock:
            self.retired.extend(self.fd_of(v) for v in self.items.values())
            self.items.clear()
            self._sweep()


class ReadCache(_Cache[str, int]):
    """Read-only descriptors by file."""

    def __init__(self, size: int = CACHE_FDS) -> None:
        super().__init__(size, lambda fd: fd)


@dataclass
class LeasedRange:
    """A byte range of ``file`` the daemon leased to this client to place rows in:
    ``[next, end)`` is still free."""

    file: str
    fd: int
    next: int
    end: int
    fsync: bool


class LeaseCache(_Cache[tuple[str, int, str], LeasedRange]):
    """The client's current lease of each ``(run, step, field)``."""

    def __init__(self, size: int = LEASES) -> None:
        super().__init__(size, lambda lease: lease.fd)
        self.unnoted = [0, 0, 0]  # appends, rows, bytes placed but not yet told
        self.unnoted_fields: dict[str, list[int]] = {}  # field -> [rows, bytes] of those
        self.fields: FieldsTable | None = None  # the daemon's fields table, once fetched

    def note(
        self, items: Sequence[AppendItem], sizes: Sequence[int], every: int = NOTE_EVERY
    ) -> NoteRequest | None:
        """Count one append of ``items`` (``sizes``: their bytes); return the note to send
        once ``every`` appends are untold."""
        with self.lock:
            u = self.unnoted
            u[0] += 1
            by_field = self.unnoted_fields
            for it, n in zip(items, sizes, strict=True):
                u[1] += it.rows
                u[2] += n
                f = by_field.get(it.field)
                if f is None:
                    by_field[it.field] = [it.rows, n]
                else:
                    f[0] += it.rows
                    f[1] += n
            if u[0] < every:
                return None
            return self._take()

    def _take(self) -> NoteRequest:
        """The note of the untold appends; they count as told from now on. Lock held."""
        u, self.unnoted = self.unnoted, [0, 0, 0]
        by_field, self.unnoted_fields = self.unnoted_fields, {}
        return NoteRequest(u[0], u[1], u[2], fields=[(f, r, n) for f, (r, n) in by_field.items()])

    def clear(self) -> None:
        """Forget every lease, and the appends untold: they went to a daemon that is gone."""
        with self.lock:
            self.unnoted = [0, 0, 0]
            self.unnoted_fields = {}
            self.fields = None  # a restarted daemon may have other settings
        super().clear()

    def take_note(self) -> NoteRequest | None:
        """The note of every untold append, if any (before stats, at close)."""
        with self.lock:
            return self._take() if self.unnoted[0] else None

    def claim(self, key: tuple[str, int, str], nbytes: int) -> tuple[LeasedRange, int] | None:
        """Take ``nbytes`` of the key's lease: ``(lease, offset)``, or ``None`` if it has
        no lease or too little room left. Call between `begin` and `end`; after writing,
        check that the lease's file was not removed (`append_steps`)."""
        with self.lock:
            lease = self.items.get(key)
            if lease is None or lease.next + nbytes > lease.end:
                return None
            offset = lease.next
            lease.next += nbytes
            self.used.add(lease.file)
            return lease, offset

    def unclaim(self, claims: Sequence[tuple[LeasedRange, int, int]]) -> None:
        """Give back ``(lease, offset, nbytes)`` claims of an append that wrote nothing,
        last first; a claim followed by another one stays taken (its bytes stay a hole)."""
        with self.lock:
            for lease, offset, nbytes in reversed(claims):
                if lease.next == offset + nbytes:
                    lease.next = offset


class Scratch:
    """Reused ``uint8`` buffers for rows that numpy converts (no re-faulting of fresh memory)."""

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        """A buffer of at least ``n`` bytes."""
        with self.lock:
            for i, b in enumerate(self.free):
                if b.nbytes >= n:
                    return self.free.pop(i)
        return np.empty(max(n, 1 << 16), dtype=np.uint8)

    def give(self, b: np.ndarray) -> None:
        with self.lock:
            if len(self.free) < 4 and b.nbytes <= KEPT_SCRATCH:
                self.free.append(b)
