"""Pure segment operations (docs/contract.md, "Pure segment operations"), by example and against a row-by-row model."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from payload_client import (
    InvalidRequestError,
    InvalidSegmentError,
    PayloadSegment,
    clip_segments,
    merge_pd_segments,
    row_nbytes,
    shift_segments,
)

R = "routed_experts"
M = "sampling_mask"


def mk(field: str, pos: int, rows: int, offset: int = 0, shape: list[int] | None = None,
       dtype: str = "uint8", file: str = "n/r/0/a.bin") -> PayloadSegment:  # fmt: skip
    return PayloadSegment(field, file, offset, pos, rows, dtype, shape or [2, 3])


# -- a row-by-row model: a segment list is the sequence of rows it names ----------------


def expand(segs: list[PayloadSegment]) -> list[tuple[str, str, int, int, str, tuple[int, ...]]]:
    """Every row as (field, file, byte offset, position, dtype, shape), in list order."""
    out = []
    for s in segs:
        rb = row_nbytes(s)
        for k in range(s.rows):
            out.append((s.field, s.file, s.offset + k * rb, s.pos + k, s.dtype, tuple(s.shape)))
    return out


def placeholders(segs: list[PayloadSegment]) -> list[PayloadSegment]:
    return [s for s in segs if s.rows == 0]


segments_st = st.lists(
    st.builds(
        PayloadSegment,
        field=st.sampled_from([R, M]),
        file=st.sampled_from(["n/r/0/a.bin", "n/r/1/b.bin"]),
        offset=st.integers(0, 10_000),
        pos=st.integers(0, 60),
        rows=st.integers(0, 12),
        dtype=st.sampled_from(["uint8", "uint16", "int32"]),
        shape=st.lists(st.integers(1, 5), min_size=1, max_size=2),
    ),
    max_size=8,
)


@given(segments_st, st.integers(0, 80), st.integers(0, 80))
def test_clip_keeps_exactly_the_rows_in_the_window(
    segs: list[PayloadSegment], a: int, b: int
) -> None:
    lo, hi = min(a, b), max(a, b)
    got = clip_segments(segs, lo, hi)
    assert expand(got) == [r for r in expand(segs) if lo <= r[3] < hi]
    assert placeholders(got) == [s for s in placeholders(segs) if lo <= s.pos <= hi]
    # segment by segment, in input order
    assert got == [c for s in segs for c in clip_segments([s], lo, hi)]


@given(segments_st, st.integers(-60, 60))
def test_shift_moves_every_row_by_delta(segs: list[PayloadSegment], delta: int) -> None:
    if any(s.pos + delta < 0 for s in segs):
        with pytest.raises(InvalidRequestError, match="pos"):
            shift_segments(segs, delta)
        return
    got = shift_segments(segs, delta)
    assert [(f, fi, o, p + delta, d, sh) for f, fi, o, p, d, sh in expand(segs)] == expand(got)
    assert len(got) == len(segs)


def test_clip_trims_front_and_back() -> None:
    s = mk(R, pos=10, rows=10, offset=100)  # rows of 6 bytes
    (got,) = clip_segments([s], 12, 15)
    assert (got.pos, got.rows, got.offset) == (12, 3, 112)
    assert clip_segments([s], 20, 30) == []
    assert clip_segments([s], 0, 10) == []
    assert clip_segments([s], 0, 100) == [s]


def test_clip_keeps_placeholders_inside_closed_window() -> None:
    p = mk(M, pos=5, rows=0, shape=[1])
    assert clip_segments([p], 5, 5) == [p]
    assert clip_segments([p], 0, 5) == [p]
    assert clip_segments([p], 6, 9) == []


@pytest.mark.parametrize(("lo", "hi"), [(5, 4), (-1, 3), (0.5, 3), (True, 3)])
def test_clip_refuses_bad_windows(lo: object, hi: int) -> None:
    with pytest.raises(InvalidRequestError):
        clip_segments([mk(R, 0, 1)], lo, hi)  # type: ignore[call-overload]


def test_ops_refuse_invalid_segments() -> None:
    bad = mk(R, 0, 1, offset=-1)
    with pytest.raises(InvalidSegmentError, match="segment 1: offset"):
        clip_segments([mk(R, 0, 1), bad], 0, 1)
    with pytest.raises(InvalidSegmentError, match="offset"):
        shift_segments([bad], 1)


def test_shift_overflow_and_negative() -> None:
    with pytest.raises(InvalidRequestError, match="< 0"):
        shift_segments([mk(R, 3, 1)], -4)
    with pytest.raises(InvalidRequestError, match="overflow"):
        shift_segments([mk(R, 3, 1)], 2**63 - 4)


# -- merge_pd_segments (the router's P/D rule) ------------------------------------------


def test_merge_prepends_prefill_drops_and_trims_decode() -> None:
    pre = [mk(R, 0, 100, file="p.bin", shape=[48, 8]), mk(M, 0, 1, file="pm.bin", shape=[4])]
    dec = [
        mk(R, 50, 40, file="d.bin", shape=[48, 8]),  # ends at 90 <= cut: dropped
        mk(M, 99, 2, file="dm.bin", shape=[3]),  # other field: kept as is
        mk(R, 99, 10, offset=0, file="d.bin", shape=[48, 8], dtype="uint16"),  # trimmed by 1
    ]
    got = merge_pd_segments(pre, dec)
    assert got[0] == pre[0]
    assert got[1] == dec[1]
    assert (got[2].pos, got[2].rows, got[2].offset) == (100, 9, 768)
    assert len(got) == 3


def test_merge_no_op_and_errors() -> None:
    dec = [mk(M, 0, 2)]
    assert merge_pd_segments([], dec) == dec
    with pytest.raises(InvalidRequestError, match="prefill has none"):
        merge_pd_segments([mk(M, 0, 1)], [mk(R, 0, 1)])
    with pytest.raises(InvalidSegmentError, match="prefill"):
        merge_pd_segments([mk(R, 2**63 - 2, 5)], [mk(R, 0, 1)])


def test_segments_round_trip_through_msgpack_after_ops() -> None:
    segs = shift_segments(clip_segments([mk(R, 0, 10)], 2, 7), 100)
    wire = msgspec.msgpack.encode(segs)
    assert msgspec.msgpack.decode(wire, type=list[PayloadSegment]) == segs
