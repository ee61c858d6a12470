"""The column-by-column paths agree with the segment-by-segment ones (docs/contract.md, "The segment model" and "Pure segment operations").

Long lists are validated and operated on column by column; the references here are the
segment-by-segment definitions (`validate_segment` over the list, and the operations as
loops over it). On random lists of many segments, valid or with a few bad values planted,
both must give the same result, or the same exception: class, index, field and message.
"""

from __future__ import annotations

import gc
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import astuple

from payload_client import (
    SUPPORTED_DTYPES,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadSegment,
    clip_segments,
    merge_pd_segments,
    shift_segments,
    validate_segment,
    validate_segments,
)
from payload_client.segments._ops import _MERGE_BULK_MIN
from payload_client.segments._segment import _BULK_MIN, INT64_MAX, segment_columns

R, M = "routed_experts", "sampling_mask"
ITEMSIZE = {d: np.dtype(d).itemsize for d in SUPPORTED_DTYPES}


# -- the segment-by-segment references ---------------------------------------------------


def nbytes(s: PayloadSegment) -> int:
    return ITEMSIZE[s.dtype] * math.prod(s.shape)


def ref_validate(segs: Sequence[PayloadSegment]) -> list[PayloadSegment]:
    return [validate_segment(s, i) for i, s in enumerate(segs)]


def ref_trim_front(s: PayloadSegment, k: int) -> PayloadSegment:
    if k == 0:
        return s
    return PayloadSegment(
        s.field, s.file, s.offset + k * nbytes(s), s.pos + k, s.rows - k, s.dtype, list(s.shape)
    )


def ref_clip(segs: Sequence[PayloadSegment], lo: int, hi: int) -> list[PayloadSegment]:
    out = []
    for s in ref_validate(segs):
        if s.rows == 0:
            if lo <= s.pos <= hi:
                out.append(s)
            continue
        start, stop = max(s.pos, lo), min(s.pos + s.rows, hi)
        if start >= stop:
            continue
        s = ref_trim_front(s, start - s.pos)
        if stop - start != s.rows:
            s = PayloadSegment(s.field, s.file, s.offset, s.pos, stop - start, s.dtype, [*s.shape])
        out.append(s)
    return out


def ref_shift(segs: Sequence[PayloadSegment], delta: int) -> list[PayloadSegment]:
    out = []
    for i, s in enumerate(ref_validate(segs)):
        pos = s.pos + delta
        if pos < 0:
            raise InvalidRequestError(f"segment {i}: shift by {delta} makes pos {pos} < 0")
        if pos + s.rows > INT64_MAX:
            raise InvalidRequestError(f"segment {i}: shift by {delta} overflows int64")
        out.append(PayloadSegment(s.field, s.file, s.offset, pos, s.rows, s.dtype, [*s.shape]))
    return out


def ref_side(segs: Sequence[PayloadSegment], side: str) -> list[PayloadSegment]:
    try:
        return ref_validate(segs)
    except InvalidSegmentError as exc:
        err = InvalidSegmentError(f"{side} {exc}", field=exc.field)
        err.index = exc.index
        raise err from None


def ref_merge(
    prefill: Sequence[PayloadSegment], decode: Sequence[PayloadSegment], field: str
) -> list[PayloadSegment]:
    pre, dec = ref_side(prefill, "prefill"), ref_side(decode, "decode")
    head = [s for s in pre if s.field == field]
    if not head:
        if any(s.field == field for s in dec):
            raise InvalidRequestError(
                f"decode carries {field!r} segments but prefill has none to stitch onto"
            )
        return list(dec)
    cut = max(s.pos + s.rows for s in head)
    tail = [s for s in dec if s.field != field or s.pos + s.rows > cut]
    return head + [s if s.field != field else ref_trim_front(s, max(0, cut - s.pos)) for s in tail]


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What ``fn(*args)`` returns, or the class, index, field and text of what it raises."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # any difference counts, a crash too
        where = (getattr(exc, "index", None), getattr(exc, "field", None))
        return ("raised", type(exc), *where, str(exc))


# -- random lists of many segments, a few values planted ---------------------------------


class Str(str):
    pass


class Int(int):
    pass


class Sub(PayloadSegment, frozen=True):
    pass


