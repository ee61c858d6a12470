"""Columnar segment lists (`SegmentList`) give what lists of `PayloadSegment` give.

docs/contract.md, "The segment model", "Pure segment operations" and "Reading a window": a
`SegmentList` is checked on construction, operated on and planned over as numpy columns; on
random lists (short ones, checked segment by segment, and long ones, past the 24 and 48
segments where object lists switch to column checks) and random arguments, every path must
give the same segments, the same plan and the same rows, or the same exception: class,
index, attribute and message.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import astuple

from payload_client import (
    InvalidSegmentError,
    PayloadClient,
    PayloadSegment,
    SegmentList,
    SegmentListWire,
    Window,
    WindowPlan,
    assemble,
    clip_segments,
    decode_columns,
    decode_segments,
    encode_segments,
    merge_pd_segments,
    plan_window,
    shift_segments,
    validate_segments,
)
from payload_client.segments._columns import COLUMNS_VERSION
from payload_client.segments._segment import bounded_prod
from tests.client.test_bulk import (
    ITEMSIZE,
    R,
    deltas,
    good_segment,
    nbytes,
    outcome,
    segment_lists,
)
from tests.conftest import Daemon
from tests.reference import dense_read

INT64_MAX = 2**63 - 1
CODE, INT = np.dtype("<i4"), np.dtype("<i8")


def norm(segs: Sequence[PayloadSegment]) -> list[PayloadSegment]:
    """Plain segments with list shapes: what a `SegmentList` holds (a tuple shape, or a
    subclass of `PayloadSegment`, comes back from the columns as a plain list)."""
    return [msgspec.structs.replace(PayloadSegment(*astuple(s)), shape=list(s.shape)) for s in segs]


def check_columns(sl: SegmentList, segs: Sequence[PayloadSegment]) -> None:
    """``sl`` holds ``segs`` in consistent, read-only columns, and compares equal to them."""
    want = norm(segs)
    assert isinstance(sl, SegmentList)
    assert sl == want and list(sl) == want and sl.to_list() == want and len(sl) == len(want)
    assert [sl[i] for i in range(-len(sl), len(sl))] == want + want
    for name, dtype in (("field", np.intp), ("file", np.intp), ("kind", np.intp),
                        ("offset", np.int64), ("pos", np.int64), ("rows", np.int64),
                        ("row_nbytes", np.int64)):  # fmt: skip
        a = getattr(sl, name)
        assert a.dtype == dtype and a.shape == (len(want),) and not a.flags.writeable, name
    assert sl.row_nbytes.tolist() == [ITEMSIZE[s.dtype] * math.prod(s.shape) for s in want]
    assert [sl.fields[f] for f in sl.field] == [s.field for s in want]
    assert [sl.files[f] for f in sl.file] == [s.file for s in want]


def same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    """The same exception (class, index, attribute, message), or a `SegmentList` result
    equal to the object path's list."""
    assert got[0] == want[0], (got, want)
    if want[0] == "raised":
        assert got == want
        return
    check_columns(got[1], want[1])


# -- construction and validation ---------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(segment_lists())
def test_construction_raises_what_validate_segments_raises(segs: list[Any]) -> None:
    want = outcome(validate_segments, segs)
    got = outcome(SegmentList, segs)
    if want[0] == "raised":
        assert got == want
        assert outcome(encode_segments, segs, "columns") == want
        return
    same(got, want)
    assert SegmentList(segs) == segs or segs != norm(segs)  # equal unless shapes were tuples
    assert SegmentList(got[1]) == norm(segs)  # taken as it is
    assert SegmentList(tuple(segs)) == norm(segs) and SegmentList(iter(segs)) == norm(segs)


def sized(
    elements: st.SearchStrategy[PayloadSegment], *sizes: tuple[int, int]
) -> st.SearchStrategy[list[PayloadSegment]]:
    """Lists of ``elements``, their length in one of ``sizes`` (``(least, most)``) drawn
    first: each range is as likely as the others."""
    ranges = [(a, b) for a, b in sizes if a <= b]
    return st.sampled_from(ranges).flatmap(
        lambda r: st.lists(elements, min_size=r[0], max_size=r[1])
    )


@st.composite
def valid_lists(draw: st.DrawFn, long: int = 64) -> list[PayloadSegment]:
    """Valid lists, short (fewer than 24) and long (up to ``long``), with a segment at the
    int64 edges now and then."""
    segs: list[PayloadSegment] = draw(sized(good_segment, (0, 23), (24, 47), (49, long)))
    one: dict[str, Any] = draw(
        st.fixed_dictionaries({}, optional={"dtype": st.just("uint16"), "shape": st.just([4, 2])})
    )
    segs = [msgspec.structs.replace(s, **one) for s in segs]
    segs = [s if nbytes(s) < 2**32 else msgspec.structs.replace(s, shape=[2]) for s in segs]
    if segs and draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(segs) - 1))
        s = segs[i]
        edge = draw(st.sampled_from(["end", "bytes"]))
        nb = nbytes(s)
        if edge == "end":
            segs[i] = msgspec.structs.replace(s, pos=INT64_MAX - s.rows)
        else:
            segs[i] = msgspec.structs.replace(s, offset=INT64_MAX - s.rows * nb)
    return segs


