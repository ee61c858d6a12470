"""The report of ``payloadd soak``: /proc samples of the daemon, the checks, the verdict table
and the plot.

A sample is a dict (it goes to the JSON file as it is): ``t`` (seconds since the soak
started), ``epoch`` (0, then one more at each restart), ``pid``, ``phase`` (``load`` while
writers run, ``drain`` until the final GC, ``settle`` after it), ``rss_mib`` (``VmRSS``),
``threads``, ``fds`` (entries of ``/proc/PID/fd``), ``deleted_fds`` (those whose link ends
with ``(deleted)``), ``deleted`` (the first of their paths) and ``stats`` (the daemon's
`Stats` as a dict, or ``None`` when it did not answer).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "STATS_KEPT",
    "Check",
    "dump_document",
    "format_verdict",
    "growth_checks",
    "held_deleted",
    "plot",
    "proc_sample",
]

STATS_KEPT = (
    "uptime_s",
    "appends",
    "reads",
    "data_plane_requests",
    "data_plane_fds",
    "leases",
    "leased_bytes",
    "files_open_for_append",
    "files_dirty",
    "root_bytes",
)
"""The daemon counters a sample keeps (of `Stats`)."""

GROWTH_METRICS = (("rss_mib", "RSS", "MiB"), ("fds", "descriptors", ""), ("threads", "threads", ""))
"""The metrics the growth check compares: sample key, name, unit."""


def proc_sample(pid: int, keep_paths: int = 64) -> dict[str, Any] | None:
    """RSS, threads and descriptors of process ``pid`` now; ``None`` when it is gone.

    Parameters
    ----------
    pid : int
        Process to look at (a child of ours, so ``/proc`` is readable).
    keep_paths : int
        How many paths of descriptors of removed files to keep.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss_kib = int(fields["VmRSS"].split()[0])
        threads = int(fields["Threads"])
        names = os.listdir(f"/proc/{pid}/fd")
    except (OSError, KeyError, ValueError):  # gone (killed, restarting) or a zombie
        return None
    deleted = []
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.endswith(" (deleted)") and not target.startswith("/memfd:"):
            deleted.append(target)  # (a memfd, such as the daemon's generation page, has no name)
    return {
        "pid": pid,
        "rss_mib": round(rss_kib / 1024, 2),
        "threads": threads,
        "fds": len(names),
        "deleted_fds": len(deleted),
        "deleted": sorted(deleted)[:keep_paths],
    }


@dataclass
class Check:
    """One verdict check: ``value`` against ``limit`` (``ok`` when within it).

    Attributes
    ----------
    name : str
        What is checked.
    value : float or None
        What was measured (``None``: not measured, see ``detail``).
    limit : float
        The bound: ``value <= limit``, or ``value >= limit`` when ``op`` is ``">="``.
    ok : bool
        Passed (a check that could not be measured passes, and says so in ``detail``).
    unit : str
        Unit of ``value`` and ``limit``.
    detail : str
        How it was measured, or why it failed and by how much.
    op : str
        ``"<="`` (an upper bound) or ``">="`` (a lower one).
    """

    name: str
    value: float | None
    limit: float
    ok: bool
    unit: str = ""
    detail: str = ""
    op: str = "<="

    def as_dict(self) -> dict[str, Any]:
        """For the JSON file."""
        return asdict(self)


