"""Disk limits of the store: a cap on this daemon's bytes under its node prefix
(``max_root_bytes``) and a free-space floor of the root's file system (``min_free_bytes``).

What the cap counts: the apparent size of every regular file under ``<root>/<node>`` (holes
included, as ``du --apparent-size`` shows; the daemon's ``@`` files aside), plus the bytes reserved in files still open for
appends. The root is scanned once at start; from then on a reservation counts when it is
made: an HTTP append or a data-plane reservation its rows, a data-plane lease its whole range.
When the store closes a file, the reserved bytes at its end that were never written (the
unused tail of its last lease, an append that failed) stop counting, so the count stays the
sum of the files' sizes. Garbage collection subtracts the sizes of the files it removes
(`DiskBudget.forget`); a rescan (`DiskBudget.scan`) sets the count anew.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from payload_client import StorageFullError

__all__ = ["FREE_SPACE_TTL", "DiskBudget", "tree_sizes"]

FREE_SPACE_TTL = 0.25
"""Seconds a ``statvfs`` sample of the root is used; reservations made since are subtracted
from it, so the estimate only errs low (a file system shared with other writers aside)."""


def tree_sizes(top: Path) -> dict[Path, int]:
    """Apparent sizes of the regular files below ``top`` (symlinks are not followed; a file
    removed during the walk is skipped); empty when ``top`` does not exist.

    The daemon's own files, named ``@...`` (the GC ledger and its spare file), are left
    out: the cap is on rows, and GC must stay possible at it."""
    sizes: dict[Path, int] = {}
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False) and not e.name.startswith("@"):
                    sizes[Path(e.path)] = e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return sizes


class DiskBudget:
    """This node's bytes against ``max_root_bytes``; free space against ``min_free_bytes``.

    Not thread-safe: the store calls it with its lock held.

    Parameters
    ----------
    root : Path
        The payload root (its file system is the one whose free space counts).
    node_dir : Path
        ``<root>/<node>``: the files the cap counts; scanned now.
    max_root_bytes : int
        Cap in bytes; 0 for none.
    min_free_bytes : int
        Free-space floor in bytes; 0 for none.

    Attributes
    ----------
    used : int
        Bytes counted against the cap (see the module's notes), whether or not there is one.
    refused : int
        Reservations refused by the cap or the floor.
    """

    def __init__(self, root: Path, node_dir: Path, max_root_bytes: int, min_free_bytes: int):
        self.root, self.node_dir = root, node_dir
        self.max_root_bytes, self.min_free_bytes = max_root_bytes, min_free_bytes
        self.used = self.scan()
        self.refused = 0
        self._sample = 0  # free bytes at the last statvfs
        self._sampled_at = -float("inf")
        self._since = 0  # bytes reserved since that sample

    def scan(self) -> int:
        """Sum the apparent sizes of the files under ``node_dir`` (O(files))."""
        return sum(tree_sizes(self.node_dir).values())

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still use on the root's file system: a sample at
        most `FREE_SPACE_TTL` old, less what was reserved since.

        Raises
        ------
        OSError
            ``statvfs`` of the root fails.
        """
        now = time.monotonic()
        if now - self._sampled_at > FREE_SPACE_TTL:
            st = os.statvfs(self.root)
            self._sample, self._sampled_at, self._since = st.f_bavail * st.f_frsize, now, 0
        return max(0, self._sample - self._since)

    def room(self, need: int, what: str) -> int:
        """Bytes that may be reserved now, at least ``need``; nothing is reserved yet.

        Parameters
        ----------
        need : int
            Bytes the request cannot do without.
        what : str
            The request, for the message (``"append of 1048576 bytes"``).

        Returns
        -------
        int
            The room left under both limits (a very large number when neither is set).

        Raises
        ------
        StorageFullError
            ``need`` does not fit under the cap or above the floor; the message names the
            limit, the current usage and the request.
        """
        room = 1 << 62
        if self.max_root_bytes:
            room = self.max_root_bytes - self.used
            if need > room:
                self.refused += 1
                raise StorageFullError(
                    f"storage full: {what} refused: node directory {self.node_dir} holds "
                    f"{self.used} bytes, the cap max_root_bytes is {self.max_root_bytes}"
                )
        if self.min_free_bytes:
            free = self.free_bytes()
            if need > free - self.min_free_bytes:
                self.refused += 1
                raise StorageFullError(
                    f"storage full: {what} refused: the file system of the payload root "
                    f"{self.root} has {free} bytes free, the floor min_free_bytes is "
                    f"{self.min_free_bytes}"
                )
            room = min(room, free - self.min_free_bytes)
        return room

    def spare(self) -> int:
        """The room under both limits now, as `room` finds it, but never refused: a very
        large number when neither is set, below zero when over one.

        Raises
        ------
        OSError
            ``statvfs`` of the root fails.
        """
        room = 1 << 62
        if self.max_root_bytes:
            room = self.max_root_bytes - self.used
        if self.min_free_bytes:
            room = min(room, self.free_bytes() - self.min_free_bytes)
        return room

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` just reserved (checked by `room` first)."""
        self.used += nbytes
        self._since += nbytes

    def forget(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` (removed files, or reserved bytes never written)."""
        self.used = max(0, self.used - nbytes)
