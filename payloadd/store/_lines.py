"""Lines appended to the node's own files (the GC ledger, the row shapes of its runs): whole,
fsync'd, never glued to a torn last line.

A crash (or a full file system) while a line was written leaves a last line without its
newline; whoever reads the file skips it. `append_line` starts the next line on a new line,
so that one torn line never takes a good one with it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["append_line", "make_node_dir"]


def make_node_dir(path: Path) -> None:
    """Create ``path`` (a node's directory) if missing, mode 0750 whatever the umask."""
    try:
        os.mkdir(path, 0o750)
    except FileExistsError:
        return
    os.chmod(path, 0o750)


def append_line(path: Path, data: bytes) -> int:
    """Append ``data`` (whole lines, each ending in a newline) to ``path`` and fsync it; the
    file is created with mode 0640, and its name fsync'd into its directory when new.
    Returns the byte offset of ``data`` in the file.

    Raises
    ------
    OSError
        When the file cannot be written (the lines may then be torn: a reader skips them).
    """
    make_node_dir(path.parent)
    new = not os.path.lexists(path)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        os.fchmod(fd, 0o640)  # whatever the umask
        end = os.fstat(fd).st_size
        if end and os.pread(fd, 1, end - 1) != b"\n":
            data = b"\n" + data  # after a torn line: never glued to it
            end += 1
        view = memoryview(data)
        while view.nbytes:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:  # the file's name must survive a node crash too
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return end
