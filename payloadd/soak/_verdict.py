"""The verdict of a soak run (`verdict`) and the JSON document that holds it (`document`):
counts, errors by class (expected: a transport error around a kill), and the checks: of the
data, of the daemon's resources, of its counted bytes against its files, and with
``--hostile`` of the probes of its own socket."""

from __future__ import annotations

import argparse
import os
import platform
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from payload_client import TransportError
from payloadd._version import __version__
from payloadd.soak._check import SoakShape
from payloadd.soak._report import Check, growth_checks, held_deleted
from payloadd.soak._state import Kill, RunState, since
from payloadd.soak._workers import Tally

__all__ = ["COUNTS", "GRACE", "TRANSPORT_ERRORS", "document", "is_expected", "verdict"]

GRACE = 5.0
"""Transport errors from 0.5 s before a kill to this long after the restart are expected."""
MAX_KEPT = 20
"""Unexpected errors kept for the report."""


def _subclass_names(cls: type[Exception]) -> Iterator[str]:
    yield cls.__name__
    sub: type[Exception]
    for sub in cls.__subclasses__():
        yield from _subclass_names(sub)


TRANSPORT_ERRORS = frozenset(_subclass_names(TransportError))
"""Error classes expected around a kill: the client's transport errors."""


def is_expected(event: list[Any], kills: list[Kill]) -> bool:
    """An error is expected when it is a transport error around a kill."""
    t0, t1, _, cls, _, _ = event
    if cls not in TRANSPORT_ERRORS:
        return False
    for k in kills:
        ready = k.ready if k.ready is not None else float("inf")
        if t1 >= k.at - 0.5 and t0 <= ready + GRACE:
            return True
    return False


def verdict(
    args: argparse.Namespace, state: RunState, tally: Tally, starts: list[float], t0: float
) -> dict[str, Any]:
    """Counts, errors by class and the checks, as the JSON file holds them.

    Parameters
    ----------
    args : argparse.Namespace
        The flags of ``payloadd soak``.
    state : RunState
        What the run recorded.
    tally : Tally
        The counts, errors and mismatches of every worker; ``steps_across_kills`` is added
        to its counts.
    starts : list of float
        When each start of the daemon answered (``time.monotonic``).
    t0 : float
        When the load started (``time.monotonic``).
    """
    st, c = state, tally.counts
    expected, unexpected, first = _errors(tally, st.kills, t0)
    checks = _run_checks(args, st, c, sum(unexpected.values()))
    started = [since(t0, s) for s in starts]
    slack = {"rss_mib": args.rss_slack_mib, "fds": args.fd_slack, "threads": args.thread_slack}
    checks += growth_checks(st.samples, started, args.warmup, slack, args.rss_slack_pct)
    checks += _settled_checks(args, st, t0)
    checks += bytes_checks(st)
    probe_checks, probes = _probe_checks(st, t0)
    checks += probe_checks
    final_stats = next((s["stats"] for s in reversed(st.samples) if s["stats"]), None)
    c["steps_across_kills"] = sum(
        any(st.issued[s] < k.at < t for k in st.kills) for s, t in st.read.items()
    )
    return {
        "passed": all(ch.ok for ch in checks),
        "failed": [ch.name for ch in checks if not ch.ok],
        "counts": {k: c[k] for k in COUNTS},
        "errors": {"expected": dict(expected), "unexpected": dict(unexpected)},
        "first_unexpected": first,
        "mismatch_examples": tally.mismatches,
        "checks": [ch.as_dict() for ch in checks],
        "final_stats": final_stats,
        "bytes": bytes_figures(st),
        "probes": probes,
        "neighbours": st.neighbours,
    }


COUNTS = (
    "steps",
    "micro_batches",
    "appends",
    "rows",
    "bytes",
    "in_doubt",
    "windows",
    "tail_windows",
    "rows_checked",
    "gone_checked",
    "gc_calls",
    "gc_files",
    "restarts",
    "steps_across_kills",
    "mismatches",
)
"""The counts of a verdict, in its order."""


def _errors(
    tally: Tally, kills: list[Kill], t0: float
) -> tuple[Counter[str], Counter[str], list[dict[str, Any]]]:
    """The error events of ``tally`` by class, expected (`is_expected`) and unexpected, and
    the first `MAX_KEPT` unexpected ones."""
    expected: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    first: list[dict[str, Any]] = []
    for e in sorted(tally.errors):
        if is_expected(e, kills):
            expected[e[3]] += 1
            continue
        unexpected[e[3]] += 1
        if len(first) < MAX_KEPT:
            first.append(
                {"t": since(t0, e[0]), "op": e[2], "error": e[3], "message": e[4], "who": e[5]}
            )
    return expected, unexpected, first