@settings(max_examples=100, deadline=None)
@given(valid_lists(), st.data())
def test_a_list_is_a_sequence_of_its_segments(segs: list[PayloadSegment], data: Any) -> None:
    sl = SegmentList(segs)
    want = norm(segs)
    check_columns(sl, segs)
    a, b, step = data.draw(st.tuples(st.integers(-70, 70), st.integers(-70, 70),
                                     st.sampled_from([None, 1, 2, -1, -3])))  # fmt: skip
    check_columns(sl[a:b:step], want[a:b:step])
    index = data.draw(st.lists(st.integers(0, len(segs) - 1), max_size=30) if segs else st.just([]))
    check_columns(sl.take(np.array(index, np.intp)), [want[i] for i in index])
    for field in {*sl.fields, "nope"}:
        got = sl.indices_of(field)
        assert got.tolist() == [i for i, s in enumerate(want) if s.field == field]
    for bad in (len(segs), -len(segs) - 1):
        with pytest.raises(IndexError):
            sl.__getitem__(bad)


# -- from columns, on the wire -----------------------------------------------------------


def columns_of(segs: Sequence[PayloadSegment], order: Any) -> dict[str, Any]:
    """The `SegmentList.from_columns` arguments of ``segs``, tables in a drawn order, each
    with an unused invalid entry (harmless)."""
    fields = order([*sorted({s.field for s in segs}), ""])
    files = order([*sorted({s.file for s in segs}), "/unused.bin"])
    kinds = order([*sorted({(s.dtype, tuple(s.shape)) for s in segs}), ("float64", (1,))])
    return {
        "fields": fields,
        "field": [fields.index(s.field) for s in segs],
        "files": files,
        "file": [files.index(s.file) for s in segs],
        "kinds": kinds,
        "kind": [kinds.index((s.dtype, tuple(s.shape))) for s in segs],
        "offset": [s.offset for s in segs],
        "pos": [s.pos for s in segs],
        "rows": [s.rows for s in segs],
    }


def expand(c: dict[str, Any]) -> list[PayloadSegment]:
    """The object list the columns ``c`` (codes inside their tables) stand for."""
    return [
        PayloadSegment(c["fields"][f], c["files"][fi], o, p, r, c["kinds"][k][0],
                       list(c["kinds"][k][1]))
        for f, fi, k, o, p, r in zip(c["field"], c["file"], c["kind"], c["offset"], c["pos"],
                                     c["rows"], strict=True)
    ]  # fmt: skip


def wire_of(c: dict[str, Any], version: int = COLUMNS_VERSION) -> bytes:
    """The columnar wire form of the columns ``c``, as another process may send it."""
    return msgspec.msgpack.encode(SegmentListWire(
        version, list(c["fields"]), list(c["files"]), [(d, tuple(s)) for d, s in c["kinds"]],
        *(np.asarray(c[n], CODE).tobytes() for n in ("field", "file", "kind")),
        *(np.asarray(c[n], INT).tobytes() for n in ("offset", "pos", "rows")),
    ))  # fmt: skip


# invalid values a segment's columns can carry (on the wire too)
PLANTS: dict[str, list[Any]] = {
    "offset": [-1, -(2**63), INT64_MAX, INT64_MAX - 7],
    "pos": [-1, -(2**63), INT64_MAX, INT64_MAX - 3],
    "rows": [-1, -(2**63), INT64_MAX, 2**62],
    "fields": [""],
    "files": ["", "/abs.bin", "../x.bin", "a/../b.bin", "a//b", "a/./b", "a/x\x00", ".",
              "a\\b", "a/", "/" + "y" * 300],
    "dtypes": ["float64", "uint64", "", "<u1", "bool"],
    "shapes": [(), (0,), (-1,), (3, 0), (2**62,), (2**31, 2**31, 2), (2**63 - 1,)],
}  # fmt: skip


