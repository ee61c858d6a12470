"""Window read semantics (DESIGN §4) of plan_window + assemble, against the dense model."""

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
    assert got.flags.c_contiguous and got.flags.writeable and got.flags.owndata


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


@pytest.mark.parametrize("fill", [2**31, 1.5, "0", None, True])
def test_bad_fill_for_an_integer_field(fill: object) -> None:
    with pytest.raises(InvalidRequestError, match="fill"):
        plan_window([seg("m", 0, 1, [1])], "m", 0, 1, fill)  # type: ignore[arg-type]


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
