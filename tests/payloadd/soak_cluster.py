"""A cluster soak, outside `make test`: three daemons on roots of their own, writers on every
node and trainer ranks reading through `ClusterClient` (sync and async, threads released
together each step), the orchestrator collecting each node's old steps; for ``--seconds``.
It samples the daemons' RSS, descriptors (and descriptors of removed files) and threads,
compares every window with the dense reference, and exits non-zero on any mismatch or on
growth.

    python -m tests.payloadd.soak_cluster --seconds 180
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np

from payload_client import AsyncClusterClient, ClusterClient, PayloadClient, PayloadSegment
from tests._daemons import Daemons
from tests.payloadd.procfs import deleted_fds, fds, status
from tests.payloadd.test_cluster import (
    BATCH_STEPS,
    TOKEN,
    Cluster,
    check,
    cp_windows,
    start_nodes,
    write_batch,
)

RANKS = 4


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print a line a sample and a verdict; 0 when it held."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=180.0)
    args = p.parse_args(argv)
    with TemporaryDirectory(prefix="soak-cluster-") as tmp, Daemons(Path(tmp)) as d:
        nodes = start_nodes(d)
        pids = _pids(Path(tmp))
        cluster = Cluster(nodes, [], 0)
        samples: list[tuple[float, int, int, int, int]] = []
        windows = mismatches = step = 0
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            base = step * BATCH_STEPS  # each batch in steps of its own
            segs, length = write_batch(nodes, np.random.default_rng(step), base)
            files = cluster.files()
            errors: list[BaseException] = []
            barrier = threading.Barrier(RANKS)

            step_of = (cluster, segs, length, files, barrier, errors)
            threads = [threading.Thread(target=_rank, args=(r, *step_of)) for r in range(RANKS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            windows += 2 * RANKS
            mismatches += len(errors)
            for e in errors[:1]:
                print("error:", repr(e)[:300])
            if step >= 2:  # the orchestrator frees what was trained on, on every node
                trained = base - BATCH_STEPS - 1  # the last step of two batches before
                for n in nodes.values():
                    with PayloadClient(n.socket, token=TOKEN) as c:
                        c.gc(run="mb", through_step=trained)
            step += 1
            if step % 10 == 0:
                s = _sample(pids, Path(tmp), time.monotonic() - start)
                samples.append(s)
                print(f"{s[0]:6.0f} s  step {step:4d}  rss {s[1] / 1024:6.1f} MiB  fds {s[2]}"
                      f"  removed {s[3]}  threads {s[4]}", flush=True)  # fmt: skip
        first, last = samples[len(samples) // 4], samples[-1]  # after the warm-up
        grew = last[1] - first[1] > 16 * 1024 or last[2] > first[2] + 6 or last[4] > first[4] + 3
        print(f"{step} steps, {windows} windows, {mismatches} mismatches; daemons' RSS "
              f"{first[1] / 1024:.1f} -> {last[1] / 1024:.1f} MiB, descriptors {first[2]} -> "
              f"{last[2]}, removed files held {last[3]}, threads {first[4]} -> {last[4]}")  # fmt: skip
        ok = not mismatches and not grew and last[3] == 0
        print("soak: " + ("OK" if ok else "FAILED"))
        return 0 if ok else 1


def _rank(
    r: int,
    cluster: Cluster,
    segs: list[PayloadSegment],
    length: int,
    files: dict[str, bytes],
    barrier: threading.Barrier,
    errors: list[BaseException],
) -> None:
    """CP rank ``r``: its two windows through a cluster client of a node of its own (sync for
    odd ranks, async for even ones), released with the others by ``barrier``."""
    try:
        ws = cp_windows(segs, length, RANKS)[2 * r : 2 * r + 2]
        local = ("na", "nb", "nc")[r % 3]
        if r % 2:
            with ClusterClient(cluster.map(local), token=TOKEN) as cc:
                barrier.wait(30)
                check(cc.read_many(ws), ws, files)
            return

        async def go() -> None:
            async with AsyncClusterClient(cluster.map(local), token=TOKEN) as ac:
                barrier.wait(30)
                check(await ac.read_many(ws), ws, files)

        asyncio.run(go())
    except BaseException as exc:
        errors.append(exc)


def _pids(tmp: Path) -> list[int]:
    """The daemons of this soak: the processes whose command line names its folder."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b" serve " in cmd and str(tmp).encode() in cmd:
                out.append(int(d.name))
    return out


def _sample(pids: list[int], tmp: Path, at: float) -> tuple[float, int, int, int, int]:
    """(seconds, RSS KiB, descriptors, descriptors of removed files, threads), summed."""
    return (
        at,
        sum(status(p, "VmRSS") for p in pids),
        sum(len(fds(p)) for p in pids),
        sum(len(deleted_fds(p, tmp)) for p in pids),
        sum(status(p, "Threads") for p in pids),
    )


if __name__ == "__main__":
    raise SystemExit(main())
