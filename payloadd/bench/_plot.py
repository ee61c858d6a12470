"""The ``payloadd bench`` plot: ``bench.png``, six panels drawn from the report's rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["RATIO_PREFIXES", "plot"]

RATIO_PREFIXES = ("packed ", "HTTP ceiling", "read uint8 out= (http), vs", "writes: ")
"""Rows in GB/s drawn as ratios to their baselines (panel 4), not as throughput (panel 1)."""
TRAINER = "trainer step"
"""Rows of the trainer step: its ratio rows (unit ``x``, higher is better) go to panel 4."""


def _throughput(ax: Any, rows: list[dict[str, Any]]) -> None:
    thr = [r for r in rows if r["unit"] == "GB/s" and "writers" not in r["name"]
           and not r["name"].startswith(RATIO_PREFIXES)]  # fmt: skip
    sizes = list(dict.fromkeys(r["size"] for r in thr))
    names = list(dict.fromkeys(r["name"] for r in thr))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = [next((r for r in thr if r["name"] == name and r["size"] == s), None) for s in sizes]
        xs = [j + i * width for j in range(len(sizes))]
        med = [v["median"] if v else 0 for v in vals]
        err = [
            [v["median"] - v["min"] if v else 0 for v in vals],
            [v["max"] - v["median"] if v else 0 for v in vals],
        ]
        ax.bar(xs, med, width, yerr=err, label=name, capsize=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], sizes)
    ax.set_ylabel("GB/s (median, min-max)")
    ax.set_yscale("log")
    ax.set_title("Append and window read throughput")
    ax.legend(fontsize=6)


def _barh(ax: Any, labels: list[str], values: list[float], color: str, xlabel: str,
          title: str) -> None:  # fmt: skip
    ax.barh(labels, values, color=color)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=6)
    ax.invert_yaxis()


def _segments_vs_n(ax: Any, rows: list[dict[str, Any]]) -> None:
    one = [r for r in rows if r["name"].startswith("one-row segments") and r["unit"] == "µs"]
    for name in dict.fromkeys(r["name"] for r in one):
        pts = sorted((_count(r["size"]), r) for r in one if r["name"] == name)
        ns = [n for n, _ in pts]
        ax.errorbar(ns, [r["median"] for _, r in pts], marker="o", label=name.split(", ")[-1],
                    yerr=[[r["median"] - r["min"] for _, r in pts],
                          [r["max"] - r["median"] for _, r in pts]])  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("one-row segments in the window (N)")
    ax.set_ylabel("µs per segment (median, min-max)")
    ax.axhline(2.0, color="black", linewidth=0.8, linestyle=":")  # the target at N >= 1,000
    ax.set_title("A window over N one-row segments")
    ax.legend(fontsize=6)


def _count(size: str) -> int:
    """``N=10`` -> 10, ``N=10k`` -> 10000."""
    n = size.removeprefix("N=")
    return int(n[:-1]) * 1000 if n.endswith("k") else int(n)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Draw the report's rows into ``path`` (PNG); ``False`` without matplotlib.

    Panels: throughput per size and method; round trips (ms); the RL batch's ratios (by
    handle ÷ inline, payloadd ÷ Ray) and payload share; the packed micro batch, the trainer
    step (payloadd's speed over the direct reader's and raw preadv's), the HTTP ceiling and
    the 16 MiB writes as ratios to their baselines; the cost per segment of a
    window over N one-row segments against N (log-log); the orchestrator's operations per
    segment.

    Parameters
    ----------
    rows : list of dict
        `payloadd.bench._bench.report`'s rows.
    path : Path
        The PNG to write.

    Returns
    -------
    bool
        Whether the plot was drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(22, 12), gridspec_kw={"width_ratios": [3, 2, 2]})
    _throughput(axes[0][0], rows)
    lat = [r for r in rows if r["unit"] == "ms"]
    _barh(axes[0][1], [f"{r['name']} [{r['size']}]" for r in lat], [r["median"] for r in lat],
          "tab:gray", "ms (median over repetitions, log scale)", "Round trips and appends")  # fmt: skip
    axes[0][1].set_xscale("log")
    rl = [r for r in rows if r["unit"] in ("MiB", "s") and r["ratio"] is not None]
    rl += [r for r in rows if r["unit"] == "x" and not r["name"].startswith(TRAINER)]
    _barh(axes[0][2], [r["name"].removeprefix("RL ") for r in rl],
          [r["ratio"] if r["ratio"] is not None else r["median"] for r in rl], "tab:green",
          "ratio of medians (lower is better); share: median", "RL batch: by handle / inline; "
          "payloadd / Ray")  # fmt: skip
    axes[0][2].axvline(1.0, color="black", linewidth=0.8)
    rat = [r for r in rows if r["unit"] == "GB/s" and r["ratio"] is not None
           and r["name"].startswith(RATIO_PREFIXES)]  # fmt: skip
    trainer = [r for r in rows if r["unit"] == "x" and r["name"].startswith(TRAINER)]
    _barh(axes[1][0], [f"{r['name']} [{r['size']}]" for r in rat + trainer],
          [r["ratio"] for r in rat] + [r["median"] for r in trainer], "tab:blue",
          "ratio to its baseline, median (higher is better)",
          "Packed micro batch, trainer step, HTTP ceiling, 16 MiB writes")  # fmt: skip
    axes[1][0].axvline(1.0, color="black", linewidth=0.8)
    _segments_vs_n(axes[1][1], rows)
    ops = [r for r in rows if r["name"].startswith("segments: ")]
    _barh(axes[1][2], [f"{r['name'].removeprefix('segments: ')} [{r['size']}]" for r in ops],
          [r["median"] for r in ops], "tab:purple", "µs per segment (median)",
          "Orchestrator operations on segment lists")  # fmt: skip
    axes[1][2].axvline(1.0, color="black", linewidth=0.8, linestyle=":")  # the target
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
