"""The ``payloadd bench`` plot: ``bench.png``, one panel per question the report's rows answer.

`panels` groups `payloadd.bench._bench.report`'s rows by question (appends and reads against
raw I/O, their GB/s, round trips, windows of one-row segments, the packed micro batch, the
trainer step, reads across nodes, the HTTP ceiling, 16 MiB writes, ``--fsync``, concurrent
writers, segment operations, the RL batch by handle, the RL job against its peers); a panel
with no row is left out, and a row with a baseline that no panel draws goes to a last panel.
`figure` draws them: horizontal bars, one colour per series of a panel (a series: an item
size, a CP degree, a transport), the legend to the right of its axes, each bar's value at
its end; a ratio panel says on its axis which way is better and draws 1.0 (the baseline).
`plot` writes the figure to a PNG.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["TRAINER", "Bar", "Panel", "figure", "panels", "plot", "series_colors"]

Row = dict[str, Any]
TRAINER = "trainer step"
"""Prefix of the trainer step's rows (`payloadd.bench._trainer_step`); its ``x`` rows are
ratios (payloadd's speed over the baseline's), higher is better."""
RAW = ("raw pwrite", "raw preadv", "ideal int32 reader")
"""The baselines of the throughput rows (`payloadd.bench._bench.Bench.throughput`)."""
FASTER = "payloadd speed / baseline's (higher is better \u2192)"
CHEAPER = "by handle \u00f7 inline, MiB or s (lower is better \u2190)"
PEERS = "payloadd \u00f7 the peer, s or MiB (lower is better \u2190)"
BETTER = "how many times better than its baseline (higher is better \u2192)"
WRAP = 44
"""Characters of a category's label per line."""


@dataclass(frozen=True)
class Bar:
    """One bar: its category (a label on the y axis), its series (a legend entry, a colour),
    its value, the min-max span when it has one, and the report row it draws."""

    category: str
    series: str
    value: float
    key: tuple[str, str]
    span: tuple[float, float] | None = None


@dataclass
class Panel:
    """One question: its bars (or, for a panel of lines, its points per series), how its
    x axis reads, and the reference lines it draws (value, legend label)."""

    title: str
    xlabel: str
    bars: list[Bar] = field(default_factory=list)
    log: bool = True
    ratio: bool = False
    lines: dict[str, list[tuple[int, Row]]] = field(default_factory=dict)
    references: list[tuple[float, str]] = field(default_factory=list)

    @property
    def keys(self) -> set[tuple[str, str]]:
        """The report rows the panel draws, ``(name, size)``."""
        bars = {b.key for b in self.bars}
        return bars | {(r["name"], r["size"]) for pts in self.lines.values() for _, r in pts}

    @property
    def series(self) -> list[str]:
        """The panel's series, in the order of their first bar (or line)."""
        return list(dict.fromkeys([b.series for b in self.bars] + list(self.lines)))


def _key(r: Row) -> tuple[str, str]:
    return r["name"], r["size"]


def _cp(name: str) -> tuple[str, str | None]:
    """``"packed read, CP 4 (http)"`` -> ``("packed read (http)", "CP 4")``."""
    m = re.search(r",? CP (\d+)", name)
    if m is None:
        return name, None
    return (name[: m.start()] + name[m.end() :]).strip(" ,:"), f"CP {m[1]}"


def _transport(name: str) -> tuple[str, str]:
    """``"one-row append p50, sync (data plane)"`` -> ``("one-row append p50, sync", "data plane")``."""
    m = re.fullmatch(r"(.*) \(([^()]*)\)", name)
    return (m[1], m[2]) if m else (name, "")


def _better(r: Row) -> float | None:
    """The row's ratio turned so that above 1 is better than its baseline: a ratio of GB/s
    or an ``x`` row as it is, a ratio of times or sizes inverted."""
    if r["unit"] == "x":
        return float(r["median"])
    if not r["ratio"]:
        return None
    return float(r["ratio"]) if r["unit"] == "GB/s" else 1 / float(r["ratio"])


