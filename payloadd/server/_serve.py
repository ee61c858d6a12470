"""Run the app under uvicorn, under its socket lock, on sockets the daemon binds itself or
that systemd passed it (socket activation): `serve`, in the steps of a `Service`."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from prometheus_client import disable_created_metrics

from payload_client.protocol import DATA_SOCKET_SUFFIX
from payloadd.server._activation import Inherited, match_sockets, passed_sockets
from payloadd.server._daemon import descriptor_shares
from payloadd.server._logs import configure_logging
from payloadd.server._sockets import (
    SocketLock,
    StartError,
    bind_tcp_socket,
    bind_unix_socket,
    check_peer_host,
    remove_socket_file,
    resolve_group,
)
from payloadd.server._tokens import Tokens, load_admin_token
from payloadd.server.http._app import create_app
from payloadd.server.http._protocol import HttpShares, limited_protocol
from payloadd.settings._settings import Settings
from payloadd.store._budget import Descriptors, raise_nofile_limit, return_large_buffers
from payloadd.store._counts import HTTP
from payloadd.store._store import Store

__all__ = ["Service", "serve"]

log = logging.getLogger("payloadd")

MAX_UNIX_PATH = 107
"""Bytes of a socket path ``AF_UNIX`` allows."""


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
        Unusable token settings; a TCP listener without a token, or its address in use; a
        peer port bound where other nodes' clients would not find it; an unknown socket group.
    SocketInUseError
        Another daemon answers on the socket or holds its lock.
    StartError
        Sockets passed by systemd that are not the ones the settings name (see
        `match_sockets`).
    """
    Service(settings).run()


class Service:
    """One run of the daemon, in uvicorn's steps: `load` (check what can be checked), `start`
    (the lock, the sockets), `serve` (the app under uvicorn), `shut_down` (sockets and lock
    undone, in the reverse order).

    Parameters
    ----------
    settings : Settings
        What the daemon serves, and how.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.token: Tokens | None = None
        self.gid: int | None = None  # of the socket files (socket_group)
        self.inherited: Inherited | None = None  # systemd's sockets
        self.sockets: list[socket.socket] = []  # where uvicorn serves HTTP
        self.data: socket.socket | None = None  # the data plane's
        self.peer: socket.socket | None = None  # the peer port's
        self._cleanup = contextlib.ExitStack()

    def run(self) -> None:
        """`load`, `start`, `serve` until a signal, then `shut_down` whatever happened."""
        self.load()
        try:
            self.start()
            self.serve()
        finally:
            self.shut_down()

    def load(self) -> None:
        """Take systemd's sockets, set up logging and the process, and check the root, the
        admin token, the socket group and paths; no socket file is touched yet."""
        passed = passed_sockets()  # first: LISTEN_* are unset whatever happens next
        s = self.settings
        configure_logging(s.log_level, s.log_format)
        _prepare_process()
        Store.check_root(s.root, s.node)  # fail here, with a clear message, not in the lifespan
        self.token = _checked_token(s)
        if s.peer_port is not None:
            check_peer_host(s.tcp_host, s.peer_host, s.tcp_port)
        self.gid = resolve_group(s.socket_group) if s.socket_group is not None else None
        _check_socket_path(s)
        self.inherited = match_sockets(passed, s.socket, s.data_plane) if passed else None
        if s.config is not None:
            log.info("settings from config file %s", s.config)

    def start(self) -> None:
        """Take the lock ``<socket>.lock`` (released last), then bind the sockets, or take
        those systemd passed."""
        lock = SocketLock(self.settings.socket)
        lock.acquire()
        self._cleanup.callback(lock.release)
        self.sockets = [self._http_socket()]
        self.data = self._data_socket()
        self._tcp_sockets()

    def serve(self) -> None:
        """Serve the app under uvicorn until SIGINT/SIGTERM."""
        fds = descriptor_shares(self.settings)  # what is open now is the base of the shares
        app = create_app(self.settings, self.data, fds, self.peer)
        config = self._config(app, fds)
        # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal with
        # the handlers found at start restored: these make that a clean exit (status 0,
        # socket files and lock removed by shut_down).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_cleanly)
        uvicorn.Server(config).run(sockets=self.sockets)

    def shut_down(self) -> None:
        """Close the sockets, remove the socket files the daemon bound, release the lock: what
        `start` did, undone in the reverse order."""
        self._cleanup.close()

    # -- the steps' parts ----------------------------------------------------------------

    def _http_socket(self) -> socket.socket:
        s, cleanup = self.settings, self._cleanup
        if self.inherited is not None:  # systemd's: mode, group and file are the socket unit's
            sock = cleanup.enter_context(self.inherited.http)
            log.info("HTTP API on %s, passed by systemd", s.socket)
            return sock
        sock = cleanup.enter_context(bind_unix_socket(s.socket, s.socket_mode, gid=self.gid))
        cleanup.callback(remove_socket_file, s.socket)  # only once it is ours
        return sock

    def _data_socket(self) -> socket.socket | None:
        s, cleanup, inherited = self.settings, self._cleanup, self.inherited
        if inherited is not None and inherited.data is not None:
            return cleanup.enter_context(inherited.data)
        if not s.data_plane:
            return None
        path = Path(f"{s.socket}{DATA_SOCKET_SUFFIX}")
        if inherited is not None:
            log.info("data socket not passed by systemd: payloadd binds %s", path)
        data = cleanup.enter_context(bind_unix_socket(path, s.socket_mode, gid=self.gid))
        cleanup.callback(remove_socket_file, path)
        return data

    def _tcp_sockets(self) -> None:
        """The HTTP API's TCP listener (``tcp_port``) and the peer port (``peer_port``)."""
        s, cleanup = self.settings, self._cleanup
        if s.tcp_port is not None:
            tcp = bind_tcp_socket(s.tcp_host, s.tcp_port, setting="tcp_host")
            self.sockets.append(cleanup.enter_context(tcp))
            log.info("HTTP API also on TCP %s:%d; every call needs the admin token",
                     s.tcp_host, s.tcp_port)  # fmt: skip
        if s.peer_port is not None:
            peer = bind_tcp_socket(s.peer_address, s.peer_port, setting="peer_host")
            self.peer = cleanup.enter_context(peer)

    def _config(self, app: FastAPI, fds: Descriptors) -> uvicorn.Config:
        s = self.settings
        return uvicorn.Config(
            app,
            log_level=s.log_level,
            log_config=None,  # uvicorn's loggers propagate to ours (configure_logging)
            access_log=False,  # the access log is payloadd.access (setting access_log)
            lifespan="on",
            loop="uvloop",
            http=limited_protocol(
                HttpShares(fds.shares.http_connections, fds.shares.tcp_connections),
                s.request_timeout_s,
                self.token,
                _http_refused(app),
            ),
            proxy_headers=False,
            timeout_graceful_shutdown=30,
            timeout_keep_alive=s.keep_alive_s,  # type: ignore[arg-type]
        )


