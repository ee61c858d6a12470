"""Garbage collection: the rules (watermark, run, age, orphans) that free what training has
consumed, applied to a `Store` by `GarbageCollector`, one collection at a time.

What each rule removes, the ledger that makes reads of collected steps answer 410, what is
never removed, and collections of another node's prefix: docs/operations.md, section
"Garbage collection". What one step's removal does under the store's lock:
`payloadd.store._removal.Removals.plan_step` and `Removals.remove_planned`.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from payload_client import InvalidRequestError
from payload_client.protocol import GcCount, GcReport, GcRequest, check_name
from payloadd.store._records import Removal, os_errors
from payloadd.store._store import Store

__all__ = ["GarbageCollector"]

log = logging.getLogger("payloadd.gc")


class GarbageCollector:
    """Applies the GC rules to a `Store`; one collection at a time.

    Parameters
    ----------
    store : Store
        The store whose node is collected.
    ttl_s : float
        Default age rule in seconds; 0 turns it off.
    grace_s : float, optional
        Seconds between writing a collection's ledger line and removing its files, so that
        the daemons of other nodes see the line (and answer 410) before the files go: their
        view of the ledger may lag on a distributed file system. Default: the store's
        policy (`payloadd.store._fs_kind.RootPolicy.gc_grace_s`).
    """

    def __init__(self, store: Store, ttl_s: float = 0.0, grace_s: float | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.grace_s = store.policy.gc_grace_s if grace_s is None else grace_s
        self._lock = threading.Lock()  # one collection at a time, but for their graces
        self._planned: set[str] = set()  # files a collection planned and has not removed yet
        store.ledger().keep_reserve()  # room for the ledger line of a GC on a full disk

    def collect(self, req: GcRequest) -> GcReport:
        """Apply the watermark of ``req`` (if any), the age rule, and the clean-up.

        With ``req.node`` naming another node: the watermark and, when ``req.ttl_s`` is
        given, the age rule (by file age alone), on that node's prefix; no clean-up.

        Raises
        ------
        InvalidRequestError
            ``run`` without ``through_step`` or the reverse, a bad run or node name, or
            another node without a watermark or a ``ttl_s``; the former ``before_step``.
        """
        if req.before_step is not None:
            raise InvalidRequestError(
                f"before_step is now through_step (the watermark includes its step): send "
                f'{{"run": ..., "through_step": {req.before_step}}} to remove the steps '
                f"<= {req.before_step}"
            )
        if (req.run is None) != (req.through_step is None):
            raise InvalidRequestError("run and through_step go together: give both or neither")
        node = self._other(req.node)
        if node is not None and req.run is None and req.ttl_s is None:
            raise InvalidRequestError(
                f"a collection of node {node!r}, not this daemon's ({self.store.node!r}), "
                "needs run and through_step, or ttl_s"
            )
        report = GcReport(dry_run=req.dry_run)
        with self._lock:
            if req.run is not None and req.through_step is not None:
                run = check_name(req.run, "run")
                if not req.dry_run:  # first: what is placed after it is refused
                    self._raise_mark(run, req.through_step, node)
                runs = self.store.runs(node)
                steps = [s for s in runs.get(run, []) if s <= req.through_step]
                self._remove(report, "watermark", [(run, steps)], node=node)
                report.note = _no_run(run, runs, node or self.store.node)
            default = self.ttl_s if node is None else 0.0  # another node: only when asked
            ttl = req.ttl_s if req.ttl_s is not None else default
            if ttl > 0:
                self._expire(report, ttl, node)
            if node is None:
                self._add(report, "orphan", self.store.remove_orphans(dry_run=req.dry_run))
            self.store.ledger().keep_reserve()
        return report

    def _other(self, node: str | None) -> str | None:
        """``node`` when it names another node than this daemon's, else ``None``.

        Raises
        ------
        InvalidRequestError
            A bad node name, or a node prefix that is a symlink (it may lead out of the
            root: its files are never read through it, so none is removed through it).
        """
        if node is None or node == self.store.node:
            return None
        node = check_name(node, "node")
        if os.path.islink(self.store.root / node):
            raise InvalidRequestError(
                f"node prefix {node!r} is a symlink, not a directory of the payload root: "
                "it is not collected"
            )
        return node

    def sweep(self) -> GcReport:
        """The background sweep: the age rule, orphans, empty directories; then the bytes
        counted against the cap are recounted from disk (files removed by hand)."""
        report = self.collect(GcRequest())
        self.store.recount()
        self.store.forget_unused_runs()
        return report

    def delete_run(self, run: str, *, dry_run: bool = False, node: str | None = None) -> GcReport:
        """Remove every step of ``run`` on this node, or on ``node``'s prefix.

        Raises
        ------
        InvalidRequestError
            A bad run or node name.
        """
        run = check_name(run, "run")
        other = self._other(node)
        report = GcReport(dry_run=dry_run)
        if not dry_run:  # first: a lease granted from now on fixes its shape anew
            self.store.forget_shapes(run, other)
        with self._lock:
            runs = self.store.runs(other)
            steps = runs.get(run, [])
            self._remove(report, "run", [(run, steps)], node=other)
            report.note = _no_run(run, runs, other or self.store.node)
            if not dry_run:
                report.dirs += self.store.remove_run_dir(run, other)
            self.store.ledger().keep_reserve()
        return report

    def _expire(self, report: GcReport, ttl: float, node: str | None = None) -> None:
        """The age rule: steps whose newest file is older than ``ttl`` seconds, of runs idle
        for as long (another node's: by the files' ages alone); one collection for all."""
        now_wall, now = time.time(), time.monotonic()
        own = node is None
        base = self.store.root / (node or self.store.node)
        targets: list[tuple[str, list[int]]] = []
        for run, steps in self.store.runs(node).items():
            if own and self.store.last_used.get(run, self.store.started) > now - ttl:
                continue
            old = []
            for step in steps:
                newest = _newest_mtime(base / run / str(step))
                if newest is not None and newest <= now_wall - ttl:
                    old.append(step)
            if old:
                targets.append((run, old))
        self._remove(report, "ttl", targets, idle_since=now - ttl if own else None, node=node)

    def _remove(
        self,
        report: GcReport,
        reason: str,
        targets: Iterable[tuple[str, Iterable[int]]],
        idle_since: float | None = None,
        node: str | None = None,
    ) -> None:
        """Collect the steps of ``targets`` (``(run, steps)``): plan every step (what is in
        use stays, and what is planned takes no more appends), write one ledger line per run
        of exactly the files planned, wait the grace once, then remove them."""
        removals = self.store.removals
        planned: list[tuple[str, int, Removal]] = []
        for run, steps in targets:
            for step in steps:
                rels = [r for r in self.store.step_files(run, step, node) if r not in self._planned]
                plan = removals.plan_step(
                    run, step, rels, dry_run=report.dry_run, idle_since=idle_since, node=node
                )
                planned.append((run, step, plan))
        if not report.dry_run:
            by_run: dict[str, list[tuple[str, int]]] = {}
            for run, _, plan in planned:
                by_run.setdefault(run, []).extend(plan.files)
                self._planned.update(rel for rel, _ in plan.files)
            lines: list[int] = []  # their offsets, said done once the removals happened
            try:
                for run, files in by_run.items():
                    if not files:  # nothing to remove: no line (the ledger stays small)
                        continue
                    with os_errors(self.store.root):  # a full disk: 507, nothing is removed
                        lines.append(
                            self.store.ledger(node).begin(
                                run, reason, [rel for rel, _ in files], sum(n for _, n in files)
                            )
                        )  # before any of them goes
            except BaseException:
                for files in by_run.values():  # a later collection plans them again
                    self._planned.difference_update(rel for rel, _ in files)
                raise
            if lines and self.grace_s > 0:  # every node sees the lines before the files go
                self._lock.release()  # other collections go on meanwhile (what this one
                try:  # planned takes no appends, and is taken by no other plan)
                    time.sleep(self.grace_s)
                finally:
                    self._lock.acquire()
        runs: dict[str, list[int]] = {}
        for run, step, plan in planned:
            removal = plan if report.dry_run else removals.remove_planned(run, step, plan, node)
            self._planned.difference_update(rel for rel, _ in plan.files)
            self._add(report, reason, removal)
            if removal.files or removal.dirs:
                report.steps.append((run, step))
            runs.setdefault(run, []).append(step)
        if not report.dry_run:
            self._finish(lines, node)
        for run, steps in runs.items():
            if node is not None and not report.dry_run:  # no orphan pass there
                report.dirs += self.store.remove_run_dir(run, node)
            dry = " (dry run)" if report.dry_run else ""
            where = "" if node is None else f" of node {node}"
            log.info(
                "gc %s: run %s%s, steps %s..%s%s", reason, run, where, steps[0], steps[-1], dry
            )

    def _finish(self, lines: list[int], node: str | None) -> None:
        """Say in the ledger that the collections at ``lines`` removed their files; an error
        is logged (the next start finds nothing left to remove, and says it then)."""
        for at in lines:
            try:
                self.store.ledger(node).finish(at)
            except OSError as exc:
                log.warning("gc: the end of a collection not written to the ledger: %s", exc)

    def finish_interrupted(self) -> int:
        """Finish the collections of this node's ledger that a crash cut: remove the files
        their lines list that are still there (a line says its files go), then say them
        done; at start, before the daemon serves (no client holds anything yet). Returns
        the files removed.

        Raises
        ------
        StorageFullError
            When the ledger cannot be written.
        """
        removed = 0
        ledger = self.store.ledger()
        for at, c in ledger.unfinished():
            dirs: set[Path] = set()
            left = 0
            for rel in c.files:
                path = self.store.root / rel
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                left += 1
                dirs.add(path.parent)
            removed += left
            for d in sorted(dirs, reverse=True):  # the step, then the run, when empty
                for empty in (d, d.parent):
                    with contextlib.suppress(OSError):
                        empty.rmdir()
            with os_errors(self.store.root):
                ledger.finish(at)
            log.warning(
                "gc: finished a %s collection of run %s a crash cut: %d of its %d files "
                "were still there", c.reason, c.run, left, len(c.files)
            )  # fmt: skip
        if removed:
            self.store.recount()
        return removed

    def _raise_mark(self, run: str, through: int, node: str | None) -> None:
        """Write the watermark ``through`` of ``run`` into the ledger when it rises, before
        the collection plans anything: from then on appends and leases at or below it are
        refused, and those that came before have their files planned with the step."""
        ledger = self.store.ledger(node)
        mark = ledger.mark(run, load=True)
        if mark is None or through > mark:
            # under the lock leases check the watermark under: a lease that checked it
            # before has created its file by now (the step lists it), later ones are refused
            with self.store.placing_lock(), os_errors(self.store.root):  # full disk: 507
                ledger.record(run, "watermark", [], 0, through)

    @staticmethod
    def _add(report: GcReport, reason: str, removal: Removal) -> None:
        nbytes = sum(size for _, size in removal.files)
        if removal.files:
            count = report.by_reason.setdefault(reason, GcCount())
            count.files += len(removal.files)
            count.bytes += nbytes
        report.files += len(removal.files)
        report.bytes += nbytes
        report.dirs += removal.dirs
        report.in_use += removal.in_use


def _no_run(run: str, runs: dict[str, list[int]], node: str) -> str:
    """What a collection of a run that is not on disk says ("" when it is): its node's runs,
    and the one the name is closest to."""
    if run in runs:
        return ""
    close = difflib.get_close_matches(run, runs, n=1)
    meant = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(list(runs)[:10]) + (", ..." if len(runs) > 10 else "")
    return f"no run {run!r} on node {node!r}{meant} (its runs: {listed or 'none'})"


def _newest_mtime(path: os.PathLike[str]) -> float | None:
    """The latest modification time (seconds since the epoch) of the files in ``path``."""
    try:
        with os.scandir(path) as it:
            times = [e.stat(follow_symlinks=False).st_mtime for e in it if e.is_file()]
    except FileNotFoundError:
        return None
    return max(times, default=None)
