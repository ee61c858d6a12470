"""The bench's plot a person can read: a panel per question, each legend outside its axes,
distinct colours within a panel, ratio axes that say which way is better with the baseline
(1.0) drawn; and the caveats the bench prints with its table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payloadd.bench import _trainer_step
from payloadd.bench._bench import Result, report
from payloadd.bench._plot import TRAINER, figure, panels, plot, series_colors
from payloadd.cli._bench import QUICK_CAVEAT, caveats

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.container import BarContainer, ErrorbarContainer


def _results() -> list[Result]:
    """A small report's results, named as the bench's modules name them."""
    out = []

    def add(name: str, size: str, unit: str, median: float, base: str | None = None) -> None:
        out.append(Result(name, size, unit, [median * 0.9, median, median * 1.1], base))

    for i, size in enumerate(("64KiB", "1MiB", "16MiB")):
        add("raw pwrite", size, "GB/s", 2.0)
        add("raw preadv", size, "GB/s", 6.0)
        add("ideal int32 reader", size, "GB/s", 4.0)
        for t in ("data plane", "http"):
            add(f"append ({t})", size, "GB/s", 1.0 + i, "raw pwrite")
            add(f"read int32 out= ({t})", size, "GB/s", 1.5 + i, "ideal int32 reader")
            add(f"read uint8 out= ({t})", size, "GB/s", 2.5 + i, "raw preadv")
    for t in ("data plane", "http"):
        add(f"one-row append p50, sync ({t})", "384B", "ms", 0.02)
        add(f"one-row read p99, sync ({t})", "384B", "ms", 0.06)
    add("append, fsync never (data plane)", "1MiB", "GB/s", 3.0)
    add(
        "append, fsync always (data plane)", "1MiB", "GB/s", 1.0, "append, fsync never (data plane)"
    )
    for w in (1, 4, 8):
        add(f"append, {w} writers (data plane)", "1MiB", "GB/s", 2.0 + w / 4)
    for cp in (1, 4):
        base = f"packed direct reader uint8, CP {cp}"
        add(base, "8x2k", "GB/s", 4.0)
        add(f"packed read uint8 out=, CP {cp} (data plane)", "8x2k", "GB/s", 3.0, base)
        for f in (_trainer_step.RAW, _trainer_step.DIRECT, _trainer_step.PAYLOADD):
            add(f.format(cp=cp), "8x2k", "ms", 2.0)
        add(_trainer_step.VS_DIRECT.format(cp=cp), "8x2k", "x", 0.7)
        add(_trainer_step.VS_RAW.format(cp=cp), "8x2k", "x", 0.4)
    for n in ("N=10", "N=1k"):
        add("one-row segments, a pread each", n, "µs", 0.8)
        add("one-row segments, read out= (data plane)", n, "µs", 3.0,
            "one-row segments, a pread each")  # fmt: skip
    add("segments: msgpack encode", "100k", "µs", 0.08)
    add("segments: clip_segments", "100k", "µs", 0.7, "segments: msgpack encode")
    add("RL bytes sent (inline)", "4x4k", "MiB", 800.0)
    add("RL bytes sent (by handle)", "4x4k", "MiB", 12.0, "RL bytes sent (inline)")
    add("RL resident payload share (by handle)", "4x4k", "x", 0.004)
    add("RL job (ray object store)", "4x4k", "s", 0.9)
    add("RL job (payloadd)", "4x4k", "s", 0.8, "RL job (ray object store)")
    add("a row no panel knows", "1MiB", "s", 2.0, "its own baseline")
    add("its own baseline", "1MiB", "s", 1.0)
    return out


ROWS = report(_results())


def _series_colors(ax: Any) -> list[tuple[float, float, float, float]]:
    """The colour of each series the axes draw: a bar container's, a line's (not the error
    bars of bars, which have no line of their own)."""
    out = []
    for c in ax.containers:
        if isinstance(c, BarContainer) and c.patches:
            out.append(to_rgba(c.patches[0].get_facecolor()))
        elif isinstance(c, ErrorbarContainer) and c.lines[0] is not None:
            out.append(to_rgba(c.lines[0].get_color()))
    return out


def test_the_plot_is_written_from_a_report(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    assert plot(ROWS, png, ["caveat: a note"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_panel_per_question_and_every_compared_row_drawn() -> None:
    """Each question its panel, none empty; every row with a baseline (and every ``x`` row)
    in one, a row no panel knows in the last; the trainer step's ratios in their own."""
    assert TRAINER == _trainer_step.TRAINER
    got = panels(ROWS)
    titles = [p.title for p in got]
    assert len(titles) == len(set(titles)) and all(p.bars or p.lines for p in got)
    drawn = {k for p in got for k in p.keys}
    compared = {(r["name"], r["size"]) for r in ROWS if r["ratio"] or r["unit"] == "x"}
    assert compared <= drawn
    assert got[-1].title.startswith("Other") and {b.key for b in got[-1].bars} == {
        ("a row no panel knows", "1MiB")
    }
    assert got[-1].bars[0].value == pytest.approx(0.5)  # 2 s against 1 s: half as good
    trainer = next(p for p in got if p.title.startswith("A trainer rank's step"))
    assert {b.key[0] for b in trainer.bars} == {
        f.format(cp=cp) for f in (_trainer_step.VS_DIRECT, _trainer_step.VS_RAW) for cp in (1, 4)
    }
    assert trainer.series == ["CP 1", "CP 4"]


