"""Stragglers of ``payloadd soak --hostile``: threads of one client on old steps while
another thread of it moves on, the shape of asynchronous RL (the last samples of step s are
written while step s + 2 starts).

One `PayloadClient` (data plane: leases) is shared by `THREADS` threads released by one
barrier: the mover appends to a new step every `MOVE_EVERY` appends, and collects its run
through four steps back every `GC_EVERY` moves; the others append to the step two behind
the mover's. A lease the mover's requests end while a straggler still writes into it must
still be counted (the verdict's ``counted vs real bytes`` checks); appends into a step
collected under a straggler's feet are refused (`StepCollectedError`), which is expected and
counted. The run, `RUN`, is deleted when they stop.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np

from payload_client import PayloadClient, PayloadError, StepCollectedError
from payloadd.soak._workers import Tally

__all__ = ["GC_EVERY", "MOVE_EVERY", "RUN", "THREADS", "Stragglers"]

RUN = "soak-stragglers"
THREADS = 4
"""The mover and three stragglers."""
MOVE_EVERY = 8
"""Appends of the mover to a step before it moves on."""
GC_EVERY = 16
"""Moves between the mover's collections (through its step less four)."""
PAUSE_S = 0.005
"""Seconds each thread waits between appends (the load stays a neighbour's, not the soak's)."""
_ROWS = np.arange(3 * 48 * 8, dtype=np.uint8).reshape(3, 48, 8)


class Stragglers:
    """The threads, from `run` (in a thread of the soak's) until its ``stop`` is set.

    Parameters
    ----------
    socket : str
        The daemon's Unix socket.
    token : str
        The admin token (its collections and the run's deletion are admin calls).
    tally : Tally
        Where unexpected errors go.
    """

    def __init__(self, socket: str, token: str, tally: Tally) -> None:
        self.socket, self.token, self.tally = socket, token, tally
        self.counts: Counter[str] = Counter()
        self._step = 0
        self._lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        """Run the threads on one client until ``stop``; then delete `RUN`."""
        try:
            with PayloadClient(self.socket, timeout=10, token=self.token) as c:
                barrier = threading.Barrier(THREADS)
                threads = [
                    threading.Thread(target=self._thread, args=(c, i, barrier, stop), daemon=True)
                    for i in range(THREADS)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        except PayloadError as exc:
            self.tally.error("stragglers", exc, time.monotonic(), "stragglers")

    def cleanup(self) -> bool:
        """Delete `RUN`; whether it went."""
        try:
            with PayloadClient(self.socket, timeout=10, data_plane=False, token=self.token) as c:
                c.delete_run(RUN)
            return True
        except PayloadError:
            return False

    def _thread(
        self, c: PayloadClient, i: int, barrier: threading.Barrier, stop: threading.Event
    ) -> None:
        barrier.wait()
        n = 0
        while not stop.wait(PAUSE_S):
            with self._lock:
                step = self._step if i == 0 else max(0, self._step - 2)
            t0 = time.monotonic()
            try:
                c.append("routed_experts", _ROWS, 3 * n, run=RUN, step=step)
                n += 1
                self._count("mover appends" if i == 0 else "straggler appends")
            except StepCollectedError:
                self._count("straggler appends into a collected step")
            except PayloadError as exc:
                self.tally.error("straggler append", exc, t0, f"straggler {i}")
            if i == 0 and n % MOVE_EVERY == 0:
                self._move(c)

    def _move(self, c: PayloadClient) -> None:
        with self._lock:
            self._step += 1
            step = self._step
        self._count("moves")
        if step % GC_EVERY == 0:
            t0 = time.monotonic()
            try:
                c.gc(run=RUN, through_step=step - 4)
            except PayloadError as exc:
                self.tally.error("straggler gc", exc, t0, "stragglers")

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1