BAD_INTS = [-1, True, False, 1.0, 2**63, INT64_MAX, INT64_MAX - 1, -(2**63), 2**64, "3", None]
BAD_INTS.append(Int(3))
BAD: dict[str, list[Any]] = {
    "field": ["", 0, None, b"f", Str("f"), Str("")],
    "file": [
        "", "/abs.bin", "../x.bin", "a//b", "a/./b", "a/x\x00", ".", "a\\b", "a/", 3, None,
        Str("a.bin"), "/" + "y" * 300, "a/" + "z" * 300 + "/..", "q/" + "w" * 300,
    ],
    "offset": BAD_INTS,
    "pos": BAD_INTS,
    "rows": BAD_INTS,
    "dtype": ["uint64", "float64", "", "<u1", 3, None, Str("uint8")],
    "shape": [
        [], [0], [-1], [True], [1.0], [48, 8.0], [1, True], [2**62, 4], [2**62], [2**63],
        [2**64], [2**31, 2**31, 2], (48, 8), (True,), (), "ab", None, [Int(2)], [[1]],
    ],
}  # fmt: skip

good_segment = st.builds(
    PayloadSegment,
    field=st.sampled_from([R, M]),
    file=st.sampled_from(["n/r/0/a.bin", "n/r/1/b.bin", "p/" + "x" * 300]),
    offset=st.integers(0, 10_000),
    pos=st.integers(0, 200),
    rows=st.integers(0, 12),
    dtype=st.sampled_from(sorted(SUPPORTED_DTYPES)),
    shape=st.one_of(
        st.sampled_from([[48, 8], [4], [1]]).map(list),
        st.lists(st.integers(1, 5), min_size=1),
        st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple),
    ),
)


