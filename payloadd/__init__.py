"""payloadd: the per-node daemon that owns a payload root and serves segments.

Start it with ``payloadd serve --root DIR --socket PATH``; talk to it with
`payload_client.PayloadClient`. The app factory is `create_app`, the storage core `Store`.

They are imported on first use, so that ``payloadd health`` (a probe, run every few seconds)
does not import FastAPI, pydantic and numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from payloadd._version import __version__

if TYPE_CHECKING:
    from payloadd.server.http._app import create_app
    from payloadd.settings._settings import Settings
    from payloadd.store._appends import PendingAppend
    from payloadd.store._store import Store

__all__ = ["PendingAppend", "Settings", "Store", "__version__", "create_app"]

_LAZY = {
    "create_app": "payloadd.server.http._app",
    "PendingAppend": "payloadd.store._appends",
    "Settings": "payloadd.settings._settings",
    "Store": "payloadd.store._store",
}


def __getattr__(name: str) -> Any:
    """Import `create_app`, `PendingAppend`, `Settings` or `Store` on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
