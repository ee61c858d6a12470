"""The columnar planner and the coalesced read layout against the dense model (docs/contract.md, "Reading a window").

Many segments, mixed widths and dtypes, overlaps (later wins), layouts that coalesce (turns
appended back to back in one file) and layouts that do not; every ``out=`` / ``dtype=`` /
``coverage`` combination; both planners (plain Python for short lists, numpy columns for long
ones) and both layouts (piece by piece, array operations), the kernel's aliasing rule and
gaps on and off. The "I/O" copies each extent's bytes from in-memory files into its buffers,
exactly what ``preadv`` or the HTTP answer does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payload_client import PayloadSegment, plan_window
from payload_client.reads import _layout, _windows
from payload_client.reads._layout import GAP, ReadLayout
from payload_client.reads._windows import prepare_output
from tests.reference import dense_coverage, dense_read

FIELDS = {
    "routed": (["uint8", "uint16"], 2),
    "mask": (["int32", "int16"], 1),
    "w": (["float32"], 1),
}
Files = dict[str, bytes]


@st.composite
def turns(draw: st.DrawFn) -> tuple[Files, list[PayloadSegment]]:
    """Samples written turn by turn: runs of segments back to back in one file (coalescable),
    some with gaps or shuffled, at mixed widths; optionally overlapping positions."""
    files: dict[str, bytearray] = {name: bytearray(draw(st.binary(max_size=5))) for name in "abc"}
    segs: list[PayloadSegment] = []
    for _ in range(draw(st.integers(0, 6))):  # samples
        field = draw(st.sampled_from(sorted(FIELDS)))
        dtypes, rank = FIELDS[field]
        dtype = draw(st.sampled_from(dtypes))
        name = draw(st.sampled_from("abc"))
        pos = draw(st.integers(0, 40))
        fixed = draw(st.booleans())  # one shape for the sample (router ids) or one a turn
        shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
        sample = []
        for _ in range(draw(st.integers(1, 12))):  # turns
            if not fixed:
                shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
            rows = draw(st.integers(0, 5))
            if draw(st.integers(0, 5)) == 0:  # now and then a gap in the file
                files[name] += draw(st.binary(min_size=1, max_size=GAP + 8))
            n = rows * int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = draw(st.binary(min_size=n, max_size=n))
            if np.dtype(dtype).kind == "f":
                floats = np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).copy()
                floats[~np.isfinite(floats)] = 2.5
                raw = floats.tobytes()
            sample.append(
                PayloadSegment(field, name, len(files[name]), pos, rows, dtype, list(shape))
            )
            files[name] += raw
            pos += rows - (draw(st.integers(0, 2)) if draw(st.integers(0, 6)) == 0 else 0)
            pos = max(pos, 0)
        if draw(st.booleans()):
            sample = draw(st.permutations(sample))
        segs += sample
    return {k: bytes(v) for k, v in files.items()}, segs


@contextlib.contextmanager
def paths(small: int, few: int) -> Iterator[None]:
    """Which planner and which layout run: lists of at most ``small`` segments are planned
    in Python, calls of at most ``few`` pieces laid out piece by piece."""
    old = _windows._SMALL, _layout._FEW
    _windows._SMALL, _layout._FEW = small, few
    try:
        yield
    finally:
        _windows._SMALL, _layout._FEW = old


def read(files: Files, windows: list[tuple[Any, ...]], kernel: bool, gap: int) -> list[Any]:
    """Plan the windows, lay out one call, copy each extent's bytes in, finish."""
    plans, outs = [], []
    for segs, field, lo, hi, fill, out, dtype in windows:
        plan = plan_window(segs, field, lo, hi, fill, dtype)
        plans.append(plan)
        outs.append(None if plan is None else prepare_output(plan, out))
    layout = ReadLayout(plans, outs, kernel=kernel, gap=gap)
    for (file, offset, nbytes), bufs in zip(layout.extents, layout.buffers, strict=True):
        data = memoryview(files[file][offset : offset + nbytes])
        assert data.nbytes == nbytes == sum(b.nbytes for b in bufs)
        at = 0
        for b in bufs:
            b[:] = data[at : at + b.nbytes]
            at += b.nbytes
    layout.finish()
    for plan in plans:
        for f, end in (plan.ends if plan is not None else {}).items():
            assert layout.ends[f] >= end and len(files[f]) >= end
    return outs


PATHS = [(0, 0), (0, 10**6), (10**6, 0), (10**6, 10**6)]


@pytest.mark.parametrize(("small", "few"), PATHS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=turns(), field=st.sampled_from(sorted(FIELDS)), lo=st.integers(0, 60),
       n=st.integers(0, 50), fill=st.integers(-3, 3), how=st.sampled_from(["new", "out", "wide",
       "stored"]), kernel=st.booleans(), gap=st.sampled_from([0, GAP]))  # fmt: skip
