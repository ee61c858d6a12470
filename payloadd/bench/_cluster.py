"""Reads across nodes (part of ``payloadd bench``): three daemons on roots of their own, TCP
and the peer port on 127.0.0.1 behind a generated token, read through `ClusterClient`.

- **Cross-node reads**, 1 MiB and 16 MiB windows of router ids stored on node ``nb``, read by
  a trainer on node ``na``: over the peer port and over HTTP, against raw loopback TCP of the
  same stored bytes: a bare server in a child process ``os.sendfile``-s the range (its file
  opened once), the bench ``recv_into``-s it straight into a preallocated array (the
  physical floor of moving those bytes between two processes over TCP). Reads rotate over
  distinct stored copies.
- **A packed micro batch spread over the three nodes** (`payloadd.bench._packed`'s batch:
  8 samples x 2,048 tokens written turn by turn, sample ``i`` on node ``i % 3``), read by CP
  window through `ClusterClient` from node ``na`` (its own daemon by socket: the data plane;
  the others over the peer port), and with ``data_plane=False`` (HTTP to every node),
  against the per-segment direct reader over the three roots' files.

Run ``python -m payloadd.bench._cluster PORT`` for the bare sendfile server (it serves files
by absolute path, on 127.0.0.1).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import ClusterClient, PayloadClient, PayloadSegment
from payloadd.bench._daemon_process import start_daemon
from payloadd.bench._measure import Add, Op, measure_gbps, page_aligned
from payloadd.bench._packed import (
    PackedBatch,
    client_reads,
    direct_reads,
    measure_reads,
    routed_outputs,
    stored_copies,
)
from payloadd.bench._rl_batch import LAYERS, ROUTED, ROUTED_FILL, TOP_K

__all__ = ["NODES", "bench_cluster", "main", "start_nodes"]

NODES = ("na", "nb", "nc")
SIZES = {"1MiB": 2_730, "16MiB": 43_690}
"""Rows of router ids of each window size (as in the throughput rows)."""
RUN = "bench-cluster"
RAW = "cross-node: raw TCP sendfile -> recv_into"
_REQUEST = struct.Struct("<QQH")  # offset, bytes, length of the path that follows


def main(argv: list[str] | None = None) -> None:
    """The bare server: ``PORT``; each request ``offset, nbytes, path`` is answered with
    those bytes of that file by ``os.sendfile``; one connection at a time."""
    port = int((argv if argv is not None else sys.argv[1:])[0])
    fds: dict[bytes, int] = {}
    with socket.create_server(("127.0.0.1", port)) as server:
        while True:
            conn, _ = server.accept()
            with conn, contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while head := _recv_exact(conn, _REQUEST.size):
                    offset, n, k = _REQUEST.unpack(head)
                    path = _recv_exact(conn, k)
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    sent = 0
                    while sent < n:
                        sent += os.sendfile(conn.fileno(), fds[path], offset + sent, n - sent)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return bytes(buf)


@contextlib.contextmanager
def _bare_server() -> Iterator[int]:
    """The bare sendfile server in a child process; yields its port once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-m", "payloadd.bench._cluster", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the bare sendfile server did not start") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(15)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def start_nodes(tmp: Path, token: str) -> Iterator[dict[str, tuple[Path, Path, str]]]:
    """Three daemons (`NODES`), each on a root of its own with TCP and the peer port on
    127.0.0.1; yields ``node -> (root, socket, http://127.0.0.1:port)``."""
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=token)
    tmp.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        nodes = {}
        for name in NODES:
            root, sock, http = tmp / name, tmp / f"{name}.sock", _free_port()  # short paths
            flags = ("--node", name, "--tcp-port", str(http), "--peer-port", str(_free_port()))
            stack.enter_context(start_daemon(root, sock, *flags, env=env))
            nodes[name] = (root, sock, f"http://127.0.0.1:{http}")
        yield nodes


def bench_cluster(add: Add, tmp: Path, repeat: int, quick: bool) -> None:
    """Measure reads across nodes: cross-node windows against raw TCP, and the packed micro
    batch over three nodes against the direct reader.

    Parameters
    ----------
    add : Add
        Records the samples (`Bench.add`).
    tmp : Path
        Folder for the three daemons' roots and sockets.
    repeat : int
        Repetitions.
    quick : bool
        Fewer stored copies and calls.
    """
    token = secrets.token_hex(32)
    with start_nodes(tmp, token) as nodes, contextlib.ExitStack() as stack:
        trainer = {
            n: (f"unix://{sock}" if n == "na" else url) for n, (_, sock, url) in nodes.items()
        }
        peer = stack.enter_context(ClusterClient(trainer, token=token))
        http = stack.enter_context(ClusterClient(trainer, token=token, data_plane=False))
        writers = {n: stack.enter_context(PayloadClient(sock)) for n, (_, sock, _) in nodes.items()}
        _cross_node(add, writers["nb"], nodes["nb"][0], peer, http, repeat, quick)
        _packed(add, writers, {n: r for n, (r, _, _) in nodes.items()}, tmp, peer, http, repeat,
                quick)  # fmt: skip


