"""What a test reads of a running daemon from /proc: descriptors, memory, threads."""

from __future__ import annotations

import os
import resource
from pathlib import Path


def fds(pid: int) -> list[str]:
    """What each open descriptor of ``pid`` points to (``readlink`` of /proc/PID/fd/*)."""
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:  # closed meanwhile
            continue
    return out


def deleted_fds(pid: int, root: Path) -> list[str]:
    """Descriptors of ``pid`` that hold removed files under ``root`` (their space is not
    freed). Others are not the daemon's data: libffi keeps an unlinked file in /tmp."""
    prefix = f"{os.path.realpath(root)}/"
    return [t for t in fds(pid) if t.endswith(" (deleted)") and t.startswith(prefix)]


def status(pid: int, key: str) -> int:
    """A number of /proc/PID/status (``VmRSS`` and ``VmHWM`` in KiB, ``Threads``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise KeyError(key)


def reset_peak_rss(pid: int) -> None:
    """Start ``VmHWM`` (the peak RSS) of ``pid`` anew from its RSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def set_nofile(pid: int, soft: int) -> int:
    """Set the soft ``RLIMIT_NOFILE`` of running process ``pid`` (its hard limit stays);
    return the soft limit it had."""
    old, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    return old
