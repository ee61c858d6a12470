"""The records the modules of the storage core share: files open for appends, placed rows,
removals, and the translation of OS errors of the payload root.

A leaf of `payloadd.store`: it imports nothing of the store but the descriptor budget's
error test (`payloadd.store._budget.out_of_descriptors`).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from payload_client import PayloadError, ServerError, StorageFullError
from payloadd.store._budget import out_of_descriptors

__all__ = ["AppendFile", "Placement", "Removal", "os_errors"]


@contextlib.contextmanager
def os_errors(root: Path) -> Iterator[None]:
    """Translate OS errors of the payload root: a full disk or quota is 507, no descriptor left
    503, others 500."""
    try:
        yield
    except PayloadError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageFullError(f"payload root {root} is full: {exc.strerror}") from exc
        busy = out_of_descriptors(exc)
        if busy is not None:
            raise busy from exc
        raise ServerError(f"I/O error under the payload root {root}: {exc}") from exc


@dataclass(eq=False)
class AppendFile:
    """A data file open for appends. ``size`` is the end of what has been reserved.

    ``owner`` 0: a shared file, written only by the daemon (HTTP appends). Otherwise the file
    is private to one data-plane connection (its leases) or to one pending append (its own
    fresh files): nobody else's rows are ever placed in it, so the descriptors handed out for
    it can only damage what their holder wrote. ``fd`` is the daemon's descriptor (-1 for a
    lease file: its client writes it through a descriptor of its own). ``open`` while its
    reserved bytes count against the cap; it ends once the file is sealed and unused.
    ``users`` counts pending appends and leases, ``leases`` the leases among them (GC may
    remove a leased file: the client checks after writing, see `Store.remove_step`)."""

    rel: str
    size: int
    fd: int
    key: tuple[str, int, str]
    owner: int = 0
    ino: tuple[int, int] = (0, 0)
    users: int = 0
    leases: int = 0
    sealed: bool = False
    open: bool = True


@dataclass(frozen=True)
class Placement:
    """A reserved byte range of one file for rows ``[pos, pos + rows)`` of one item."""

    item: int
    file: AppendFile
    offset: int
    pos: int
    rows: int
    nbytes: int


@dataclass
class Removal:
    """What one removal took (or would take): files as ``(path, size in bytes)``, the
    directories removed, and files kept because an append was writing to them."""

    files: list[tuple[str, int]] = field(default_factory=list)
    dirs: int = 0
    in_use: int = 0
