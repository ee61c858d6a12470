"""Removal of the store's files (garbage collection; the rules are in _gc.py).

`Removals` lists the runs and steps on disk and removes the data files of a step
(`Removals.plan_step`, then `Removals.remove_planned`), empty run directories and orphans, under the lock of the store's
`payloadd.store._files.FileTable`; `payloadd.store._store.Store` owns one and answers its
removal methods with it. `payloadd.store._records.Removal` is what one removal took.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Collection
from pathlib import Path

from payload_client.protocol import INT64_MAX
from payloadd.store._files import FileTable
from payloadd.store._readers import Readers
from payloadd.store._records import Removal, os_errors

__all__ = ["Removals"]


class Removals:
    """Removes the data files of a payload root, under the lock of the store's file table.

    Parameters
    ----------
    table : FileTable
        The files open for appends of this daemon's node (its root, node, lock, and disk
        budget: removed bytes of this node stop counting).
    reads : Readers
        Whose cached descriptors of removed files are closed.
    last_use : callable
        The monotonic time a run of this node was last appended to or read (the store's
        `Store.last_used`, or its start).
    """

    def __init__(self, table: FileTable, reads: Readers, last_use: Callable[[str], float]) -> None:
        self.table, self.reads, self._last_use = table, reads, last_use
        self.root, self.node = table.root, table.node

    def runs(self, node: str | None = None) -> dict[str, list[int]]:
        """The runs of ``node`` (default: this daemon's) and their steps on disk, both
        sorted."""
        out: dict[str, list[int]] = {}
        base = self.root / (node or self.node)
        for run in sorted(_dir_names(base)):
            steps = (_step_of(name) for name in _dir_names(base / run))
            out[run] = sorted(step for step in steps if step is not None)
        return out

    def step_files(self, run: str, step: int, node: str | None = None) -> list[str]:
        """The data files of one step of ``node`` (default: this daemon's), relative to the
        root, sorted."""
        rel_dir = f"{node or self.node}/{run}/{step}"
        return [f"{rel_dir}/{name}" for name in _file_names(self.root / rel_dir)]

    def plan_step(
        self,
        run: str,
        step: int,
        files: Collection[str],
        *,
        dry_run: bool = False,
        idle_since: float | None = None,
        node: str | None = None,
    ) -> Removal:
        """Decide which data files of one step a collection removes, and take them out of
        use: the first half of a removal (`remove_planned` is the second).

        Files a pending append still writes to are kept (`Removal.in_use`). A leased file
        is removed: the data-plane client checks its file after writing and places the rows
        again in a new lease when it is gone (a lease append written between the plan and
        the removal, during the collection's grace, is acknowledged and then removed with
        its step: appends to a step being collected are the caller's mistake). Every file planned stops being a current file now (`FileTable.forget_removed`),
        so no append lands in it between the plan and its removal: the collection lists
        exactly these files in its ledger line, waits its grace, then removes them.

        Another node's step (``node``) is planned the same way, but this daemon knows
        nothing of that node's appends in flight and leases: see `GarbageCollector`.

        Parameters
        ----------
        run, step : str, int
            The step directory ``<root>/<node>/<run>/<step>``.
        files : collection of str
            Its files (from `step_files`); files created since stay.
        dry_run : bool
            Count, take nothing out of use.
        idle_since : float, optional
            Monotonic time: plan nothing when the run was appended to or read after it
            (checked under the lock that appends take; this node's runs only).
        node : str, optional
            The node prefix; default: this daemon's.

        Returns
        -------
        Removal
            The files to remove with their sizes, and the files kept in use.
        """
        own = node is None or node == self.node
        out = Removal()
        with self.table.lock, os_errors(self.root):
            if own and idle_since is not None and self._last_use(run) > idle_since:
                return out
            for rel in sorted(files):
                f = self.table.open_files.get(rel)
                if f is not None and f.users > f.leases:
                    out.in_use += 1
                    continue
                try:
                    size = os.lstat(self.root / rel).st_size
                except FileNotFoundError:
                    continue
                out.files.append((rel, size))
                if not dry_run and f is not None:
                    self.table.forget_removed(f)
        return out

    def remove_planned(
        self, run: str, step: int, planned: Removal, node: str | None = None
    ) -> Removal:
        """Remove the files of a plan (`plan_step`), then the step's directory if empty.

        The daemon's cached read descriptor of a removed file is closed; a client's (or a
        read in progress) keeps the file's blocks until closed. Another node's files do not
        count against this daemon's cap.

        Returns
        -------
        Removal
            What was removed (``in_use`` as planned).
        """
        own = node is None or node == self.node
        out = Removal(in_use=planned.in_use)
        with self.table.lock, os_errors(self.root):
            removing = self.table.removing() if planned.files else contextlib.nullcontext()
            with removing:  # clients check their leases' files after it
                for rel, size in planned.files:
                    try:
                        os.unlink(self.root / rel)
                    except FileNotFoundError:
                        continue
                    out.files.append((rel, size))
                    if own:
                        self.table.budget.forget(size)
                    self.reads.drop(rel)
            out.dirs += _rmdir_if_empty(self.root / f"{self.node if own else node}/{run}/{step}")
        return out

    def remove_run_dir(self, run: str, node: str | None = None) -> int:
        """Remove the directory of ``run`` of ``node`` (default: this daemon's) if it is
        empty; 1 if removed."""
        with self.table.lock:
            return _rmdir_if_empty(self.root / (node or self.node) / run)

    def remove_orphans(self, *, dry_run: bool = False) -> Removal:
        """Remove this node's empty data files of earlier daemons, and empty directories.

        An earlier daemon's file of 0 bytes never took a row, so no append was acknowledged
        from it (a crash between creating a file and writing it leaves one). Files of this
        daemon and non-empty files are never orphans: bytes written by an append in flight at
        a crash (a torn tail) sit in files that also hold acknowledged segments and are
        reclaimed with their step.
        """
        out = Removal()
        base = self.root / self.node
        for run, steps in self.runs().items():
            for step in steps:
                rel_dir = f"{self.node}/{run}/{step}"
                with self.table.lock, os_errors(self.root):
                    for name in _file_names(self.root / rel_dir):
                        if f"-{self.table.instance}-" in name:
                            continue
                        rel = f"{rel_dir}/{name}"
                        try:
                            if os.lstat(self.root / rel).st_size:
                                continue
                        except FileNotFoundError:
                            continue
                        out.files.append((rel, 0))
                        if not dry_run:
                            with self.table.removing():
                                os.unlink(self.root / rel)
                    if not dry_run:
                        out.dirs += _rmdir_if_empty(self.root / rel_dir)
            if not dry_run:
                with self.table.lock, os_errors(self.root):
                    out.dirs += _rmdir_if_empty(base / run)
        return out


_DATA_FILE = re.compile(r".+-[0-9a-f]{8}-[0-9]{6,}\.bin")


def _step_of(name: str) -> int | None:
    """The step a directory named ``name`` holds (named as the store names them: ``str(step)``),
    or ``None`` for any other name (``"007"``, ``"²"``, ``"x"``)."""
    if not (name.isascii() and name.isdigit() and len(name) <= 19):
        return None
    step = int(name)
    return step if str(step) == name and step <= INT64_MAX else None


def _dir_names(path: Path) -> list[str]:
    """Names of the sub-directories of ``path`` (none when it is missing)."""
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _file_names(path: Path) -> list[str]:
    """Names of the data files in ``path`` (regular files named as the store names them)."""
    try:
        with os.scandir(path) as it:
            return sorted(
                e.name
                for e in it
                if e.is_file(follow_symlinks=False) and _DATA_FILE.fullmatch(e.name)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _rmdir_if_empty(path: Path) -> int:
    """Remove ``path`` if it is an empty directory; return 1 if removed, else 0."""
    try:
        os.rmdir(path)
    except OSError:  # not empty, missing
        return 0
    return 1