def _prepare_process() -> None:
    """Raise the soft ``RLIMIT_NOFILE``, return large buffers to the system, and make
    Prometheus write no ``*_created`` series."""
    before, now = raise_nofile_limit()
    if now != before:
        log.info("RLIMIT_NOFILE: soft limit raised from %d to %d", before, now)
    return_large_buffers()
    disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series


def _checked_token(s: Settings) -> Tokens | None:
    """The admin tokens (`load_admin_token`, warning of a token file every user reads), which
    a TCP listener and the peer port need."""
    token = load_admin_token(s)
    for port, what in ((s.tcp_port, "TCP listener (tcp_port)"),
                       (s.peer_port, "peer port (peer_port)")):  # fmt: skip
        if port is not None and token is None:
            raise StartError(
                f"the {what} needs an admin token: set admin_token_file or PAYLOADD_ADMIN_TOKEN"
            )
    return token


def _check_socket_path(s: Settings) -> None:
    """The socket path, and the data socket's beside it, fit in ``AF_UNIX``'s address."""
    longest = len(os.fsencode(s.socket)) + (len(DATA_SOCKET_SUFFIX) if s.data_plane else 0)
    if longest > MAX_UNIX_PATH:
        raise OSError(
            f"socket path {s.socket} (and its data socket, {DATA_SOCKET_SUFFIX}) is "
            "longer than the 107 bytes AF_UNIX allows"
        )


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _http_refused(app: FastAPI) -> Callable[[str], None]:
    """Count a connection the HTTP protocol refused or closed in the app's metrics."""

    def refused(reason: str) -> None:
        app.state.daemon.metrics.refused_one(HTTP, reason)

    return refused