def _ratio_bars(
    rows: list[Row], keep: Callable[[Row], bool], category: Callable[[Row], str]
) -> list[Bar]:
    """Bars of the ratio of each kept row with a ratio; series: its CP, else its size."""
    bars = []
    for r in rows:
        if keep(r) and r["ratio"]:
            cp = _cp(r["name"])[1]
            bars.append(Bar(category(r), cp or r["size"], float(r["ratio"]), _key(r)))
    return bars


def _median_bars(
    rows: list[Row], keep: Callable[[Row], bool], category: Callable[[Row], str],
    series: Callable[[Row], str],
) -> list[Bar]:  # fmt: skip
    return [Bar(category(r), series(r), float(r["median"]), _key(r),
                (float(r["min"]), float(r["max"]))) for r in rows if keep(r)]  # fmt: skip


def _vs_raw(rows: list[Row]) -> Panel:
    bars = _ratio_bars(rows, lambda r: r["baseline"] in RAW,
                       lambda r: f"{r['name']} vs {r['baseline']}")  # fmt: skip
    return Panel("Appends and reads against raw I/O on the same file system, per item size",
                 FASTER, bars, ratio=True)  # fmt: skip


def _throughput(rows: list[Row]) -> Panel:
    names = {n for r in rows if r["baseline"] in RAW for n in (r["name"], r["baseline"])}
    bars = _median_bars(rows, lambda r: r["unit"] == "GB/s" and r["name"] in names,
                        lambda r: r["name"], lambda r: r["size"])  # fmt: skip
    return Panel("The same appends and reads and their baselines, GB/s per item size",
                 "GB/s, median (min-max) (higher is better \u2192)", bars)  # fmt: skip


def _round_trips(rows: list[Row]) -> Panel:
    bars = _median_bars(
        rows, lambda r: r["unit"] == "ms" and "fsync" not in r["name"]
        and not r["name"].startswith(TRAINER),
        lambda r: _transport(r["name"])[0], lambda r: _transport(r["name"])[1] or r["size"],
    )  # fmt: skip
    return Panel("One-row round trips and appends that open a new key, per transport",
                 "ms a call, median (min-max) of the repetitions (lower is better \u2190)",
                 bars)  # fmt: skip


def _one_rows(rows: list[Row]) -> Panel:
    one = [r for r in rows if r["name"].startswith("one-row segments") and r["unit"] == "µs"]
    lines = {}
    for name in dict.fromkeys(r["name"] for r in one):
        pts = sorted(((_count(r["size"]), r) for r in one if r["name"] == name),
                     key=lambda p: p[0])  # fmt: skip
        lines[name.removeprefix("one-row segments, ")] = pts
    return Panel("A window over N one-row segments, against pread",
                 "one-row segments in the window (N)", lines=lines,
                 references=[(2.0, "target: 2 µs a segment at N \u2265 1,000")])  # fmt: skip


def _packed(rows: list[Row]) -> Panel:
    bars = _ratio_bars(rows, lambda r: r["name"].startswith("packed "),
                       lambda r: _cp(r["name"])[0].removeprefix("packed "))  # fmt: skip
    return Panel("A packed micro batch by CP window against the per-segment direct reader",
                 FASTER, bars, ratio=True)  # fmt: skip


def _trainer(rows: list[Row]) -> Panel:
    bars = []
    for r in rows:
        if r["name"].startswith(TRAINER) and r["unit"] == "x":
            name, cp = _cp(r["name"].removesuffix(" (higher is better)"))
            what = name.removeprefix(TRAINER).strip(" :")
            bars.append(Bar(what, cp or r["size"], float(r["median"]), _key(r),
                            (float(r["min"]), float(r["max"]))))  # fmt: skip
    return Panel("A trainer rank's step (a new list, routing + mask) against the direct "
                 "reader and raw preadv", FASTER, bars, ratio=True)  # fmt: skip


