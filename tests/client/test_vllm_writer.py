"""The vLLM writer without vLLM: completions of vLLM's shapes (plain objects with the same
attributes), written to a real daemon and read back bit for bit."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from payload_client import AsyncPayloadClient, InvalidRequestError, PayloadClient
from payload_client.vllm import MASK, ROUTED, awrite_outputs, mask_blocks, write_outputs

LAYERS, TOP_K = 2, 2


@dataclass
class Mask:
    token_ids: list[list[int]]


@dataclass
class Completion:
    token_ids: list[int]
    routed_experts: np.ndarray | None = None
    sampling_mask: Mask | None = None


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Completion] = field(default_factory=list)


def completion(rng: np.random.Generator, prompt_len: int, gen_len: int, start: int = 0,
               widths: list[int] | None = None, dtype: type = np.uint8) -> Completion:  # fmt: skip
    """A completion as vLLM gives it: routing of every token fed forward from ``start``
    (the prompt and the completion but its last token), a support set per generated token."""
    fed = prompt_len + gen_len - 1
    routed: np.ndarray = rng.integers(0, 8, (fed - start, LAYERS, TOP_K)).astype(dtype)
    widths = widths or [TOP_K * 2] * gen_len
    mask = Mask([sorted(rng.choice(1024, w, replace=False).tolist()) for w in widths])
    return Completion(list(rng.integers(0, 1024, gen_len)), routed, mask)


def dense_mask(c: Completion, width: int) -> np.ndarray:
    assert c.sampling_mask is not None
    out = np.full((len(c.sampling_mask.token_ids), width), -1, np.int32)
    for j, ids in enumerate(c.sampling_mask.token_ids):
        out[j, : len(ids)] = ids
    return out


def test_a_batch_is_written_in_one_round_trip_and_reads_back_bit_for_bit(
    client: PayloadClient,
    run_name: str,
) -> None:
    rng = np.random.default_rng(0)
    outputs = [
        Output(list(range(p)), [completion(rng, p, g) for _ in range(n)])
        for p, g, n in ((5, 8, 1), (17, 3, 2), (40, 1, 1))
    ]
    before = client.stats().appends
    segs = write_outputs(client, outputs, run=run_name, step=0)
    assert client.stats().appends == before + 1  # one round trip for the batch
    for out, per in zip(outputs, segs, strict=True):
        p = len(out.prompt_token_ids)
        for c, mine in zip(out.outputs, per, strict=True):
            g = len(c.token_ids)
            assert c.routed_experts is not None
            np.testing.assert_array_equal(
                client.read_field(mine, ROUTED, 0, p + g - 1, 0), c.routed_experts
            )
            np.testing.assert_array_equal(
                client.read_field(mine, MASK, p, p + g, -1), dense_mask(c, TOP_K * 2)
            )


def test_the_delta_of_a_later_turn_goes_where_its_tokens_are(
    client: PayloadClient, run_name: str
) -> None:
    """``routed_experts_prompt_start=k``: rows from token k; a second turn's delta after
    the first turn's rows reads as the whole sample's routing."""
    rng = np.random.default_rng(1)
    whole = completion(rng, 30, 6)
    assert whole.routed_experts is not None
    first = Completion(whole.token_ids[:4], whole.routed_experts[: 12 + 4 - 1], None)
    # turn 2: prompt = turn 1's prompt + its completion + the user's next words (30 tokens)
    second = Completion(whole.token_ids, whole.routed_experts[15:], None)
    segs = write_outputs(client, [Output([0] * 12, [first])], run=run_name, step=1, fields=[ROUTED])
    segs2 = write_outputs(
        client, [Output([0] * 30, [second])], run=run_name, step=1, fields=[ROUTED]
    )
    assert segs2[0][0][0].pos == 15
    both = segs[0][0] + segs2[0][0]
    np.testing.assert_array_equal(client.read_field(both, ROUTED, 0, 35, 0), whole.routed_experts)


def test_masks_of_varying_widths_keep_each_row_its_own_width(
    client: PayloadClient, run_name: str
) -> None:
    rng = np.random.default_rng(2)
    widths = [3, 3, 1, 5, 5, 5, 2]
    c = completion(rng, 4, len(widths), widths=widths)
    (per,) = write_outputs(client, [Output([1] * 4, [c])], run=run_name, step=2, fields=[MASK])
    masks = [s for s in per[0] if s.field == MASK]
    assert [(s.pos, s.rows, s.shape) for s in masks] == [
        (4, 2, [3]), (6, 1, [1]), (7, 3, [5]), (10, 1, [2])
    ]  # fmt: skip
    np.testing.assert_array_equal(client.read_field(masks, MASK, 4, 11, -1), dense_mask(c, 5))


def test_uint16_routing_above_256_experts(client: PayloadClient, run_name: str) -> None:
    rng = np.random.default_rng(3)
    c = completion(rng, 6, 4, dtype=np.uint16)
    assert c.routed_experts is not None
    c.routed_experts[:] = rng.integers(0, 384, c.routed_experts.shape)
    (per,) = write_outputs(client, [Output([2] * 6, [c])], run=run_name, step=0, fields=[ROUTED])
    got = client.read_field(per[0], ROUTED, 0, 9, 0, dtype=np.uint16)
    assert got is not None
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, c.routed_experts)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (lambda c: setattr(c, "routed_experts", None), "enable_return_routed_experts"),
        (lambda c: setattr(c, "sampling_mask", None), "return_sampling_mask"),
        (lambda c: setattr(c, "routed_experts", np.zeros((20, 2, 2), np.uint8)), "more than"),
        (lambda c: setattr(c, "routed_experts", np.zeros((3, 2, 2), np.int64)), "uint8 or"),
        (lambda c: c.sampling_mask.token_ids.pop(), "for 4 generated"),
        (lambda c: c.sampling_mask.token_ids.__setitem__(1, []), "row 1 is empty"),
    ],
)
def test_a_completion_that_does_not_hold_what_was_asked_writes_nothing(
    client: PayloadClient, broken: object, message: str, run_name: str
) -> None:
    rng = np.random.default_rng(4)
    good, bad = completion(rng, 5, 4), completion(rng, 5, 4)
    broken(bad)  # type: ignore[operator]
    before = client.stats().appends
    with pytest.raises(InvalidRequestError, match=message) as info:
        write_outputs(
            client, [Output([0] * 5, [good]), Output([0] * 5, [bad])], run=run_name, step=3
        )
    assert "outputs[1].outputs[0]" in str(info.value)
    assert client.stats().appends == before  # not even the good one


def test_mask_blocks_group_rows_of_one_width_in_a_row() -> None:
    blocks = mask_blocks([[1, 2], [3, 4], [5], [6, 7]])
    assert [(at, b.tolist()) for at, b in blocks] == [
        (0, [[1, 2], [3, 4]]), (2, [[5]]), (3, [[6, 7]])
    ]  # fmt: skip
    assert all(b.dtype == np.int32 for _, b in blocks)
    assert mask_blocks([]) == []


@pytest.mark.asyncio
async def test_the_async_writer(aclient: AsyncPayloadClient, run_name: str) -> None:
    rng = np.random.default_rng(5)
    c = completion(rng, 9, 5)
    assert c.routed_experts is not None
    (per,) = await awrite_outputs(aclient, [Output([3] * 9, [c])], run=run_name, step=0)
    got = await aclient.read_field(per[0], ROUTED, 0, 13, 0)
    np.testing.assert_array_equal(got, c.routed_experts)
