"""The ``payloadd bench`` command: its flags, and the run that prints the table and writes
``bench.json`` and ``bench.png`` (the measurements: `payloadd.bench._bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from payloadd.bench._bench import (
    RL_BATCH,
    RL_QUICK,
    SIZES,
    Bench,
    format_table,
    machine,
    report,
)
from payloadd.bench._daemon_process import start_daemon
from payloadd.bench._plot import plot
from payloadd.cli._common import positive_int

__all__ = ["add_bench_flags", "run_bench"]


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``payloadd bench``."""
    p.add_argument(
        "--root",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="folder on the file system to measure; a temporary root is made inside [/tmp]",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=5, help="repetitions of every measurement [5]"
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer calls; throughput rows at 64KiB and 1MiB only"
    )
    p.add_argument(
        "--skip-ray",
        action="store_true",
        help="skip the Ray comparison even when Ray is installed (it starts servers on every "
        "network interface); TransferQueue, which runs on Ray, too",
    )
    p.add_argument(
        "--skip-transferqueue",
        action="store_true",
        help="skip the TransferQueue comparison even when it is installed",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("docs/benchmarks"),
        help="folder for bench.json and bench.png [docs/benchmarks]",
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write JSON and the plot. Returns 0."""
    sizes = dict(list(SIZES.items())[:2]) if args.quick else SIZES
    with tempfile.TemporaryDirectory(prefix="payloadd-bench-", dir=args.root) as tmp:
        root, socket = Path(tmp) / "root", Path(tmp) / "payloadd.sock"
        with start_daemon(root, socket):
            bench = Bench(root, socket, args.repeat, args.quick)
            t0 = time.perf_counter()
            bench.throughput(sizes)
            bench.latency()
            bench.writers()
            bench.fsync_cost()
            bench.packed()
            bench.one_rows()
            bench.segment_ops()
            bench.new_keys()
            bench.writes()
            bench.http_ceiling()
            bench.cluster()
            spec = RL_QUICK if args.quick else RL_BATCH
            notes = [bench.rl(spec)]
            notes.append("Ray: skipped (--skip-ray)" if args.skip_ray else bench.ray(spec))
            if args.skip_ray or args.skip_transferqueue:
                flag = "--skip-ray: it runs on Ray" if args.skip_ray else "--skip-transferqueue"
                notes.append(f"TransferQueue: skipped ({flag})")
            else:
                notes.append(bench.transferqueue(spec))
            notes = [n for n in notes if n is not None]
            seconds = time.perf_counter() - t0
    rows = report(list(bench.results.values()))
    print(f"payloadd bench: {args.repeat} repetitions, {seconds:.0f} s, {machine()}")
    print(format_table(rows))
    for note in notes:
        print(f"not measured: {note}")
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": machine(),
        "repeat": args.repeat,
        "quick": args.quick,
        "rl_batch": dataclasses.asdict(spec),
        "notes": notes,
        "results": rows,
    }
    (args.out / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    drawn = plot(rows, args.out / "bench.png")
    print(f"wrote {args.out / 'bench.json'}" + (f" and {args.out / 'bench.png'}" if drawn else
          " (no plot: install matplotlib, e.g. the 'bench' extra)"))  # fmt: skip
    return 0
