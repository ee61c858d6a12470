"""The scaffolding runs a real vLLM engine on this CPU: routed experts and sampling masks come
back in-process and over HTTP in the shapes the writer is built for.

Run with ``.venv-vllm/bin/pytest tests/vllm`` (``make check-vllm``); never collected elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.vllm.engine import decode_npy, post_json
from tests.vllm.tiny_model import EXPERTS, LAYERS, TOP_K

PROMPTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "A mixture of experts routes every token to two of its eight experts.",
]
"""Three prompts of different lengths (3, 33 and 14 tokens)."""
GEN = 8
SAMPLING = {"temperature": 0.8, "top_k": 20, "max_tokens": GEN, "ignore_eos": True}
"""Sampling that makes masks (temperature > 0, ``top_k > 0``), ``GEN`` tokens every time."""


def _params(**more: Any) -> Any:
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    return SamplingParams(**{**SAMPLING, **more})


def _check_routing(routing: Any, rows: int) -> None:
    assert isinstance(routing, np.ndarray)
    assert routing.dtype == np.uint8
    assert routing.shape == (rows, LAYERS, TOP_K)
    assert int(routing.max()) < EXPERTS
    # the top-k of one token never names an expert twice
    assert (routing[:, :, 0] != routing[:, :, 1]).all()


def _check_masks(masks: list[list[int]], sampled: list[int]) -> None:
    assert len(masks) == len(sampled)
    for ids, token in zip(masks, sampled, strict=True):
        assert 0 < len(ids) <= SAMPLING["top_k"]
        assert token in ids


def test_offline_routing_and_masks(offline_llm: Any) -> None:
    outputs = offline_llm.generate(PROMPTS, _params(), use_tqdm=False)
    lengths = set()
    for out in outputs:
        (c,) = out.outputs
        prompt, gen = len(out.prompt_token_ids), len(c.token_ids)
        assert gen == GEN
        lengths.add(prompt)
        _check_routing(c.routed_experts, prompt + gen - 1)
        _check_masks(c.sampling_mask.token_ids, list(c.token_ids))
    assert len(lengths) == len(PROMPTS)


def test_offline_prompt_start_drops_rows(offline_llm: Any) -> None:
    """``routed_experts_prompt_start=k``: the same rows less the first k (a prefix-cache hit
    the second and third time: the rows of cached tokens come back all the same)."""
    prompt = PROMPTS[1]
    (full,) = offline_llm.generate([prompt], _params(seed=7), use_tqdm=False)
    (again,) = offline_llm.generate([prompt], _params(seed=7), use_tqdm=False)
    (delta,) = offline_llm.generate(
        [prompt], _params(seed=7, routed_experts_prompt_start=5), use_tqdm=False
    )
    assert again.num_cached_tokens > 0
    assert list(again.outputs[0].token_ids) == list(full.outputs[0].token_ids)
    routing = full.outputs[0].routed_experts
    assert np.array_equal(again.outputs[0].routed_experts, routing)
    assert np.array_equal(delta.outputs[0].routed_experts, routing[5:])


def test_http_completions_routing(openai_server: str, tiny_model_dir: Path) -> None:
    body = {
        "model": str(tiny_model_dir),
        "prompt": PROMPTS,
        **SAMPLING,
        "return_token_ids": True,
    }
    answer = post_json(f"{openai_server}/v1/completions", body)
    assert len(answer["choices"]) == len(PROMPTS)
    for choice in answer["choices"]:
        rows = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1
        _check_routing(decode_npy(choice["routed_experts"]), rows)
        assert "sampling_mask" not in choice  # masks only on /inference/v1/generate

    one = post_json(
        f"{openai_server}/v1/completions",
        {**body, "prompt": PROMPTS[0], "routed_experts_prompt_start": 2, "seed": 3},
    )
    (choice,) = one["choices"]
    rows = len(choice["prompt_token_ids"]) + len(choice["token_ids"]) - 1 - 2
    _check_routing(decode_npy(choice["routed_experts"]), rows)


def test_http_chat_routing(openai_server: str, tiny_model_dir: Path) -> None:
    body = {
        "model": str(tiny_model_dir),
        "messages": [{"role": "user", "content": "Hello world!"}],
        **SAMPLING,
        "return_token_ids": True,
    }
    answer = post_json(f"{openai_server}/v1/chat/completions", body)
    (choice,) = answer["choices"]
    # the chat template's tokens are in the prompt (prompt_token_ids at the top level)
    rows = len(answer["prompt_token_ids"]) + len(choice["token_ids"]) - 1
    _check_routing(decode_npy(choice["routed_experts"]), rows)


def test_http_generate_routing_and_masks(openai_server: str, tiny_model_dir: Path) -> None:
    prompt = [5, 6, 7, 8, 9]
    body = {"model": str(tiny_model_dir), "token_ids": prompt, "sampling_params": SAMPLING}
    answer = post_json(f"{openai_server}/inference/v1/generate", body)
    (choice,) = answer["choices"]
    assert len(choice["token_ids"]) == GEN
    _check_routing(decode_npy(choice["routed_experts"]), len(prompt) + GEN - 1)
    _check_masks(choice["sampling_mask"], choice["token_ids"])


def test_http_equals_offline(openai_server: str, tiny_model_dir: Path, offline_llm: Any) -> None:
    """Two engines, one model: the same seed gives the same tokens, routing and masks bit for
    bit; and a prefill of prompt + completion (no cache) routes as the decode steps did."""
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]

    prompt = list(range(100, 140))
    body = {
        "model": str(tiny_model_dir),
        "token_ids": prompt,
        "sampling_params": {**SAMPLING, "seed": 11},
    }
    (choice,) = post_json(f"{openai_server}/inference/v1/generate", body)["choices"]
    (out,) = offline_llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)], _params(seed=11), use_tqdm=False
    )
    c = out.outputs[0]
    assert list(c.token_ids) == choice["token_ids"]
    assert np.array_equal(c.routed_experts, decode_npy(choice["routed_experts"]))
    assert c.sampling_mask.token_ids == choice["sampling_mask"]

    whole = TokensPrompt(prompt_token_ids=[*prompt, *c.token_ids[:-1]], cache_salt="no-cache")
    (again,) = offline_llm.generate([whole], _params(max_tokens=1), use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert np.array_equal(again.outputs[0].routed_experts, c.routed_experts)
