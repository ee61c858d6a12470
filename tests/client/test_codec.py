"""Segment lists between processes: `encode_segments` / `decode_segments` in every form an
orchestrator sends them, the errors of what is not a segment list, and the collector left
as it was found."""

from __future__ import annotations

import doctest
import gc
import json

import msgspec
import pytest

from payload_client import (
    InvalidSegmentError,
    PayloadSegment,
    decode_segments,
    encode_segments,
    shift_segments,
)
from payload_client.segments import _codec as codec

SEGS = [
    PayloadSegment("routed_experts", f"n{i % 3}/r1/{i}/routed_experts-1-0.bin", 384 * i, 10 * i,
                   10, "uint8", [48, 8])
    for i in range(50)
] + [PayloadSegment("sampling_mask", "n0/r1/0/sampling_mask-1-0.bin", 0, 5, 3, "int32", [7])]  # fmt: skip


def test_the_module_examples() -> None:
    assert doctest.testmod(codec).failed == 0


@pytest.mark.parametrize(
    "sent",
    [
        lambda s: encode_segments(s),
        lambda s: msgspec.msgpack.encode(s),
        lambda s: bytearray(encode_segments(s)),
        lambda s: memoryview(encode_segments(s)),
        lambda s: encode_segments(s, "json"),
        lambda s: b"  \n" + encode_segments(s, "json"),
        lambda s: encode_segments(s, "json").decode(),
        lambda s: json.loads(encode_segments(s, "json")),  # a list of arrays
        lambda s: [list(msgspec.structs.astuple(x)) for x in s],
        lambda s: list(s),  # already segments
    ],
)
def test_every_form_decodes_to_the_same_list(sent) -> None:
    got = decode_segments(sent(SEGS))
    assert got == SEGS and all(type(s) is PayloadSegment for s in got)
    assert shift_segments(got, 7)[0].pos == 7


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([["f", "n/r/0/a", "x", 0, 1, "uint8", [1]]], "item 0, offset: Expected `int`, got `str`"),
        ([*SEGS[:2], ["f", "n/r/0/a", 0, 0, 1, "uint8"]], "item 2"),
        ({"not": "a list"}, "Expected `array`, got `object`"),
        (b"\xc1\x00", "not a msgpack or JSON list of segments"),
        ("[1, 2]", "item 0: Expected `array`, got `int`"),
        ("[[", "not a msgpack or JSON list of segments"),
        ([["f", "n/r/0/a", 0, 0, 1, "uint8", ["w"]]], "item 0, shape"),
    ],
)
def test_what_is_not_a_segment_list_is_named(data: object, message: str) -> None:
    with pytest.raises(InvalidSegmentError, match=message.replace("[", r"\[")):
        decode_segments(data)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        decode_segments(encode_segments(SEGS))
        assert gc.isenabled() is enabled
        with pytest.raises(InvalidSegmentError):
            decode_segments(b"\xc1")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
