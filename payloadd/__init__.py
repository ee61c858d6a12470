"""payloadd: the per-node daemon that owns a payload root and serves segments.

Start it with ``payloadd serve --root DIR --socket PATH``; talk to it with
`payload_client.PayloadClient`. The app factory is `create_app`, the storage core `Store`.
"""

__version__ = "0.1.0"

from ._app import create_app
from ._appends import PendingAppend
from ._settings import Settings
from ._store import Store

__all__ = ["PendingAppend", "Settings", "Store", "__version__", "create_app"]
