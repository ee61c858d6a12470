"""The HTTP control plane: `create_app` builds the FastAPI app around the routes (`router`).

The daemon's start-up and shutdown, the data plane's included, are `Daemon`'s: the app's
lifespan is `Daemon.serve`, and the daemon is on the app's state for the routes. There are no
module globals. Errors become answers in one handler (`install_error_handler`).
"""

from __future__ import annotations

import socket

from fastapi import FastAPI

from payloadd._version import __version__
from payloadd.server._daemon import Daemon
from payloadd.server._metrics import Metrics
from payloadd.server._tokens import Tokens, load_admin_token
from payloadd.server.http._access import AccessMiddleware
from payloadd.server.http._answers import install_error_handler
from payloadd.server.http._auth import TokenGuard
from payloadd.server.http._openapi import install_openapi
from payloadd.server.http._routes import router
from payloadd.settings._settings import Settings
from payloadd.store._budget import Descriptors

__all__ = ["create_app"]


def create_app(
    settings: Settings,
    data_listener: socket.socket | None = None,
    fds: Descriptors | None = None,
    peer_listener: socket.socket | None = None,
) -> FastAPI:
    """Build the daemon's ASGI app for ``settings``: the routes of `router` behind
    `TokenGuard`, inside `AccessMiddleware`, with the `Daemon`'s lifespan (`Daemon.serve`)
    and metrics (`Metrics`, in a registry of this app's own).

    Parameters
    ----------
    settings : Settings
        What the daemon serves, and how.
    data_listener, peer_listener : socket.socket, optional
        The data plane's and the peer port's listening sockets, already bound (`serve`
        reports a busy address before starting); bound at start-up when not given.
    fds : Descriptors, optional
        The daemon's shares of ``RLIMIT_NOFILE``; computed at start-up when not given.

    Raises
    ------
    StartError
        The admin token settings are unusable (see `load_admin_token`).
    """
    token = load_admin_token(settings, warn=False)  # serve() warned already
    daemon = Daemon(settings, data_listener, fds, peer_listener)
    app = FastAPI(
        title="payloadd",
        version=__version__,
        summary="Per-node daemon for per-token side data of LLM RL, passed by handle.",
        lifespan=daemon.lifespan,
        routes=router.routes,  # not included: AccessMiddleware names them (a template each)
        docs_url=None,
        redoc_url=None,
    )
    app.state.daemon = daemon  # what the routes reach (request.app.state), the protocol too
    app.state.metrics = daemon.metrics  # (as before the routes moved: for embedders)
    _around(app, token, daemon.metrics, settings.access_log)
    return app


def _around(app: FastAPI, token: Tokens | None, metrics: Metrics, access_log: bool) -> None:
    """What answers around the routes: the error handler, the OpenAPI document, the token
    guard; outermost, `AccessMiddleware`, around Starlette's error middleware too, so that
    it sees every answer."""
    install_error_handler(app, metrics)
    install_openapi(app)
    app.add_middleware(TokenGuard, token=token)
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: AccessMiddleware(  # type: ignore[method-assign]
        build(), metrics, app.routes, access_log
    )
