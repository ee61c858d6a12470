"""The measured costs behind docs/scaling.md: what a peer-port and an HTTP connection cost a
daemon, a node in a `ClusterClient`'s map and a client, a segment in a list, a GC call a
step and the ledger's growth, on loopback.

``unshare -n sh -c 'ip link set lo up; .venv/bin/python -m tests.integration.scale_costs'``
(a network namespace of its own: the daemon's TCP ports are nobody else's). Prints a line a
cost; takes about a minute.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from payload_client import ClusterClient, PayloadClient, decode_segments, encode_segments
from payload_client.protocol import FRAME_PREFIX, PeerHello
from payloadd.bench._daemon_process import start_daemon
from payloadd.bench._packed import PackedBatch, write_packed

TOKEN = "scale-costs-token-" + "x" * 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _usage(pid: int | str) -> tuple[int, int, int]:
    """RSS (KiB), threads and descriptors of process ``pid``."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return (int(status["VmRSS"].split()[0]), int(status["Threads"]),
            len(os.listdir(f"/proc/{pid}/fd")))  # fmt: skip


def _per(pid: int, k: int, open_one: Callable[[], socket.socket], what: str) -> None:
    """Open ``k`` connections with ``open_one`` and say what each costs the daemon."""
    base = _usage(pid)
    socks = [open_one() for _ in range(k)]
    time.sleep(1)
    now = _usage(pid)
    print(f"{k} {what}: RSS +{(now[0] - base[0]) / k:.1f} KiB each, threads "
          f"+{now[1] - base[1]}, descriptors +{now[2] - base[2]}")  # fmt: skip
    for s in socks:
        s.close()
    time.sleep(1)


def _peer(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    body = msgspec.msgpack.encode(PeerHello(TOKEN))
    s.sendall(FRAME_PREFIX.pack(len(body)) + body)
    s.recv(4096)  # the welcome
    return s


def _http(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"GET /v1/stats HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    s.recv(65536)
    return s


def cluster_maps() -> None:
    for n in (128, 1024):
        gc.collect()
        before, t = _usage("self")[0], time.perf_counter()
        nodes = {f"n{i}": f"http://10.{i // 250}.{i % 250}.1:8765" for i in range(n)}
        with ClusterClient(nodes, token=TOKEN):
            made, after = time.perf_counter() - t, _usage("self")[0]
        print(f"a ClusterClient of {n} nodes: made in {made * 1000:.0f} ms, "
              f"RSS +{(after - before) / n:.1f} KiB a node")  # fmt: skip
    gc.collect()
    before, t = _usage("self")[0], time.perf_counter()
    clients = [PayloadClient(base_url=f"http://10.0.0.{i}:8765") for i in range(1, 101)]
    made, after = time.perf_counter() - t, _usage("self")[0]
    print(f"a PayloadClient over TCP: {made * 10:.2f} ms, {(after - before) / 100:.0f} KiB")
    for c in clients:
        c.close()


def daemon_costs(folder: Path) -> None:
    http, peer = _free_port(), _free_port()
    flags = ("--node", "n", "--tcp-port", str(http), "--peer-port", str(peer), "--keep-alive-s",
             "600", "--max-peer-connections", "2048", "--max-peer-connections-per-host", "2048")  # fmt: skip
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN)
    with start_daemon(folder / "root", folder / "s.sock", *flags, env=env) as d:
        time.sleep(1)
        for k in (64, 256, 1024):
            _per(d.pid, k, lambda: _peer(peer), "peer-port connections")
        _per(d.pid, 256, lambda: _http(http), "HTTP connections over TCP")
        with PayloadClient(str(folder / "s.sock"), token=TOKEN) as c:
            segs = write_packed(PackedBatch(samples=8), c, run="lists", first_step=1000)
            step_lists = segs * 128  # 1,024 samples
            t = time.perf_counter()
            data = encode_segments(step_lists, "columns")
            enc = time.perf_counter() - t
            t = time.perf_counter()
            decode_segments(data)
            dec = time.perf_counter() - t
            packed = len(encode_segments(segs, "msgpack")) / len(segs)
            print(f"segment lists: {len(data) / len(step_lists):.1f} bytes a segment (columns), "
                  f"{packed:.1f} (msgpack), "
                  f"encoded at {len(data) / enc / 1e6:.0f} MB/s, decoded at "
                  f"{len(data) / dec / 1e6:.0f} MB/s")  # fmt: skip
            _gc_steps(folder, c)


def _gc_steps(folder: Path, c: PayloadClient, steps: int = 20) -> None:
    """8 writers append both fields a step; one GC call a step collects it."""
    writers = [PayloadClient(str(folder / "s.sock")) for _ in range(8)]
    for step in range(steps):
        for w in writers:
            w.append("routed_experts", np.zeros((64, 48, 8), np.uint8), 0, run="r", step=step)
            w.append("sampling_mask", np.zeros((64, 4), np.int32), 0, run="r", step=step)
    files = sum(1 for _ in (folder / "root" / "n" / "r").rglob("*.bin"))
    ledger = folder / "root" / "n" / "@gc-ledger.jsonl"
    size = ledger.stat().st_size if ledger.exists() else 0
    took = []
    for step in range(steps):
        t = time.perf_counter()
        c.gc("r", through_step=step)
        took.append(time.perf_counter() - t)
    grew = (ledger.stat().st_size - size) / steps
    print(f"GC: a call a step ({files // steps} files a step): median "
          f"{1000 * float(np.median(took)):.1f} ms; the ledger +{grew:.0f} bytes a step")  # fmt: skip
    for w in writers:
        w.close()


def main() -> int:
    cluster_maps()
    with tempfile.TemporaryDirectory() as folder:
        daemon_costs(Path(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
