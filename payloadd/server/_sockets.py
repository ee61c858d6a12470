"""Sockets the daemon binds itself, and the lock that makes it the only daemon on its socket.

Unix sockets get an exact file mode (and optionally a group); a stale socket file is
replaced, a live one kept. ``<socket>.lock`` (`SocketLock`) is taken before any socket file
is touched, so two daemons started at the same moment cannot both get past it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import ipaddress
import os
import socket
import stat
from pathlib import Path
from typing import Any

__all__ = [
    "LOCK_SUFFIX",
    "SocketInUseError",
    "SocketLock",
    "StartError",
    "bind_tcp_socket",
    "bind_unix_socket",
    "check_peer_host",
    "remove_socket_file",
    "resolve_group",
]

LOCK_SUFFIX = ".lock"
"""The lock file is the socket path plus this suffix."""


class StartError(RuntimeError):
    """The daemon cannot start as configured (the message says why)."""


class SocketInUseError(StartError):
    """Another live daemon answers on the socket path, or holds its lock."""


class SocketLock:
    """An exclusive `fcntl.flock` on ``<socket>.lock``, held for the daemon's life.

    The file holds the owner's pid (for people; the lock itself is what counts). The kernel
    drops the lock when the process dies, however it dies, so a killed daemon never blocks
    a restart. `release` removes the file while still holding the lock; `acquire` checks
    after locking that the path still names the file it locked, so a daemon that opened
    the file just before an earlier one removed it does not run beside a third one.
    """

    def __init__(self, socket_path: str | os.PathLike[str]) -> None:
        self.socket_path = Path(socket_path)
        self.path = Path(f"{socket_path}{LOCK_SUFFIX}")
        self._fd = -1

    def acquire(self) -> None:
        """Take the lock without waiting.

        Raises
        ------
        SocketInUseError
            Another process holds it (a daemon serves, or is starting on, the socket).
        OSError
            The lock file cannot be created or opened.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(self.path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = self._owner(fd)
                os.close(fd)
                who = f"payloadd (pid {owner})" if owner else "another payloadd"
                raise SocketInUseError(
                    f"a live daemon already listens on {self.socket_path}: {who} holds {self.path}"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # removed by the daemon that held it: lock the current file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @staticmethod
    def _owner(fd: int) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(os.pread(fd, 32, 0).decode().strip())
        return None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1


def resolve_group(group: str) -> int:
    """Return the gid of ``group``: a group name, or a number taken as a gid.

    Raises
    ------
    StartError
        No group of that name exists.
    """
    if group.isascii() and group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise StartError(f"socket_group: no group named {group!r} on this host") from None


def bind_unix_socket(
    path: Path, mode: int = 0o660, backlog: int = 1024, gid: int | None = None
) -> socket.socket:
    """Bind and listen on a Unix stream socket at ``path`` with file mode ``mode``.

    A socket file left by a dead daemon (connecting is refused) is replaced; one a live
    process accepts on is not, nor one this user may not connect to. The file is created
    accessible to its owner only, given group ``gid`` (when not ``None``), then mode
    ``mode``, before it listens: nobody else can connect until it has its final owner and
    mode.

    Raises
    ------
    SocketInUseError
        When something accepts connections on ``path``.
    FileExistsError
        When ``path`` exists and is not a socket.
    PermissionError
        When ``path`` exists and this user may not connect to it, or ``gid`` cannot be set
        (a group this user is not in).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            path.unlink()  # stale: the file is there but nobody listens
        else:
            raise SocketInUseError(f"a live daemon already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(old)
        try:
            if gid is not None and os.stat(path).st_gid != gid:
                os.chown(path, -1, gid)
            os.chmod(path, mode)
        except PermissionError as exc:
            os.unlink(path)
            raise PermissionError(
                exc.errno, f"cannot give socket {path} group {gid} and mode {mode:o}: {exc}"
            ) from None
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def remove_socket_file(path: str | os.PathLike[str]) -> None:
    """Remove the socket file ``path`` if it is there and is a socket."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _bind_address(host: str, port: int, setting: str) -> tuple[int, Any]:
    """The family and address `bind_tcp_socket` binds for ``host`` (its first).

    Raises
    ------
    StartError
        ``host`` does not resolve.
    """
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except socket.gaierror as exc:
        raise StartError(f"{setting} {host!r} does not resolve: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    return family, address


def check_peer_host(tcp_host: str, peer_host: str | None, tcp_port: int | None) -> None:
    """Whether other nodes' clients can reach a peer port bound on ``peer_host``: they look
    for it at the host of this node's HTTP URL, ``tcp_host``, so it must be bound there, or
    on a wildcard of its family (``0.0.0.0`` for IPv4, ``::`` for either). Both are resolved
    as binding does (``localhost`` is 127.0.0.1). Nothing to check when ``peer_host`` is
    unset (the port follows ``tcp_host``) or without a TCP listener (``tcp_port`` unset:
    no URL to compare with).

    Raises
    ------
    StartError
        Other nodes could not reach the peer port (the message says what to set), or a host
        does not resolve.
    """
    if peer_host is None or tcp_port is None or peer_host == tcp_host:
        return
    tcp_family, tcp_address = _bind_address(tcp_host, tcp_port, "tcp_host")
    peer_family, peer_address = _bind_address(peer_host, tcp_port, "peer_host")
    tcp, peer = ipaddress.ip_address(tcp_address[0]), ipaddress.ip_address(peer_address[0])
    if peer == tcp or (peer.is_unspecified and (peer_family == tcp_family or peer.version == 6)):
        return  # (a loopback peer_host beside another tcp_host is neither)
    wildcard = "::" if tcp.version == 6 else "0.0.0.0"
    raise StartError(
        f"peer_host {peer_host} is not where other nodes look for the peer port: their "
        f"clients connect to it at the host of this node's HTTP URL (tcp_host {tcp_host}); "
        f"leave peer_host unset (it follows tcp_host) or bind it to {wildcard}"
    )


def bind_tcp_socket(
    host: str, port: int, backlog: int = 1024, *, setting: str = "tcp_host"
) -> socket.socket:
    """Bind and listen on TCP ``host:port`` (IPv4 or IPv6, the first address ``host`` has);
    ``setting`` names where ``host`` came from, in errors.

    Raises
    ------
    StartError
        ``host`` does not resolve, or the address is in use or cannot be bound.
    """
    family, address = _bind_address(host, port, setting)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        what = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound: {exc}"
        shown = f"[{host}]" if ":" in host else host
        raise StartError(f"{setting} address {shown}:{port} {what}") from None
    return sock
