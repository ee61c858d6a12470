"""Descriptor caches of the data plane client: read descriptors by file, leases by key, and
the daemon's removal generation.

Both caches close what they evict only when no I/O is in flight, so a descriptor number is
never used after it was closed (and perhaps reused for another file).

`GenerationPage` is the daemon's removal generation, mapped read-only: a counter the daemon
makes odd while it removes data files and even again after (``payloadd.store._generation``).
While it reads the same even value as when a descriptor's file was last seen linked, the
file is still linked: no ``fstat`` is needed to know it. The lease appends use it (`LeasedRange.seen`); a read can
too: `LeaseCache.generation` holds the connection's page, passed with the fields table
(`FieldsReply`, asked once per connection; a read before any append can ask for it the
same way, `append_steps` shows how), and is dropped with the connection's leases.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from ...wire._dataplane import NoteRequest
from ...wire._http import AppendItem, FieldsTable

__all__ = [
    "CACHE_FDS",
    "DROP_REMOVED_S",
    "GenerationPage",
    "TELL_USE_S",
    "KEPT_SCRATCH",
    "WRITTEN",
    "LEASES",
    "LEASE_ALONG",
    "MAX_FDS",
    "NOTE_EVERY",
    "LeaseCache",
    "LeasedRange",
    "ReadCache",
    "Scratch",
]

CACHE_FDS = 128
"""Read-only descriptors a client keeps open (least recently used ones are closed)."""
MAX_FDS = 250
"""Most descriptors one reply may carry (Linux passes at most 253 in one message)."""
LEASES = 64
"""Leases (one per run, step and field) a client keeps; the daemon keeps as many per
connection."""
NOTE_EVERY = 64
"""Appends a client places in its leases before it tells the daemon's counters."""
LEASE_ALONG = min(MAX_FDS - 1, LEASES // 4)
"""Most keys a client asks to lease along with the one it needs (`LeaseCache.fields_before`,
and the other keys of the same append), in the same round trip."""
WRITTEN = 2 * LEASES
"""Most leases one lease request names as written (`LeaseCache.take_written`; the rest go
with the next one)."""
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
_U64 = struct.Struct("<Q")


class GenerationPage:
    """The daemon's removal generation, read from the page it passed (a read-only mapping).

    The daemon makes it odd while it removes data files (garbage collection, a connection's
    unused lease files, a given-up reservation) and even again after. So: a file seen linked
    after the generation read an even ``g`` is still linked while `value` is ``g`` (read
    after the I/O that must have reached a linked file); an odd value is never remembered
    (`seen`): the file may go right after it was seen. Files removed by hand are not counted: they are found by
    `LeaseCache.drop_removed`, and after an answer naming a missing file
    (`LeaseCache.suspect`).

    Parameters
    ----------
    fd : int
        The page's descriptor, as passed; closed here (the mapping stays).

    Raises
    ------
    OSError, ValueError
        It cannot be mapped (the descriptor is closed all the same).
    """

    def __init__(self, fd: int) -> None:
        try:
            self._page = mmap.mmap(fd, _U64.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._read = _U64.unpack_from

    def value(self) -> int:
        """The generation now (odd: a removal under way)."""
        return int(self._read(self._page)[0])

    def seen(self) -> int:
        """The generation now, to remember as checked before a look at a file: -1 while a
        removal is under way (odd), which then counts as never checked."""
        value = int(self._read(self._page)[0])
        return -1 if value & 1 else value

    @classmethod
    def of(cls, fds: Sequence[int]) -> GenerationPage | None:
        """The page of the one descriptor in ``fds``, or ``None`` (every descriptor closed)
        when there is not exactly one or it cannot be mapped."""
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return None
        with contextlib.suppress(OSError, ValueError):
            return cls(fds[0])
        return None


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
                self._retire(old)
            self.items[key] = value
            while len(self.items) > self.size:
                self._retire(self.items.popitem(last=False)[1])
            self._sweep()

    def _retire(self, value: V) -> None:
        """``value`` left the cache: its descriptor closes once no I/O uses it. Lock held."""
        self.retired.append(self.fd_of(value))

    def begin(self) -> None:
        with self.lock:
            self.inflight += 1

    def end(self) -> None:
        with self.lock:
            self.inflight -= 1
            self._sweep()

    def _sweep(self) -> None:  # lock held
        if self.inflight == 0 and self.retired:
            for fd in self.retired:
                os.close(fd)
            self.retired.clear()

    def drop_removed(self) -> int:
        """Forget every entry whose file was removed (link count 0), so that its descriptor
        closes and the file's space is freed; return how many."""
        with self.lock:
            gone = [k for k, v in self.items.items() if os.fstat(self.fd_of(v)).st_nlink == 0]
            for k in gone:
                self._retire(self.items.pop(k))
            self._sweep()
        return len(gone)

    def forget(self, key: K) -> None:
        """Forget one entry (its descriptor closes once no I/O uses it)."""
        with self.lock:
            value = self.items.pop(key, None)
            if value is not None:
                self._retire(value)
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


@dataclass(eq=False)
class LeasedRange:
    """A byte range of ``file`` the daemon leased to this client to place rows in:
    ``[next, end)`` is still free, ``[start, next)`` taken.

    ``seen`` is the removal generation (`GenerationPage`), even, read before ``file`` was
    last known to be linked (granted by the daemon, or checked); -1: never, check it.

    ``claims``: appends that claimed room in it and have not settled it yet (their rows on
    their way, or given back). ``ending``: it left the cache (ended, or dropped) while
    ``claims``: the daemon is told once they settle (`LeaseCache.written`), and keeps its
    file open until then."""

    file: str
    fd: int
    next: int
    end: int
    fsync: bool
    start: int = 0
    seen: int = -1
    claims: int = 0
    ending: bool = False


class LeaseCache(_Cache[tuple[str, int, str], LeasedRange]):
    """The client's current lease of each ``(run, step, field)``."""

    def __init__(self, size: int = LEASES) -> None:
        super().__init__(size, lambda lease: lease.fd)
        self.unnoted = [0, 0, 0]  # appends, rows, bytes placed but not yet told
        self.unnoted_fields: dict[str, list[int]] = {}  # field -> [rows, bytes] of those
        self.fields: FieldsTable | None = None  # the daemon's fields table, once fetched
        self.generation: GenerationPage | None = None  # passed with the fields table
        # run -> its two latest steps leased in -> field -> lease (for `fields_before`)
        self.recent: dict[str, dict[int, dict[str, LeasedRange]]] = {}
        # (run, field) -> the row pattern the daemon took for it, and a shape of it
        self.shapes: dict[tuple[str, str], tuple[tuple[int, ...], list[int]]] = {}
        # (file, start) of the leases let go of whose rows are all in place, for the next
        # lease request to name (`LeaseRequest.written`)
        self.written: list[tuple[str, int]] = []

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
            self.generation = None  # its page is another (this mapping closes once unused)
            self.recent = {}
            self.shapes = {}
            self.written = []  # (a late one names a file of the gone connection: passed over)
        super().clear()

    def suspect(self) -> None:
        """Check every lease's file before the next rows in it are acknowledged: a file of
        the daemon's was found missing, maybe removed by hand (no generation counts that)."""
        with self.lock:
            for lease in self.items.values():
                lease.seen = -1

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
            lease.claims += 1
            self.used.add(lease.file)
            return lease, offset

    def claim_all(
        self, items: Sequence[AppendItem], sizes: Sequence[int]
    ) -> list[tuple[LeasedRange, int]] | None:
        """`claim` room for every item in its key's lease, all or none, and `begin` I/O:
        ``(lease, offset)`` of each item; ``None`` when one key has no lease or too little
        room (then nothing is claimed or begun). Call `settle` after writing."""
        with self.lock:
            leases = self.items
            got: list[tuple[LeasedRange, int]] = []
            for it, n in zip(items, sizes, strict=True):
                lease = leases.get((it.run, it.step, it.field))
                if lease is None or lease.next + n > lease.end:
                    for taken, offset in reversed(got):
                        taken.next = offset
                        taken.claims -= 1
                    return None
                got.append((lease, lease.next))
                lease.next += n
                lease.claims += 1
            self.inflight += 1
            used = self.used
            for lease, _ in got:
                used.add(lease.file)
        return got

    def has_room(self, key: tuple[str, int, str], nbytes: int) -> bool:
        """Whether the client's lease of ``key`` has ``nbytes`` free now."""
        with self.lock:
            lease = self.items.get(key)
            return lease is not None and lease.next + nbytes <= lease.end

    def holds(self, key: tuple[str, int, str]) -> bool:
        """Whether the client has a lease of ``key`` (with room or not)."""
        with self.lock:
            return key in self.items

    def fields_before(self, run: str, step: int) -> list[str]:
        """The fields appended to in the latest step of ``run`` before ``step`` (of the two
        latest the client leased in): those it likely appends to in ``step`` too."""
        with self.lock:
            steps = self.recent.get(run)
            before = [s for s in steps if s < step] if steps else []
            if not before or steps is None:
                return []
            return [f for f, lease in steps[max(before)].items() if lease.next > lease.start]

    def put(self, key: tuple[str, int, str], value: LeasedRange) -> None:
        """Keep ``value``, the lease of ``key`` (`_Cache.put`); remembered by step of its
        run for `fields_before`."""
        run, step, fld = key
        with self.lock:
            steps = self.recent.pop(run, None) or {}
            self.recent[run] = steps  # the run used last goes last
            steps.setdefault(step, {})[fld] = value
            if len(steps) > 2:
                del steps[min(steps)]
            if len(self.recent) > self.size:
                del self.recent[next(iter(self.recent))]
        super().put(key, value)

    def finish(
        self, key: tuple[str, int, str]
    ) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
        """End the leases a lease request of ``key`` tells the daemon the client is done
        with (`LeaseRequest.done`): ``key``'s own (it is renewed) and those of the run's
        steps older than its two latest (``key``'s step counted): ``(file, start, used)``
        each, ``used`` the end of what was claimed of it; and ``(file, start)`` of those
        with claims still unsettled (`LeaseRequest.writing`: named in `written` once they
        settle). No more claims fit in them from now on; their descriptors close once no
        I/O uses them."""
        run, step, _ = key
        with self.lock:
            steps = sorted({*self.recent.get(run, ()), step})
            oldest = steps[-2] if len(steps) > 1 else step  # steps before it are done
            done = [k for k in self.items if k == key or (k[0] == run and k[1] < min(oldest, step))]
            out, writing = [], []
            for k in done:
                lease = self.items.pop(k)
                lease.end = lease.next
                self.retired.append(lease.fd)
                out.append((lease.file, lease.start, lease.next))
                if lease.claims:
                    lease.ending = True
                    writing.append((lease.file, lease.start))
            self._sweep()
        return out, writing

    def _retire(self, value: LeasedRange) -> None:
        """A lease left the cache without ``done`` (beyond `LEASES`, its file removed...):
        the daemon is told once its claims settle (`written`), at once if none is open.
        Lock held."""
        self.retired.append(value.fd)
        value.end = value.next
        if value.claims:
            value.ending = True
        else:
            self.written.append((value.file, value.start))

    def settle(self, claims: Sequence[tuple[LeasedRange, int]]) -> None:
        """The claims ``(lease, offset)`` of an append (`claim_all`'s) are settled, their
        rows written or given back, and its I/O ends (`end`): a lease let go of whose last
        claim this was is named in the next lease request (`written`)."""
        with self.lock:
            for lease, _ in claims:
                lease.claims -= 1
                if lease.ending and not lease.claims:
                    lease.ending = False
                    self.written.append((lease.file, lease.start))
            self.inflight -= 1
            if self.retired:
                self._sweep()

    def take_written(self) -> list[tuple[str, int]]:
        """The leases a lease request names (`LeaseRequest.written`), at most `WRITTEN`:
        named from now on."""
        with self.lock:
            out, self.written = self.written[:WRITTEN], self.written[WRITTEN:]
        return out

    def forget_lease(self, lease: LeasedRange) -> None:
        """Forget ``lease`` if it is still its key's (`forget`)."""
        with self.lock:
            key = next((k for k, v in self.items.items() if v is lease), None)
            if key is not None:
                del self.items[key]
                self._retire(lease)
                self._sweep()

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
