"""Run the app under uvicorn on a Unix socket the daemon binds itself (mode, stale files)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import uvicorn

from payload_client._wire import DATA_SOCKET_SUFFIX

from ._app import create_app
from ._settings import Settings
from ._sockets import bind_unix_socket
from ._store import Store

__all__ = ["serve"]

log = logging.getLogger("payloadd")


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
    longest = len(os.fsencode(settings.socket)) + (
        len(DATA_SOCKET_SUFFIX) if settings.data_plane else 0
    )
    if longest > 107:
        raise OSError(
            f"socket path {settings.socket} (and its data socket, {DATA_SOCKET_SUFFIX}) is "
            "longer than the 107 bytes AF_UNIX allows"
        )
    sock = bind_unix_socket(settings.socket, settings.socket_mode)
    data = None
    if settings.data_plane:
        try:
            data_path = Path(f"{settings.socket}{DATA_SOCKET_SUFFIX}")
            data = bind_unix_socket(data_path, settings.socket_mode)
        except BaseException:
            sock.close()
            os.unlink(settings.socket)
            raise
    config = uvicorn.Config(
        create_app(settings, data),
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
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