def test_plan_and_layout_match_the_dense_model(
    small: int, few: int, data: tuple[Files, list[PayloadSegment]], field: str, lo: int,
    n: int, fill: int, how: str, kernel: bool, gap: int,
) -> None:  # fmt: skip
    files, segs = data
    hi = lo + n
    want = dense_read(files, segs, field, lo, hi, fill)
    with paths(small, few):
        plan = plan_window(segs, field, lo, hi, fill)
        if want is None:
            assert plan is None
            return
        assert plan is not None
        np.testing.assert_array_equal(plan.covered(), dense_coverage(segs, field, lo, hi))
        # the files to check: exactly those of segments that intersect the window (rows
        # wholly overwritten by later segments included), each to its longest segment
        ends: dict[str, int] = {}
        for s in segs:
            if s.field == field and max(s.pos, lo) < min(s.pos + s.rows, hi):
                end = s.offset + s.rows * np.dtype(s.dtype).itemsize * int(np.prod(s.shape))
                ends[s.file] = max(ends.get(s.file, 0), end)
        assert dict(plan.ends) == ends
        stored = {s.dtype for s in segs if s.field == field}
        out, dtype = None, None
        if how == "out":
            out = np.full(want.shape, 99, want.dtype)
        elif how == "wide":
            out = np.full((n, *(d + 2 for d in want.shape[1:])), 99, want.dtype)
        elif how == "stored" and len(stored) == 1:
            dtype = stored.pop()
            if fill < 0 and np.dtype(dtype).kind == "u":
                fill = 0
                want = dense_read(files, segs, field, lo, hi, fill)
                assert want is not None
        (got,) = read(files, [(segs, field, lo, hi, fill, out, dtype)], kernel, gap)
    if dtype is not None:
        assert got.dtype == np.dtype(dtype)
    if how == "wide":
        lead = tuple(slice(0, d) for d in want.shape)
        np.testing.assert_array_equal(got[lead], want.astype(got.dtype))
        rest = np.ones(got.shape, bool)
        rest[lead] = False
        assert (got[rest] == fill).all()
    else:
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want.astype(got.dtype))
    if out is not None:
        assert got is out


@pytest.mark.parametrize(("small", "few"), PATHS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=turns(), cuts=st.lists(st.integers(0, 80), min_size=2, max_size=8), kernel=st.booleans()
)
def test_one_call_of_many_windows_matches_each_alone(
    small: int, few: int, data: tuple[Files, list[PayloadSegment]], cuts: list[int], kernel: bool
) -> None:
    """Windows of one call share extents (CP ranks of one micro batch, overlapping ones too):
    each still reads as if alone."""
    files, segs = data
    cuts = sorted(cuts)
    windows = [
        (segs, f, a, b + 1, -1, None, None) for f in FIELDS for a, b in itertools.pairwise(cuts)
    ]
    with paths(small, few):
        got = read(files, windows, kernel, GAP)
    for (_, f, a, b, fill, _, _), arr in zip(windows, got, strict=True):
        want = dense_read(files, segs, f, a, b, fill)
        if want is None:
            assert arr is None
        else:
            np.testing.assert_array_equal(arr, want)


def test_turns_back_to_back_are_one_extent_and_one_buffer() -> None:
    """A packed micro batch: each sample's turns lie back to back in its file and in the
    output, so a stored-dtype read is one extent, one buffer, per sample."""
    segs, files = [], {}
    for s in range(4):
        name, at, pos = f"s{s}.bin", 0, s * 100
        for rows in (10, 30, 5, 55):
            segs.append(PayloadSegment("routed", name, at, pos, rows, "uint8", [48, 8]))
            at, pos = at + rows * 384, pos + rows
        files[name] = bytes(np.random.default_rng(s).integers(0, 255, at, dtype=np.uint8))
    plan = plan_window(segs, "routed", 0, 400, 0, np.uint8)
    assert plan is not None and plan.count == 4
    out = np.empty((400, 48, 8), np.uint8)
    layout = ReadLayout([plan], [out], kernel=False)
    assert [len(b) for b in layout.buffers] == [1, 1, 1, 1]
    assert layout.stage is None  # straight into the output
    # int32: the same four extents, staged, widened by four numpy copies
    wide = plan_window(segs, "routed", 0, 400, 0)
    assert wide is not None
    layout = ReadLayout([wide], [np.empty((400, 48, 8), np.int32)], kernel=True)
    assert len(layout.extents) == 4 and layout.stage is not None


def test_one_row_segments_of_ragged_widths_are_one_extent() -> None:
    widths = np.random.default_rng(0).integers(1, 64, 1000)
    segs, at = [], 0
    for i, w in enumerate(widths.tolist()):
        segs.append(PayloadSegment("mask", "m.bin", at, i, 1, "int32", [w]))
        at += 4 * w
    plan = plan_window(segs, "mask", 0, 1000, -1)
    assert plan is not None
    layout = ReadLayout([plan], [prepare_output(plan)], kernel=True)
    assert layout.extents == [("m.bin", 0, at)] and len(layout.buffers[0]) == 1


@pytest.mark.parametrize(("small", "few"), PATHS)
def test_only_intersecting_segments_name_files_to_check(small: int, few: int) -> None:
    far = PayloadSegment("m", "gone.bin", 0, 100, 2, "int32", [3])
    near = PayloadSegment("m", "here.bin", 8, 0, 2, "int32", [3])
    hidden = PayloadSegment("m", "hidden.bin", 0, 1, 1, "int32", [3])  # overwritten below
    with paths(small, few):
        alone = plan_window([far], "m", 0, 10, 0)
        both = plan_window([far, hidden, near], "m", 0, 10, 0)
    assert alone is not None and dict(alone.ends) == {} and alone.count == 0
    assert both is not None and dict(both.ends) == {"here.bin": 32, "hidden.bin": 12}
    assert [p.file for p in both.pieces] == ["here.bin"]


@pytest.mark.parametrize(("small", "few"), PATHS)
def test_a_large_window_no_segment_reaches_is_all_fill(small: int, few: int) -> None:
    """Many segments, none in the window, an output large enough to be page-matched."""
    segs = [PayloadSegment("routed", "a.bin", i * 384, 10_000 + i, 1, "uint8", [48, 8])
            for i in range(20)]  # fmt: skip
    with paths(small, few):
        (got,) = read({"a.bin": bytes(20 * 384)}, [(segs, "routed", 0, 1000, 7, None, None)],
                      True, GAP)  # fmt: skip
    assert got.shape == (1000, 48, 8) and (got == 7).all()
