"""The ``payloadd demo`` command: its flags, and the run that prints what each side of one RL
step did and whether every window matched the inline path (the step itself:
`payloadd.bench._demo`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from payload_client import AsyncClusterClient, AsyncPayloadClient
from payloadd.bench._daemon_process import start_daemon
from payloadd.bench._demo import make_samples, train_step, write_samples
from payloadd.cli._common import positive_int

__all__ = ["add_demo_flags", "run_demo"]


def _degrees(text: str) -> list[int]:
    try:
        return [positive_int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CP degrees like 1,2,4, got {text!r}") from None


def add_demo_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``payloadd demo``."""
    p.add_argument("--samples", type=positive_int, default=24, help="multi-turn samples [24]")
    p.add_argument(
        "--max-tokens", type=positive_int, default=8192, help="tokens per sample, at most [8192]"
    )
    p.add_argument("--seq-len", type=positive_int, default=8192,
                   help="micro batch length in tokens; longer samples are truncated [8192]")  # fmt: skip
    p.add_argument("--dp", type=positive_int, default=2, help="data-parallel ranks [2]")
    p.add_argument(
        "--cp", type=_degrees, default=[1, 2, 4], help="context-parallel degrees to check [1,2,4]"
    )
    p.add_argument(
        "--writers", type=positive_int, default=8, help="concurrent inference writers [8]"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed [0]")
    p.add_argument(
        "--root",
        type=Path,
        help="payload root to use [a temporary folder, removed after]; "
        "with --nodes, the folder of each node's root ROOT/NODE",
    )
    p.add_argument(
        "--nodes", type=positive_int, default=1,
        help="daemons, each on a root of its own (no shared file system) with TCP and the "
        "peer port on 127.0.0.1 behind a generated token; the samples' writers are spread "
        "over them and the trainer ranks read through AsyncClusterClient [1]",
    )  # fmt: skip


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


async def _play(args: argparse.Namespace, nodes: dict[str, Node], token: str | None) -> int:
    cps: list[int] = args.cp
    t0 = time.perf_counter()
    samples = make_samples(args.samples, args.max_tokens, args.seed)
    gen_s = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    row_bytes = sum(s.routed.nbytes for s in samples)
    mask_bytes = sum(s.mask[a:b, :w].nbytes for s in samples for a, b, w in s.mask_runs)
    names = list(nodes)
    writers = {n: AsyncPayloadClient(nodes[n].socket) for n in names}
    # the trainer on the first node: its daemon by socket, the others over TCP
    trainer_map = {n: f"unix://{v.socket}" if n == names[0] else v.url for n, v in nodes.items()}
    trainer = AsyncClusterClient(trainer_map, token=token) if len(nodes) > 1 else writers[names[0]]
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(  # each node's inference writes its share of the samples
            write_samples(writers[n], samples[i :: len(names)],
                          max(1, args.writers // len(names)), run="demo", step=0)
            for i, n in enumerate(names)
        ))  # fmt: skip
        write_s = time.perf_counter() - t0
        results = [await train_step(trainer, samples, args.seq_len, args.dp, cp) for cp in cps]
        all_stats = [await writers[n].stats() for n in names]
    finally:
        for c in writers.values():
            await c.close()
        if isinstance(trainer, AsyncClusterClient):
            await trainer.close()
    segments = sum(len(s.segments) for s in samples)
    handle_wire = sum(len(msgspec.msgpack.encode(s.segments)) for s in samples)
    inline_wire = row_bytes + sum(s.mask.nbytes for s in samples)
    print(f"payloadd demo: {args.samples} samples, {tokens:,} tokens (generated in {gen_s:.1f} s)")
    print(
        f"  inference  wrote {_mb(row_bytes)} routing + {_mb(mask_bytes)} masks"
        f" as {segments:,} segments with {args.writers} writers:"
        f" {_mb((row_bytes + mask_bytes) / write_s)}/s"
    )
    print(
        f"  orchestr.  handles {handle_wire / 1e3:,.1f} kB msgpack vs {_mb(inline_wire)} inline"
        f" ({handle_wire / inline_wire:.4f}x)"
    )
    for stats in all_stats:
        where = "daemon    " if len(all_stats) == 1 else f"{stats.node:<10}"
        reads = "HTTP reads" if len(all_stats) == 1 else "reads answered (HTTP, peer port)"
        print(
            f"  {where} {stats.appends:,} appends ({stats.leases:,} leases),"
            f" {stats.data_plane_requests:,} data-plane requests, {stats.reads:,} {reads};"
            f" root {stats.root}"
        )
    across = f" through ClusterClient from node {names[0]}" if len(names) > 1 else ""
    print(f"  trainer    {args.dp} DP ranks{across}; windows read bit for bit against inline:")
    failed = False
    for r in results:
        verdict = "parity OK" if r.mismatches == 0 and r.windows else "MISMATCH"
        failed |= verdict != "parity OK"
        print(
            f"    CP {r.cp}: {r.windows:4d} windows, {r.mismatches} mismatches,"
            f" {_mb(r.bytes_read / r.seconds)}/s into int32   {verdict}"
        )
    print("demo: " + ("FAILED" if failed else "OK"))
    return 1 if failed else 0


@dataclass(frozen=True)
class Node:
    """A daemon of the demo: its socket, and its TCP URL when it has one."""

    socket: Path
    url: str = ""


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; return 0 when every window matched the inline path."""
    tmp = Path(tempfile.mkdtemp(prefix="payloadd-demo-"))
    try:
        if args.nodes == 1:
            socket = tmp / "payloadd.sock"
            with start_daemon(args.root or tmp / "root", socket):
                return asyncio.run(_play(args, {"demo": Node(socket)}, None))
        token = secrets.token_hex(32)
        env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=token)
        with contextlib.ExitStack() as stack:
            nodes = {}
            for i in range(args.nodes):
                name = f"node-{chr(ord('a') + i)}" if i < 26 else f"node-{i}"
                http, peer = free_tcp_port(), free_tcp_port()
                sock = tmp / f"{name}.sock"
                stack.enter_context(start_daemon(
                    (args.root or tmp) / name, sock, "--node", name, "--tcp-port", str(http),
                    "--peer-port", str(peer), env=env,
                ))  # fmt: skip
                nodes[name] = Node(sock, f"http://127.0.0.1:{http}")
            return asyncio.run(_play(args, nodes, token))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def free_tcp_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
