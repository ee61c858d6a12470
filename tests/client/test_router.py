"""Prefill/decode stitching (docs/contract.md, "Pure segment operations") of segments and of whole generate responses."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
import numpy as np
import pytest

from payload_client import (
    InvalidRequestError,
    InvalidSegmentError,
    PayloadClient,
    PayloadSegment,
    merge_pd_responses,
    merge_pd_segments,
    prefill_has_routed_experts,
)

R = "routed_experts"
M = "sampling_mask"
ITEMSIZE = {"uint8": 1, "uint16": 2}


def seg(field: str, pos: int, rows: int, offset: int = 0, dtype: str = "uint8",
        shape: list[int] | None = None, file: str = "n/r/0/d.bin") -> list[Any]:  # fmt: skip
    """A segment as the 7-element JSON array a generate response carries."""
    return [field, file, offset, pos, rows, dtype, shape or [48, 8]]


def response(*payloads: list[list[Any]] | None, **extra: Any) -> dict[str, Any]:
    choices = [{"index": i, "payload": p} for i, p in enumerate(payloads)]
    return {"id": "cmpl-1", "choices": choices, **extra}


# -- merge_pd_segments: prepend, drop, partial trim -------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_merge_pd_segments_prepends_drops_and_trims(dtype: str) -> None:
    rb = ITEMSIZE[dtype] * 48 * 8
    pre = [
        PayloadSegment(R, "p.bin", 0, 0, 60, dtype, [48, 8]),
        PayloadSegment(R, "p.bin", 60 * rb, 60, 40, dtype, [48, 8]),
    ]
    dec = [
        PayloadSegment(R, "d.bin", 0, 90, 10, dtype, [48, 8]),  # [90, 100): dropped
        PayloadSegment(M, "m.bin", 0, 99, 3, "int32", [5]),  # other field: as is
        PayloadSegment(R, "d.bin", 10 * rb, 97, 20, dtype, [48, 8]),  # 3 rows trimmed
        PayloadSegment(R, "d.bin", 30 * rb, 117, 5, dtype, [48, 8]),  # after cut: as is
    ]
    got = merge_pd_segments(pre, dec)
    assert got == [
        pre[0],
        pre[1],
        dec[1],
        PayloadSegment(R, "d.bin", 13 * rb, 100, 17, dtype, [48, 8]),
        dec[3],
    ]


def test_merge_pd_segments_errors_keep_the_index() -> None:
    bad = PayloadSegment(R, "/abs.bin", 0, 0, 1, "uint8", [1])
    with pytest.raises(InvalidSegmentError, match="decode segment 1: file") as info:
        merge_pd_segments([], [PayloadSegment(M, "a.bin", 0, 0, 1, "uint8", [1]), bad])
    assert (info.value.index, info.value.field) == (1, "file")


# -- merge_pd_responses -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_responses_prepend_prefill_to_every_decode_choice(dtype: str) -> None:
    rb = ITEMSIZE[dtype] * 48 * 8
    pre_r = seg(R, 0, 100, dtype=dtype, file="p.bin")
    prefill = response([seg(M, 0, 100, dtype="int32", shape=[4], file="pm.bin"), pre_r])
    decode = response(
        [seg(R, 99, 31, dtype=dtype)],  # one row overlaps: trimmed
        [seg(R, 80, 20, dtype=dtype), seg(R, 100, 5, offset=20 * rb, dtype=dtype)],  # dropped
        None,  # no payload: gets the prefill segments
    )
    before = copy.deepcopy((prefill, decode))
    got = merge_pd_responses(prefill, decode)
    assert (prefill, decode) == before  # inputs untouched
    assert got["id"] == "cmpl-1"
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert got["choices"][0]["payload"] == [pre_r, seg(R, 100, 30, offset=rb, dtype=dtype)]
    assert got["choices"][1]["payload"] == [pre_r, seg(R, 100, 5, offset=20 * rb, dtype=dtype)]
    assert got["choices"][2]["payload"] == [pre_r]
    assert prefill_has_routed_experts(prefill)


def test_responses_keep_other_fields_of_decode_in_order() -> None:
    prefill = response([seg(R, 0, 10, file="p.bin"), seg(M, 0, 10, shape=[9], file="pm.bin")])
    m1, m2, x = seg(M, 9, 2, shape=[3]), seg(M, 11, 4, shape=[7]), seg("weights", 9, 6, shape=[1])
    decode = response([m1, seg(R, 9, 6), x, m2])
    got = merge_pd_responses(prefill, decode)["choices"][0]["payload"]
    assert got == [seg(R, 0, 10, file="p.bin"), m1, seg(R, 10, 5, offset=384), x, m2]
    # stitching another field leaves routed_experts to the decode side
    got = merge_pd_responses(prefill, decode, field=M)["choices"][0]["payload"]
    want = [seg(M, 0, 10, shape=[9], file="pm.bin"), seg(M, 10, 1, offset=3, shape=[3])]
    assert got == [*want, seg(R, 9, 6), x, m2]


def test_responses_stitch_several_fields_one_after_the_other() -> None:
    """Prefill: the prompt's routing [0, 10) and the first generated token's mask (10);
    decode (prompt + that token): routing [0, 14), masks from 11. Both fields stitched: the
    prefill's rows, then the decode's from the prefill's end; one field at a time gives the
    same, and the routed field alone loses the prefill's mask row."""
    pre_r, pre_m = seg(R, 0, 10, file="p.bin"), seg(M, 10, 1, shape=[4], file="pm.bin")
    dec_r, dec_m = seg(R, 0, 14), seg(M, 11, 3, shape=[4], file="dm.bin")
    prefill, decode = response([pre_r, pre_m]), response([dec_r, dec_m])
    both = merge_pd_responses(prefill, decode, (R, M))
    assert both == merge_pd_responses(prefill, merge_pd_responses(prefill, decode), M)
    want = [pre_m, pre_r, seg(R, 10, 4, offset=10 * 384), dec_m]
    assert both["choices"][0]["payload"] == want
    alone = merge_pd_responses(prefill, decode)["choices"][0]["payload"]
    assert pre_m not in alone and dec_m in alone
    for bad in ([], [R, ""], [R, 3]):
        with pytest.raises(InvalidRequestError, match="sequence of them"):
            merge_pd_responses(prefill, decode, bad)  # type: ignore[arg-type]