def _thirds(values: Sequence[float]) -> tuple[float, float]:
    """Medians of the second and the last third of ``values`` (in time order)."""
    n = len(values)
    second = values[n // 3 : 2 * n // 3]
    last = values[2 * n // 3 :]
    return statistics.median(second), statistics.median(last)


def growth_checks(
    samples: Sequence[dict[str, Any]],
    starts: Sequence[float],
    warmup: float,
    slack: dict[str, float],
    rss_slack_pct: float,
) -> list[Check]:
    """Did RSS, descriptors or threads grow under load? One check per metric.

    Each daemon epoch (from a start to the next restart) is judged apart, since a restart
    frees everything: its load-phase samples at least ``warmup`` seconds after its start, in
    time order, split in thirds; the growth is the median of the last third minus the median
    of the second. The check takes the epoch that grew most. An epoch with fewer than 6 such
    samples is skipped; with none left, the check passes and says it was not measured.

    Parameters
    ----------
    samples : sequence of dict
        The soak's samples (`proc_sample` plus ``t``, ``epoch``, ``phase``).
    starts : sequence of float
        ``t`` of each daemon start, epoch by epoch.
    warmup : float
        Seconds after each start whose samples are left out.
    slack : dict
        Allowed growth per metric key (``rss_mib`` in MiB, ``fds``, ``threads``).
    rss_slack_pct : float
        RSS may also grow by this percentage of the second third's median, when that is more.
    """
    out = []
    for key, name, unit in GROWTH_METRICS:
        worst: tuple[float, float, int, float, float, int] | None = None
        for epoch, start in enumerate(starts):
            vals = [
                float(s[key])
                for s in samples
                if s["epoch"] == epoch and s["phase"] == "load" and s["t"] >= start + warmup
            ]
            if len(vals) < 6:
                continue
            second, last = _thirds(vals)
            limit = slack[key]
            if key == "rss_mib":
                limit = max(limit, second * rss_slack_pct / 100)
            growth = last - second
            if worst is None or growth - limit > worst[0] - worst[1]:
                worst = (growth, limit, epoch, second, last, len(vals))
        if worst is None:
            out.append(
                Check(
                    f"{name} growth",
                    None,
                    slack[key],
                    True,
                    unit,
                    "not measured: no daemon epoch had 6 load samples after the warm-up",
                )
            )
            continue
        growth, limit, epoch, second, last, n = worst
        detail = (
            f"epoch {epoch}: median of the last third {last:g} vs the second third {second:g} "
            f"({n} samples)"
        )
        if growth > limit:
            detail += f"; grew {growth - limit:g}{' ' + unit if unit else ''} more than allowed"
        out.append(
            Check(
                f"{name} growth", round(growth, 3), round(limit, 3), growth <= limit, unit, detail
            )
        )
    return out


def held_deleted(samples: Sequence[dict[str, Any]], held_s: float) -> dict[str, float]:
    """Removed files whose descriptor a daemon held in consecutive samples for at least
    ``held_s`` seconds: path -> seconds held (the longest stretch, per daemon process).

    GC closes the daemon's descriptors of the files it removes at once, and a read under way
    ends within a client timeout: a removed file held longer is a leaked descriptor.
    """
    spans: dict[tuple[int, str], tuple[float, float]] = {}
    longest: dict[str, float] = {}
    before: set[tuple[int, str]] = set()
    for s in samples:
        now = {(s["pid"], path) for path in s["deleted"]}
        for key in now:
            first = spans[key][0] if key in before else s["t"]
            spans[key] = (first, s["t"])
            held = s["t"] - first
            if held >= held_s:
                longest[key[1]] = max(longest.get(key[1], 0.0), held)
        before = now
    return longest


def dump_document(doc: dict[str, Any]) -> str:
    """The JSON file's text: indented, but one line per sample (a long soak has many)."""
    samples = doc.get("samples", [])
    if not samples:
        return json.dumps(doc, indent=1) + "\n"
    head = json.dumps({**doc, "samples": []}, indent=1)  # the last key: it ends the text
    rows = ",\n".join("  " + json.dumps(s, separators=(",", ":")) for s in samples)
    return head.replace('"samples": []', '"samples": [\n' + rows + "\n ]") + "\n"


def plot(
    samples: Sequence[dict[str, Any]],
    kills: Sequence[float],
    final_gc: float | None,
    path: Path,
    title: str,
) -> bool:
    """Draw RSS, descriptors, descriptors of removed files, threads and two daemon counters
    over time, restarts and the final GC marked; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("rss_mib", "RSS (MiB)"),
        ("fds", "open descriptors"),
        ("deleted_fds", "descriptors of removed files"),
        ("threads", "threads"),
        ("root_mib", "root_bytes (MiB)"),
        ("files_open_for_append", "files_open_for_append"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), sharex=True)
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for epoch in sorted({s["epoch"] for s in samples}):
            pts = [(s["t"], _value(s, key)) for s in samples if s["epoch"] == epoch]
            pts = [(t, v) for t, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", color="tab:blue", linewidth=1)
        for i, t in enumerate(kills):
            ax.axvline(
                t,
                color="tab:red",
                linestyle="--",
                linewidth=0.8,
                label="SIGKILL + restart" if i == 0 else None,
            )
        if final_gc is not None:
            ax.axvline(final_gc, color="tab:green", linestyle=":", linewidth=1, label="final GC")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("seconds")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _value(sample: dict[str, Any], key: str) -> float | None:
    if key in sample:
        return float(sample[key])
    stats = sample.get("stats")
    if not stats:
        return None
    if key == "root_mib":
        return float(stats["root_bytes"]) / 2**20
    return float(stats[key])


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    text = f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"
    return f"{text} {unit}".strip()


def _classes(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} {n:,}" for k, n in sorted(errors.items())) or "none"


def _pressure_lines(v: dict[str, Any]) -> list[str]:
    """The counted and real bytes; with ``--hostile``, what the neighbours did and what the
    probes saw."""
    out = []
    b = v.get("bytes")
    if b:
        rest = b["at_rest"]
        at_rest = "not measured" if rest is None else f"{rest['drift']:,} at rest"
        drift = "-" if b["max_drift"] is None else f"{b['max_drift']:,}"
        out.append(
            f"  bytes      counted - real: {at_rest}; largest in {b['samples']:,} samples "
            f"{drift} (tolerance there {b['max_drift_tolerance'] or 0:,})"
        )
    for kind, n in (v.get("neighbours") or {}).get("kinds", {}).items():
        answers = ", ".join(f"{a} {k:,}" for a, k in n["answers"].items()) or "none"
        out.append(
            f"  neighbour  {kind:13} {n['planned']:>4}: opened {n['opened']:,}, closed by the "
            f"daemon {n['closed']:,} (open {n['held_max_s']:g} s at most), refused "
            f"{n['refused']:,}; answers: {answers}"
        )
    stragglers = (v.get("neighbours") or {}).get("stragglers")
    if stragglers:
        out.append("  stragglers " + ", ".join(f"{k} {n:,}" for k, n in sorted(stragglers.items())))
    p = v.get("probes")
    if p:
        refused = sum(n for k, n in p["calls"].items() if k.endswith(" refused"))
        out.append(
            f"  probes     health {p['health']:,}, failed {p['health_failed']:,}; "
            f"state-changing calls {sum(p['calls'].values()):,}: {refused:,} refused, "
            f"{sum(p['refusals_checked'].values()):,} checked, "
            f"{len(p['refusals_executed']):,} carried out"
        )
    return out


def format_verdict(doc: dict[str, Any]) -> str:
    """The verdict of a soak's JSON document as a short text table."""
    v, s, c = doc["verdict"], doc["settings"], doc["verdict"]["counts"]
    daemon = f", daemon flags {' '.join(s['daemon_arg'])}" if s["daemon_arg"] else ""
    if s.get("hostile"):
        daemon += "; hostile neighbours"
    lines = [
        f"payloadd soak: {s['duration']:g} s; {s['writers']} writer threads + "
        f"{s['writer_processes']} processes; {s['ranks']} ranks ({s['reader_processes']} "
        f"processes); {s['samples_per_step']} samples a step; kill every {s['kill_every']:g} s"
        + daemon,
        f"  steps      {c['steps']:,} ({c['micro_batches']:,} micro batches)",
        f"  appends    {c['appends']:,} acknowledged: {c['rows']:,} rows, "
        f"{c['bytes'] / 2**20:,.1f} MiB; {c['in_doubt']:,} in doubt (not checked)",
        f"  compared   {c['windows']:,} windows + {c['tail_windows']:,} truncated tails, "
        f"{c['rows_checked']:,} rows: {c['mismatches']:,} mismatches",
        f"  gc         {c['gc_calls']:,} calls, {c['gc_files']:,} files; "
        f"{c['gone_checked']:,} reads of collected segments gave 410",
        f"  restarts   {c['restarts']:,}; {c['steps_across_kills']:,} steps written before a kill "
        "and read after it",
        f"  errors     expected (transport, around a kill): {_classes(v['errors']['expected'])}",
        f"             unexpected: {_classes(v['errors']['unexpected'])}",
    ]
    for e in v["first_unexpected"][:5]:
        lines.append(f"    at {e['t']:.1f} s, {e['who']}, {e['op']}: {e['error']}: {e['message']}")
    for m in v["mismatch_examples"][:5]:
        lines.append(f"    mismatch: {m}")
    lines += _pressure_lines(v)
    st = v["final_stats"]
    if st:
        lines.append(
            f"  daemon     last stats: root_bytes {st['root_bytes']:,}, files_open_for_append "
            f"{st['files_open_for_append']}, leases {st['leases']:,}, data_plane_fds "
            f"{st['data_plane_fds']:,}"
        )
    lines.append(f"  {'check':30} {'value':>10} {'bound':>12}  result")
    for ch in v["checks"]:
        bound = f"{ch['op']} {_fmt(ch['limit'], ch['unit'])}"
        result = "ok  " if ch["ok"] else "FAIL"
        lines.append(
            f"  {ch['name']:30} {_fmt(ch['value'], ch['unit']):>10} {bound:>12}  {result}  "
            f"{ch['detail']}"
        )
    verdict = "OK" if v["passed"] else "FAILED: " + ", ".join(v["failed"])
    lines.append(f"soak: {verdict}")
    return "\n".join(lines)
