"""Collected watermarks: appends into a step at or below its run's watermark are refused.

``gc(run=r, through_step=N)`` writes ``N`` into the GC ledger of the node it collects
(`payloadd.store._ledger.Collected.through`): steps ``<= N`` of run ``r`` were trained on
and are gone, so rows appended there would be read by nobody. A run's watermark is the
largest over every node's ledger of the payload root: on a shared root another node's
collection counts. This daemon's own collections count at once (its ledger is indexed as
it writes it); the ledgers of other nodes, and lines another daemon wrote into this
node's, are read again at most every `REFRESH_S` seconds, when an append asks.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

from payload_client import StepCollectedError
from payloadd.store._ledger import LEDGER_NAME, Ledger
from payloadd.store._readers import Readers

__all__ = ["REFRESH_S", "Watermarks"]

REFRESH_S = 1.0
"""Most seconds between two looks at the other nodes' ledgers."""


class Watermarks:
    """The collected watermark of each run, over every node's ledger of a payload root.

    Parameters
    ----------
    reads : Readers
        The store's read side (it keeps each node's `Ledger`).
    refresh_s : float
        Seconds between two looks at the other nodes' ledgers.
    """

    def __init__(self, reads: Readers, refresh_s: float = REFRESH_S) -> None:
        self.reads = reads
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._ledgers: list[Ledger] = [reads.ledger()]
        self._next = 0.0

    def _refresh(self) -> None:
        """Find the nodes' ledgers of the root and read what was appended to each."""
        root = self.reads.root
        found: list[Ledger] = [self.reads.ledger()]
        try:
            with os.scandir(root) as it:
                names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            names = []
        for name in names:
            if name != self.reads.node and os.path.isfile(root / name / LEDGER_NAME):
                found.append(self.reads.ledger(name))
        for led in found:
            led.mark("", load=True)
        self._ledgers = found

    def refresh_if_due(self) -> None:
        """Read the nodes' ledgers again when `refresh_s` passed since the last look (I/O:
        call it before taking the lock `check` is called under)."""
        if time.monotonic() >= self._next:
            with self._lock:
                if time.monotonic() >= self._next:
                    self._refresh()
                    self._next = time.monotonic() + self.refresh_s

    def mark(self, run: str) -> int | None:
        """The watermark of ``run`` over every node's ledger as last read (``None``: never
        collected); no I/O. This daemon's own collections count at once."""
        marks = [m for led in self._ledgers if (m := led.mark(run)) is not None]
        return max(marks, default=None)

    def check(self, keys: Iterable[tuple[str, int]], what: str = "an append") -> None:
        """Refuse ``what`` into any ``(run, step)`` of ``keys`` at or below its run's watermark
        (`mark`: no I/O, so that it can run under the lock appends are placed under, which
        a collection plans under too).

        Raises
        ------
        StepCollectedError
            Naming the run, the step and the watermark.
        """
        for run, step in dict.fromkeys(keys):
            mark = self.mark(run)
            if mark is not None and step <= mark:
                raise StepCollectedError(
                    f"{what} into step {step} of run {run!r} is refused: the run was "
                    f"garbage-collected through step {mark} (gc through_step={mark}), so its "
                    f"rows would be read by nobody; nothing was stored. Append into a step "
                    f"above {mark}, or drop the rows of a step already trained on"
                )
