"""The ``payloadd bench`` command: its flags, and the run that prints the table and writes
``bench.json`` and ``bench.png`` (the measurements: `payloadd.bench._bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
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
from payloadd.bench._trainer_step import format_trainer_summary, trainer_summary
from payloadd.cli._common import positive_int

__all__ = ["add_bench_flags", "caveats", "load_1min", "run_bench"]


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``payloadd bench``."""
    p.add_argument(
        "--root",
        type=Path,
        default=None,  # the temporary folder, looked up when bench runs: every command builds
        # this parser, and a read-only root file system (a container's) may have none
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
        default=None,
        help="folder for bench.json and bench.png [a new folder payloadd-bench-* in the "
        "temporary folder; give --out docs/benchmarks in a checkout to update its published "
        "figures]",
    )


STEPS = (
    ("throughput", "append and read throughput against raw I/O"),
    ("latency", "one-row round trips"),
    ("writers", "concurrent writers"),
    ("fsync_cost", "each fsync policy"),
    ("packed", "a packed micro batch against the direct reader; a trainer step on it"),
    ("one_rows", "windows of N one-row segments"),
    ("segment_ops", "segment operations at 100,000"),
    ("new_keys", "appends that open a new key"),
    ("writes", "16 MiB appends against raw pwrite variants"),
    ("http_ceiling", "HTTP reads against a bare uvicorn app"),
    ("cluster", "reads across three daemons"),
)
"""The measurements before the RL batch's, in order: a `Bench` method and what it measures."""


QUICK_CAVEAT = (
    "caveat: --quick: fewer calls a sample, item sizes 64KiB and 1MiB only, an RL batch of "
    "4 x 4k tokens: the figures are indicative, not to be read against a full run's or the "
    "targets"
)


def load_1min() -> float | None:
    """The 1-minute load average (`os.getloadavg`), ``None`` where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def caveats(
    quick: bool, repeat: int, loads: tuple[float | None, float | None], cores: int | None
) -> list[str]:
    """What to keep in mind when reading the run's figures, a line each.

    Parameters
    ----------
    quick : bool
        Whether the run was ``--quick``.
    repeat : int
        Repetitions of every measurement.
    loads : tuple of (float or None, float or None)
        The 1-minute load average at the start and at the end of the run (`load_1min`).
    cores : int or None
        The machine's cores (`os.cpu_count`).

    Returns
    -------
    list of str
        ``caveat: ...`` for ``--quick`` and for fewer than 3 repetitions; ``warning: ...``
        when the load average at the start or the end was above the cores; empty when none.
    """
    lines = [QUICK_CAVEAT] if quick else []
    if repeat < 3:
        lines.append(f"caveat: --repeat {repeat}: the min-max span of {repeat} sample(s) a row "
                     "says little about the spread")  # fmt: skip
    busy = [f"{load:.2f} at the {when}" for when, load in zip(("start", "end"), loads, strict=True)
            if load is not None and cores and load > cores]  # fmt: skip
    if busy:
        lines.append(f"warning: the machine was busy: 1-minute load average {' and '.join(busy)} "
                     f"of the run, above its {cores} cores: other work took CPU time from the "
                     "measurements, which are slower and noisier than on an idle machine")  # fmt: skip
    return lines


def _progress(i: int, total: int, what: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {i}/{total} {what}", file=sys.stderr, flush=True)


def _environment() -> str:
    """The machine as a readable block."""
    m = machine()
    width = max(map(len, m))
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in m.items())


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, saying on stderr what it measures as it goes; print the table;
    write JSON and the plot. Returns 0."""
    sizes = dict(list(SIZES.items())[:2]) if args.quick else SIZES
    out = args.out or Path(tempfile.mkdtemp(prefix="payloadd-bench-"))
    total = len(STEPS) + 3  # and the RL batch, Ray, TransferQueue
    load_start = load_1min()
    with tempfile.TemporaryDirectory(
        prefix="payloadd-bench-", dir=args.root or tempfile.gettempdir()
    ) as tmp:
        root, socket = Path(tmp) / "root", Path(tmp) / "payloadd.sock"
        with start_daemon(root, socket):
            bench = Bench(root, socket, args.repeat, args.quick)
            t0 = time.perf_counter()
            for i, (step, what) in enumerate(STEPS, 1):
                _progress(i, total, what, t0)
                if step == "throughput":
                    bench.throughput(sizes)
                else:
                    getattr(bench, step)()
            spec = RL_QUICK if args.quick else RL_BATCH
            _progress(total - 2, total, "the RL batch, inline and by handle", t0)
            notes = [bench.rl(spec)]
            _progress(total - 1, total, "the RL job on Ray's object store", t0)
            notes.append("Ray: skipped (--skip-ray)" if args.skip_ray else bench.ray(spec))
            _progress(total, total, "the RL job on TransferQueue", t0)
            if args.skip_ray or args.skip_transferqueue:
                flag = "--skip-ray: it runs on Ray" if args.skip_ray else "--skip-transferqueue"
                notes.append(f"TransferQueue: skipped ({flag})")
            else:
                notes.append(bench.transferqueue(spec))
            notes = [n for n in notes if n is not None]
            seconds = time.perf_counter() - t0
            load_end = load_1min()  # the daemons' still running: the run's own load
    rows = report(list(bench.results.values()))
    said = caveats(args.quick, args.repeat, (load_start, load_end), os.cpu_count())
    minutes, secs = divmod(round(seconds), 60)
    print(f"payloadd bench: {args.repeat} repetitions, {minutes} min {secs:02d} s in all")
    print(_environment())
    print(format_table(rows))
    print("ratio: the row's median / its baseline's; of GB/s higher is better, of ms, µs, s "
          "and MiB lower is better")  # fmt: skip
    for line in said:
        print(line)
    trainer = trainer_summary(rows)
    if trainer:
        print(format_trainer_summary(trainer))
    for note in notes:
        print(f"not measured: {note}")
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": machine(),
        "repeat": args.repeat,
        "quick": args.quick,
        "seconds": round(seconds, 1),
        "load_1min": {"start": load_start, "end": load_end, "cores": os.cpu_count()},
        "caveats": said,
        "rl_batch": dataclasses.asdict(spec),
        "notes": notes,
        "results": rows,
        "trainer_step": trainer,
    }
    (out / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    drawn = plot(rows, out / "bench.png", said)
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if drawn else
          " (no plot: install matplotlib, e.g. the 'bench' extra)"))  # fmt: skip
    return 0