def _against(r: Row) -> str:
    """A row's label with its baseline's, less their shared prefix and the CP."""
    base = _cp(r["baseline"])[0].split(": ", 1)[-1]
    return f"{_cp(r['name'])[0]} vs {base}"


def _cluster(rows: list[Row]) -> Panel:
    bars = _ratio_bars(rows, lambda r: r["name"].startswith(("cross-node", "cluster ")),
                       _against)  # fmt: skip
    return Panel("Reads across three daemons against raw loopback TCP and the direct reader",
                 FASTER, bars, ratio=True)  # fmt: skip


def _http_ceiling(rows: list[Row]) -> Panel:
    bars = _ratio_bars(rows, lambda r: str(r["baseline"]).startswith("HTTP ceiling"),
                       lambda r: f"{r['name'].split(', vs')[0]} vs {r['baseline']}")  # fmt: skip
    return Panel("payloadd's HTTP reads against a bare uvicorn app (the ceiling)", FASTER,
                 bars, ratio=True)  # fmt: skip


def _writes(rows: list[Row]) -> Panel:
    bars = _ratio_bars(rows, lambda r: r["name"].startswith("writes: "),
                       lambda r: _against(r).removeprefix("writes: "))  # fmt: skip
    return Panel("16 MiB writes, call by call, against raw pwrite to a growing file", FASTER,
                 bars, ratio=True)  # fmt: skip


def _fsync(rows: list[Row]) -> Panel:
    bars = []
    for r in rows:
        m = re.search(r",? fsync (\w+)", r["name"])
        if m and r["ratio"]:
            what = f"{r['name'][: m.start()]}{r['name'][m.end() :]}, {r['size']}"
            cost = 1 / float(r["ratio"]) if r["unit"] == "GB/s" else float(r["ratio"])
            bars.append(Bar(what, f"fsync {m[1]}", cost, _key(r)))
    return Panel("What each --fsync policy costs, against fsync never",
                 "time a call \u00f7 fsync never's (lower is better \u2190)", bars,
                 ratio=True)  # fmt: skip


def _writers(rows: list[Row]) -> Panel:
    bars = _median_bars(rows, lambda r: bool(re.match(r"append, \d+ writers", r["name"])),
                        lambda r: _transport(r["name"])[0].removeprefix("append, "),
                        lambda r: f"{_transport(r['name'])[1]}, {r['size']} appends")  # fmt: skip
    return Panel("Concurrent writers, a client each", "GB/s in all, median (min-max) "
                 "(higher is better \u2192)", bars, log=False)  # fmt: skip


def _segment_ops(rows: list[Row]) -> Panel:
    bars = _median_bars(rows, lambda r: r["name"].startswith("segments: "),
                        lambda r: r["name"].removeprefix("segments: "),
                        lambda r: f"{r['size']} segments")  # fmt: skip
    return Panel("The orchestrator's operations on a segment list",
                 "µs a segment, median (min-max) (lower is better \u2190)", bars, log=False,
                 references=[(1.0, "target: 1 µs a segment")])  # fmt: skip


def _rl_handle(rows: list[Row]) -> Panel:
    bars = [Bar(r["name"].removeprefix("RL ").removesuffix(" (by handle)"), "by handle",
                float(r["ratio"]), _key(r))
            for r in rows if str(r["baseline"]).endswith("(inline)") and r["ratio"]]  # fmt: skip
    bars += [Bar("resident payload share", "by handle", float(r["median"]), _key(r),
                 (float(r["min"]), float(r["max"])))
             for r in rows if r["name"] == "RL resident payload share (by handle)"]  # fmt: skip
    return Panel("The RL batch carried by handle against inline", CHEAPER, bars,
                 ratio=True)  # fmt: skip


def _rl_peers(rows: list[Row]) -> Panel:
    bars = []
    for r in rows:
        name, who = _transport(r["name"])
        if r["name"].startswith("RL ") and who.startswith("payloadd") and r["ratio"]:
            peer = _transport(str(r["baseline"]))[1]
            bars.append(Bar(name.removeprefix("RL "), f"vs {peer}", float(r["ratio"]), _key(r)))
    return Panel("The RL job on payloadd against Ray's object store and TransferQueue", PEERS,
                 bars, ratio=True)  # fmt: skip


