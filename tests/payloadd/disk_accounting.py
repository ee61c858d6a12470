"""What the disk cap counts under many writers: writer processes x fields, released by a
barrier onto one daemon step after step, each appending multi-turn samples over the data
plane; after every step (writers idle, connections open) and at the end (writers gone, GC
run) it compares the three accounts an operator sees: the cap's count (`Stats.root_bytes`),
the files (`Usage.bytes`, `Usage.disk_bytes`) with what is reserved (`Stats.reserved_bytes`),
and the GC report's bytes. `measure` is also what `test_disk_limits` runs, smaller.

    python -m tests.payloadd.disk_accounting --writers 8 --steps 6
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.synchronize
import sys
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np

from payload_client import PayloadClient
from tests._daemons import Daemons

FIELDS = {  # field -> (row shape, dtype): router replay, logprobs, a mask
    "routed_experts": ((48, 8), np.uint8),
    "logprobs": ((1,), np.float32),
    "loss_mask": ((1,), np.uint8),
}


TABLE = {  # the daemon's fields table: the three declared (unknown fields are refused)
    "routed_experts": {"dtypes": ["uint8"], "ragged": False},
    "logprobs": {"dtypes": ["float32"], "fill": 0.0, "ragged": False},
    "loss_mask": {"dtypes": ["uint8"], "ragged": False},
}


@dataclass
class StepAccount:
    """The accounts after one step, every writer idle with its connection open."""

    step: int
    written: int  # row bytes the writers appended so far (their own count)
    root_bytes: int  # counted against the cap
    reserved_bytes: int  # of which reserved, not written yet
    file_bytes: int  # Usage.bytes: the files' sizes
    disk_bytes: int  # Usage.disk_bytes: blocks


@dataclass
class Account:
    """What `measure` saw."""

    steps: list[StepAccount] = field(default_factory=list)
    refused: int = 0  # appends refused (StorageFullError), all writers
    written: int = 0  # row bytes acknowledged in all
    closed_root_bytes: int = 0  # after every writer closed
    closed_file_bytes: int = 0
    gc_bytes: int = 0  # GC of every step: the report's bytes
    after_gc_root_bytes: int = 0


def _writer(
    sock: str,
    seed: int,
    steps: int,
    samples: int,
    go: mp.synchronize.Barrier,
    idle: mp.synchronize.Barrier,
    total: Any,
    out: mp.Queue[tuple[int, int]],
) -> None:
    """Append ``samples`` multi-turn samples a step and field, released by ``go``, then
    wait at ``idle`` while the parent looks (``total``: the row bytes acknowledged so far,
    all writers); put ``(bytes written, refused)`` at the end."""
    rng = np.random.default_rng(seed)
    written = refused = 0
    with PayloadClient(sock) as c:
        for step in range(steps):
            go.wait()
            for _ in range(samples):
                turns = rng.integers(80, 400, int(rng.integers(1, 4)))  # tokens a turn
                for name, (shape, dtype) in FIELDS.items():
                    pos = 0
                    for t in turns:
                        rows = np.zeros((int(t), *shape), dtype)
                        try:
                            c.append(name, rows, pos, run="acct", step=step)
                            written += rows.nbytes
                            with total.get_lock():
                                total.value += rows.nbytes
                        except Exception as exc:  # StorageFullError: counted, and on
                            if type(exc).__name__ != "StorageFullError":
                                raise
                            refused += 1
                        pos += int(t)
            idle.wait()
            idle.wait()  # the parent has looked
    out.put((written, refused))


def measure(
    root: Path, *, writers: int = 8, steps: int = 3, samples: int = 12, cap: int = 0
) -> Account:
    """Run the writers against a new daemon on ``root`` (``cap``: its max_root_bytes)."""
    sock = root.parent / f"{root.name}.sock"
    acct = Account()
    flags = ["--node", "n", "--max-root-bytes", str(cap), "--fields", json.dumps(TABLE)]
    with Daemons(root.parent).run(*flags, root=root, socket=sock), PayloadClient(sock) as probe:
        ctx = mp.get_context("spawn")
        go, idle = ctx.Barrier(writers + 1), ctx.Barrier(writers + 1)
        out: mp.Queue[tuple[int, int]] = ctx.Queue()
        total = ctx.Value("q", 0)
        procs = [
            ctx.Process(target=_writer, args=(str(sock), i, steps, samples, go, idle, total, out))
            for i in range(writers)
        ]
        for p in procs:
            p.start()
        try:
            for step in range(steps):
                go.wait(120)
                idle.wait(300)
                stats, usage = probe.stats(), probe.usage(max_steps=0)
                acct.steps.append(
                    StepAccount(
                        step,
                        total.value,
                        stats.root_bytes,
                        stats.reserved_bytes,
                        usage.bytes,
                        usage.disk_bytes,
                    )
                )
                idle.wait(120)
            for _ in procs:
                written, refused = out.get(timeout=120)
                acct.written += written
                acct.refused += refused
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        acct.closed_root_bytes = probe.stats().root_bytes
        acct.closed_file_bytes = probe.usage(max_steps=0).bytes
        acct.gc_bytes = probe.gc("acct", through_step=steps).bytes
        acct.after_gc_root_bytes = probe.stats().root_bytes
    return acct


def _mib(n: int) -> str:
    return f"{n / (1 << 20):8.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    """Print the accounts of a run; 0."""
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples", type=int, default=12, help="samples a step, field and writer")
    p.add_argument("--cap", type=int, default=0, help="max_root_bytes of the daemon (0: none)")
    args = p.parse_args(argv)
    with TemporaryDirectory(prefix="disk-accounting-") as tmp:
        a = measure(
            Path(tmp) / "root",
            writers=args.writers,
            steps=args.steps,
            samples=args.samples,
            cap=args.cap,
        )
    print(f"{args.writers} writers x {len(FIELDS)} fields, {args.samples} samples a step")
    print("step   written         counted (cap)   reserved        files           on disk")
    for s in a.steps:
        print(
            f"{s.step:4d} {_mib(s.written)} {_mib(s.root_bytes)} {_mib(s.reserved_bytes)} "
            f"{_mib(s.file_bytes)} {_mib(s.disk_bytes)}"
        )
    print(f"writers gone: counted {_mib(a.closed_root_bytes)}, files {_mib(a.closed_file_bytes)}")
    print(f"GC report: {_mib(a.gc_bytes)}; counted after GC {_mib(a.after_gc_root_bytes)}")
    print(f"acknowledged {_mib(a.written)}; appends refused {a.refused}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
