"""The writer against a real in-process vLLM engine and a real payloadd daemon: what is
written by handle reads back as vLLM's inline arrays, bit for bit, through multi-turn delta
writes, the orchestrator's truncation and packing, the trainer's CP windows and a
prefill/decode split; and what travels, by handle against inline.

Every expectation is built from vLLM's own arrays with numpy (`tests.vllm.offline`); the
daemon has its default fields table. Run with ``.venv-vllm/bin/pytest tests/vllm``
(``make check-vllm``); ``-s`` prints the figures, ``$PAYLOADD_CHECK_OUT`` (a folder) gets them
as ``vllm-offline-travel.json``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    PayloadClient,
    PayloadSegment,
    Window,
    clip_segments,
    decode_segments,
    encode_segments,
    merge_pd_responses,
    row_nbytes,
    shift_segments,
)
from payload_client.vllm import MASK, ROUTED, awrite_outputs, write_outputs
from tests.conftest import Daemon, Daemons, default_env
from tests.vllm.engine import decode_npy, offline_engine
from tests.vllm.offline import (
    SAMPLING,
    dense_masks,
    inline_micro_batch,
    params,
    prompt,
    run_turns,
    tokens_of,
)
from tests.vllm.tiny_model import LAYERS, TOP_K

WIDTH = SAMPLING["top_k"]
"""The widest support set top-k sampling keeps."""


@pytest.fixture(scope="module")
def vllm_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A real daemon with the default fields table (routed_experts uint8/uint16, fixed;
    sampling_mask int32, ragged)."""
    with Daemons(tmp_path_factory.mktemp("vllm-daemon")) as d:
        own = d.start("--node", "vllm", socket=d.folder / "payloadd.sock", env=default_env())
        yield Daemon(own.root, own.socket)


@pytest.fixture
def client(vllm_daemon: Daemon) -> Iterator[PayloadClient]:
    """A client of that daemon (rows by descriptor, over the data plane)."""
    with PayloadClient(vllm_daemon.socket) as c:
        yield c


@pytest.fixture(scope="module")
def decode_llm(tiny_model_dir: Path) -> Iterator[Any]:
    """A second in-process engine on the same model: the decode side of a P/D split."""
    llm = offline_engine(tiny_model_dir)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _read_routing(client: PayloadClient, segs: list[PayloadSegment], hi: int) -> Any:
    """Routing over ``[0, hi)`` in the stored dtype, with which rows are real."""
    return client.read_field(segs, ROUTED, 0, hi, 0, dtype=np.uint8, coverage=True)


def _covered(hi: int, lo: int, stop: int) -> np.ndarray:
    """``bool [hi]``: True on ``[lo, stop)``."""
    out = np.zeros(hi, bool)
    out[lo:stop] = True
    return out


def _check_completion(
    client: PayloadClient, segs: list[PayloadSegment], p: int, c: Any, where: str
) -> None:
    """A completion's segments read back as its inline arrays: routing rows ``[0, p + g - 1)``
    (the last sampled token has none), masks at the generated tokens ``[p, p + g)``."""
    g = len(c.token_ids)
    routing, covered = _read_routing(client, segs, p + g)
    assert routing.dtype == np.uint8, where
    np.testing.assert_array_equal(covered, _covered(p + g, 0, p + g - 1), err_msg=where)
    assert routing[: p + g - 1].tobytes() == c.routed_experts.tobytes(), where
    masks, covered = client.read_field(segs, MASK, 0, p + g, -1, coverage=True)
    assert masks is not None
    np.testing.assert_array_equal(covered, _covered(p + g, p, p + g), err_msg=where)
    want = np.full((p + g, WIDTH), -1, np.int32)
    want[p:] = dense_masks(c.sampling_mask.token_ids, WIDTH)
    assert masks.dtype == np.int32, where
    np.testing.assert_array_equal(masks, want[:, : masks.shape[1]], err_msg=where)
    assert (want[:, masks.shape[1] :] == -1).all(), where  # nothing wider was dropped


# 1. A batch of different prompt lengths, one request with n=2, one round trip.

BATCH = [(3, 5, 1), (17, 8, 1), (40, 3, 1), (75, 6, 1), (33, 7, 2)]
"""(prompt tokens, generated tokens, completions) of each request."""