@st.composite
def planted_columns(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """Columns of a valid list, with (most of the time) one invalid value planted: in a
    column, or in a table entry that segments use."""
    segs = draw(valid_lists())
    c = columns_of(segs, lambda t: draw(st.permutations(t)))
    what = draw(st.sampled_from(["none", *PLANTS]))
    if not segs or what == "none":
        return c, "none"
    i = draw(st.integers(0, len(segs) - 1))
    value = draw(st.sampled_from(PLANTS[what]))
    if what in ("offset", "pos", "rows"):
        c[what][i] = value
    elif what in ("fields", "files"):
        c[what][c[what[:-1]][i]] = value
    else:
        d, shape = c["kinds"][c["kind"][i]]
        c["kinds"][c["kind"][i]] = (value, shape) if what == "dtypes" else (d, value)
    return c, what


@settings(max_examples=200, deadline=None)
@given(planted_columns())
def test_columns_raise_what_validate_segments_raises(planted: tuple[dict[str, Any], str]) -> None:
    c, _ = planted
    segs = expand(c)
    want = outcome(validate_segments, segs)
    for got in (outcome(SegmentList.from_columns, *c.values()),
                outcome(decode_columns, wire_of(c)),
                outcome(decode_columns, bytearray(wire_of(c)))):  # fmt: skip
        if want[0] == "raised":
            assert got == want
        else:
            same(got, want)
            assert got[1].fields == tuple(c["fields"]) and got[1].files == tuple(c["files"])


@settings(max_examples=100, deadline=None)
@given(valid_lists())
def test_the_columnar_wire_form_round_trips(segs: list[PayloadSegment]) -> None:
    sl = SegmentList(segs)
    for data in (encode_segments(segs, "columns"), encode_segments(sl, "columns")):
        check_columns(decode_columns(data), segs)
        check_columns(decode_columns(memoryview(data)), segs)
        assert msgspec.msgpack.decode(data, type=SegmentListWire).columns == COLUMNS_VERSION
    for form in ("msgpack", "json"):  # the other forms decode into columns too
        check_columns(decode_columns(encode_segments(sl, form)), segs)
    check_columns(decode_columns(segs), segs)
    assert decode_columns(sl) is sl


@st.composite
def coded_columns(draw: st.DrawFn) -> dict[str, Any]:
    segs = draw(valid_lists().filter(bool))
    return columns_of(segs, lambda t: t)


@settings(max_examples=100, deadline=None)
@given(coded_columns(), st.data())
def test_codes_outside_their_tables_are_refused(c: dict[str, Any], data: Any) -> None:
    name = data.draw(st.sampled_from(["field", "file", "kind"]))
    i = data.draw(st.integers(0, len(c[name]) - 1))
    size = len(c[name + "s"])
    c[name][i] = code = data.draw(st.sampled_from([-1, size, size + 5, -(2**31), 2**31 - 1]))
    want = ("raised", InvalidSegmentError, i, "dtype" if name == "kind" else name,
            f"segment {i}: {name} code {code} is outside the list's {size} {name}s")  # fmt: skip
    assert outcome(SegmentList.from_columns, *c.values()) == want
    assert outcome(decode_columns, wire_of(c)) == want


def refused(fn: Any, *args: Any) -> str:
    """The message of the `InvalidSegmentError` (and nothing else) ``fn(*args)`` raises."""
    with pytest.raises(InvalidSegmentError) as info:
        fn(*args)
    assert type(info.value) is InvalidSegmentError
    return str(info.value)


@settings(max_examples=60, deadline=None)
@given(coded_columns(), st.data())
def test_columns_that_are_not_integer_arrays_of_one_length_are_refused(
    c: dict[str, Any], data: Any
) -> None:
    name = data.draw(st.sampled_from(["field", "file", "kind", "offset", "pos", "rows"]))
    n = len(c[name])
    args = dict(c)
    args[name] = data.draw(st.sampled_from([
        c[name] + [0], c[name][:-1], [c[name]], np.array(c[name], float),
        [float(x) for x in c[name]], np.array(c[name], object), [str(x) for x in c[name]],
        [*c[name][:-1], 2**63], np.zeros((n, 1), np.int64),
    ]))  # fmt: skip
    assert "segment column" in refused(SegmentList.from_columns, *args.values())
    # on the wire: a column of another length, or not of whole entries
    size = (CODE if name in ("field", "file", "kind") else INT).itemsize
    wire = msgspec.msgpack.decode(wire_of(c), type=SegmentListWire)
    blob = getattr(wire, name)
    cut = data.draw(st.sampled_from([blob[:-size], blob + blob[:size], blob[:-1], blob + b"\0"]))
    bad = msgspec.msgpack.encode(msgspec.structs.replace(wire, **{name: cut}))
    assert "segment column" in refused(decode_columns, bad)


@settings(max_examples=60, deadline=None)
@given(coded_columns(), st.data())
def test_tables_of_other_types_are_refused(c: dict[str, Any], data: Any) -> None:
    table = data.draw(st.sampled_from(["fields", "files"]))
    c[table] = [*c[table][:-1], data.draw(st.sampled_from([3, None, b"a.bin"]))]
    assert "must be strings" in refused(SegmentList.from_columns, *c.values())
    c = dict(c, **{table: [*c[table][:-1], c[table][0]]})
    c["kind"] = [0] * len(c["kind"])  # every segment uses the kind planted first
    # kinds that are not (dtype, shape) pairs
    c["kinds"] = [data.draw(st.sampled_from(["uint8", ("uint8",), ("uint8", 3), None])),
                  *c["kinds"]]  # fmt: skip
    assert refused(SegmentList.from_columns, *c.values()).startswith("segment 0: ")
    # shapes whose entries are not ints, though equal to ints (and hashed alike)
    shape = data.draw(st.sampled_from([(True,), [1.0], (2, True), (np.int64(1),), (3.0, 2)]))
    c["kinds"][0] = ("uint8", shape)
    want = outcome(validate_segments, expand(c))
    assert want[0] == "raised" and want[1:3] == (InvalidSegmentError, 0)
    assert outcome(SegmentList.from_columns, *c.values()) == want


COLUMN_NAMES = ("fields", "field", "files", "file", "kinds", "kind", "offset", "pos", "rows")
ODD_SHAPES = [("int8", (17, True), (17, 1)), ("int16", (19, 2.0), (19, 2)),
              ("uint16", (23, np.int64(3)), (23, 3)), ("float16", (True,), (1,))]  # fmt: skip


@pytest.mark.parametrize(("dtype", "odd", "like"), ODD_SHAPES)
def test_a_kind_is_judged_on_its_own_not_on_an_equal_one(
    dtype: str, odd: tuple[Any, ...], like: tuple[int, ...]
) -> None:
    """``(17, True) == (17, 1)``, hashed alike: whichever of the two `from_columns` sees
    first, the first is refused as `validate_segments` refuses it, the second taken."""

    def columns(shape: tuple[Any, ...]) -> tuple[Any, ...]:
        return ["f"], [0], ["a.bin"], [0], [(dtype, shape)], [0], [0], [0], [1]

    seg = PayloadSegment("f", "a.bin", 0, 0, 1, dtype, list(like))
    bad = outcome(validate_segments, [msgspec.structs.replace(seg, shape=list(odd))])
    assert bad[0] == "raised"
    assert outcome(SegmentList.from_columns, *columns(odd)) == bad
    assert outcome(SegmentList.from_columns, *columns(like)) == ("ok", [seg])
    assert outcome(decode_columns, encode_segments([seg], "columns")) == ("ok", [seg])
    assert outcome(SegmentList.from_columns, *columns(odd)) == bad
    if not any(isinstance(x, np.integer) for x in odd):  # (msgpack has no numpy integer)
        wire = wire_of(dict(zip(COLUMN_NAMES, columns(odd), strict=True)))
        assert outcome(decode_columns, wire)[:2] == ("raised", InvalidSegmentError)


@settings(max_examples=100, deadline=None)
@given(valid_lists(), st.integers(0, 2**31 - 1).filter(lambda v: v != COLUMNS_VERSION),
       st.data())  # fmt: skip
def test_other_versions_and_broken_bytes_are_refused(
    segs: list[PayloadSegment], version: int, data: Any
) -> None:
    c = columns_of(segs, lambda t: t)
    message = refused(decode_columns, wire_of(c, version))
    assert f"version {version}" in message and f"version {COLUMNS_VERSION}" in message
    whole = encode_segments(segs, "columns")
    cut = data.draw(st.integers(0, len(whole) - 1))
    refused(decode_columns, whole[:cut])
    head = data.draw(st.sampled_from([0x80, 0x81, 0x8A, 0x8F, 0xDE, 0xDF]))
    refused(decode_columns, bytes([head]) + data.draw(st.binary(max_size=64)))
    # a byte changed anywhere: refused, or a list that is valid
    at = data.draw(st.integers(0, len(whole) - 1))
    flipped = bytearray(whole)
    flipped[at] ^= data.draw(st.integers(1, 255))
    got = outcome(decode_columns, bytes(flipped))
    if got[0] == "raised":
        assert got[1] is InvalidSegmentError, got
    else:
        assert validate_segments(got[1].to_list()) == got[1]


# -- operations ---------------------------------------------------------------------------

ODD_BOUNDS = [-1, -5, INT64_MAX, 2**63, 1.0, True, None, "3", np.int64(7), np.uint8(9)]
BOUNDS = st.integers(0, 7).flatmap(
    lambda k: st.sampled_from(ODD_BOUNDS) if k == 0 else st.integers(0, 220)
)
"""Window bounds: mostly integers around the segments' positions, now and then a negative,
one beyond int64, or no Python integer."""


@settings(max_examples=200, deadline=None)
@given(valid_lists(), BOUNDS, BOUNDS, deltas, st.booleans(), st.data())
def test_clip_and_shift_agree(
    segs: list[PayloadSegment], lo: Any, hi: Any, delta: int, ordered: bool, data: Any
) -> None:
    if ordered and type(lo) is type(hi) is int:  # lo > hi half as often
        lo, hi = sorted((lo, hi))
    sl = SegmentList(segs)
    want = outcome(clip_segments, segs, lo, hi)
    same(outcome(clip_segments, sl, lo, hi), want)
    same(outcome(sl.clip, lo, hi), want)
    if want[0] == "ok":  # and an operation on an operation's result
        base, cols = want[1], outcome(clip_segments, sl, lo, hi)[1]
        same(outcome(shift_segments, cols, delta), outcome(shift_segments, base, delta))
    want = outcome(shift_segments, segs, delta)
    same(outcome(shift_segments, sl, delta), want)
    same(outcome(sl.shift, delta), want)
    for bad in (1.0, True, None, -(2**63), 2**63):
        same(outcome(sl.shift, bad), outcome(shift_segments, segs, bad))
    if not segs:
        return
    # at the edges of two segments: windows, and shifts to pos 0 or to the int64 end
    a, b = (segs[data.draw(st.integers(0, len(segs) - 1))] for _ in range(2))
    for d in (-a.pos - 1, -a.pos, INT64_MAX - a.pos - a.rows, INT64_MAX - a.pos - a.rows + 1):
        same(outcome(sl.shift, d), outcome(shift_segments, segs, d))
    for lo, hi in ((a.pos, b.pos), (a.pos, b.pos + b.rows), (a.pos + a.rows, b.pos + 1)):
        same(outcome(sl.clip, lo, hi), outcome(clip_segments, segs, lo, hi))


UNUSED = PayloadSegment("zz", "zz/unused.bin", 0, 0, 1, "int8", [7])


def sides(segs: list[Any]) -> list[Any]:
    """``segs`` and, when it is valid, its `SegmentList`."""
    try:
        return [segs, SegmentList(segs)]
    except InvalidSegmentError:
        return [segs]


@settings(max_examples=200, deadline=None)
@given(
    valid_lists() | segment_lists(),
    valid_lists() | segment_lists(),
    st.sampled_from([R, R, R, "sampling_mask", "x", "", 3]),
)
def test_merge_agrees(pre: list[Any], dec: list[Any], field: Any) -> None:
    ends = [s.pos + s.rows for s in pre if isinstance(s, PayloadSegment) and s.field == field
            and type(s.pos) is type(s.rows) is int]  # fmt: skip
    cut = max([e for e in ends if 0 <= e <= INT64_MAX], default=0)
    dec = [  # around the prefill's end, so that some decode segments straddle it
        msgspec.structs.replace(s, pos=max(0, s.pos + cut - 100))
        if isinstance(s, PayloadSegment) and type(s.pos) is int and 0 <= s.pos <= 200
        else s
        for s in dec
    ]
    want = outcome(merge_pd_segments, pre, dec, field)
    for a in sides(pre):
        for b in sides(dec):
            if a is pre and b is dec:
                continue
            same(outcome(merge_pd_segments, a, b, field), want)
            same(outcome(SegmentList.merge_pd, a, b, field), want)


@settings(max_examples=100, deadline=None)
@given(st.lists(valid_lists(long=30), max_size=5), st.data())
def test_concat_is_the_parts_one_after_another(parts: list[list[Any]], data: Any) -> None:
    given_parts: list[Any] = []
    for p in parts:
        form = data.draw(st.sampled_from(["list", "columns", "derived", "tuple"]))
        if form == "columns":
            given_parts.append(SegmentList(p))
        elif form == "derived":  # its tables hold what none of its segments uses
            given_parts.append(SegmentList([*p, UNUSED])[: len(p)])
        else:
            given_parts.append(p if form == "list" else tuple(p))
    check_columns(SegmentList.concat(given_parts), [s for p in parts for s in p])
    check_columns(SegmentList.concat(iter(given_parts)), [s for p in parts for s in p])
    bad = data.draw(segment_lists())
    want = outcome(SegmentList, bad)
    if want[0] == "raised":
        at = data.draw(st.integers(0, len(given_parts)))
        assert outcome(SegmentList.concat, [*given_parts[:at], bad, *given_parts[at:]]) == want


# -- planning and assembling a window -----------------------------------------------------

FILE_BYTES = 4096
FILES = ("n0/r/0/a.bin", "n0/r/0/b.bin", "n1/r/1/c.bin")
# field -> (dtypes, row shapes) of its rows (ragged: the last dimension)
READ_FIELDS = {
    "routed": (["uint8", "uint16"], [[4, 2]]),
    "mask": (["int32", "int16"], [[w] for w in range(1, 9)]),
    "w": (["float16", "float32"], [[1], [2], [3]]),
}
# a kind a list has now and then: another fixed dimension, rank, or integer/float
ODD = [("routed", "uint8", [3, 2]), ("routed", "uint8", [4]), ("mask", "float32", [2]),
       ("mask", "int32", [2, 3]), ("w", "uint8", [2])]  # fmt: skip


@pytest.fixture(scope="module")
def payload_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A payload root with a few files of random bytes."""
    root = tmp_path_factory.mktemp("columns")
    rng = np.random.default_rng(3)
    for name in FILES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(rng.integers(0, 256, FILE_BYTES, np.uint8).tobytes())
    return root


@st.composite
def read_segment(draw: st.DrawFn, kind: tuple[str, str, list[int]] | None = None) -> PayloadSegment:
    if kind is None:
        field = draw(st.sampled_from(sorted(READ_FIELDS)))
        dtypes, shapes = READ_FIELDS[field]
        kind = (field, draw(st.sampled_from(dtypes)), draw(st.sampled_from(shapes)))
    field, dtype, shape = kind
    rows = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 12]))
    nbytes = rows * ITEMSIZE[dtype] * math.prod(shape)
    offset = draw(st.integers(0, FILE_BYTES - nbytes))
    return PayloadSegment(field, draw(st.sampled_from(FILES)), offset, draw(st.integers(0, 40)),
                          rows, dtype, list(shape))  # fmt: skip


@st.composite
def read_lists(draw: st.DrawFn) -> list[PayloadSegment]:
    """Short lists (an object list of up to 8 is planned in plain Python) and long ones; one
    segment of an odd kind now and then."""
    segs = draw(sized(read_segment(), (0, 8), (9, 16)))
    if len(segs) > 8 and draw(st.booleans()):  # long: copies, at other positions and files
        segs = [
            msgspec.structs.replace(s, pos=(s.pos + 13 * k) % 41, file=FILES[(j + k) % 3])
            for k in range(-(-49 // len(segs)))
            for j, s in enumerate(segs)
        ]
    if segs and draw(st.integers(0, 4)) == 0:
        i = draw(st.integers(0, len(segs) - 1))
        segs[i] = draw(read_segment(draw(st.sampled_from(ODD))))
    return segs


def plan_of(plan: WindowPlan | None) -> Any:
    """What two plans of one window must agree on: all but the order of the pieces' files
    (that of the list's table of files; within a file, the pieces are in offset order)."""
    if plan is None:
        return None
    pieces = plan.pieces
    files = list(dict.fromkeys(p.file for p in pieces))
    assert list(pieces) == sorted(pieces, key=lambda p: (files.index(p.file), p.offset))
    fill = (type(plan.fill), repr(plan.fill))  # NaN: equal to itself here
    return (plan.lo, plan.hi, plan.row_shape, plan.dtype, fill, dict(plan.ends), sorted(pieces),
            plan.count, plan.nbytes, plan.covered_rows, plan.narrow, plan.covered().tolist())  # fmt: skip


def read_pieces(root: Path, plan: WindowPlan) -> bytes:
    """The pieces' bytes, read from the files, in plan order."""
    out = []
    for p in plan.pieces:
        fd = os.open(root / p.file, os.O_RDONLY)
        try:
            out.append(os.pread(fd, p.nbytes, p.offset))
        finally:
            os.close(fd)
    return b"".join(out)


def the_same_array(got: np.ndarray | None, want: np.ndarray | None) -> None:
    """Bit for bit: dtype, shape, bytes."""
    if want is None:
        assert got is None
        return
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def columnar_forms(segs: list[PayloadSegment]) -> Iterator[SegmentList]:
    """The list as columns: built, decoded from the wire, concatenated, and with its
    tables in another order (codes of unused entries in them)."""
    sl = SegmentList(segs)
    yield sl
    yield decode_columns(encode_segments(segs, "columns"))
    yield SegmentList.concat([segs[: len(segs) // 2], SegmentList(segs[len(segs) // 2 :])])
    yield SegmentList.from_columns(*columns_of(segs, lambda t: t[::-1]).values())


GOOD_FILLS = [0, -1, 7, 300, -40000]
BAD_FILLS = [1.5, 2**40, 0.5, float("nan"), True, None]  # nan: good for a float field


@settings(max_examples=300, deadline=None)
@given(
    read_lists(),
    st.sampled_from(sorted(READ_FIELDS)),
    st.integers(-1, 45),
    st.integers(-1, 30),
    st.sampled_from(GOOD_FILLS * 6 + BAD_FILLS),
    st.sampled_from([None] * 16 + ["uint8", "int64", np.int16, "float32", "bool", "x"]),
    st.sampled_from([None, True, True, True, False]),
)
def test_plans_and_reads_agree(
    payload_root: Path,
    segs: list[PayloadSegment],
    field: str,
    lo: int,
    n: int,
    fill: Any,
    dtype: Any,
    ragged: bool | None,
) -> None:
    hi = lo + n
    want = outcome(plan_window, segs, field, lo, hi, fill, dtype, ragged)
    forms = list(columnar_forms(segs))
    for sl in forms:
        got = outcome(plan_window, sl, field, lo, hi, fill, dtype, ragged)
        if want[0] == "raised":
            assert got == want
            continue
        assert got[0] == "ok", (got, want)
        assert plan_of(got[1]) == plan_of(want[1])
    if want[0] == "raised" or want[1] is None:
        return
    plan = want[1]
    array = assemble(plan, read_pieces(payload_root, plan))
    for sl in forms:
        p = plan_window(sl, field, lo, hi, fill, dtype, ragged)
        assert p is not None
        the_same_array(assemble(p, read_pieces(payload_root, p)), array)
    if dtype is None and fill is not True:  # and the rows are the dense model's
        files = {f: (payload_root / f).read_bytes() for f in FILES}
        the_same_array(array, dense_read(files, segs, field, lo, hi, fill))


# -- reads from a daemon ------------------------------------------------------------------


@pytest.fixture(scope="module")
def appended(daemon: Daemon) -> list[PayloadSegment]:
    """Rows of a fixed-shape field and of a ragged one, appended at overlapping positions,
    and a few placeholders."""
    rng = np.random.default_rng(11)
    segs: list[PayloadSegment] = []
    with PayloadClient(daemon.socket) as c:
        for _ in range(30):
            pos, n = int(rng.integers(0, 150)), int(rng.integers(1, 10))
            routed = rng.integers(0, 256, (n, 4, 2)).astype(np.uint8)
            segs += c.append(R, routed, pos, run="columns", step=0)
            mask = rng.integers(-1, 5000, (n, int(rng.integers(1, 9)))).astype(np.int32)
            segs += c.append("sampling_mask", mask, pos + 1, run="columns", step=0)
    holders = [msgspec.structs.replace(s, pos=int(p), rows=0) for s, p in
               zip(segs[:6], rng.integers(0, 160, 6), strict=True)]  # fmt: skip
    return segs + holders


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "http"])
def test_reads_from_a_daemon_are_the_same_bit_for_bit(
    daemon: Daemon, appended: list[PayloadSegment], data_plane: bool
) -> None:
    rng = np.random.default_rng(5 + data_plane)
    files = {s.file: (daemon.root / s.file).read_bytes() for s in appended}
    read = 0
    with PayloadClient(daemon.socket, data_plane=data_plane) as c:
        for k in range(40):
            order = rng.permutation(len(appended))[: int(rng.integers(1, len(appended) + 1))]
            segs = [appended[i] for i in order]  # overlapping: the later one wins
            field = (R, "sampling_mask")[k % 2]
            fill = 0 if field == R else -1
            lo = int(rng.integers(0, 170))
            hi = lo + int(rng.integers(0, 40))
            want = c.read_field(segs, field, lo, hi, fill)
            the_same_array(want, dense_read(files, segs, field, lo, hi, fill))
            if want is None:
                continue
            read += want.size > 0
            forms = [SegmentList(segs), decode_columns(encode_segments(segs, "columns"))]
            for sl in forms:
                the_same_array(c.read_field(sl, field, lo, hi, fill), want)
                out = np.full(want.shape, 77, want.dtype)
                assert c.read_field(sl, field, lo, hi, fill, out=out) is out
                the_same_array(out, want)
                wider = np.full((hi - lo, *(d + 3 for d in want.shape[1:])), 77, want.dtype)
                c.read_field(sl, field, lo, hi, fill, out=wider)
                the_same_array(wider[(slice(None), *map(slice, want.shape[1:]))], want)
                wider[(slice(None), *map(slice, want.shape[1:]))] = fill
                assert (wider == fill).all()
            got = c.read_many([Window(forms[0], field, lo, hi, fill), (segs, field, lo, hi, fill),
                               (forms[1], field, lo, hi, fill)])  # fmt: skip
            for array in got:
                the_same_array(array, want)
    assert read >= 20  # most windows have rows


# -- a review's findings (each failed before its fix) -------------------------------------


def test_a_list_made_of_columns_owns_them() -> None:
    base = np.zeros(4, np.intp)
    codes, offset = base[:2], np.array([0, 8], np.int64)
    sl = SegmentList.from_columns(("f",), codes, ("a/b.bin",), codes, (("uint8", (8,)),),
                                  codes, offset, [0, 1], [1, 1])  # fmt: skip
    base[1], offset[0] = 7, -5  # the caller's arrays: still theirs, still writeable
    assert sl.field.tolist() == [0, 0] and sl.offset.tolist() == [0, 8]
    assert sl[1] == PayloadSegment("f", "a/b.bin", 8, 1, 1, "uint8", [8])
    assert not sl.offset.flags.writeable


def test_a_row_shape_of_many_large_entries_is_refused_without_its_product() -> None:
    def entries() -> Iterator[int]:
        yield from (2**40, 2**40)  # past int64 here: nothing after this may be read
        raise AssertionError("multiplied past the bound")

    assert bounded_prod(entries()) == INT64_MAX + 1
    assert bounded_prod([3, 4, 5]) == 60
    wide = [2**62] * 20_000  # its product has 1.2 million digits
    sl = encode_segments([PayloadSegment("f", "a/b.bin", 0, 0, 1, "uint8", [8])], "columns")
    wire = msgspec.msgpack.decode(sl)
    wire["kinds"] = [["uint8", wide]]
    with pytest.raises(InvalidSegmentError, match="row size overflows int64"):
        decode_columns(msgspec.msgpack.encode(wire))
    arrays = msgspec.msgpack.encode([["f", "a/b.bin", 0, 0, 1, "uint8", wide]])
    with pytest.raises(InvalidSegmentError, match="row size overflows int64"):
        decode_columns(arrays)


def test_bytes_in_a_strided_memoryview_are_read() -> None:
    segs = [PayloadSegment("f", "a/b.bin", 0, 0, 1, "uint8", [8])]
    for data in (encode_segments(segs, "columns"), encode_segments(segs)):
        spread = np.zeros(2 * len(data), np.uint8)
        spread[::2] = np.frombuffer(data, np.uint8)
        view = memoryview(spread.data)[::2]
        assert not view.c_contiguous
        assert decode_columns(view) == segs and decode_segments(view) == segs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((("f",), [[0], [0, 0]], ("a",), [0], [("uint8", (1,))], [0], [0], [0], [1]),
         "segment columns must be integer arrays"),
        ((None, [0], ("a",), [0], [("uint8", (1,))], [0], [0], [0], [1]),
         "the fields of segment columns must be a list, got NoneType"),
        ((("f",), [0], "ab", [0], [("uint8", (1,))], [0], [0], [0], [1]),
         "the files of segment columns must be a list, got str"),
        ((("f",), [0], ("a",), [0], None, [0], [0], [0], [1]),
         "the kinds of segment columns must be a list, got NoneType"),
    ],
)  # fmt: skip
def test_columns_of_other_shapes_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(InvalidSegmentError, match=message):
        SegmentList.from_columns(*args)


def test_what_is_no_list_is_refused_as_the_list_functions_refuse_it() -> None:
    good = SegmentList([PayloadSegment("f", "a/b.bin", 0, 0, 1, "uint8", [8])])
    bad: Any
    for bad in (None, 5):
        with pytest.raises(InvalidSegmentError, match="segments must be a list of PayloadSegment"):
            SegmentList(bad)
        with pytest.raises(InvalidSegmentError) as got:
            SegmentList.merge_pd(bad, good)
        with pytest.raises(InvalidSegmentError) as want:
            merge_pd_segments(bad, [])
        assert str(got.value) == str(want.value)
        with pytest.raises(InvalidSegmentError):
            SegmentList.concat(bad)
        with pytest.raises(InvalidSegmentError):
            SegmentList.concat([good, bad])


def _mask(pos: int, rows: int, offset: int) -> PayloadSegment:
    return PayloadSegment("mask", "n0/r/0/a.bin", offset, pos, rows, "int32", [1])


@pytest.mark.parametrize(
    ("segs", "lo", "hi"),
    [
        # a later segment's rows cut in two by an earlier one's bounds: one piece again
        ([_mask(22, 2, 0), _mask(21, 2, 1)], 0, 24),
        # two segments in position order naming the same bytes: pieces in file order
        ([_mask(2, 2, 0), _mask(4, 1, 0)], 3, 5),
    ],
)
def test_segments_naming_the_same_bytes_plan_as_their_list_does(
    segs: list[PayloadSegment], lo: int, hi: int
) -> None:
    """Bytes of a file that two segments name (hypothesis found both): the columns'
    planner gives the list's pieces, sorted by file and offset, merged where back to back."""
    want = plan_window(segs, "mask", lo, hi, -1)
    for form in columnar_forms(segs):
        got = plan_window(form, "mask", lo, hi, -1)
        assert got is not None and want is not None
        assert plan_of(got) == plan_of(want)