BUILDERS = (_vs_raw, _throughput, _round_trips, _one_rows, _packed, _trainer, _cluster,
            _http_ceiling, _writes, _fsync, _writers, _segment_ops, _rl_handle, _rl_peers)  # fmt: skip
"""One a question, in the order of the figure."""


def panels(rows: list[Row]) -> list[Panel]:
    """The report's rows grouped by the question they answer, each a `Panel`.

    Panels with no row are left out. Rows with a baseline (or ``x`` rows) that no panel
    draws go to a last panel, turned so that above 1 is better.

    Parameters
    ----------
    rows : list of dict
        `payloadd.bench._bench.report`'s rows.

    Returns
    -------
    list of Panel
        In the order of the figure.
    """
    out = [p for p in (build(rows) for build in BUILDERS) if p.bars or p.lines]
    drawn = set().union(*(p.keys for p in out))
    rest = [Bar(f"{r['name']} vs {r['baseline'] or 'its baseline'}", r["size"], v, _key(r))
            for r in rows if _key(r) not in drawn and (v := _better(r)) is not None]  # fmt: skip
    if rest:
        out.append(Panel("Other rows against their baselines", BETTER, rest, ratio=True))
    return out


def _count(size: str) -> int:
    """``N=10`` -> 10, ``N=10k`` -> 10000."""
    n = size.removeprefix("N=")
    return int(n[:-1]) * 1000 if n.endswith("k") else int(n)


def series_colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinct colours: tab10 up to 10, tab20 up to 20, else a resampled turbo."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    cmap = colormaps["turbo"].resampled(n)
    return [cmap(i) for i in range(n)]


def _label(v: float, ratio: bool) -> str:
    return f"{v:.2f}x" if ratio and v >= 0.1 else f"{v:.3g}" + ("x" if ratio else "")