@pytest.fixture(scope="module")
def batch_outputs(offline_llm: Any) -> list[Any]:
    prompts = [prompt(tokens_of(100 * i, p)) for i, (p, _, _) in enumerate(BATCH)]
    sampling = [params(max_tokens=g, n=n, seed=i) for i, (_, g, n) in enumerate(BATCH)]
    outputs: list[Any] = offline_llm.generate(prompts, sampling, use_tqdm=False)
    return outputs


def test_a_batch_reads_back_as_the_inline_arrays(
    client: PayloadClient, vllm_daemon: Daemon, batch_outputs: list[Any]
) -> None:
    outputs = batch_outputs
    assert [(len(o.prompt_token_ids), len(o.outputs)) for o in outputs] == [
        (p, n) for p, _, n in BATCH
    ]
    pair = outputs[-1].outputs
    assert list(pair[0].token_ids) != list(pair[1].token_ids)  # two samples, not one twice
    before = client.stats().appends
    written = write_outputs(client, outputs, run="offline", step=1)
    assert client.stats().appends == before + 1  # one round trip for the whole batch

    async def write_async() -> list[list[list[PayloadSegment]]]:
        async with AsyncPayloadClient(vllm_daemon.socket) as ac:
            return await awrite_outputs(ac, outputs, run="offline", step=2)

    written_async = asyncio.run(write_async())
    assert client.stats().appends == before + 2
    for segs in (written, written_async):
        for i, (out, per) in enumerate(zip(outputs, segs, strict=True)):
            assert len(per) == len(out.outputs)
            for k, (c, mine) in enumerate(zip(out.outputs, per, strict=True)):
                routed = [s for s in mine if s.field == ROUTED]
                assert [(s.dtype, s.shape) for s in routed] == [("uint8", [LAYERS, TOP_K])]
                _check_completion(client, mine, len(out.prompt_token_ids), c, f"{i}.{k}")
    # the two completions of one prompt: their own rows, the prompt's rows alike
    a, b = written[-1]
    assert a[0].offset != b[0].offset
    ra, rb = (client.read_field(s, ROUTED, 0, 33, 0, dtype=np.uint8) for s in (a, b))
    assert ra is not None and rb is not None
    assert ra.tobytes() == rb.tobytes()


# 2. Multi-turn: three turns, prefix caching, each turn writes its delta.


def test_three_turns_of_deltas_read_as_a_one_shot_run(
    client: PayloadClient, offline_llm: Any
) -> None:
    users = [[tokens_of(1000, 45), tokens_of(2000, 9), tokens_of(3000, 14)]]
    gens = [7, 5, 6]
    before = client.stats().appends
    (s,) = run_turns(offline_llm, client, users, gens, run="turns", step=0, seed=40)
    assert client.stats().appends == before + 3  # one round trip a turn
    assert s.cached[0] == 0 and all(c >= 32 for c in s.cached[1:])  # the prefix cache served
    # each turn asked only for the rows not written yet, and got them
    assert s.starts == [0, 45 + 7 - 1, 45 + 7 + 9 + 5 - 1]
    # a later turn's delta: the previous completion's last token, then its own but the last
    assert [len(d) for d in s.deltas] == [45 + 7 - 1, 1 + 9 + 5 - 1, 1 + 14 + 6 - 1]
    n = len(s.tokens)
    assert sum(map(len, users[0])) + sum(gens) == n

    (one,) = offline_llm.generate(
        [prompt(s.tokens, salt="one-shot")], params(max_tokens=1, seed=1), use_tqdm=False
    )
    assert one.num_cached_tokens == 0  # computed afresh, not from the turns' cache
    whole = one.outputs[0].routed_experts
    assert whole.shape == (n, LAYERS, TOP_K)
    routing, covered = _read_routing(client, s.segments, n)
    # rows [0, n - 1): the one-shot's last row is the final sampled token, which the
    # multi-turn engine never fed forward
    np.testing.assert_array_equal(covered, _covered(n, 0, n - 1))
    assert routing[: n - 1].tobytes() == whole[: n - 1].tobytes()
    assert routing[n - 1].tolist() == np.zeros((LAYERS, TOP_K)).tolist()

    masks, covered = client.read_field(s.segments, MASK, 0, n, -1, coverage=True)
    want = np.full((n, WIDTH), -1, np.int32)
    for pos, ids in s.masks.items():
        want[pos, : len(ids)] = ids
    np.testing.assert_array_equal(covered, (want != -1).any(axis=1))
    assert int(covered.sum()) == sum(gens)
    np.testing.assert_array_equal(masks, want)


