"""Run the app under uvicorn on a Unix socket the daemon binds itself (mode, stale files)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
from pathlib import Path

import uvicorn

from ._app import create_app
from ._settings import Settings
from ._store import Store

__all__ = ["bind_unix_socket", "serve"]

log = logging.getLogger("payloadd")


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


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def serve(settings: Settings) -> None:
    """Serve ``settings`` until SIGINT/SIGTERM; remove the socket file on exit.

    Raises
    ------
    OSError
        The root cannot be created or written, or the socket cannot be bound.
    SocketInUseError
        Another daemon answers on the socket.
    """
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    Store.check_root(settings.root)  # fail here, with a clear message, not in the lifespan
    if len(os.fsencode(settings.socket)) > 107:
        raise OSError(f"socket path is longer than the 107 bytes AF_UNIX allows: {settings.socket}")
    sock = bind_unix_socket(settings.socket, settings.socket_mode)
    config = uvicorn.Config(
        create_app(settings),
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal with the
    # handlers found at start restored: these make that a clean exit (status 0, socket removed).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(settings.socket)