def _cross_node(
    add: Add,
    writer: PayloadClient,
    root: Path,
    peer: ClusterClient,
    http: ClusterClient,
    repeat: int,
    quick: bool,
) -> None:
    budget = (16 << 20) if quick else (64 << 20)
    with _bare_server() as port, socket.create_connection(("127.0.0.1", port)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for label, n in SIZES.items():
            rows = np.random.default_rng(16).integers(0, 128, (n, LAYERS, TOP_K), np.uint8)
            segs = [s for _ in range(max(2, budget // rows.nbytes))
                    for s in writer.append(ROUTED, rows, 0, run=RUN, step=0)]  # fmt: skip
            out = page_aligned(rows.nbytes).reshape(rows.shape)
            ops = _cross_node_ops(raw, root, segs, out, peer, http)
            measure_gbps(add, ops, label, max(2, budget // rows.nbytes), repeat)
            if not np.array_equal(out, rows):
                raise RuntimeError("a cross-node read gave other rows than were written")


def _cross_node_ops(
    raw: socket.socket,
    root: Path,
    segs: list[PayloadSegment],
    out: np.ndarray,
    peer: ClusterClient,
    http: ClusterClient,
) -> list[Op]:
    """The raw TCP read and payloadd's, each of the next stored copy into ``out``."""
    view = memoryview(out.reshape(-1).data)
    paths = [os.fsencode(root / s.file) for s in segs]
    asks = itertools.cycle(
        [_REQUEST.pack(s.offset, out.nbytes, len(p)) + p for s, p in zip(segs, paths, strict=True)]
    )
    turn = itertools.cycle(segs)

    def bare() -> None:
        raw.sendall(next(asks))
        got = 0
        while got < len(view):
            got += raw.recv_into(view[got:])

    def reader(cc: ClusterClient) -> Callable[[], Any]:
        def read() -> None:
            s = next(turn)
            cc.read_field([s], ROUTED, 0, s.rows, 0, dtype=np.uint8, out=out)

        return read

    return [
        (RAW, bare, out.nbytes, None),
        ("cross-node read uint8 out= (peer port)", reader(peer), out.nbytes, RAW),
        ("cross-node read uint8 out= (http)", reader(http), out.nbytes, RAW),
    ]


def _packed(
    add: Add,
    writers: dict[str, PayloadClient],
    roots: dict[str, Path],
    tmp: Path,
    peer: ClusterClient,
    http: ClusterClient,
    repeat: int,
    quick: bool,
) -> None:
    spec = PackedBatch()
    clients = [writers[n] for n in NODES]  # sample i written on node i % 3
    view = tmp / "all-roots"  # one folder showing every node's prefix, for the direct reader
    view.mkdir(exist_ok=True)
    for node, root in roots.items():
        with contextlib.suppress(FileExistsError):
            (view / node).symlink_to(root / node)
    with stored_copies(spec, clients, RUN, view, 3 if quick else 8) as (batches, reader):
        turn = itertools.cycle(batches)
        ops: list[Op] = []
        for cp in (1, spec.cp):
            wins, out, nbytes = routed_outputs(spec, cp, batches)
            base = f"cluster packed: direct reader uint8, CP {cp}"
            direct = direct_reads(reader, turn, wins, out, None)

            def cluster(cc: ClusterClient, wins: Any = wins, out: np.ndarray = out) -> Any:
                return client_reads(cc, turn, ROUTED, wins, out, ROUTED_FILL)

            ops += [
                (base, direct, nbytes, None),
                (f"cluster packed read uint8 out=, CP {cp} (3 nodes, peer port)", cluster(peer),
                 nbytes, base),
                (f"cluster packed read uint8 out=, CP {cp} (3 nodes, http)", cluster(http),
                 nbytes, base),
            ]  # fmt: skip
        measure_reads(add, ops, spec, repeat, quick)


if __name__ == "__main__":
    main()
