"""Appends that open a new key, and 16 MiB appends against raw ``pwrite`` variants (part of
``payloadd bench``).

**New keys.** An append to a ``(run, step, field)`` the client has no lease of costs a round
trip to the daemon (a new lease, in a new file). Inference meets one per field at every new
step: 200 steps x 2 fields (router ids ``uint8 [1, 48, 8]``, a mask row ``int32 [1, 16]``),
one small append each, in milliseconds per append (mean and p50), against the same appends to
keys already open (one step, both fields alternating), on the data plane.

**16 MiB writes.** Page-cache writes on a VM are bimodal: the first write of a page the guest
has handed back to the hypervisor (free page reporting) faults fresh memory in and runs at a
fraction of the speed of a write into memory the guest still holds. So several raw ``pwrite``
variants of the same 16 MiB are timed alongside payloadd's 16 MiB append, **call by call**
(one call of each in turn, the order rotated at every call), so all of them meet the same
memory:

- a growing file (the throughput baseline), a fresh file each call (as payloadd starts a new
  lease), a fresh file ``posix_fallocate``-d before the (timed) ``pwrite``, and a file
  rewritten in place (its pages already in the page cache: no new page at all);
- the growing file and payloadd's append again, each call just after touching and freeing
  as much anonymous memory as it writes (so the kernel hands it pages the guest holds: the
  "warm" mode, which takes the hypervisor out of the comparison).

What the appends and baselines wrote is removed after every repetition.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from payload_client import PayloadClient
from payloadd.bench._measure import Add, pct, rotated
from payloadd.bench._rl_batch import LAYERS, MASK, ROUTED, TOP_K

__all__ = ["WRITE_BYTES", "bench_new_keys", "bench_writes"]

NEW_KEY_RUN = "bench-new-keys"
WRITES_RUN = "bench-writes-16m"
WRITE_BYTES = 43_690 * LAYERS * TOP_K
"""The 16 MiB item: 43,690 rows of router ids (16,776,960 bytes)."""


def bench_new_keys(add: Add, socket: Path, repeat: int, steps: int = 200) -> None:
    """Time appends that open a new key against appends to open keys, interleaved, in
    milliseconds.

    Parameters
    ----------
    add, socket, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`).
    steps : int
        New steps a repetition.
    """
    rng = np.random.default_rng(2)
    items: list[tuple[str, np.ndarray]] = [(ROUTED, rng.integers(0, 128, (1, LAYERS, TOP_K), dtype=np.uint8)),
             (MASK, rng.integers(0, 1000, (1, 16), dtype=np.int32))]  # fmt: skip
    fresh = [1]  # the next new step

    def one(c: PayloadClient, step: int) -> list[float]:
        ts = []
        for field, rows in items:
            t0 = time.perf_counter()
            c.append(field, rows, 0, run=NEW_KEY_RUN, step=step)
            ts.append(time.perf_counter() - t0)
        return ts

    def new_keys(c: PayloadClient) -> list[float]:
        ts = [t for j in range(steps) for t in one(c, fresh[0] + j)]
        fresh[0] += steps
        return ts

    def same_keys(c: PayloadClient) -> list[float]:
        return [t for _ in range(steps) for t in one(c, 0)]

    methods = [("new-key", new_keys, "same-key"), ("same-key", same_keys, None)]
    with PayloadClient(socket) as c:
        one(c, 0)  # connected, fields table fetched, the same keys leased
        for r in range(repeat):
            for name, run, base in rotated(methods, r):
                ts = run(c)
                add(f"{name} append, mean (data plane)", "small", "ms",
                    statistics.fmean(ts) * 1e3, base and f"{base} append, mean (data plane)")  # fmt: skip
                add(f"{name} append p50 (data plane)", "small", "ms", pct(ts, 50),
                    base and f"{base} append p50 (data plane)")  # fmt: skip
    with PayloadClient(socket) as admin:  # its leases are gone with the client above
        admin.delete_run(NEW_KEY_RUN)


def _warm(nbytes: int) -> None:
    """Touch twice ``nbytes`` of anonymous memory and free it: the next writes of ``nbytes``
    get pages the guest holds."""
    np.ones(2 * nbytes, np.uint8)


def bench_writes(add: Add, socket: Path, root: Path, scratch: Path, repeat: int,
                 quick: bool) -> None:  # fmt: skip
    """Time 16 MiB appends and raw ``pwrite`` variants, call by call, in GB/s.

    Parameters
    ----------
    add, socket, root, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`); what the appends wrote
        is removed from ``root`` after each repetition.
    scratch : Path
        A folder on the same file system for the raw files.
    quick : bool
        2 calls of each method a repetition instead of 8.
    """
    rows = np.random.default_rng(3).integers(0, 128, (43_690, LAYERS, TOP_K), dtype=np.uint8)
    raw = _RawFiles(scratch / "writes-16m", rows.tobytes())
    with PayloadClient(socket) as c:

        def append(warm: bool = False) -> float:
            if warm:
                _warm(rows.nbytes)
            t0 = time.perf_counter()
            c.append(ROUTED, rows, 0, run=WRITES_RUN, step=0)
            return time.perf_counter() - t0

        methods = _write_methods(raw, append)
        k = 2 if quick else 8
        try:
            raw.rewritten()  # the rewritten file's pages are in the page cache
            for r in range(repeat):
                _restart(raw, root)
                append()  # connected, fields table fetched
                took = _calls(methods, k, r * k)
                for name, _, b in methods:
                    add(name, "16MiB", "GB/s", rows.nbytes / statistics.fmean(took[name]) / 1e9, b)
        finally:
            _restart(raw, root)
            raw.close()


_Method = tuple[str, Callable[[], float], str | None]
"""A write measured: ``(row name, timed call, baseline row or None)``."""


def _write_methods(raw: _RawFiles, append: Callable[[bool], float]) -> list[_Method]:
    """The raw ``pwrite`` variants and payloadd's append, cold and warm."""
    base, warm = "writes: raw pwrite, growing file", "writes: raw pwrite, growing, warm"
    return [
        (base, raw.growing, None),
        ("writes: raw pwrite, fresh file a call", raw.fresh, base),
        ("writes: raw pwrite, fallocated fresh file", lambda: raw.fresh(True), base),
        ("writes: raw pwrite, file rewritten", raw.rewritten, base),
        ("writes: append (data plane)", lambda: append(False), base),
        (warm, lambda: raw.growing(True), None),
        ("writes: append (data plane), warm", lambda: append(True), warm),
    ]