def test_responses_no_op_without_routed_segments() -> None:
    prefill = response([seg(M, 0, 4, shape=[2])], None)
    decode = response([seg(M, 4, 2, shape=[3])], None, [], extra={"usage": 3})
    decode["choices"][1].pop("payload")
    assert merge_pd_responses(prefill, decode) == decode
    assert merge_pd_responses({"choices": []}, decode) == decode
    assert not prefill_has_routed_experts(prefill)
    assert not prefill_has_routed_experts({"choices": []})


def test_responses_pass_trailing_wire_elements_through() -> None:
    """Arrays of a newer wire version (fields appended at the end) keep their extras."""
    pre = [*seg(R, 0, 10, file="p.bin"), "new"]
    dec = [*seg(R, 8, 4), {"k": 1}]
    got = merge_pd_responses(response([pre]), response([dec]))["choices"][0]["payload"]
    assert got == [pre, [*seg(R, 10, 2, offset=768), {"k": 1}]]


def test_decode_without_prefill_is_an_error() -> None:
    with pytest.raises(InvalidRequestError, match="prefill has none"):
        merge_pd_segments([PayloadSegment(M, "a.bin", 0, 0, 1, "uint8", [1])],
                          [PayloadSegment(R, "a.bin", 0, 0, 1, "uint8", [1])])  # fmt: skip
    prefill = response([seg(M, 0, 4, shape=[2])])
    decode = response([seg(M, 4, 1)], [seg(R, 4, 1)])
    with pytest.raises(InvalidRequestError, match=r"decode choices\[1\].*prefill has none"):
        merge_pd_responses(prefill, decode)


