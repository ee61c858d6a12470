"""What the daemon's node holds on disk: files, bytes and ages per run and step, the disk
limits, and the last collections of the GC ledger; sync, no HTTP.

`node_usage` walks ``<root>/<node>`` once: O(files), one ``lstat`` per file, so the daemon
calls it in a worker thread (``GET /v1/admin/usage``). The answer is bounded: at most
``max_steps`` runs and ``max_steps`` steps are listed (runs in name order, steps ascending);
the totals cover every step, and ``more_runs`` / ``more_steps`` count what is not listed.
Files removed or added during the walk are counted as the walk finds them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from payload_client.protocol import GcEntry, RunUsage, StepUsage, Usage
from payloadd.settings._usage_query import MAX_USAGE_ENTRIES as LIMIT
from payloadd.store._ledger import Collected
from payloadd.store._store import Store

__all__ = ["DEFAULT_LEDGER", "DEFAULT_MAX_STEPS", "LIMIT", "node_usage", "step_usage"]

DEFAULT_MAX_STEPS = 1000
"""Steps (and runs) listed when the caller does not say."""
DEFAULT_LEDGER = 20
"""GC ledger entries returned when the caller does not say."""


def step_usage(path: Path, step: int) -> StepUsage:
    """Count the regular files of one step directory (symlinks are not followed).

    Parameters
    ----------
    path : pathlib.Path
        The step directory; a missing one counts as empty.
    step : int
        Its step, copied into the answer.

    Returns
    -------
    StepUsage
        Files, apparent bytes (``st_size``), bytes on disk (``st_blocks * 512``) and the
        newest modification time (0.0 when there is no file).
    """
    out = StepUsage(step, 0, 0, 0, 0.0)
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed during the walk (GC)
            continue
        out.files += 1
        out.bytes += st.st_size
        out.disk_bytes += st.st_blocks * 512
        out.mtime = max(out.mtime, st.st_mtime)
    return out


def _entry(c: Collected) -> GcEntry:
    steps = set()
    for rel in c.files:  # <node>/<run>/<step>/<file>
        parts = rel.split("/")
        if len(parts) == 4 and parts[2].isdigit():
            steps.add(int(parts[2]))
    return GcEntry(c.at, c.reason, c.run, sorted(steps), len(c.files), c.bytes)


def node_usage(
    store: Store,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
    ledger: int = DEFAULT_LEDGER,
    run: str | None = None,
) -> Usage:
    """Walk the store's node directory and report its usage.

    Parameters
    ----------
    store : Store
        The store whose node (``<root>/<node>``) is walked; its disk limits and GC ledger
        are reported too.
    max_steps : int, default `DEFAULT_MAX_STEPS`
        Most steps listed, and most runs listed (>= 0). Totals count every step.
    ledger : int, default `DEFAULT_LEDGER`
        Most GC ledger entries returned, the last ones (>= 0).
    run : str, optional
        List this run only (the others still count in the totals and in ``more_runs``).

    Returns
    -------
    Usage
        Per run and step: files, bytes, bytes on disk, newest modification time; totals;
        the disk limits as `Store.stats` reports them; the last ledger entries.

    Raises
    ------
    ValueError
        ``max_steps`` or ``ledger`` is negative.
    """
    if max_steps < 0 or ledger < 0:
        raise ValueError(f"max_steps and ledger must be >= 0, got {max_steps}, {ledger}")
    stats = store.stats()  # disk limits and free space, before the walk
    walk = _Walk(store.root / store.node, max_steps, run)
    for name, steps in store.runs().items():
        walk.add(name, steps)
    entries, n_entries, ledger_bytes = _ledger_tail(store, ledger)
    return Usage(
        node=store.node,
        root=str(store.root),
        now=time.time(),
        files=walk.total.files,
        bytes=walk.total.bytes,
        disk_bytes=walk.total.disk_bytes,
        steps=walk.steps,
        runs=walk.runs,
        more_runs=walk.more_runs,
        more_steps=walk.more_steps,
        root_bytes=stats.root_bytes,
        max_root_bytes=stats.max_root_bytes,
        free_bytes=stats.free_bytes,
        min_free_bytes=stats.min_free_bytes,
        ledger=entries,
        ledger_entries=n_entries,
        ledger_bytes=ledger_bytes,
    )


class _Walk:
    """The usage of a node's runs, added one run at a time: every step counts in the
    totals; at most ``max_steps`` runs (only ``run``, when given) and ``max_steps`` steps are
    listed, the others counted in ``more_runs`` and ``more_steps``."""

    def __init__(self, base: Path, max_steps: int, run: str | None) -> None:
        self.base, self.max_steps, self.run = base, max_steps, run
        self.runs: list[RunUsage] = []
        self.total = StepUsage(0, 0, 0, 0, 0.0)
        self.listed = self.more_runs = self.more_steps = self.steps = 0

    def add(self, name: str, steps: list[int]) -> None:
        """Count run ``name`` and its ``steps``."""
        show = len(self.runs) < self.max_steps and self.run in (None, name)
        usage = RunUsage(name, 0, 0, 0, 0.0, [])
        for step in steps:
            s = step_usage(self.base / name / str(step), step)
            usage.files += s.files
            usage.bytes += s.bytes
            usage.disk_bytes += s.disk_bytes
            usage.mtime = max(usage.mtime, s.mtime)
            if show and self.listed < self.max_steps:
                usage.steps.append(s)
                self.listed += 1
            else:
                usage.more_steps += 1
        self.steps += len(steps)
        self.total.files += usage.files
        self.total.bytes += usage.bytes
        self.total.disk_bytes += usage.disk_bytes
        self.more_steps += usage.more_steps
        if show:
            self.runs.append(usage)
        else:
            self.more_runs += 1


def _ledger_tail(store: Store, n: int) -> tuple[list[GcEntry], int, int]:
    """The last ``n`` entries of the store's GC ledger, how many it holds, and its size in
    bytes."""
    led = store.ledger()
    entries, n_entries = led.recent(n)
    try:
        ledger_bytes = os.stat(led.path).st_size
    except FileNotFoundError:
        ledger_bytes = 0
    return [_entry(c) for c in entries], n_entries, ledger_bytes