@st.composite
def planted(draw: st.DrawFn, s: PayloadSegment) -> Any:
    """``s`` with one bad (or edge) value, or something that is not a plain segment."""
    kind = draw(st.sampled_from([*BAD, "end", "size", "other"]))
    if kind in BAD:
        return msgspec.structs.replace(s, **{kind: draw(st.sampled_from(BAD[kind]))})
    d = draw(st.sampled_from([-1, 0, 1]))
    if kind == "end":  # pos + rows at the int64 edge
        return msgspec.structs.replace(s, pos=INT64_MAX - s.rows + d)
    if kind == "size":  # offset + rows * row_nbytes at the int64 edge
        rows = draw(st.sampled_from([s.rows, 1, INT64_MAX // nbytes(s)]))
        return msgspec.structs.replace(s, offset=INT64_MAX - rows * nbytes(s) + d, rows=rows)
    return draw(st.sampled_from([None, ("f", "a", 0, 0, 1, "uint8", [1]), Sub(*astuple(s))]))


@st.composite
def segment_lists(draw: st.DrawFn) -> list[Any]:
    """Short lists (worked on segment by segment) and long ones (column by column)."""
    short = st.lists(good_segment, max_size=_BULK_MIN - 1)
    long = st.lists(good_segment, min_size=_BULK_MIN, max_size=_BULK_MIN + 40)
    segs: list[Any] = draw(short | long)
    # one dtype, one row shape or both across the list (one kind: the usual case)
    same: dict[str, Any] = draw(
        st.fixed_dictionaries({}, optional={"dtype": st.just("uint16"), "shape": st.just([4, 2])})
    )
    segs = [msgspec.structs.replace(s, **same) for s in segs]
    k = min(len(segs), draw(st.sampled_from([0, 1, 1, 1, 2, 3])))
    for i in draw(st.sets(st.integers(0, len(segs) - 1), min_size=k, max_size=k)) if k else ():
        segs[i] = draw(planted(segs[i]))
    return segs


def same(got: tuple[Any, ...], want: tuple[Any, ...], inputs: Sequence[Any] = ()) -> None:
    """The same exception, or equal results that reuse the same inputs unchanged."""
    assert got[0] == want[0], (got, want)
    if got[0] == "raised":
        assert got == want
        return
    assert got[1] == want[1]

    def reused(out: list[Any]) -> list[bool]:
        return [any(o is s for s in inputs) for o in out]

    assert reused(got[1]) == reused(want[1])


# -- the properties -----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(segment_lists())
def test_validate_segments_agrees(segs: list[Any]) -> None:
    got, want = outcome(validate_segments, segs), outcome(ref_validate, segs)
    same(got, want)
    if got[0] == "ok":
        assert got[1] is not segs and all(a is b for a, b in zip(got[1], segs, strict=True))


@settings(max_examples=200, deadline=None)
@given(segment_lists())
def test_segment_columns_agree(segs: list[Any]) -> None:
    got, want = outcome(segment_columns, segs), outcome(ref_validate, segs)
    if want[0] == "raised":
        assert got == want
        return
    assert got[0] == "ok", got
    cols = got[1]
    assert all(a is b for a, b in zip(cols.segments, segs, strict=True))
    assert cols.field == [s.field for s in segs] and cols.file == [s.file for s in segs]
    for name in ("offset", "pos", "rows", "row_nbytes"):
        array = getattr(cols, name)
        assert array.dtype == np.int64 and array.shape == (len(segs),)
    assert cols.offset.tolist() == [s.offset for s in segs]
    assert cols.pos.tolist() == [s.pos for s in segs]
    assert cols.rows.tolist() == [s.rows for s in segs]
    assert cols.row_nbytes.tolist() == [nbytes(s) for s in segs]
    assert cols.kind.dtype == np.intp
    assert [cols.kinds[k] for k in cols.kind] == [(s.dtype, tuple(s.shape)) for s in segs]
    assert cols.kinds == list(dict.fromkeys((s.dtype, tuple(s.shape)) for s in segs))


@settings(max_examples=200, deadline=None)
@given(segment_lists(), st.integers(0, 220), st.integers(0, 220))
def test_clip_agrees(segs: list[Any], a: int, b: int) -> None:
    lo, hi = min(a, b), max(a, b)
    same(outcome(clip_segments, segs, lo, hi), outcome(ref_clip, segs, lo, hi), segs)


deltas = st.one_of(
    st.integers(-220, 220),
    st.sampled_from([INT64_MAX, -INT64_MAX, INT64_MAX - 200, 2**62]),
    st.integers(-INT64_MAX, INT64_MAX),
)


@settings(max_examples=200, deadline=None)
@given(segment_lists(), deltas)
def test_shift_agrees(segs: list[Any], delta: int) -> None:
    same(outcome(shift_segments, segs, delta), outcome(ref_shift, segs, delta), segs)


@settings(max_examples=200, deadline=None)
@given(segment_lists(), segment_lists(), st.sampled_from([R, M, "x"]))
def test_merge_agrees(pre: list[Any], dec: list[Any], field: str) -> None:
    assert _MERGE_BULK_MIN < _BULK_MIN + 40  # long lists reach it
    # the decode side around the prefill's end, so that some of its segments straddle it
    ends = [
        s.pos + s.rows
        for s in pre
        if isinstance(s, PayloadSegment) and s.field == field and type(s.pos) is type(s.rows) is int
    ]
    cut = max([e for e in ends if 0 <= e <= INT64_MAX], default=0)
    dec = [
        msgspec.structs.replace(s, pos=max(0, s.pos + cut - 100))
        if isinstance(s, PayloadSegment) and type(s.pos) is int and 0 <= s.pos <= 200
        else s
        for s in dec
    ]
    got, want = outcome(merge_pd_segments, pre, dec, field), outcome(ref_merge, pre, dec, field)
    same(got, want, pre + dec)


# -- by example ---------------------------------------------------------------------------


def many(n: int = 100) -> list[PayloadSegment]:
    return [PayloadSegment(R, "n/r/0/a.bin", i * 6, i * 3, 3, "uint8", [2, 3]) for i in range(n)]


def test_a_bool_among_equal_shapes_is_found() -> None:
    # (True,) == (1,) and hash alike: a set of the shapes alone would hide it
    segs = [PayloadSegment(R, "a.bin", 0, i, 1, "uint8", [1]) for i in range(50)]
    segs[20] = msgspec.structs.replace(segs[20], shape=[True])
    segs[30] = msgspec.structs.replace(segs[30], shape=[1.0])
    with pytest.raises(InvalidSegmentError, match="segment 20: shape") as info:
        validate_segments(segs)
    assert (info.value.index, info.value.field) == (20, "shape")


def test_the_first_bad_segment_is_named_not_the_first_bad_field() -> None:
    segs = many()
    segs[30] = msgspec.structs.replace(segs[30], field="")
    segs[20] = msgspec.structs.replace(segs[20], pos=2**63 - 2)  # pos + rows overflows
    with pytest.raises(InvalidSegmentError) as info:
        segment_columns(segs)
    assert (info.value.index, info.value.field) == (20, "rows")
    assert str(info.value) == "segment 20: pos + rows overflows int64"


def test_offsets_at_the_int64_edge() -> None:
    segs = many()
    segs[40] = msgspec.structs.replace(segs[40], offset=INT64_MAX - 3 * 6)  # ends at the edge
    assert validate_segments(segs) == segs
    segs[41] = msgspec.structs.replace(segs[41], offset=INT64_MAX - 3 * 6 + 1)
    with pytest.raises(InvalidSegmentError, match=r"segment 41: offset .* overflows int64"):
        validate_segments(segs)


def test_shift_names_the_first_offending_segment() -> None:
    segs = many()
    with pytest.raises(InvalidRequestError, match=r"^segment 0: shift by -1 makes pos -1 < 0$"):
        shift_segments(segs, -1)
    segs[70] = msgspec.structs.replace(segs[70], pos=INT64_MAX - 10, rows=5)
    segs[80] = msgspec.structs.replace(segs[80], pos=INT64_MAX - 5, rows=5)
    with pytest.raises(InvalidRequestError, match=r"^segment 80: shift by 1 overflows int64$"):
        shift_segments(segs, 1)
    with pytest.raises(InvalidRequestError, match=r"^segment 70: shift by 6 overflows int64$"):
        shift_segments(segs, 6)


def test_merge_trims_in_a_long_list() -> None:
    pre = [PayloadSegment(R, "p.bin", 0, 0, 50, "uint8", [2, 3])]
    dec = [PayloadSegment(R, "d.bin", 600 * i, 10 * i, 100, "uint8", [2, 3]) for i in range(40)]
    got = merge_pd_segments(pre, dec)
    assert got == ref_merge(pre, dec, R)
    assert (got[1].offset, got[1].pos, got[1].rows) == (50 * 6, 50, 50)


@pytest.mark.parametrize("vary", ["dtype", "shape"])
def test_columns_of_kinds_in_first_seen_order(vary: str) -> None:
    dtypes = ["int32", "uint8", "float16"] if vary == "dtype" else ["uint8"]
    shapes = [[9], [2, 2], [1]] if vary == "shape" else [[3]]
    segs = [
        PayloadSegment(R, "a.bin", 0, i, 1, dtypes[i % len(dtypes)], shapes[i % len(shapes)])
        for i in range(40)
    ]
    cols = segment_columns(segs)
    assert cols.kinds == [
        (dtypes[i % len(dtypes)], tuple(shapes[i % len(shapes)])) for i in range(3)
    ]
    assert cols.kind.tolist() == [i % 3 for i in range(40)]
    assert cols.row_nbytes.tolist() == [nbytes(s) for s in segs]


def test_columns_of_several_kinds() -> None:
    segs = [
        PayloadSegment(R, "a.bin", 0, i, 1, ("uint8", "int32")[i % 2], [[4], [2, 2]][i % 3 == 0])
        for i in range(40)
    ]
    cols = segment_columns(segs)
    assert cols.kinds == [("uint8", (2, 2)), ("int32", (4,)), ("uint8", (4,)), ("int32", (2, 2))]
    assert cols.kind[:7].tolist() == [0, 1, 2, 3, 2, 1, 0]
    assert cols.row_nbytes.tolist() == [nbytes(s) for s in segs]


def test_segments_are_not_tracked_by_the_collector() -> None:
    seg = PayloadSegment(R, "a.bin", 1, 2, 3, "uint16", [4, 2])
    assert not gc.is_tracked(seg)
    assert pickle.loads(pickle.dumps(seg)) == seg
    moved = PayloadSegment(R, "a.bin", 1, 5, 3, "uint16", [4, 2])
    assert msgspec.structs.replace(seg, pos=5) == moved
    assert seg != msgspec.structs.replace(seg, shape=[4, 3])
    with pytest.raises(TypeError):  # a list field: unhashable, as before
        hash(seg)


@pytest.mark.parametrize("n", [3, _BULK_MIN])
def test_shift_makes_every_shape_a_list_and_shares_lists(n: int) -> None:
    class Shape(list[int]):
        pass

    shapes: list[Any] = [(2, 3), Shape([2, 3]), [2, 3]] * n
    segs = [PayloadSegment(R, "a.bin", 0, i, 1, "uint8", sh) for i, sh in enumerate(shapes)]
    got = shift_segments(segs, 5)
    assert [type(s.shape) for s in got] == [list] * len(segs)
    assert got == [msgspec.structs.replace(s, pos=s.pos + 5, shape=[2, 3]) for s in segs]
    only_lists = [s for s in segs if type(s.shape) is list]
    moved = shift_segments(only_lists, 1)
    assert all(a.shape is b.shape for a, b in zip(moved, only_lists, strict=True))