def _run_checks(
    args: argparse.Namespace, state: RunState, c: Counter[str], unexpected: int
) -> list[Check]:
    """The checks of the data and of the run: no mismatch, no ``unexpected`` error, a window
    compared, a 410 read checked once GC collected, the run completed within ``--drain``."""
    checks = [
        Check(
            "mismatches",
            c["mismatches"],
            0,
            c["mismatches"] == 0,
            "",
            "windows, tails and 410 reads that did not give what was written",
        ),
        Check(
            "unexpected errors",
            unexpected,
            0,
            not unexpected,
            "",
            "any error but a transport error around a kill",
        ),
        Check("windows compared", c["windows"], 1, c["windows"] >= 1, "", "at least one", ">="),
    ]
    if c["gc_calls"]:
        checks.append(
            Check(
                "410 reads checked",
                c["gone_checked"],
                1,
                c["gone_checked"] >= 1,
                "",
                "at least one, once GC collected",
                ">=",
            )
        )
    st = state
    drained = None if st.final_gc is None else round(st.final_gc - st.load_end, 1)
    why = st.aborted or "seconds from the end of the load to the final GC"
    checks.append(Check("run completed", drained, args.drain, st.aborted is None, "s", why))
    return checks


def bytes_figures(state: RunState) -> dict[str, Any]:
    """The counted and real bytes: samples measured, the largest drift of any (``counted -
    real``, signed), and the measure at rest."""
    measured = [s["bytes"] for s in state.samples if s.get("bytes")]
    worst = max(measured, key=lambda b: abs(b["drift"]), default=None)
    return {
        "samples": len(measured),
        "max_drift": None if worst is None else worst["drift"],
        "max_drift_tolerance": None if worst is None else worst["tolerance"],
        "at_rest": state.at_rest,
    }


def bytes_checks(state: RunState) -> list[Check]:
    """The daemon's counted root bytes (less what is reserved and not written) against the
    files' sizes: in every sample within a lease of each file open for appends, either way;
    at rest (every client closed) equal."""
    measured = [(s["t"], s["bytes"]) for s in state.samples if s.get("bytes")]
    beyond = [(abs(b["drift"]) - b["tolerance"], t, b) for t, b in measured]
    beyond = [x for x in beyond if x[0] > 0]
    name = "counted vs real bytes"
    if not measured:
        out = [Check(name, None, 0, True, "B", "not measured: no sample")]
    else:  # the sample beyond its tolerance by most, else the one of the largest drift
        if beyond:
            _, t, b = max(beyond, key=lambda x: x[0])
        else:
            t, b = max(measured, key=lambda m: abs(m[1]["drift"]))
        detail = (
            f"{len(measured)} samples, {len(beyond)} beyond a lease for each file open; "
            f"{'the worst' if beyond else 'the largest'} at {t:g} s: counted - real = "
            f"{b['drift']:,} (tolerance {b['tolerance']:,}: {b['open']} files open)"
        )
        excess = max((x[0] for x in beyond), default=0)
        out = [Check(name, excess, 0, not beyond, "B", detail)]
    rest = state.at_rest
    name = "counted vs real bytes at rest"
    if rest is None:
        out.append(Check(name, None, 0, True, "B", "not measured: the run did not get there"))
        return out
    drift = rest["drift"]
    ok = drift == 0 and rest["counted"][-1] == rest["real"]
    detail = (
        f"counted {rest['counted'][-1]:,} (less what is reserved), files {rest['real']:,} ({rest['files']} files, "
        f"{rest['open']} open for appends) once every client closed"
    )
    if drift < 0:
        detail += f"; the count is {-drift:,} bytes below the files"
    elif drift > 0:
        detail += f"; the count is {drift:,} bytes above the files"
    out.append(Check(name, drift, 0, ok, "B", detail))
    return out