# 3. The orchestrator packs (truncation, shift_segments), the trainer reads CP windows.


def test_packed_samples_read_by_cp_ranks_as_the_inline_tensors(
    client: PayloadClient, offline_llm: Any
) -> None:
    users = [
        [tokens_of(4000, 40), tokens_of(4100, 8), tokens_of(4200, 5)],
        [tokens_of(5000, 34), tokens_of(5100, 12), tokens_of(5200, 3)],
        [tokens_of(6000, 50), tokens_of(6100, 6), tokens_of(6200, 9)],
    ]
    samples = run_turns(offline_llm, client, users, [6, 5, 4], run="pack", step=0, seed=70)
    # truncation: the first in its last completion (masks and routing cut), the second
    # whole, the third in its second turn's user tokens (that turn's masks all gone)
    lengths = [len(samples[0].tokens) - 3, len(samples[1].tokens), 50 + 6 + 3]
    packed: list[PayloadSegment] = []
    at = 0
    for s, n in zip(samples, lengths, strict=True):
        packed += shift_segments(clip_segments(s.segments, 0, n), at)
        at += n
    padded = -(-at // 4) * 4 + 4  # a multiple of every CP degree, and padding to read
    routing, labels = inline_micro_batch(samples, lengths, padded, WIDTH)
    assert (labels != -1).any() and routing.any()

    for cp in (1, 2, 4):
        size = padded // cp
        for r in range(cp):
            lo, hi = r * size, (r + 1) * size
            mask = np.empty((size, WIDTH), np.int32)
            got, got_mask = client.read_many(
                [
                    Window(packed, ROUTED, lo, hi, 0, dtype=np.uint8),
                    Window(packed, MASK, lo + 1, hi + 1, -1, out=mask),
                ]
            )
            assert got is not None and got_mask is mask
            where = f"cp {cp} rank {r} [{lo}, {hi})"
            assert got.dtype == np.uint8 and got.shape == (size, LAYERS, TOP_K), where
            assert got.tobytes() == routing[lo:hi].tobytes(), where
            assert mask.tobytes() == labels[lo:hi].tobytes(), where


# 4. Prefill/decode on two engines, stitched by the router = one colocated engine.


def _response(token_ids: list[int], segs: list[PayloadSegment]) -> dict[str, Any]:
    """A generate response by handle: ``choices[0].payload`` = the segment arrays."""
    payload = json.loads(encode_segments(segs, "json"))
    return {"choices": [{"index": 0, "token_ids": token_ids, "payload": payload}]}


def test_prefill_and_decode_stitched_read_as_one_colocated_engine(
    client: PayloadClient, vllm_daemon: Daemon, offline_llm: Any, decode_llm: Any
) -> None:
    prompt_ids, g, seed = tokens_of(7000, 70), 9, 23
    p = len(prompt_ids)
    (co,) = offline_llm.generate(
        [prompt(prompt_ids, salt="colocated")], params(max_tokens=g, seed=seed), use_tqdm=False
    )
    colocated = co.outputs[0]
    # the prefill engine: the prompt and the first token; its rows [0, p), t0's mask at p
    (pre,) = offline_llm.generate(
        [prompt(prompt_ids, salt="prefill")], params(max_tokens=1, seed=seed), use_tqdm=False
    )
    t0 = list(pre.outputs[0].token_ids)
    # the decode engine continues from prompt + t0 (its own prefill of them stands in for a
    # KV transfer): rows [0, p + g - 1), masks of the tokens after t0 at [p + 1, p + g)
    decode_params = params(max_tokens=g - 1, seed=seed)
    (dec,) = decode_llm.generate([prompt([*prompt_ids, *t0])], decode_params, use_tqdm=False)
    rest = list(dec.outputs[0].token_ids)
    # seeded sampling is per position: the split sampled the colocated engine's tokens
    assert [*t0, *rest] == list(colocated.token_ids)

    with PayloadClient(vllm_daemon.socket) as decode_client:  # the decode node's writer
        ((pre_segs,),) = write_outputs(client, [pre], run="pd", step=0)
        ((dec_segs,),) = write_outputs(decode_client, [dec], run="pd", step=0)
    prefill, decode = _response(t0, pre_segs), _response(rest, dec_segs)
    # both fields stitch at the prefill's end: routing at p, masks at p + 1 (the prefill
    # holds the mask of t0); the default, routed_experts alone, keeps the decode's masks
    only_routed = merge_pd_responses(prefill, decode)
    merged = merge_pd_responses(prefill, decode, (ROUTED, MASK))
    assert merged == merge_pd_responses(prefill, only_routed, MASK)  # one field after the other
    payload = merged["choices"][0]["payload"]
    segs = decode_segments(payload)

    # which side holds which rows: the prefill's arrays as they came, then the decode's
    # from p on (its rows [0, p), recomputed by the decode engine, are dropped)
    (pre_routed,) = [s for s in pre_segs if s.field == ROUTED]
    (dec_routed,) = [s for s in dec_segs if s.field == ROUTED]
    routed = [s for s in segs if s.field == ROUTED]
    assert routed == [
        pre_routed,
        PayloadSegment(ROUTED, dec_routed.file, dec_routed.offset + p * row_nbytes(dec_routed),
                       p, p + g - 1 - p, "uint8", [LAYERS, TOP_K]),
    ]  # fmt: skip
    assert [s for s in segs if s.field == MASK] == [
        *(s for s in pre_segs if s.field == MASK),
        *(s for s in dec_segs if s.field == MASK),
    ]
    assert [s.pos for s in segs if s.field == MASK][:2] == [p, p + 1]

    routing, covered = _read_routing(client, segs, p + g)
    np.testing.assert_array_equal(covered, _covered(p + g, 0, p + g - 1))
    assert routing[: p + g - 1].tobytes() == colocated.routed_experts.tobytes()
    # each side alone: the prefill's rows are its inline ones, the decode's rows from p
    # (row p: t0 fed forward, which only the decode engine did) are its inline ones
    assert routing[:p].tobytes() == pre.outputs[0].routed_experts.tobytes()
    assert routing[p:-1].tobytes() == dec.outputs[0].routed_experts[p:].tobytes()

    masks, covered = client.read_field(segs, MASK, 0, p + g, -1, coverage=True)
    assert masks is not None
    np.testing.assert_array_equal(covered, _covered(p + g, p, p + g))
    np.testing.assert_array_equal(masks[p:], dense_masks(colocated.sampling_mask.token_ids, WIDTH))
    # stitched on routed_experts alone, the mask of t0 is lost
    lost = decode_segments(only_routed["choices"][0]["payload"])
    assert not client.read_field(lost, MASK, 0, p + g, -1, coverage=True).covered[p]


# 5. What travels: the response bytes and the orchestrator's memory, inline vs by handle.

TRAVEL_REQUESTS, TRAVEL_PROMPT, TRAVEL_GEN = 32, 192, 8
"""32 requests of 200 tokens (192 prompt, 8 generated)."""
REAL_ROUTING = (48, 8)
"""A real MoE's routing row (48 layers, top-8: Qwen3-30B-A3B), for the extrapolated figure."""


def _dumps(body: Any) -> bytes:
    """JSON as vLLM's server writes it (pydantic's compact form)."""
    return json.dumps(body, separators=(",", ":")).encode()


def _held(decode: Any, bodies: list[bytes]) -> tuple[Any, int, int]:
    """``decode(bodies)``, its peak and the bytes it still holds (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        held = decode(bodies)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return held, peak, current


def _decode_inline(bodies: list[bytes]) -> list[tuple[np.ndarray, list[list[int]]]]:
    """What an inline orchestrator keeps of each choice: the routing decoded, the masks."""
    out = []
    for body in bodies:
        for choice in json.loads(body)["choices"]:
            out.append((decode_npy(choice["routed_experts"]), choice["sampling_mask"]))
    return out


def _decode_handles(bodies: list[bytes]) -> list[list[PayloadSegment]]:
    return [decode_segments(c["payload"]) for b in bodies for c in json.loads(b)["choices"]]


def test_what_travels_by_handle_against_inline(client: PayloadClient, offline_llm: Any) -> None:
    from vllm.utils.serial_utils import numpy2base64  # type: ignore[import-not-found, unused-ignore]

    prompts = [prompt(tokens_of(8000 + 7 * i, TRAVEL_PROMPT)) for i in range(TRAVEL_REQUESTS)]
    outputs = offline_llm.generate(prompts, params(max_tokens=TRAVEL_GEN, seed=5), use_tqdm=False)
    before = client.stats().appends
    written = write_outputs(client, outputs, run="travel", step=0)
    assert client.stats().appends == before + 1

    def choice(c: Any, **data: Any) -> dict[str, Any]:
        return {"index": 0, "token_ids": list(c.token_ids), "finish_reason": "length", **data}

    inline, handle, inline_side, handle_side = [], [], 0, 0
    real_routing = 0
    for out, (segs,) in zip(outputs, written, strict=True):
        (c,) = out.outputs
        routed = numpy2base64(c.routed_experts)
        masks = [list(ids) for ids in c.sampling_mask.token_ids]
        payload = json.loads(encode_segments(segs, "json"))
        inline.append(_dumps({"choices": [choice(c, routed_experts=routed, sampling_mask=masks)]}))
        handle.append(_dumps({"choices": [choice(c, payload=payload)]}))
        inline_side += len(_dumps(routed)) + len(_dumps(masks))
        handle_side += len(_dumps(payload))
        shape = (len(c.routed_experts), *REAL_ROUTING)
        real_routing += len(_dumps(numpy2base64(np.zeros(shape, np.uint8))))

    inline_held, inline_peak, inline_now = _held(_decode_inline, inline)
    handle_held, handle_peak, handle_now = _held(_decode_handles, handle)
    # what either orchestrator holds is the same data: the inline arrays bit for bit
    assert len(inline_held) == len(handle_held) == TRAVEL_REQUESTS
    for (routing, masks), segs, out in zip(inline_held, handle_held, outputs, strict=True):
        p, g = len(out.prompt_token_ids), len(masks)
        assert routing.tobytes() == out.outputs[0].routed_experts.tobytes()
        got = client.read_field(segs, ROUTED, 0, p + g - 1, 0, dtype=np.uint8)
        assert got is not None and got.tobytes() == routing.tobytes()
        got = client.read_field(segs, MASK, p, p + g, -1, out=np.empty((g, WIDTH), np.int32))
        assert got is not None and got.tobytes() == dense_masks(masks, WIDTH).tobytes()

    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs)
    figures = {
        "engine": f"vLLM offline, tiny Qwen3-MoE ({LAYERS} layers, top-{TOP_K}), CPU",
        "requests": TRAVEL_REQUESTS,
        "tokens": tokens,
        "generated_tokens": TRAVEL_REQUESTS * TRAVEL_GEN,
        "mask_width": WIDTH,
        "segments": sum(len(s) for s in handle_held),
        "response_bytes_inline": sum(map(len, inline)),
        "response_bytes_by_handle": sum(map(len, handle)),
        "side_data_bytes_inline": inline_side,
        "side_data_bytes_by_handle": handle_side,
        "inline_routing_bytes_if_48x8": real_routing,
        "orchestrator_peak_bytes_inline": inline_peak,
        "orchestrator_held_bytes_inline": inline_now,
        "orchestrator_peak_bytes_by_handle": handle_peak,
        "orchestrator_held_bytes_by_handle": handle_now,
    }
    print("\ncheck-vllm what travels:", json.dumps(figures, indent=1))
    if out_dir := os.environ.get("PAYLOADD_CHECK_OUT"):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "vllm-offline-travel.json").write_text(json.dumps(figures, indent=1))
    assert handle_side < inline_side
    assert sum(map(len, handle)) < sum(map(len, inline))
    assert handle_now < inline_now
