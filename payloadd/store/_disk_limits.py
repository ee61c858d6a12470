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
from payload_client.protocol import format_size

__all__ = ["FREE_ROOM", "FREE_SPACE_TTL", "DiskBudget", "tree_sizes"]

FREE_SPACE_TTL = 0.25
"""Seconds a ``statvfs`` sample of the root is used; reservations made since are subtracted
from it, so the estimate only errs low (a file system shared with other writers aside)."""


FREE_ROOM = (
    "To make room, collect the steps already trained on (client.gc(run=RUN, through_step=N), "
    "or payloadd gc --run RUN --through-step N)"
)
"""What a refusal by either limit says frees room first (the rest of the sentence is the
limit's own)."""


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

    def room(self, need: int) -> int:
        """Bytes that may be reserved now, at least ``need``; nothing is reserved yet.

        Parameters
        ----------
        need : int
            Bytes the append cannot do without (its rows; on the data plane, the rows it
            asks a lease for).

        Returns
        -------
        int
            The room left under both limits (a very large number when neither is set).

        Raises
        ------
        StorageFullError
            ``need`` does not fit under the cap or above the floor; the message names the
            limit, what is counted against it and what the append needed (`format_size`),
            and what frees room.
        """
        room = 1 << 62
        if self.max_root_bytes:
            room = self.max_root_bytes - self.used
            if need > room:
                self.refused += 1
                raise StorageFullError(
                    f"storage full: an append of {format_size(need, exact=True)} does not fit "
                    f"under the cap max_root_bytes = {format_size(self.max_root_bytes, exact=True)}"
                    f": this node's files under {self.node_dir} and its appends in progress "
                    f"count {format_size(self.used, exact=True)}, leaving "
                    f"{format_size(max(0, room))}. {FREE_ROOM}, or restart the daemon with a "
                    "larger --max-root-bytes"
                )
        if self.min_free_bytes:
            free = self.free_bytes()
            if need > free - self.min_free_bytes:
                self.refused += 1
                raise StorageFullError(
                    f"storage full: an append of {format_size(need, exact=True)} does not fit "
                    "above the free-space floor min_free_bytes = "
                    f"{format_size(self.min_free_bytes, exact=True)}: the file system of the "
                    f"payload root {self.root} has {format_size(free, exact=True)} free. "
                    f"{FREE_ROOM}, free space on that file system, or restart the daemon "
                    "with a smaller --min-free-bytes"
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
