"""What the fail-closed checks cost on the hot path: small appends and a packed read per op.

Run: ``python -m tests.payloadd.hot_path`` (a daemon on a temporary root, the default
fields). Prints, for the data plane and HTTP, the median over 5 rounds of: one append of
4 rows (``routed_experts`` ``uint8 [4, 48, 8]`` and ``sampling_mask`` ``int32 [4, 16]`` in
turn, a new run each round), and one read of a window over a 480-segment list (960 rows) of
each field. Compare two checkouts by running it with each one's packages first on
``PYTHONPATH``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from payload_client import PayloadClient
from tests._daemons import Daemons

ROUNDS = 5


def _round(c: PayloadClient, run: str, n: int) -> tuple[float, float]:
    """µs per append and per window read, of one round."""
    rows, mask = np.zeros((4, 48, 8), np.uint8), np.zeros((4, 16), np.int32)
    t = time.perf_counter()
    segs = []
    for i in range(n):
        segs += c.append("routed_experts", rows, 4 * i, run=run, step=0)
        segs += c.append("sampling_mask", mask, 4 * i, run=run, step=0)
    append_us = (time.perf_counter() - t) / (2 * n) * 1e6
    packed = segs[:480]
    t = time.perf_counter()
    for _ in range(200):
        c.read_field(packed, "routed_experts", 0, 960, 0)
        c.read_field(packed, "sampling_mask", 1, 961, -1)
    return append_us, (time.perf_counter() - t) / 400 * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "s.sock"
        with Daemons(Path(tmp)).run("--node", "p", socket=sock):
            for dp in (True, False):
                with PayloadClient(sock, data_plane=dp) as c:
                    got = [_round(c, f"h{int(dp)}-{r}", 2000 if dp else 300) for r in range(ROUNDS)]
                name = "data plane" if dp else "http"
                append_us = statistics.median(a for a, _ in got)
                read_us = statistics.median(r for _, r in got)
                print(
                    f"{name:10s}  append {append_us:8.1f} us   read (480 segments) {read_us:8.1f} us"
                )


if __name__ == "__main__":
    main()