def _calls(methods: list[_Method], k: int, first: int) -> dict[str, list[float]]:
    """``k`` calls of each method, one of each in turn, the order `rotated` at every call
    (call ``i`` by ``first + i``): the seconds of each method's calls."""
    took: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    for i in range(k):
        for name, op, _ in rotated(methods, first + i):
            took[name].append(op())
    return took


def _restart(raw: _RawFiles, root: Path) -> None:
    """Every repetition starts on an empty folder of raw files (a new growing file) and with
    no step of the appends' run under ``root``."""
    raw.restart()
    for d in root.glob(f"*/{WRITES_RUN}"):
        shutil.rmtree(d, ignore_errors=True)


class _RawFiles:
    """The raw ``pwrite`` baselines' files in ``folder`` (made here), each call writing
    ``data``: a growing file, a fresh file a call and a file rewritten in place (``reused``).

    Parameters
    ----------
    folder : Path
        Their folder, on the file system of the payload root.
    data : bytes
        What every call writes.
    """

    def __init__(self, folder: Path, data: bytes) -> None:
        self.folder, self.data, self.n = folder, data, len(data)
        folder.mkdir(exist_ok=True)
        self.seq = 0
        self.grow_fd, self.grow_end = -1, 0
        self.reused = os.open(folder / "reused", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _fresh_fd(self) -> int:
        self.seq += 1
        return os.open(self.folder / f"f{self.seq}",
                       os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)  # fmt: skip

    def restart(self) -> None:
        """Remove every file but ``reused``; a new, empty growing file."""
        if self.grow_fd >= 0:
            os.close(self.grow_fd)
        for p in self.folder.iterdir():
            if p.name != "reused":
                p.unlink()
        self.grow_fd, self.grow_end = self._fresh_fd(), 0

    def close(self) -> None:
        """Close the files and remove the folder."""
        if self.grow_fd >= 0:
            os.close(self.grow_fd)
            self.grow_fd = -1
        os.close(self.reused)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _timed_write(self, fd: int, offset: int) -> float:
        t0 = time.perf_counter()
        os.pwrite(fd, self.data, offset)
        return time.perf_counter() - t0

    def growing(self, warm: bool = False) -> float:
        """Write at the end of the growing file (``warm``: just after `_warm`)."""
        if warm:
            _warm(self.n)
        t = self._timed_write(self.grow_fd, self.grow_end)
        self.grow_end += self.n
        return t

    def fresh(self, allocate: bool = False) -> float:
        """Write a fresh file (``allocate``: ``posix_fallocate``-d first, untimed)."""
        fd = self._fresh_fd()
        try:
            if allocate:
                os.posix_fallocate(fd, 0, self.n)
            return self._timed_write(fd, 0)
        finally:
            os.close(fd)

    def rewritten(self) -> float:
        """Rewrite ``reused`` in place."""
        return self._timed_write(self.reused, 0)