@pytest.mark.parametrize(
    ("pre", "dec", "match"),
    [
        ([seg(R, 2**63 - 2, 5)], [], r"prefill choices\[0\].payload\[0\].*pos \+ rows overflows"),
        ([seg(R, 0, 5)], [seg(R, 0, 2**62)], r"decode choices\[0\].payload\[0\].*row_nbytes"),
        ([seg(R, 0, 5)], [seg(R, 0, 1, shape=[2**62, 4])], "row size overflows"),
        ([seg(R, 0, 5)], [seg(R, 0, 1, offset=2**64)], "offset must be in"),
        ([seg(R, 0, 5)], [seg(R, -1, 1)], "pos must be in"),
        ([seg(R, 0, 5.0)], [], r"payload\[0\]: rows must be an integer, got float"),  # type: ignore[arg-type]
        ([seg(R, 0, 5)], [seg(R, True, 1)], "pos must be an integer"),
        ([seg(R, 0, 5)], [seg(R, 0, 1, dtype="int64")], "dtype must be one of"),
        ([seg(R, 0, 5)], [seg(R, 0, 1, file="../x.bin")], "file must"),
        ([seg(R, 0, 5)], [seg(R, 0, 1)[:6]], "must be an array"),
        ([seg(R, 0, 5)], [{"field": R}], "must be an array"),
    ],
)
def test_invalid_or_overflowing_metadata_is_an_error(
    pre: list[Any], dec: list[Any], match: str
) -> None:
    with pytest.raises(InvalidSegmentError, match=match):
        merge_pd_responses(response(pre), response(dec))


@pytest.mark.parametrize(
    ("prefill", "decode", "match"),
    [
        ([], response([]), "prefill response must be a JSON object"),
        ({"choices": None}, response([]), "prefill response must have a 'choices' list"),
        (response([]), {"choices": [1]}, r"decode choices\[0\] must be a JSON object"),
        (
            {"choices": [{"payload": {"x": 1}}]},
            response([]),
            r"prefill choices\[0\].payload must be a list",
        ),
    ],
)
def test_malformed_responses_are_refused(prefill: Any, decode: Any, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        merge_pd_responses(prefill, decode)


def test_prefill_has_routed_experts_inline_or_by_handle() -> None:
    assert prefill_has_routed_experts({"choices": [{"routed_experts": [[[1]]]}]})
    assert prefill_has_routed_experts(response([seg(M, 0, 1), seg(R, 0, 1)]))
    assert not prefill_has_routed_experts({"choices": [{"routed_experts": None}]})
    assert not prefill_has_routed_experts(response(None, [seg(R, 0, 1)]))  # only choices[0]
    with pytest.raises(InvalidSegmentError, match="offset"):
        prefill_has_routed_experts(response([seg(R, 0, 1, offset=-3)]))
    with pytest.raises(InvalidRequestError, match="field must be"):
        prefill_has_routed_experts(response([]), field="")


# -- round trip through a real daemon ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_stitched_segments_read_prefill_rows_then_decode_rows(
    client: PayloadClient, dtype: str
) -> None:
    rng = np.random.default_rng(5)
    prompt_len, new_tokens, shape = 37, 12, (48, 8)
    top = 255 if dtype == "uint8" else 1000
    pre_rows = rng.integers(0, top, (prompt_len, *shape)).astype(dtype)
    # decode's first forward is at prompt_len - 1: its first row overlaps prefill's last
    dec_rows = rng.integers(0, top, (new_tokens + 1, *shape)).astype(dtype)
    mask = rng.integers(-1, 50, (new_tokens, 6)).astype("int32")
    run = f"router-{dtype}"
    pre = client.append(R, pre_rows, 0, run=run, step=0)
    dec = client.append(R, dec_rows[:5], prompt_len - 1, run=run, step=0)
    dec += client.append(R, dec_rows[5:], prompt_len + 4, run=run, step=0)
    dec_mask = client.append(M, mask, prompt_len, run=run, step=0)
    # responses as a router gets them: JSON text
    prefill = json.loads(json.dumps(response(msgspec.to_builtins(pre))))
    decode = json.loads(json.dumps(response(msgspec.to_builtins([*dec_mask, *dec]))))
    assert prefill_has_routed_experts(prefill)

    payload = merge_pd_responses(prefill, decode)["choices"][0]["payload"]
    stitched = msgspec.convert(payload, list[PayloadSegment])
    end = prompt_len + new_tokens
    got = client.read_field(stitched, R, 0, end, fill=0)
    assert got is not None
    want = np.concatenate([pre_rows, dec_rows[1:]]).astype(np.int32)
    np.testing.assert_array_equal(got, want)
    got_mask = client.read_field(stitched, M, prompt_len, end, fill=-1)
    np.testing.assert_array_equal(got_mask, mask)
    # unstitched, decode's overlapping row would win at prompt_len - 1
    raw = client.read_field([*pre, *dec], R, prompt_len - 1, prompt_len, fill=0)
    assert raw is not None
    assert not np.array_equal(raw[0], pre_rows[-1])
