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


TCP_ESTABLISHED, TCP_CLOSE_WAIT, TCP_LISTEN = "01", "08", "0A"
"""States of /proc/net/tcp (``st``, hexadecimal)."""


def tcp_sockets(port: int) -> list[tuple[int, str, int]]:
    """The IPv4 TCP sockets of this machine whose local port is ``port`` (a daemon's
    listener, and the connections it accepted or has queued): (remote port, state, receive
    queue) each; a listener's receive queue is its accept queue."""
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, queues, *_ = line.split()
        if int(local.rsplit(":", 1)[1], 16) == port:
            rx = int(queues.split(":")[1], 16)
            out.append((int(remote.rsplit(":", 1)[1], 16), state, rx))
    return out


def tcp_open(port: int, remote_ports: set[int]) -> set[int]:
    """Which of ``remote_ports`` still have a connection to local ``port`` that its owner
    has not closed (established, or closed by the other end only)."""
    return {
        remote
        for remote, state, _ in tcp_sockets(port)
        if remote in remote_ports and state in (TCP_ESTABLISHED, TCP_CLOSE_WAIT)
    }


def accept_queue(port: int) -> int:
    """How many connections wait in the accept queue of the listener on ``port`` (an IPv4
    one: `AssertionError` when there is none)."""
    queues = [rx for _, state, rx in tcp_sockets(port) if state == TCP_LISTEN]
    assert queues, f"no IPv4 listener on port {port}"
    return sum(queues)


def unix_connections(path: Path | str) -> tuple[int, int]:
    """The connections to the Unix socket listening on ``path``, from /proc/net/unix: how
    many its owner has accepted and still holds open (closed by the other end or not), and
    how many wait in its accept queue."""
    accepted = queued = 0
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split(maxsplit=7)
        if len(fields) < 8 or fields[7] != str(path) or fields[3] == _UNIX_LISTENING:
            continue
        if fields[6] == "0":  # no socket of its own yet: not accepted
            queued += 1
        else:
            accepted += 1
    return accepted, queued


_UNIX_LISTENING = "00010000"
"""The flags of a listening socket in /proc/net/unix (``__SO_ACCEPTCON``)."""
