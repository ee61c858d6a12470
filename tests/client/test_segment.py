"""The segment model (docs/contract.md, "The segment model"): wire form, validation, row size."""

from __future__ import annotations

import msgspec
import pytest

from payload_client import InvalidSegmentError, PayloadSegment, row_nbytes, validate_segment
from payload_client.segments._segment import _path_problem, check_relative_path

GOOD = PayloadSegment("routed_experts", "n/r/0/f.bin", 128, 5, 3, "uint8", [48, 8])


def seg(**changes: object) -> PayloadSegment:
    return msgspec.structs.replace(GOOD, **changes)


def test_wire_form_is_an_array_in_contract_order() -> None:
    expected = ["routed_experts", "n/r/0/f.bin", 128, 5, 3, "uint8", [48, 8]]
    assert msgspec.json.decode(msgspec.json.encode(GOOD)) == expected
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(GOOD)) == expected
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(expected), type=PayloadSegment) == GOOD
    assert [f for f in PayloadSegment.__struct_fields__] == [
        "field", "file", "offset", "pos", "rows", "dtype", "shape"
    ]  # fmt: skip


def test_segment_is_frozen() -> None:
    with pytest.raises(AttributeError):
        GOOD.pos = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw",
    [
        ["f", "a", True, 0, 1, "uint8", [1]],  # bool is not an int
        ["f", "a", 0, 1.0, 1, "uint8", [1]],  # float is not an int
        ["f", "a", 0, 0, "1", "uint8", [1]],
        ["f", "a", 0, 0, 1, "uint8", [1.5]],
    ],
)
def test_decoding_refuses_non_integer_metadata(raw: list[object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(raw), type=PayloadSegment)


def test_row_nbytes() -> None:
    assert row_nbytes(GOOD) == 384
    assert row_nbytes(seg(dtype="uint16")) == 768
    assert row_nbytes(seg(dtype="int32", shape=[64])) == 256
    assert row_nbytes(seg(dtype="float16", shape=[3, 2, 2])) == 24


def test_zero_row_placeholder_is_valid() -> None:
    assert validate_segment(seg(rows=0, shape=[1])) is not None


@pytest.mark.parametrize(
    ("changes", "bad"),
    [
        ({"field": ""}, "field"),
        ({"file": ""}, "file"),
        ({"file": "/etc/passwd"}, "file"),
        ({"file": "../x.bin"}, "file"),
        ({"file": "a/../../x.bin"}, "file"),
        ({"file": "a/./x.bin"}, "file"),
        ({"file": "a//x.bin"}, "file"),
        ({"file": "a/x\x00.bin"}, "file"),
        ({"file": "."}, "file"),
        ({"offset": -1}, "offset"),
        ({"offset": 1.0}, "offset"),
        ({"offset": True}, "offset"),
        ({"pos": -5}, "pos"),
        ({"pos": 2**63}, "pos"),
        ({"rows": -1}, "rows"),
        ({"rows": "3"}, "rows"),
        ({"dtype": "uint64"}, "dtype"),
        ({"dtype": "float64"}, "dtype"),
        ({"dtype": "<u1"}, "dtype"),
        ({"shape": []}, "shape"),
        ({"shape": [48, 0]}, "shape"),
        ({"shape": [-1]}, "shape"),
        ({"shape": [True]}, "shape"),
        ({"shape": [2**62, 4]}, "shape"),  # row size overflows int64
        ({"pos": 2**63 - 2, "rows": 3}, "rows"),  # pos + rows overflows
        ({"offset": 2**63 - 100, "rows": 1}, "offset"),  # end overflows
    ],
)
def test_invalid_segment_names_the_bad_field(changes: dict[str, object], bad: str) -> None:
    with pytest.raises(InvalidSegmentError) as info:
        validate_segment(seg(**changes), 7)
    assert info.value.field == bad
    assert info.value.index == 7
    assert str(info.value).startswith("segment 7: ")
    assert isinstance(info.value, ValueError)


def test_not_a_segment_is_refused() -> None:
    with pytest.raises(InvalidSegmentError, match="expected a PayloadSegment"):
        validate_segment(("f", "a", 0, 0, 1, "uint8", [1]))


def test_verdicts_on_long_paths_are_not_kept() -> None:
    # a daemon checks every path it is sent: long ones must not pile up in the cache
    _path_problem.cache_clear()
    for k in range(5):
        with pytest.raises(ValueError, match="relative to the payload root"):
            check_relative_path("/" + "x" * 100_000 + str(k))
        check_relative_path("a/" + "y" * 1000 + str(k))
    check_relative_path("a/b.bin")
    assert _path_problem.cache_info().currsize == 1