def test_legends_lie_outside_every_axes_and_colours_are_distinct() -> None:
    fig = figure(ROWS, ["caveat: a note"])
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in fig.axes]
    assert len(fig.axes) == len(panels(ROWS))
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(b) for b in boxes), ax.get_title()  # no panel's axes
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
        colors = _series_colors(ax)
        assert colors and len(colors) == len(set(colors)), ax.get_title()


def test_ratio_axes_say_which_way_is_better_and_draw_the_baseline() -> None:
    fig = figure(ROWS)
    for panel, ax in zip(panels(ROWS), fig.axes, strict=True):
        label = ax.get_xlabel() if panel.bars else ax.get_ylabel()
        assert "higher is better" in label or "lower is better" in label, panel.title
        if panel.ratio:
            assert any(
                np.asarray(ln.get_xdata(), float).tolist() == [1.0, 1.0] for ln in ax.get_lines()
            ), panel.title


@pytest.mark.parametrize("n", [1, 4, 10, 11, 20, 21, 40])
def test_series_colours_are_distinct(n: int) -> None:
    colors = series_colors(n)
    assert len(colors) == n and len(set(colors)) == n


def test_caveats_of_a_quick_run_and_of_a_busy_machine() -> None:
    assert caveats(False, 5, (0.5, 1.9), 2) == []
    assert caveats(True, 5, (0.5, 0.5), 2) == [QUICK_CAVEAT]
    assert "indicative" in QUICK_CAVEAT and "64KiB and 1MiB only" in QUICK_CAVEAT
    (few,) = caveats(False, 1, (None, None), 2)
    assert few.startswith("caveat: --repeat 1")
    (start,) = caveats(False, 5, (3.5, 1.0), 2)
    assert start.startswith("warning: the machine was busy") and "3.50 at the start" in start
    assert "end" not in start.split("above")[0] and "2 cores" in start
    (both,) = caveats(False, 5, (16.25, 9.0), 8)
    assert "16.25 at the start and 9.00 at the end" in both and "8 cores" in both
    assert caveats(False, 5, (2.0, 2.0), 2) == []  # at the cores: not above
    assert caveats(False, 5, (9.0, 9.0), None) == []  # no core count: no verdict
    quick_busy = caveats(True, 2, (1.0, 4.0), 2)
    assert quick_busy[0] == QUICK_CAVEAT and quick_busy[1].startswith("caveat: --repeat 2")
    assert "4.00 at the end" in quick_busy[2]
