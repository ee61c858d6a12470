"""Counted and real bytes of the soak's node: the daemon's ``root_bytes`` (`Stats`) against
the sizes of the files under ``<root>/<node>``, walked by `payloadd.bench._root_bytes.count_files`.

What the daemon counts (docs/operations.md, ``max_root_bytes``): the apparent size of every
regular file under its node's directory but its own ``@`` files (the GC ledger), plus the
bytes reserved and not written yet (`Stats.reserved_bytes`). The soak compares the count
less what is reserved with the files: equal at rest, exactly; while clients write into
their leases, the files may be ahead of it by at most a lease (``lease_bytes``) for each
file open for appends.

`measure` brackets a walk of the files between two ``stats()`` calls: the drift is how far
the files' sum lies outside the two counts (``counted - real``: negative when the count is
below the files), the tolerance ``lease_bytes`` times the files open for appends. `at_rest`
measures once every client of the soak is closed, waiting a moment for the daemon to end
their leases.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from payload_client import PayloadClient, PayloadError, Stats
from payloadd.bench._root_bytes import count_files
from payloadd.settings._settings import Settings
from payloadd.settings._sizes import parse_size

__all__ = ["AT_REST_WAIT_S", "at_rest", "lease_bytes", "measure"]

AT_REST_WAIT_S = 5.0
"""Seconds `at_rest` waits, at most, for the count to equal the files."""


def lease_bytes(daemon_args: Sequence[str]) -> int:
    """The daemon's ``lease_bytes``: from ``--daemon-arg`` (``--lease-bytes=X`` or
    ``--lease-bytes X``), else ``PAYLOADD_LEASE_BYTES``, else the default."""
    value: object = os.environ.get("PAYLOADD_LEASE_BYTES") or None
    for i, arg in enumerate(daemon_args):
        if arg.startswith("--lease-bytes="):
            value = arg.split("=", 1)[1]
        elif arg == "--lease-bytes" and i + 1 < len(daemon_args):
            value = daemon_args[i + 1]
    default = int(Settings.model_fields["lease_bytes"].default)
    try:  # (a daemon that takes no such value does not start: the soak ends first)
        return int(parse_size(value)) if value is not None else default  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return default


def measure(socket: str, node_dir: Path, lease: int) -> tuple[dict[str, Any], Stats] | None:
    """Counted and real bytes now (see the module docstring), and the second `Stats`;
    ``None`` when the daemon did not answer."""
    with (
        contextlib.suppress(PayloadError, OSError),
        PayloadClient(socket, timeout=5, data_plane=False) as c,
    ):
        first = c.stats()
        real, files = count_files(node_dir)
        second = c.stats()
        counts = [st.root_bytes - st.reserved_bytes for st in (first, second)]
        lo, hi = sorted(counts)
        drift = lo - real if lo > real else hi - real if hi < real else 0
        n_open = max(first.files_open_for_append, second.files_open_for_append)
        out = {
            "counted": counts,
            "real": real,
            "files": files,
            "open": n_open,
            "drift": drift,
            "tolerance": lease * n_open,
        }
        return out, second
    return None


def at_rest(socket: str, node_dir: Path, lease: int, until: float) -> dict[str, Any] | None:
    """`measure` once every client is closed: again every 0.1 s until the count equals the
    files, for `AT_REST_WAIT_S` at most (or until ``until``); the last measure, with the
    seconds waited (``waited_s``). ``None`` when the daemon did not answer."""
    began = time.monotonic()
    deadline = min(began + AT_REST_WAIT_S, until)
    while True:
        got = measure(socket, node_dir, lease)
        if got is not None and (got[0]["drift"] == 0 and got[0]["counted"][1] == got[0]["real"]):
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if got is None:
        return None
    return {**got[0], "waited_s": round(time.monotonic() - began, 2)}
