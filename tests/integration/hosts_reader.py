"""A trainer rank inside a host's network stack (``ip netns exec``): reads the windows of a
job file through `ClusterClient` or `AsyncClusterClient` and compares them with the expected
arrays, bit for bit; prints one JSON line (``ok``, the error of a read that failed, seconds).

``python -m tests.integration.hosts_reader JOB.json``; the job names the node map, the token,
the segments (`encode_segments`, columns), the windows and the ``.npy`` of each expected
array.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import (
    AsyncClusterClient,
    ClusterClient,
    PayloadError,
    Timeout,
    Window,
    decode_segments,
)


def _windows(job: dict[str, Any]) -> list[Window]:
    segs = list(decode_segments(Path(job["segments"]).read_bytes()))
    return [Window(segs, f, lo, hi, fill) for f, lo, hi, fill in job["windows"]]


def _compare(results: list[Any], job: dict[str, Any]) -> str | None:
    for i, (got, want_path) in enumerate(zip(results, job["expected"], strict=True)):
        want = np.load(want_path)
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            return f"window {i}: {type(got).__name__} {getattr(got, 'shape', None)}"
        if not np.array_equal(got, want):
            return f"window {i}: the bytes differ"
    return None


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    windows = _windows(job)
    timeout = Timeout(connect=job["connect_s"], read=job["read_s"])
    t0 = time.monotonic()
    times: list[float] = []
    try:
        if job["mode"] == "async":

            async def run() -> list[Any]:
                async with AsyncClusterClient(job["nodes"], token=job["token"],
                                              timeout=timeout) as c:  # fmt: skip
                    return await c.read_many(windows)

            results = asyncio.run(run())
        else:
            with ClusterClient(job["nodes"], token=job["token"], timeout=timeout) as c:
                results = c.read_many(windows)
                times = []
                for _ in range(job.get("repeat", 0)):  # timed reads, the connections made
                    t = time.perf_counter()
                    c.read_many(windows)
                    times.append(time.perf_counter() - t)
    except PayloadError as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - t0}
    else:
        bad = _compare(results, job)
        out = {"ok": bad is None, "error": bad, "s": time.monotonic() - t0, "times": times}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
