"""Window read semantics (docs/contract.md, "Reading a window") of plan_window + assemble, against the dense model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from payload_client import (
    InvalidRequestError,
    InvalidSegmentError,
    PayloadSegment,
    assemble,
    plan_window,
)
from payload_client.reads._layout import direct_view
from payload_client.reads._windows import PAGE, page_matched
from payload_client.transports.dataplane._descriptors import KEPT_SCRATCH, Scratch
from tests.reference import dense_read

# field -> (dtypes it may be written in, rank of its rows)
FIELDS = {
    "routed": (["uint8", "uint16"], 2),
    "mask": (["int32"], 1),
    "w": (["float16", "float32"], 1),
}


def local_read(files: dict[str, bytes], segs: list[PayloadSegment], field: str, lo: int, hi: int,
               fill: int | float, dtype: object = None,
               out: np.ndarray | None = None) -> np.ndarray | None:  # fmt: skip
    plan = plan_window(segs, field, lo, hi, fill, dtype)
    if plan is None:
        return None
    data = b"".join(files[p.file][p.offset : p.offset + p.nbytes] for p in plan.pieces)
    return assemble(plan, data, out)


@st.composite
def stored(draw: st.DrawFn) -> tuple[dict[str, bytes], list[PayloadSegment]]:
    """Random rows written to a few in-memory files, and the segments naming them."""
    files: dict[str, bytearray] = {"a.bin": bytearray(), "b.bin": bytearray()}
    segs = []
    for _ in range(draw(st.integers(0, 7))):
        field = draw(st.sampled_from(sorted(FIELDS)))
        dtypes, rank = FIELDS[field]
        dtype = draw(st.sampled_from(dtypes))
        shape = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
        rows = draw(st.integers(0, 6))
        pos = draw(st.integers(0, 30))
        name = draw(st.sampled_from(sorted(files)))
        n = rows * int(np.prod(shape)) * np.dtype(dtype).itemsize
        files[name] += draw(st.binary(min_size=3, max_size=3))  # rows never start at 0
        segs.append(PayloadSegment(field, name, len(files[name]), pos, rows, dtype, shape))
        values = draw(st.binary(min_size=n, max_size=n))
        if np.dtype(dtype).kind == "f":  # keep floats finite so equality is meaningful
            floats = np.frombuffer(values, np.dtype(dtype).newbyteorder("<")).copy()
            floats[~np.isfinite(floats)] = 1.5
            values = floats.tobytes()
        files[name] += values
    return {k: bytes(v) for k, v in files.items()}, segs


@given(stored(), st.sampled_from(sorted(FIELDS)), st.integers(0, 40), st.integers(0, 12),
       st.integers(-3, 3))  # fmt: skip
def test_read_matches_dense_model(
    data: tuple[dict[str, bytes], list[PayloadSegment]], field: str, lo: int, n: int, fill: int
) -> None:
    files, segs = data
    got = local_read(files, segs, field, lo, lo + n, fill)
    want = dense_read(files, segs, field, lo, lo + n, fill)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    # fresh (docs/contract.md, "Reading a window"): shares memory with nothing, not even another read of the same window
    assert got.flags.c_contiguous and got.flags.writeable and got.flags.aligned
    again = local_read(files, segs, field, lo, lo + n, fill)
    assert again is not None and not np.shares_memory(got, again)


def seg(field: str, pos: int, rows: int, shape: list[int], offset: int = 0,
        dtype: str = "int32") -> PayloadSegment:  # fmt: skip
    return PayloadSegment(field, "a.bin", offset, pos, rows, dtype, shape)


def test_later_segments_win_row_by_row_and_narrow_rows_fill_leading_entries() -> None:
    wide = np.arange(12, dtype="<i4").tobytes()  # 4 rows of width 3 at pos 0..3
    narrow = np.array([[90], [91]], dtype="<i4").tobytes()  # 2 rows of width 1 at pos 1..2
    files = {"a.bin": wide + narrow}
    segs = [seg("m", 0, 4, [3]), seg("m", 1, 2, [1], offset=48)]
    got = local_read(files, segs, "m", 0, 5, -1)
    assert got is not None
    np.testing.assert_array_equal(
        got, [[0, 1, 2], [90, -1, -1], [91, -1, -1], [9, 10, 11], [-1, -1, -1]]
    )


def test_row_shape_from_intersecting_segments_else_all() -> None:
    files = {"a.bin": bytes(64)}
    segs = [seg("m", 0, 2, [2]), seg("m", 10, 1, [5], offset=8)]
    got = local_read(files, segs, "m", 0, 2, 7)
    assert got is not None and got.shape == (2, 2)  # the width-5 row does not intersect
    empty = local_read(files, segs, "m", 4, 4, 7)
    assert empty is not None and empty.shape == (0, 5)  # nothing intersects: all segments
    outside = local_read(files, segs, "m", 3, 6, 7)
    assert outside is not None and outside.shape == (3, 5) and (outside == 7).all()


def test_placeholder_carries_width() -> None:
    got = local_read({"a.bin": b""}, [seg("m", 3, 0, [4])], "m", 0, 2, -1)
    assert got is not None and got.shape == (2, 4) and (got == -1).all()


def test_checks_come_in_contract_order() -> None:
    bad = seg("other", 0, 1, [1], offset=-1)
    with pytest.raises(InvalidRequestError):  # window first
        plan_window([bad], "m", 3, 2, 0)
    with pytest.raises(InvalidSegmentError):  # then any invalid segment, of any field
        plan_window([bad], "m", 0, 2, 0)
    assert plan_window([seg("other", 0, 1, [1])], "m", 0, 2, 0) is None  # then the filter


@pytest.mark.parametrize(
    "fill", [2**31, 1.5, "0", None, True, pytest.param(10**400, id="10**400"), np.nan]
)
def test_bad_fill_for_an_integer_field(fill: object) -> None:
    with pytest.raises(InvalidRequestError, match="fill"):
        plan_window([seg("m", 0, 1, [1])], "m", 0, 1, fill)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fill", "stored", "dtype"),
    [
        (1e39, "float32", None),
        (-1e300, "float16", None),
        (70000.0, "float16", np.float16),
        pytest.param(-(10**400), "float32", None, id="-10**400"),
    ],
)
def test_a_float_fill_out_of_the_outputs_range_is_refused(
    fill: float, stored: str, dtype: object
) -> None:
    w = seg("w", 0, 1, [1], dtype=stored)
    with pytest.raises(InvalidRequestError, match="does not fit the output dtype"):
        plan_window([w], "w", 0, 2, fill, dtype)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf, 3.4e38, -0.0])
def test_float_fills_the_output_holds_are_taken(fill: float) -> None:
    plan = plan_window([seg("w", 0, 0, [2], dtype="float32")], "w", 0, 2, fill)
    assert plan is not None
    got = assemble(plan, b"")
    np.testing.assert_array_equal(got, np.full((2, 2), fill, np.float32))


def test_mixed_ranks_or_kinds_are_refused() -> None:
    with pytest.raises(InvalidSegmentError, match="ranks"):
        plan_window([seg("m", 0, 1, [1]), seg("m", 1, 1, [1, 1])], "m", 0, 2, 0)
    with pytest.raises(InvalidSegmentError, match="mix"):
        plan_window([seg("m", 0, 1, [1]), seg("m", 1, 1, [1], dtype="float32")], "m", 0, 2, 0)


def test_only_window_rows_are_planned() -> None:
    s = PayloadSegment("r", "a.bin", 1000, 100, 1000, "uint8", [48, 8])
    plan = plan_window([s], "r", 150, 160, 0)
    assert plan is not None
    (p,) = plan.pieces
    assert (p.offset, p.nbytes, p.end, p.dst) == (1000 + 50 * 384, 10 * 384, 1000 + 1000 * 384, 0)


@given(stored(), st.sampled_from(["routed", "mask"]), st.integers(0, 40), st.integers(0, 12),
       st.integers(-3, 3), st.integers(0, 3))  # fmt: skip
def test_other_dtypes_and_wider_out_arrays_keep_the_semantics(
    data: tuple[dict[str, bytes], list[PayloadSegment]], field: str, lo: int, n: int, fill: int,
    extra: int,
) -> None:  # fmt: skip
    files, segs = data
    want = dense_read(files, segs, field, lo, lo + n, fill)
    if want is None:
        return
    wide = local_read(files, segs, field, lo, lo + n, fill, dtype=np.int64)
    assert wide is not None and wide.dtype == np.int64
    np.testing.assert_array_equal(wide, want)
    out = np.full((n, *(d + extra for d in want.shape[1:])), 99, np.int32)
    got = local_read(files, segs, field, lo, lo + n, fill, out=out)
    assert got is out
    np.testing.assert_array_equal(out[(slice(None), *(slice(0, d) for d in want.shape[1:]))], want)
    assert (out.sum() - want.sum()) == fill * (out.size - want.size)  # the rest is fill


def test_stored_dtype_reads_need_a_wide_enough_dtype() -> None:
    files = {"a.bin": np.array([[200], [7]], "<u1").tobytes() + np.array([[300]], "<u2").tobytes()}
    u8 = [seg("r", 0, 2, [1], dtype="uint8")]
    got = local_read(files, u8, "r", 0, 3, 0, dtype=np.uint8)
    assert got is not None and got.dtype == np.uint8
    np.testing.assert_array_equal(got[:, 0], [200, 7, 0])
    both = [*u8, seg("r", 2, 1, [1], offset=2, dtype="uint16")]
    with pytest.raises(InvalidRequestError, match="cannot hold the uint16"):
        plan_window(both, "r", 0, 3, 0, np.uint8)
    with pytest.raises(InvalidRequestError, match="cannot hold"):
        plan_window(u8, "r", 0, 3, 0, np.int8)
    with pytest.raises(InvalidRequestError, match="fill -1 does not fit"):
        plan_window(u8, "r", 0, 3, -1, np.uint8)
    with pytest.raises(InvalidRequestError, match="integer or float"):
        plan_window(u8, "r", 0, 3, 0, np.bool_)


def test_out_arrays_that_do_not_fit_are_refused() -> None:
    files = {"a.bin": bytes(8)}
    segs = [seg("m", 0, 2, [4], dtype="uint8")]
    plan = plan_window(segs, "m", 0, 2, -1)
    assert plan is not None
    for bad, match in [
        (np.zeros((2, 4), np.int64), "dtype"),
        (np.zeros((3, 4), np.int32), "shape"),
        (np.zeros((2, 3), np.int32), "shape"),
        (np.zeros((2, 4, 1), np.int32), "shape"),
        ([[0] * 4] * 2, "numpy"),
    ]:
        with pytest.raises(InvalidRequestError, match=match):
            assemble(plan, files["a.bin"], bad)  # type: ignore[arg-type]
    frozen = np.zeros((2, 4), np.int32)
    frozen.flags.writeable = False
    with pytest.raises(InvalidRequestError, match="read-only"):
        assemble(plan, files["a.bin"], frozen)


def test_page_matched_buffers_start_at_the_sources_page_offset() -> None:
    buf = np.empty(10_000 + PAGE, np.uint8)
    for offset in (0, 1, 16, 384, 4095, 4096 * 7 + 100):
        view = page_matched(buf, offset, 10_000)
        assert view.nbytes == 10_000 and np.shares_memory(view, buf)
        assert view.ctypes.data % PAGE == offset % PAGE


def test_new_outputs_start_where_their_first_piece_starts_in_its_page() -> None:
    # a stored-dtype read of rows at file offset 384 * 5 lands on the same page offset
    s = seg("routed", 10, 400, [48, 8], offset=384 * 5, dtype="uint8")
    plan = plan_window([s], "routed", 12, 250, 0, dtype=np.uint8)
    assert plan is not None
    out = plan.new_output()
    first = plan.pieces[0]
    assert out.shape == (238, 48, 8) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert (out.ctypes.data + first.dst * 384) % PAGE == first.offset % PAGE
    # below 64 KiB a plain array: no page to spare for a copy that fast
    small = plan_window([s], "routed", 12, 50, 0, dtype=np.uint8)
    assert small is not None and small.new_output().flags.owndata
    # an int32 read of rows at an offset that is no multiple of 4 stays aligned for numpy
    odd = seg("mask", 0, 4, [3], offset=1, dtype="uint8")
    plan = plan_window([odd], "mask", 0, 4, -1)
    assert plan is not None and plan.new_output().ctypes.data % 4 == 0


def test_direct_reads_avoid_destinations_just_past_the_source_in_its_page() -> None:
    s = seg("routed", 0, 10, [48, 8], offset=0, dtype="uint8")
    plan = plan_window([s], "routed", 0, 10, 0, dtype=np.uint8)
    assert plan is not None
    buf = np.empty(3840 + 2 * PAGE, np.uint8)
    base = page_matched(buf, 0, 3840 + PAGE)
    for shift, direct in ((0, True), (1, False), (16, False), (63, False), (64, True)):
        out = base[shift : shift + 3840].reshape(10, 48, 8)
        assert (direct_view(plan, out, plan.pieces[0]) is not None) is direct, shift


def test_an_unhashable_dtype_that_is_too_narrow_is_a_clear_error() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]
        dtype = np.dtype("uint8")

    s = seg("mask", 0, 2, [3])  # int32 rows
    with pytest.raises(InvalidRequestError, match="cannot hold the int32 rows of field 'mask'"):
        plan_window([s], "mask", 0, 2, -1, dtype=Unhashable())


def test_only_moderate_scratch_buffers_are_kept_for_the_next_read() -> None:
    scratch = Scratch()
    small, big = scratch.take(1 << 20), scratch.take(KEPT_SCRATCH + 1)
    scratch.give(small)
    scratch.give(big)
    assert scratch.free == [small]
    assert scratch.take(1000) is small  # reused, not allocated again
