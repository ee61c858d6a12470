"""What the daemon may hold at once: its share of file descriptors and of memory in flight.

A daemon that runs for weeks must never learn its limits from a failing system call: an
``EMFILE`` in the middle of an append leaves debris, and one at ``accept()`` used to stop the
data plane for good. So the daemon counts.

**Descriptors** (`Descriptors`). At start ``serve`` raises the soft ``RLIMIT_NOFILE`` to the
hard one (`raise_nofile_limit`); the lifespan then counts the descriptors already open and
splits what is left, less a slack for what is never counted (directory walks, the ledger,
logging)::

    limit = base (open at start) + slack + HTTP connections (Unix socket) + TCP connections
            + data-plane connections + peer-port connections + files open for appends
            + cached read descriptors + per-request descriptors

Each share is the configured maximum or an eighth of what is left, whichever is smaller
(the per-request share takes the rest, at least half), so that a low limit gives a small
daemon that still serves, not one that fails later. Connections beyond their share are
refused at once (HTTP: 503; the data plane closes the connection, and clients fall back to
HTTP). The two caches simply hold fewer descriptors. A request takes the descriptors it will
hold from the per-request share for as long as it runs (`Descriptors.held`): short of them it
is refused with `BusyError` (503), above the whole share with `PayloadTooLargeError` (413);
nothing of it is done either way.

**Memory in flight** (`InFlight`): the bytes of request frames and control bodies being
received at once, on every transport. Row bytes are not counted: they stream to and from
files a chunk at a time. So that memory freed is memory given back, ``serve`` fixes glibc's
mmap threshold (`return_large_buffers`).

**Local before remote.** What comes over the network (HTTP over TCP, the peer port) may hold
at most half of the per-request descriptors (`REMOTE_SHARE`) and half of the bytes in flight,
one host at most an eighth of them (`HOST_SHARE`): whatever other hosts send, the node's own
clients (the Unix sockets) keep the other half.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from payload_client import BusyError, PayloadTooLargeError

__all__ = [
    "HOST_SHARE",
    "REMOTE_SHARE",
    "SLACK",
    "Descriptors",
    "InFlight",
    "open_descriptors",
    "out_of_descriptors",
    "raise_nofile_limit",
    "return_large_buffers",
]

log = logging.getLogger("payloadd")

SLACK = 32
"""Descriptors left out of every share (fewer under a limit below 1024): directory walks,
the GC ledger, log files, the event loop's own; none holds more than a few, and never for
long."""

REMOTE_SHARE = 2
"""What arrives over the network holds at most 1/REMOTE_SHARE of the per-request descriptors
and of ``max_inflight_bytes``."""
HOST_SHARE = 8
"""One remote host holds at most 1/HOST_SHARE of ``max_inflight_bytes``."""

APPEND_FILES = 256
"""Most data files kept open for appends (one per run, step and field) when the limit is high."""
READ_CACHE = 256
"""Most read-only descriptors the daemon keeps for later reads when the limit is high."""


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit where allowed.

    Returns
    -------
    tuple of int
        ``(soft before, soft now)``. An infinite hard limit is taken as the kernel's
        ``fs.nr_open``; a refused raise keeps the soft limit (and is logged).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("RLIMIT_NOFILE: could not raise the soft limit %d to %d: %s",
                        soft, target, exc)  # fmt: skip
            return soft, soft
        return soft, target
    return soft, soft


MMAP_THRESHOLD = 2 << 20
"""Allocations from this size on are mapped on their own and go back to the system when
freed (`return_large_buffers`)."""


def return_large_buffers(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc map large allocations on their own, so that freeing gives them back.

    By default glibc raises its mmap threshold each time a mapped block is freed; large
    request buffers then come from per-thread arenas, which keep them after use: 20
    connections each sending a 7 MiB frame once left the daemon 112 MiB larger, though the
    frames were in flight two at a time. A fixed threshold turns that off (14 MiB then).

    Returns
    -------
    bool
        Whether it was set (``False`` off glibc).
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # M_MMAP_THRESHOLD; and M_TRIM_THRESHOLD, which a fixed mmap threshold leaves at 128 KiB:
    # twice it (as glibc's own adjustment sets it) keeps a 1 MiB read chunk in the heap
    # from one read to the next, instead of giving it back and faulting it in again
    return bool(mallopt(-3, threshold)) and bool(mallopt(-1, 2 * threshold))


def out_of_descriptors(exc: OSError) -> BusyError | None:
    """The `BusyError` for ``exc`` when it says the process has no descriptor left
    (``EMFILE``, ``ENFILE``), else ``None``: the one message for it, wherever it meets one."""
    if exc.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    return BusyError(
        f"daemon out of file descriptors for now ({exc.strerror}); try again", reason="descriptors"
    )


def open_descriptors() -> int:
    """Descriptors this process has open now (``/proc/self/fd``; 0 where there is none)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own
    except OSError:
        return 0


