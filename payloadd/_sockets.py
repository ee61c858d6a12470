"""Unix sockets the daemon binds itself: exact file mode, stale files replaced, live ones kept."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

__all__ = ["SocketInUseError", "bind_unix_socket"]


class SocketInUseError(RuntimeError):
    """Another live daemon answers on the socket path."""


def bind_unix_socket(path: Path, mode: int = 0o660, backlog: int = 1024) -> socket.socket:
    """Bind and listen on a Unix stream socket at ``path`` with file mode ``mode``.

    A socket file left by a dead daemon (connecting is refused) is replaced; one a live
    process accepts on is not, nor one this user may not connect to.

    Raises
    ------
    SocketInUseError
        When something accepts connections on ``path``.
    FileExistsError
        When ``path`` exists and is not a socket.
    PermissionError
        When ``path`` exists and this user may not connect to it.
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
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(os.fspath(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(backlog)
    return sock
