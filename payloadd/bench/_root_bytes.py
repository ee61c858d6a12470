"""The daemon's count of its node's bytes against the files under the root: the drift that
``max_root_bytes`` would be passed by.

The count (`Stats.root_bytes`) is the apparent size of every file under ``<root>/<node>``
(the daemon's ``@`` files aside) plus what is reserved at the ends of the files open for
appends and not written yet (`Stats.reserved_bytes`). So at a quiet point, the count less
what is reserved is the files' sizes, exactly: `root_bytes` looks, and `RootBytes.drift`
says by how much they differ (below 0: the files hold bytes the count misses). For the
soak's verdict and the tests; it needs the root's files, so it runs on the daemon's node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from payload_client import PayloadClient

__all__ = ["LOOKS", "RootBytes", "count_files", "file_bytes", "root_bytes"]

LOOKS = 5
"""Most looks `root_bytes` takes to find the daemon quiet."""


@dataclass(frozen=True)
class RootBytes:
    """What `root_bytes` saw.

    Attributes
    ----------
    counted : int
        The daemon's count against the cap (`Stats.root_bytes`).
    reserved : int
        Of it, reserved at the ends of the files open for appends and not written yet
        (`Stats.reserved_bytes`).
    files : int
        The apparent sizes (``st_size``) of the node's files under the root, the daemon's
        ``@`` files aside: what the cap counts once nothing is reserved.
    quiet : bool
        The count and what is reserved were the same before and after the walk of the
        files: nothing was appended, written or collected meanwhile, so the three figures
        are of one moment.
    """

    counted: int
    reserved: int
    files: int
    quiet: bool

    @property
    def drift(self) -> int:
        """``counted - reserved - files``: 0 when the count is the files'. Below 0, the
        files hold bytes the count misses (the cap lets them be passed by as much); above,
        the count holds bytes no file has."""
        return self.counted - self.reserved - self.files

    def describe(self) -> str:
        """One line: the figures, and the drift."""
        when = "" if self.quiet else " (not quiet: appends went on during the look)"
        return (
            f"counted {self.counted:,} bytes, of which {self.reserved:,} reserved and "
            f"unwritten; the files {self.files:,} bytes: drift {self.drift:+,}{when}"
        )


def file_bytes(node_dir: Path) -> int:
    """Sum the apparent sizes of the regular files below ``node_dir`` (symlinks are not
    followed; names starting with ``@``, the daemon's own, left out; a file removed
    during the walk is skipped): what the daemon's cap counts of them."""
    return count_files(node_dir)[0]


def count_files(node_dir: Path) -> tuple[int, int]:
    """`file_bytes`, and how many files: ``(bytes, files)``."""
    total = files = 0
    stack = [str(node_dir)]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False) and not e.name.startswith("@"):
                    total += e.stat(follow_symlinks=False).st_size
                    files += 1
            except FileNotFoundError:
                continue
    return total, files


def root_bytes(client: PayloadClient, root: Path | None = None, looks: int = LOOKS) -> RootBytes:
    """Compare the daemon's count of its node's bytes with the files under its root.

    The daemon's stats, a walk of ``<root>/<node>``, its stats again; looked at again (at
    most ``looks`` times) until the two stats agree (`RootBytes.quiet`). Call it where the
    load is quiet (after the writers' appends returned) for figures that must agree:
    ``drift == 0``.

    Parameters
    ----------
    client : PayloadClient
        A client of the daemon (its stats).
    root : pathlib.Path, optional
        The payload root as this process sees it; the daemon's own (`Stats.root`) by
        default.
    looks : int, default `LOOKS`
        Most looks.

    Returns
    -------
    RootBytes
        The last look.
    """
    seen = None
    for _ in range(max(1, looks)):
        before = client.stats()
        node_dir = Path(before.root if root is None else root) / before.node
        files = file_bytes(node_dir)
        after = client.stats()
        quiet = (before.root_bytes, before.reserved_bytes) == (
            after.root_bytes,
            after.reserved_bytes,
        )
        seen = RootBytes(after.root_bytes, after.reserved_bytes, files, quiet)
        if quiet:
            break
    assert seen is not None
    return seen
