"""Run the app under uvicorn, under its socket lock, on sockets the daemon binds itself or
that systemd passed it (socket activation)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from prometheus_client import disable_created_metrics

from payload_client.protocol import DATA_SOCKET_SUFFIX
from payloadd.server._activation import match_sockets, passed_sockets
from payloadd.server._app import create_app
from payloadd.server._auth import load_admin_token
from payloadd.server._daemon import descriptor_shares
from payloadd.server._http_protocol import HttpShares, limited_protocol
from payloadd.server._logs import configure_logging
from payloadd.server._sockets import (
    SocketLock,
    StartError,
    bind_tcp_socket,
    bind_unix_socket,
    remove_socket_file,
    resolve_group,
)
from payloadd.settings._settings import Settings
from payloadd.store._budget import raise_nofile_limit, return_large_buffers
from payloadd.store._counts import HTTP
from payloadd.store._store import Store

__all__ = ["serve"]

log = logging.getLogger("payloadd")


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _http_refused(app: FastAPI) -> Callable[[str], None]:
    """Count a connection the HTTP protocol refused or closed in the app's metrics."""

    def refused(reason: str) -> None:
        app.state.metrics.refused_one(HTTP, reason)

    return refused


def serve(settings: Settings) -> None:
    """Serve ``settings`` until SIGINT/SIGTERM, then remove the socket files and the lock.

    Everything that can be checked is checked before any socket file is touched: the root,
    the admin token, the TCP listener's need for it, the socket group, then the lock
    ``<socket>.lock``, held until exit so that no second daemon can bind beside this one.

    Sockets systemd passed (``LISTEN_FDS``, see `passed_sockets`) are used instead of
    binding: the HTTP socket, and the data socket if passed (else the daemon binds it).
    Their files are systemd's: they are never removed, and never shut down, so that
    connections made while no daemon runs wait in their queue for the next one.

    Raises
    ------
    OSError
        The root cannot be created or written, or a socket cannot be bound.
    StartError
        Unusable token settings; a TCP listener without a token, or its address in use; an
        unknown socket group.
    SocketInUseError
        Another daemon answers on the socket or holds its lock.
    StartError
        Sockets passed by systemd that are not the ones the settings name (see
        `match_sockets`).
    """
    passed = passed_sockets()  # first: LISTEN_* are unset whatever happens next
    configure_logging(settings.log_level, settings.log_format)
    before, now = raise_nofile_limit()
    if now != before:
        log.info("RLIMIT_NOFILE: soft limit raised from %d to %d", before, now)
    return_large_buffers()
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series
    Store.check_root(
        settings.root, settings.node
    )  # fail here, with a clear message, not in the lifespan
    token = load_admin_token(settings)
    for port, what in ((settings.tcp_port, "TCP listener (tcp_port)"),
                       (settings.peer_port, "peer port (peer_port)")):  # fmt: skip
        if port is not None and token is None:
            raise StartError(
                f"the {what} needs an admin token: set admin_token_file or PAYLOADD_ADMIN_TOKEN"
            )
    gid = resolve_group(settings.socket_group) if settings.socket_group is not None else None
    longest = len(os.fsencode(settings.socket)) + (
        len(DATA_SOCKET_SUFFIX) if settings.data_plane else 0
    )
    if longest > 107:
        raise OSError(
            f"socket path {settings.socket} (and its data socket, {DATA_SOCKET_SUFFIX}) is "
            "longer than the 107 bytes AF_UNIX allows"
        )
    inherited = match_sockets(passed, settings.socket, settings.data_plane) if passed else None
    if settings.config is not None:
        log.info("settings from config file %s", settings.config)
    lock = SocketLock(settings.socket)
    lock.acquire()
    with contextlib.ExitStack() as cleanup:  # undone in reverse order, the lock last
        cleanup.callback(lock.release)
        if inherited is not None:  # systemd's: mode, group and file are the socket unit's
            sock = cleanup.enter_context(inherited.http)
            log.info("HTTP API on %s, passed by systemd", settings.socket)
        else:
            sock = cleanup.enter_context(
                bind_unix_socket(settings.socket, settings.socket_mode, gid=gid)
            )
            cleanup.callback(remove_socket_file, settings.socket)  # only once it is ours
        sockets = [sock]
        data = None
        if inherited is not None and inherited.data is not None:
            data = cleanup.enter_context(inherited.data)
        elif settings.data_plane:
            data_path = Path(f"{settings.socket}{DATA_SOCKET_SUFFIX}")
            if inherited is not None:
                log.info("data socket not passed by systemd: payloadd binds %s", data_path)
            data = cleanup.enter_context(bind_unix_socket(data_path, settings.socket_mode, gid=gid))
            cleanup.callback(remove_socket_file, data_path)
        if settings.tcp_port is not None:
            tcp = cleanup.enter_context(bind_tcp_socket(settings.tcp_host, settings.tcp_port))
            sockets.append(tcp)
            log.info(
                "HTTP API also on TCP %s:%d; every call needs the admin token",
                settings.tcp_host,
                settings.tcp_port,
            )
        peer = None
        if settings.peer_port is not None:
            peer = cleanup.enter_context(bind_tcp_socket(settings.peer_host, settings.peer_port))
        fds = descriptor_shares(settings)  # what is open now is the base of the shares
        app = create_app(settings, data, fds, peer)
        config = uvicorn.Config(
            app,
            log_level=settings.log_level,
            log_config=None,  # uvicorn's loggers propagate to ours (configure_logging)
            access_log=False,  # the access log is payloadd.access (setting access_log)
            lifespan="on",
            loop="uvloop",
            http=limited_protocol(
                HttpShares(fds.shares.http_connections, fds.shares.tcp_connections),
                settings.request_timeout_s,
                token,
                _http_refused(app),
            ),
            proxy_headers=False,
            timeout_graceful_shutdown=30,
            timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        )
        # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal with
        # the handlers found at start restored: these make that a clean exit (status 0,
        # socket files and lock removed by the cleanup above).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_cleanly)
        uvicorn.Server(config).run(sockets=sockets)
