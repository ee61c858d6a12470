"""``payloadd stat``: a summary of a running daemon for a person (or, with ``--json``, a
script): the daemon, its disk and limits, rates between two samples, its runs and steps,
and the last collections of its GC ledger.

Rates come from two samples of ``GET /v1/stats`` ``--interval`` seconds apart, divided by
the difference of the daemon's own ``uptime_s``; usage (``GET /v1/admin/usage``, an admin
call) is sampled with each, and the table shows the second.
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from typing import Any

import msgspec

from payload_client import Stats, Usage
from payload_client.protocol import format_size
from payloadd.cli._common import (
    FlagError,
    add_connection_flags,
    emit,
    exit_status,
    open_client,
    table,
)
from payloadd.settings._usage_query import MAX_USAGE_ENTRIES

__all__ = ["add_stat_flags", "rates", "render", "run_stat"]

RATES = {
    "appends_per_s": "appends",
    "rows_appended_per_s": "rows_appended",
    "bytes_appended_per_s": "bytes_appended",
    "reads_per_s": "reads",
    "bytes_read_per_s": "bytes_read",
    "data_plane_requests_per_s": "data_plane_requests",
    "leases_per_s": "leases",
}
"""Rate name -> the `Stats` counter it is the growth of, per second."""
MAX_INTERVAL_S = 86400.0
"""Longest ``--interval`` (a day; ``time.sleep`` overflows far beyond)."""
CLOCK_SLACK = 1e-3
"""How much slower than this host's clock a daemon's (over TCP, on another host) may run."""


def add_stat_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``payloadd stat`` to ``parser``."""
    add_connection_flags(parser)
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between the two samples the rates come from, at most "
        f"{MAX_INTERVAL_S:g}; 0: one sample, no rates [default: 1]",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=50,
        metavar="N",
        help=f"most steps (and runs) listed, 0 to {MAX_USAGE_ENTRIES} [default: 50]",
    )
    parser.add_argument(
        "--ledger",
        type=int,
        default=10,
        metavar="N",
        help=f"GC ledger entries shown, the last ones, 0 to {MAX_USAGE_ENTRIES} [default: 10]",
    )
    parser.add_argument(
        "--run", metavar="RUN", help="list this run only (the totals still count every run)"
    )
    parser.add_argument("--json", action="store_true", help="print the data as JSON")


def rates(
    first: Stats, second: Stats, u1: Usage, u2: Usage, elapsed_s: float = 0.0
) -> dict[str, float] | None:
    """Per-second growth of the counters between two samples of the same daemon run.

    Parameters
    ----------
    first, second : Stats
        The two samples of ``GET /v1/stats``, in the order taken.
    u1, u2 : Usage
        The usage sampled with each.
    elapsed_s : float
        Seconds (this process's monotonic clock) from the end of the first sample to the
        start of the second. The daemon that answered both was up for at least as long
        between them: when its uptime grew less (by more than `CLOCK_SLACK`, for a daemon
        on another host), the second answer came from a daemon started since (a restart).

    Returns
    -------
    dict or None
        ``interval_s`` (the daemon's seconds between the samples), each rate of `RATES`,
        and ``disk_bytes_per_s`` (growth of the node's bytes on disk, negative when GC freed
        more than was written); ``None`` when the daemon restarted in between (its uptime
        grew less than ``elapsed_s``, or a counter went down) or no time passed.
    """
    dt = second.uptime_s - first.uptime_s
    if dt <= 0 or dt < elapsed_s * (1 - CLOCK_SLACK):
        return None
    if any(getattr(second, c) < getattr(first, c) for c in RATES.values()):
        return None  # counters never go down within one daemon run
    out = {"interval_s": dt}
    for name, counter in RATES.items():
        out[name] = (getattr(second, counter) - getattr(first, counter)) / dt
    du = u2.now - u1.now
    out["disk_bytes_per_s"] = (u2.disk_bytes - u1.disk_bytes) / du if du > 0 else 0.0
    return out