def _probe_checks(state: RunState, t0: float) -> tuple[list[Check], dict[str, Any] | None]:
    """With ``--hostile``: every health probe of the Unix socket answered ``ok`` (but a
    transport error around a kill), and no refused call was carried out; the figures."""
    p = state.probes
    if p is None:
        return [], None
    failed = [e for e in p.health_failed if not is_expected(e, state.kills)]
    detail = f"{p.health:,} probes of GET /healthz over the Unix socket"
    if len(p.health_failed) > len(failed):
        detail += f"; {len(p.health_failed) - len(failed)} around a kill not counted"
    if failed:
        e = failed[0]
        detail += f"; the first at {since(t0, e[0]):g} s: {e[3]}: {e[4]}"
    elif not p.health:
        detail += ": none made"
    checks = [Check("health probes failed", len(failed), 0, not failed and p.health > 0, "",
                    detail)]  # fmt: skip
    checked = sum(p.checked.values())
    refused = sum(n for k, n in p.calls.items() if k.endswith(" refused"))
    detail = (
        f"{checked:,} refused calls checked of {refused:,} answered BusyError "
        f"({', '.join(f'{k} {n}' for k, n in sorted(p.checked.items())) or 'none'}); "
        f"{sum(p.calls.values()):,} state-changing calls"
    )
    if p.executed:
        detail += "; " + p.executed[0]
    ok = not p.executed
    checks.append(Check("refused calls executed", len(p.executed), 0, ok, "", detail))
    figures = {
        "health": p.health,
        "health_failed": len(failed),
        "health_failed_around_kills": len(p.health_failed) - len(failed),
        "health_failures": [
            {"t": since(t0, e[0]), "error": e[3], "message": e[4]} for e in failed[:MAX_KEPT]
        ],
        "calls": dict(sorted(p.calls.items())),
        "refusals_checked": dict(sorted(p.checked.items())),
        "refusals_executed": p.executed[:MAX_KEPT],
    }
    return checks, figures


def _settled_checks(args: argparse.Namespace, state: RunState, t0: float) -> list[Check]:
    """What the daemon holds at the last sample, ``--settle`` seconds after the final GC
    collected every step: descriptors of removed files (at most ``--deleted-fds-max``),
    and its own count of files open for appends and of root bytes (0)."""
    a, st = args, state
    deleted = "descriptors of removed files"
    settled = [s for s in st.samples if s["phase"] == "settle"]
    if not settled or st.final_gc is None:
        why = "not measured: no sample after the final GC"
        return [Check(deleted, None, a.deleted_fds_max, False, "", why)]
    last = settled[-1]
    n = last["deleted_fds"]
    most = max(s["deleted_fds"] for s in st.samples)
    after = f"{last['t'] - since(t0, st.final_gc):.1f} s after the final GC"
    detail = f"{after} (at most {most} during the run)"
    if n > a.deleted_fds_max:
        detail += f"; {n - a.deleted_fds_max} over the bound: " + ", ".join(last["deleted"][:2])
    out = [Check(deleted, n, a.deleted_fds_max, n <= a.deleted_fds_max, "", detail)]
    held = held_deleted(st.samples, a.held_s)
    detail = f"removed files a daemon held open for {a.held_s:g} s or more, over the run"
    if held:
        path, secs = max(held.items(), key=lambda kv: kv[1])
        detail += f"; the longest {secs:.0f} s: {path}"
    ok = len(held) <= a.deleted_fds_max
    out.append(Check("removed files held", len(held), a.deleted_fds_max, ok, "", detail))
    stats = last["stats"]
    for key in ("files_open_for_append", "root_bytes"):
        if stats is None:
            out.append(Check(key, None, 0, False, "", "not measured: stats() failed"))
            continue
        value = stats[key]
        out.append(Check(key, value, 0, value == 0, "", f"the daemon's count, {after}"))
    return out


def document(
    args: argparse.Namespace,
    shape: SoakShape,
    state: RunState,
    starts: list[float],
    t0: float,
    verdict: dict[str, Any],
) -> dict[str, Any]:
    """The JSON file: settings, verdict, kills and samples."""
    settings = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "command"
    }
    final = state.final_gc
    return {
        "payloadd": __version__,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "settings": settings,
        "shape": msgspec.structs.asdict(shape),
        "verdict": verdict,
        "kills": [
            {
                "t": since(t0, k.at),
                "ready_t": None if k.ready is None else since(t0, k.ready),
                "old_pid": k.old_pid,
                "new_pid": k.new_pid,
            }
            for k in state.kills
        ],
        "starts": [since(t0, s) for s in starts],
        "load_end_t": since(t0, state.load_end),
        "final_gc_t": None if final is None else since(t0, final),
        "samples": state.samples,
    }