def _plain_log_ticks(axis: Any, span: float) -> None:
    """Tick labels of a log axis as plain numbers (0.01, 0.1, 1, 10); under 1.5 decades,
    2 and 5 times a power of ten labelled too."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _: Any) -> str:
        lead = round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0
        return f"{v:g}" if span < 30 and lead in (2, 5) else ""

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _draw_bars(ax: Axes, panel: Panel) -> None:
    cats = list(dict.fromkeys(b.category for b in panel.bars))
    series = panel.series
    # a category's bars side by side, only its own series (a panel may mix sizes and CPs)
    present = {c: [s for s in series if any(b.category == c and b.series == s
                                            for b in panel.bars)] for c in cats}  # fmt: skip
    height = 0.8 / max(len(v) for v in present.values())
    for name, color in zip(series, series_colors(len(series)), strict=True):
        bars = [b for b in panel.bars if b.series == name and (b.value > 0 or not panel.log)]
        ys = [cats.index(b.category) + (present[b.category].index(name)
              - (len(present[b.category]) - 1) / 2) * height for b in bars]  # fmt: skip
        err = [[b.value - b.span[0] if b.span else 0 for b in bars],
               [b.span[1] - b.value if b.span else 0 for b in bars]]  # fmt: skip
        drawn = ax.barh(ys, [b.value for b in bars], height, color=color, label=name,
                        xerr=err if any(b.span for b in bars) else None,
                        error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "0.3"})  # fmt: skip
        ax.bar_label(drawn, [_label(b.value, panel.ratio) for b in bars], padding=3,
                     fontsize=7)  # fmt: skip
    ax.set_yticks(range(len(cats)), [textwrap.fill(c, WRAP) for c in cats], fontsize=8)
    ax.set_ylim(len(cats) - 0.5, -0.5)  # the first category on top
    values = [v for b in panel.bars for v in (b.value, *(b.span or ())) if v > 0]
    if panel.log and values:
        ax.set_xscale("log")
        lo, hi = min([*values, 1.0] if panel.ratio else values), max([*values, 1.0])
        ax.set_xlim(lo / 1.5, hi * 3)  # room for the labels at the bars' ends
        _plain_log_ticks(ax.xaxis, hi * 3 / (lo / 1.5))
    elif values:
        ax.set_xlim(0, max(values) * 1.2)
    if panel.ratio:
        ax.axvline(1.0, color="black", linewidth=1.2, label="1.0: as the baseline")
    ax.grid(axis="x", which="major", linewidth=0.4, alpha=0.5)


def _draw_lines(ax: Axes, panel: Panel) -> None:
    colors = series_colors(len(panel.lines))
    for (name, pts), color in zip(panel.lines.items(), colors, strict=True):
        med = [r["median"] for _, r in pts]
        ax.errorbar([n for n, _ in pts], med, marker="o", color=color, label=name, capsize=2,
                    yerr=[[r["median"] - r["min"] for _, r in pts],
                          [r["max"] - r["median"] for _, r in pts]])  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        _plain_log_ticks(axis, hi / lo)
    ax.set_ylabel("µs a segment, median (min-max)\n(lower is better \u2193)", fontsize=9)
    ax.grid(which="major", linewidth=0.4, alpha=0.5)


def _draw(ax: Axes, panel: Panel) -> None:
    if panel.lines:
        _draw_lines(ax, panel)
        for value, label in panel.references:
            ax.axhline(value, color="black", linewidth=1, linestyle=":", label=label)
    else:
        _draw_bars(ax, panel)
        for value, label in panel.references:
            ax.axvline(value, color="black", linewidth=1, linestyle=":", label=label)
    ax.set_title(panel.title, fontsize=11, loc="left")
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0,
              frameon=False)  # fmt: skip


def _height(panel: Panel) -> float:
    """Inches the panel needs: its bars (a line of label each), at least 3.2."""
    if panel.lines:
        return 4.5
    cats = len({b.category for b in panel.bars})
    return max(3.2, 1.3 + 0.2 * len(panel.bars) + 0.15 * cats)


def figure(rows: list[Row], notes: Sequence[str] = ()) -> Figure:
    """The plot of the report's rows: `panels` in two columns, ``notes`` (the run's caveats)
    on top. Needs matplotlib (``ImportError`` without it).

    Parameters
    ----------
    rows : list of dict
        `payloadd.bench._bench.report`'s rows.
    notes : sequence of str
        Lines printed above the panels (``--quick``, a busy machine).

    Returns
    -------
    matplotlib.figure.Figure
        The figure, not yet drawn; each panel's legend outside its axes, to the right.
    """
    from matplotlib.figure import Figure

    todo = panels(rows)
    pairs = [todo[i : i + 2] for i in range(0, len(todo), 2)]
    heights = [max(_height(p) for p in pair) for pair in pairs] or [1.0]
    top = 0.25 * len(notes) + (0.3 if notes else 0)
    fig = Figure(figsize=(22, sum(heights) + top), layout="constrained")
    if notes:
        fig.suptitle("\n".join(notes), color="firebrick", fontsize=11, ha="left", x=0.01)
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
    for i, pair in enumerate(pairs):
        for k, panel in enumerate(pair):
            _draw(fig.add_subplot(grid[i, k]), panel)
    return fig


def plot(rows: list[Row], path: Path, notes: Sequence[str] = ()) -> bool:
    """Draw the report's rows into ``path`` (PNG, `figure`); ``False`` without matplotlib.

    Parameters
    ----------
    rows : list of dict
        `payloadd.bench._bench.report`'s rows.
    path : Path
        The PNG to write.
    notes : sequence of str
        The run's caveats, printed above the panels.

    Returns
    -------
    bool
        Whether the plot was drawn.
    """
    try:
        fig = figure(rows, notes)
    except ImportError:
        return False
    fig.savefig(path, dpi=100)
    return True