@dataclass(frozen=True)
class Shares:
    """How `Descriptors` split the limit (see the module's notes); all in descriptors."""

    limit: int
    base: int
    http_connections: int
    tcp_connections: int
    data_connections: int
    peer_connections: int
    append_files: int
    read_cache: int
    per_request: int


class Descriptors:
    """This daemon's shares of ``RLIMIT_NOFILE``, and the per-request share's count.

    Thread-safe.

    Parameters
    ----------
    limit : int
        The soft ``RLIMIT_NOFILE``.
    base : int
        Descriptors open before the daemon serves (sockets, logs, the interpreter's own).
    max_connections, max_tcp_connections, max_data_connections, max_peer_connections : int
        The configured most HTTP connections on the Unix socket, over TCP, data-plane and
        peer-port connections (0: none of that kind).

    Attributes
    ----------
    shares : Shares
        The split.
    """

    def __init__(
        self,
        limit: int,
        base: int,
        *,
        max_connections: int,
        max_data_connections: int,
        max_peer_connections: int = 0,
        max_tcp_connections: int = 0,
    ) -> None:
        free = max(0, limit - base - min(SLACK, max(8, limit // 32)))

        def share(most: int) -> int:
            return max(1, min(most, free // 8)) if most else 0

        http, tcp = share(max_connections), share(max_tcp_connections)
        data, peer = share(max_data_connections), share(max_peer_connections)
        append = max(1, min(APPEND_FILES, free // 8))
        cache = max(1, min(READ_CACHE, free // 8))
        per_request = max(1, free - http - tcp - data - peer - append - cache)
        self.shares = Shares(limit, base, http, tcp, data, peer, append, cache, per_request)
        self._lock = threading.Lock()
        self._taken = 0
        self._remote = 0  # of _taken, by requests that came over the network
        self.refused = 0
        if free < 64:
            log.warning("RLIMIT_NOFILE %d with %d descriptors open leaves %d for serving: "
                        "connections, caches and requests get small shares (%s)",
                        limit, base, free, self.describe())  # fmt: skip

    @classmethod
    def of_process(
        cls,
        *,
        max_connections: int,
        max_data_connections: int,
        max_peer_connections: int = 0,
        max_tcp_connections: int = 0,
    ) -> Descriptors:
        """Shares of this process's soft limit, with what it has open now as the base."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
        return cls(
            limit,
            open_descriptors(),
            max_connections=max_connections,
            max_data_connections=max_data_connections,
            max_peer_connections=max_peer_connections,
            max_tcp_connections=max_tcp_connections,
        )

    def describe(self) -> str:
        """The shares in words, for the start-up log line."""
        s = self.shares
        return (
            f"limit {s.limit}, {s.base} open at start; HTTP connections {s.http_connections}, "
            f"TCP connections {s.tcp_connections}, "
            f"data-plane connections {s.data_connections}, peer-port connections "
            f"{s.peer_connections}, files open for appends "
            f"{s.append_files}, read cache {s.read_cache}, per request {s.per_request}"
        )

    @property
    def taken(self) -> int:
        """Per-request descriptors held now."""
        with self._lock:
            return self._taken

    def take(self, n: int, what: str, *, remote: bool = False) -> None:
        """Take ``n`` descriptors of the per-request share for ``what``.

        A request that came over the network (``remote``) takes them from at most
        1/`REMOTE_SHARE` of the share, or alone when it needs more (no other remote request
        holding any): the rest stays for the node's own clients.

        Raises
        ------
        PayloadTooLargeError
            ``n`` is above the whole per-request share: this request can never be served
            under this limit (split it, or raise ``RLIMIT_NOFILE``).
        BusyError
            Fewer than ``n`` are free now (for a remote request: of the remote part);
            nothing was taken.
        """
        if n <= 0:
            return
        cap = self.shares.per_request
        if n > cap:
            with self._lock:
                self.refused += 1
            raise PayloadTooLargeError(
                f"{what} needs {n} file descriptors, above the {cap} this daemon gives one "
                f"request (RLIMIT_NOFILE {self.shares.limit}); split it, or raise the limit"
            )
        with self._lock:
            if self._taken + n > cap:
                self.refused += 1
                raise BusyError(
                    f"daemon out of file descriptors for now: {what} needs {n}, "
                    f"{cap - self._taken} of {cap} are free (RLIMIT_NOFILE "
                    f"{self.shares.limit}); try again",
                    reason="descriptors",
                )
            if remote:
                part = max(1, cap // REMOTE_SHARE)
                if self._remote + n > part and self._remote > 0:
                    self.refused += 1
                    raise BusyError(
                        f"daemon busy: {what} needs {n} file descriptors, {part - self._remote}"
                        f" of the {part} that requests over the network may hold are free; "
                        "try again",
                        reason="descriptors",
                    )
                self._remote += n
            self._taken += n

    def give(self, n: int, *, remote: bool = False) -> None:
        """Give back ``n`` descriptors taken by `take` (with the same ``remote``)."""
        if n > 0:
            with self._lock:
                self._taken = max(0, self._taken - n)
                if remote:
                    self._remote = max(0, self._remote - n)

    @contextlib.contextmanager
    def held(self, n: int, what: str, *, remote: bool = False) -> Iterator[None]:
        """`take` ``n`` for the block, `give` them back after it."""
        self.take(n, what, remote=remote)
        try:
            yield
        finally:
            self.give(n, remote=remote)


class InFlight:
    """Bytes of request frames and control bodies being received at once, under a cap.

    Thread-safe. The data plane's connection threads and the peer port's wait for room
    (`acquire` with a timeout); the HTTP event loop never waits (`try_acquire`). Bytes of a
    request that came over the network are counted against its host (``host``, its
    address): all hosts together hold at most 1/`REMOTE_SHARE` of the cap, one host at most
    1/`HOST_SHARE`, so that the node's own clients (``host=None``) always have the rest.

    One request larger than what it may hold is let through alone (nothing else of its host,
    of the network or of anyone in flight, as the bound it is above says), so that the cap
    never refuses what the size limits allow.

    Parameters
    ----------
    cap : int
        Bytes in flight at most.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.remote_cap = max(1, cap // REMOTE_SHARE)
        self.host_cap = max(1, cap // HOST_SHARE)
        self.used = 0
        self.remote = 0
        self.peak = 0
        self.refused = 0
        self._hosts: dict[str, int] = {}
        self._cond = threading.Condition()

    def _full(self, n: int, host: str | None) -> str | None:
        """The bound ``n`` more bytes would go above (its name), ``None`` when there is room."""
        if self.used + n > self.cap and self.used > 0:
            return f"max_inflight_bytes ({self.used} of {self.cap} in flight)"
        if host is None:
            return None
        if self.remote + n > self.remote_cap and self.remote > 0:
            return (
                f"the share of max_inflight_bytes requests over the network may hold "
                f"({self.remote} of {self.remote_cap} in flight)"
            )
        mine = self._hosts.get(host, 0)
        if mine + n > self.host_cap and mine > 0:
            return (
                f"the share of max_inflight_bytes one host may hold ({host}: {mine} of "
                f"{self.host_cap} in flight)"
            )
        return None

    def _refuse(self, n: int, bound: str) -> BusyError:
        self.refused += 1
        return BusyError(
            f"daemon busy: {n} bytes of request would go above {bound}; try again",
            reason="inflight",
        )

    def _count(self, n: int, host: str | None) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if host is not None:
            self.remote += n
            self._hosts[host] = self._hosts.get(host, 0) + n

    def try_acquire(self, n: int, host: str | None = None) -> None:
        """Count ``n`` bytes (of ``host``'s, when it came over the network) now, or raise
        `BusyError` (nothing counted)."""
        with self._cond:
            bound = self._full(n, host)
            if bound is not None:
                raise self._refuse(n, bound)
            self._count(n, host)

    def acquire(self, n: int, timeout: float, host: str | None = None) -> None:
        """Count ``n`` bytes (of ``host``'s) once there is room, waiting at most ``timeout``
        seconds.

        Raises
        ------
        BusyError
            No room within ``timeout``; nothing counted.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while (bound := self._full(n, host)) is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    bound = self._full(n, host)
                    if bound is None:
                        break
                    raise self._refuse(n, bound)
            self._count(n, host)

    def release(self, n: int, host: str | None = None) -> None:
        """Stop counting ``n`` bytes (with the ``host`` they were counted with)."""
        with self._cond:
            self.used = max(0, self.used - n)
            if host is not None:
                self.remote = max(0, self.remote - n)
                left = self._hosts.get(host, 0) - n
                if left > 0:
                    self._hosts[host] = left
                else:
                    self._hosts.pop(host, None)
            self._cond.notify_all()
