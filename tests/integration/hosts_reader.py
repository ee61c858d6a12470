"""A trainer rank inside a host's network stack (``ip netns exec``): reads the windows of a
job file through `ClusterClient` or `AsyncClusterClient`; prints one JSON line.

``python -m tests.integration.hosts_reader JOB.json``. The job names the node map
(``nodes``), the token (``token``, or ``token_file``: re-read when it changes, a new client
made, as a trainer moved to a new token), the windows (``[segments file, field, lo, hi,
fill, dtype or null]``), the client limits (``connect_s``, ``read_s``) and what to do:

- once (default): read the windows, compare them with ``expected`` (``.npy`` files) bit for
  bit; with ``repeat``, then read them that many times more, timed, once the other ranks
  of the figure are ready too (``ready_dir``, ``rank``: `start_together`), into outputs
  kept from one read to the next (``reuse_out``), as a trainer reuses its buffers; with
  ``again``, the first read is compared, then read again (over the peer ports it named)
  and compared too;
- ``loop_until`` (``time.time()``): read them again and again until then, ``pause`` seconds
  apart, each read an event ``[start, end, error or null]``; the last one is compared with
  ``expected``.

The answer: ``ok``, ``error`` (of a read that failed, or a comparison), ``s``, ``times``,
``events``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
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
from tests.integration.raw_tcp import start_together


def _windows(job: dict[str, Any], outs: Sequence[np.ndarray | None] | None = None) -> list[Window]:
    out = []
    for i, (path, f, lo, hi, fill, dtype) in enumerate(job["windows"]):
        segs = list(decode_segments(Path(path).read_bytes()))
        buf = outs[i] if outs is not None else None
        out.append(Window(segs, f, lo, hi, fill, buf, None if buf is not None else dtype))
    return out


def _compare(results: list[Any], job: dict[str, Any]) -> str | None:
    for i, (got, want_path) in enumerate(zip(results, job["expected"], strict=True)):
        want = np.load(want_path)
        if not isinstance(got, np.ndarray) or got.shape != want.shape:
            return f"window {i}: {type(got).__name__} {getattr(got, 'shape', None)}"
        if not np.array_equal(got, want):
            return f"window {i}: the values differ"
    return None


class _Token:
    """The rank's token: ``job["token"]``, or the first line of ``job["token_file"]``."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.path = Path(job["token_file"]) if job.get("token_file") else None
        self.fixed = job.get("token", "")
        self.value = self.read()

    def read(self) -> str:
        return self.path.read_text().split()[0] if self.path else self.fixed

    def changed(self) -> bool:
        now = self.read()
        changed, self.value = now != self.value, now
        return changed


def _client(job: dict[str, Any], token: str) -> ClusterClient:
    timeout = Timeout(connect=job["connect_s"], read=job["read_s"])
    return ClusterClient(job["nodes"], token=token, timeout=timeout)


def _timed(c: ClusterClient, job: dict[str, Any], results: list[Any]) -> list[float]:
    """The timed reads after the first (into its outputs, when ``reuse_out``)."""
    keep = [r if isinstance(r, np.ndarray) else None for r in results]
    reuse = job.get("reuse_out") and all(k is not None for k in keep)
    windows = _windows(job, keep) if reuse else _windows(job)
    if "ready_dir" in job:
        start_together(job)
    times = []
    for _ in range(job.get("repeat", 0)):
        t = time.perf_counter()
        c.read_many(windows)
        times.append(time.perf_counter() - t)
    return times


def _loop(job: dict[str, Any]) -> dict[str, Any]:
    """Read until ``loop_until``; every read an event. A failed read is followed by a new
    client (as a trainer's retry would make one)."""
    token = _Token(job)
    windows = _windows(job)
    events: list[list[Any]] = []
    last: list[Any] = []
    c = _client(job, token.value)
    try:
        while time.time() < job["loop_until"]:
            if token.changed():
                c.close()
                c = _client(job, token.value)
            t0 = time.time()
            try:
                last = c.read_many(windows)
                events.append([t0, time.time(), None])
            except PayloadError as exc:
                events.append([t0, time.time(), f"{type(exc).__name__}: {exc}"[:300]])
                c.close()
                c = _client(job, token.value)
            time.sleep(job.get("pause", 0.05))
    finally:
        c.close()
    bad = _compare(last, job) if last else "no read succeeded"
    return {"ok": bad is None, "error": bad, "events": events}


def _once(job: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    times: list[float] = []
    if job.get("mode") == "async":

        async def run() -> list[Any]:
            timeout = Timeout(connect=job["connect_s"], read=job["read_s"])
            async with AsyncClusterClient(job["nodes"], token=job["token"],
                                          timeout=timeout) as c:  # fmt: skip
                return await c.read_many(_windows(job))

        results = asyncio.run(run())
    else:
        with _client(job, job["token"]) as c:
            results = c.read_many(_windows(job))
            if job.get("again"):  # the first read named each node's peer port
                bad = _compare(results, job)
                if bad is not None:
                    return {"ok": False, "error": f"first read: {bad}", "s": 0.0}
                results = c.read_many(_windows(job))
            times = _timed(c, job, results)
    bad = _compare(results, job) if job.get("expected") else None
    return {"ok": bad is None, "error": bad, "s": time.monotonic() - t0, "times": times}


def main(path: str) -> int:
    job = json.loads(Path(path).read_text())
    t0 = time.monotonic()
    try:
        out = _loop(job) if "loop_until" in job else _once(job)
    except PayloadError as exc:
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - t0}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
