"""The ``payloadd soak`` command: its flags, and the run that prints the verdict and writes
the JSON document and the plot (the soak itself: `payloadd.soak._run`)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from payloadd.cli._common import FlagError, positive_int
from payloadd.soak._hostile import NeighbourPlan
from payloadd.soak._pressure import make_room
from payloadd.soak._report import dump_document, format_verdict, plot
from payloadd.soak._run import Soak

__all__ = ["add_soak_flags", "run_soak"]


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


_FLAGS: dict[str, list[tuple[str, Any, Any, str]]] = {
    "load": [
        ("--duration", _positive_seconds, 60, "seconds of load (then drain, final GC, settle)"),
        ("--writers", positive_int, 4, "writer threads (sync/async x data plane/HTTP, in turn)"),
        ("--writer-processes", _count, 1, "more writers, each a process of its own"),
        ("--ranks", positive_int, 4, "trainer ranks reading each micro batch at once (CP degree)"),
        ("--reader-processes", _count, 1, "how many of the ranks are processes, not threads"),
        ("--samples-per-step", positive_int, 8, "multi-turn samples a step, over all writers"),
        ("--max-tokens", positive_int, 1280, "tokens of a sample, at most"),
        ("--max-turns", positive_int, 4, "turns of a sample, at most"),
        ("--seq-len", positive_int, 1024, "micro-batch length; longer samples are truncated"),
        ("--step-every", _seconds, 0.5, "seconds from the start of a step to the next, at least"),
        ("--gc-lag", _count, 2, "GC collects up to this many steps before the last one read"),
        ("--kill-every", _seconds, 0, "SIGKILL and restart the daemon this often; 0: never"),
        ("--seed", _count, 0, "seed of every sample and row"),
    ],
    "hostile neighbours (with --hostile)": [
        ("--hostile-idle", _count, 200, "idle TCP connections (and an eighth as many peer ones)"),
        ("--hostile-trickle", _count, 8, "TCP heads and peer hellos trickled, of each"),
        ("--hostile-stalled", _count, 4, "peer connections announcing a 16 MiB frame"),
    ],
    "sampling and output": [
        ("--sample-every", _positive_seconds, 2, "seconds between samples of the daemon"),
        ("--json", Path, Path("soak.json"), "samples, kills and the verdict"),
        ("--plot", Path, Path("soak.png"), "the plot (needs matplotlib); '' for none"),
    ],
    "checks": [
        ("--warmup", _seconds, 5, "seconds after each start left out of the growth checks"),
        ("--rss-slack-mib", _seconds, 16, "RSS may grow this many MiB (last vs second third)"),
        ("--rss-slack-pct", _seconds, 10, "or this percent of the second third's, when more"),
        ("--fd-slack", _count, 16, "open descriptors may grow by this many"),
        ("--thread-slack", _count, 4, "threads may grow by this many"),
        ("--deleted-fds-max", _count, 0, "descriptors of removed files left after the final GC"),
        ("--held-s", _positive_seconds, 10, "a removed file held open this long is leaked"),
        ("--settle", _seconds, 5, "seconds from the final GC to the last sample"),
        ("--drain", _positive_seconds, 60, "seconds the drain, final GC and settle may take"),
    ],
}


def add_soak_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``payloadd soak``."""
    for title, flags in _FLAGS.items():
        g = p.add_argument_group(title)
        for flag, kind, default, text in flags:
            g.add_argument(flag, type=kind, default=kind(default), help=f"{text} [{default}]")
        if title == "load":
            g.add_argument(
                "--daemon-arg",
                action="append",
                default=[],
                metavar="ARG",
                help="a flag for payloadd serve, e.g. --daemon-arg=--fsync=always; repeat it "
                "for more (--daemon-arg=--fsync --daemon-arg=always)",
            )
        elif title.startswith("hostile"):
            g.add_argument(
                "--hostile",
                action="store_true",
                help="also serve TCP and a peer port with an admin token, press on them with "
                "idle, trickling and stalled connections, probe the Unix socket's health and "
                "check every refused call",
            )
        elif title == "sampling and output":
            g.add_argument("--keep", action="store_true", help="keep the root and daemon log")


def _check_flags(args: argparse.Namespace) -> None:
    if args.reader_processes > args.ranks:
        raise FlagError(
            f"--reader-processes {args.reader_processes} is more than --ranks {args.ranks}"
        )
    if args.max_tokens < 2:
        raise FlagError("--max-tokens must be at least 2")
    if args.seq_len < args.ranks:
        raise FlagError(f"--seq-len {args.seq_len} is shorter than --ranks {args.ranks}")
    if args.settle >= args.drain:
        raise FlagError(f"--settle {args.settle:g} leaves no time of --drain {args.drain:g}")
    if args.hostile:
        plan = NeighbourPlan.of(args.hostile_idle, args.hostile_trickle, args.hostile_stalled)
        try:
            make_room(plan.total())
        except ValueError as exc:
            raise FlagError(f"--hostile: {exc}") from None


def run_soak(args: argparse.Namespace) -> int:
    """Run the soak; return 0 when every check passed, 1 when one failed, 2 when the daemon
    does not start (on a root and socket of the soak's own: its ``--daemon-arg`` are wrong).

    Raises
    ------
    FlagError
        Flags that do not go together.
    """
    _check_flags(args)
    tmp = Path(tempfile.mkdtemp(prefix="payloadd-soak-"))
    log_path = tmp / "daemon.log"
    try:
        with open(log_path, "ab") as log:
            soak = Soak(args, tmp, log)
            try:
                soak.daemon.start()
            except RuntimeError as exc:
                log.flush()
                print(f"payloadd soak: {exc}; its log:", file=sys.stderr)
                print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
                return 2  # on a root and socket of our own: its flags are wrong
            try:
                soak.run()
            finally:
                soak.daemon.stop()
        doc = soak.document(soak.verdict())
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(dump_document(doc))
        print(format_verdict(doc))
        note = f"wrote {args.json}"
        if str(args.plot) not in ("", "."):
            title = f"payloadd soak: {args.duration:g} s, kill every {args.kill_every:g} s"
            kills = [k["t"] for k in doc["kills"]]
            args.plot.parent.mkdir(parents=True, exist_ok=True)
            if plot(doc["samples"], kills, doc["final_gc_t"], args.plot, title):
                note += f" and {args.plot}"
            else:
                note += " (no plot: install matplotlib, e.g. the 'bench' extra)"
        print(note)
        if doc["verdict"]["passed"]:
            return 0
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        if tail:
            print("the daemon's log, last lines:\n  " + "\n  ".join(tail))
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp} (root, socket, daemon.log)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