def _age(seconds: float) -> str:
    if seconds < 0:
        return "0 s"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _steps_text(steps: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``; long lists are cut with ``...``."""
    parts: list[str] = []
    i = 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    text = ",".join(parts)
    return text if len(text) <= 24 else text[:21] + "..."


def _limit(value: int) -> str:
    # exact: a limit is read against the setting given
    return "none" if value == 0 else format_size(value, exact=True)


def _rate(bytes_per_s: float, *, signed: bool = False) -> str:
    text = format_size(bytes_per_s) + "/s"
    return "+" + text if signed and not text.startswith("-") else text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def render(stats: Stats, usage: Usage, r: dict[str, float] | None, where: str) -> str:
    """The text ``payloadd stat`` prints for one daemon."""
    up = _age(stats.uptime_s)
    lines = [
        f"daemon  node {stats.node} on {where}: root {stats.root}, up {up}, fsync {stats.fsync}",
        f"disk    {_count(usage.files, 'file')} in {_count(usage.steps, 'step')} of "
        f"{_count(len(usage.runs) + usage.more_runs, 'run')}: {format_size(usage.bytes)} "
        f"({format_size(usage.disk_bytes)} on disk)",
        f"        counted against the cap {format_size(stats.root_bytes)} (the files, and "
        f"{format_size(stats.reserved_bytes)} reserved for appends in progress), cap "
        f"{_limit(stats.max_root_bytes)}; free {format_size(stats.free_bytes)}, floor "
        f"{_limit(stats.min_free_bytes)}; appends refused {stats.appends_refused}",
    ]
    if r is None:
        lines.append("rates   none (one sample, or the daemon restarted between the samples)")
    else:
        lines += [
            f"rates   over {r['interval_s']:.2f} s: {r['appends_per_s']:.1f} appends/s, "
            f"{r['rows_appended_per_s']:.1f} rows/s, "
            f"{_rate(r['bytes_appended_per_s'])} appended",
            f"        HTTP reads {r['reads_per_s']:.1f}/s, {_rate(r['bytes_read_per_s'])}; "
            f"data plane {r['data_plane_requests_per_s']:.1f} requests/s, "
            f"{r['leases_per_s']:.1f} leases/s; "
            f"on disk {_rate(r['disk_bytes_per_s'], signed=True)}",
        ]
    lines.append("")
    rows: list[list[str]] = []
    for run in usage.runs:
        age = _age(usage.now - run.mtime) if run.files else "-"
        rows.append([run.run, "all", str(run.files), format_size(run.bytes),
                     format_size(run.disk_bytes), age])  # fmt: skip
        for s in run.steps:
            age = _age(usage.now - s.mtime) if s.files else "-"
            rows.append(["", str(s.step), str(s.files), format_size(s.bytes),
                         format_size(s.disk_bytes), age])  # fmt: skip
        if run.more_steps:
            what = "step" if run.more_steps == 1 else "steps"
            rows.append(["", f"{run.more_steps} more {what} not listed (--max-steps N, or "
                         f"--run {run.run})", "", "", "", ""])  # fmt: skip
    if usage.more_runs:
        what = "run" if usage.more_runs == 1 else "runs"
        rows.append([f"{usage.more_runs} more {what} not listed (--max-steps N, or --run RUN)",
                     "", "", "", "", ""])  # fmt: skip
    if rows:
        header = ["RUN", "STEP", "FILES", "BYTES", "ON DISK", "AGE"]
        lines.append(table(header, rows, [False, True, True, True, True, True]))
    else:
        lines.append("no runs on disk")
    lines.append("")
    ledger = usage.ledger
    n = usage.ledger_entries
    lines.append(
        f"GC ledger: {n} collection{'' if n == 1 else 's'} ({format_size(usage.ledger_bytes)})"
        + (f", the last {len(ledger)}:" if ledger else "")
    )
    if ledger:
        rows = []
        for e in ledger:
            at = datetime.datetime.fromtimestamp(e.at, datetime.UTC)
            size = "?" if e.bytes is None else format_size(e.bytes)
            rows.append([at.strftime("%Y-%m-%d %H:%M:%S"), e.reason, e.run,
                         _steps_text(e.steps), str(e.files), size])  # fmt: skip
        header = ["TIME (UTC)", "RULE", "RUN", "STEPS", "FILES", "BYTES"]
        lines.append(table(header, rows, [False, False, False, False, True, True]))
    return "\n".join(lines)


def _check_flags(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.interval) and 0 <= args.interval <= MAX_INTERVAL_S):
        raise FlagError(
            f"--interval must be >= 0 and <= {MAX_INTERVAL_S:g} seconds, got {args.interval}"
        )
    for flag, value in (("--max-steps", args.max_steps), ("--ledger", args.ledger)):
        if not 0 <= value <= MAX_USAGE_ENTRIES:
            raise FlagError(f"{flag} must be in [0, {MAX_USAGE_ENTRIES}], got {value}")


def _sample_and_print(args: argparse.Namespace) -> int:
    with open_client(args, data_plane=False) as c:
        s1, u1 = c.stats(), c.usage(max_steps=args.max_steps, ledger=args.ledger, run=args.run)
        s2, u2 = s1, u1
        sampled, elapsed = time.monotonic(), 0.0
        if args.interval > 0:
            time.sleep(args.interval)
            elapsed = time.monotonic() - sampled  # the daemon's uptime grows as much
            s2, u2 = c.stats(), c.usage(max_steps=args.max_steps, ledger=args.ledger, run=args.run)
        where = c.where
    r = rates(s1, s2, u1, u2, elapsed) if args.interval > 0 else None
    if args.json:
        doc: dict[str, Any] = {"daemon": where, "rates": r, "stats": s2, "usage": u2}
        emit(msgspec.json.format(msgspec.json.encode(doc)).decode())
    else:
        emit(render(s2, u2, r, where))
    return 0


def run_stat(args: argparse.Namespace) -> int:
    """Run ``payloadd stat``: exit status 0, 1 on a daemon or connection error.

    Raises
    ------
    FlagError
        A flag out of range, or a token file that cannot be read.
    """
    _check_flags(args)
    return exit_status("stat", lambda: _sample_and_print(args))
