"""Helpers of the offline-engine checks (`tests.vllm.test_offline_writer`): multi-turn samples
written by handle turn by turn, and the tensors the inline path would build from vLLM's own
arrays (numpy, by hand: nothing of payload_client's reading or segment operations).

Positions are token positions of a sample, prompt then completion; a sample's routing row
``t`` is token ``t`` fed forward, its mask row at ``t`` the support set ``t`` was sampled from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from payload_client import PayloadClient, PayloadSegment
from payload_client.vllm import write_outputs
from tests.vllm.tiny_model import LAYERS, TOP_K

__all__ = [
    "SAMPLING",
    "Sample",
    "dense_masks",
    "inline_micro_batch",
    "params",
    "prompt",
    "run_turns",
    "tokens_of",
]

SAMPLING: Mapping[str, Any] = {"temperature": 0.8, "top_k": 20, "ignore_eos": True}
"""Sampling that makes masks (temperature > 0, ``top_k > 0``) and never stops early."""


def params(**more: Any) -> Any:
    """``vllm.SamplingParams`` of `SAMPLING` and ``more``."""
    from vllm import SamplingParams  # type: ignore[import-not-found, unused-ignore]

    return SamplingParams(**{**SAMPLING, **more})


def prompt(token_ids: Sequence[int], salt: str | None = None) -> Any:
    """A prompt of token ids (no tokenizer in the way); ``salt`` keeps it off other requests'
    prefix cache (vLLM's ``cache_salt``)."""
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found, unused-ignore]

    if salt is None:
        return TokensPrompt(prompt_token_ids=list(token_ids))
    return TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=salt)


def tokens_of(start: int, count: int) -> list[int]:
    """``count`` token ids from ``start``, kept in ``[10, 1000)`` of the tiny vocabulary."""
    return [10 + (start + i) % 990 for i in range(count)]


def dense_masks(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """Support sets as ``int32 [len(rows), width]``, padded with -1 (what the inline path
    builds from ``sampling_mask`` lists)."""
    out = np.full((len(rows), width), -1, np.int32)
    for j, ids in enumerate(rows):
        out[j, : len(ids)] = ids
    return out


@dataclass
class Sample:
    """A multi-turn sample as the orchestrator keeps it: by handle and, beside it, vLLM's
    inline arrays (to build the expectations from)."""

    tokens: list[int] = field(default_factory=list)
    """The sample so far: every turn's prompt, then its completion."""
    segments: list[PayloadSegment] = field(default_factory=list)
    """Every turn's segments, in turn order."""
    deltas: list[np.ndarray] = field(default_factory=list)
    """Each turn's inline ``routed_experts`` (its delta)."""
    starts: list[int] = field(default_factory=list)
    """Each turn's ``routed_experts_prompt_start``."""
    cached: list[int] = field(default_factory=list)
    """Each turn's ``num_cached_tokens`` (prefix-cache hits)."""
    masks: dict[int, list[int]] = field(default_factory=dict)
    """Position -> the inline support set of the token there (generated tokens only)."""

    def routing(self) -> np.ndarray:
        """The inline routing of the whole sample: the turns' deltas end to end
        (``uint8 [len(tokens) - 1, layers, top_k]``)."""
        return np.concatenate(self.deltas)


def run_turns(
    llm: Any,
    client: PayloadClient,
    users: Sequence[Sequence[Sequence[int]]],
    gens: Sequence[int],
    *,
    run: str,
    step: int,
    seed: int,
) -> list[Sample]:
    """Roll out ``len(users)`` multi-turn samples together, turn by turn.

    Turn ``t`` of sample ``i`` prompts with the sample so far plus ``users[i][t]``, generates
    ``gens[t]`` tokens, and asks only for the rows not written yet
    (``routed_experts_prompt_start = len(sample so far) - 1``: the last token of the previous
    completion was never fed forward, so its row is this turn's first). Each turn's outputs
    go to the daemon in one `write_outputs` call.
    """
    samples = [Sample() for _ in users]
    for t, gen in enumerate(gens):
        prompts, sampling = [], []
        for i, s in enumerate(samples):
            start = max(len(s.tokens) - 1, 0)
            s.starts.append(start)
            prompts.append(prompt([*s.tokens, *users[i][t]]))
            sampling.append(
                params(max_tokens=gen, seed=seed + 100 * i + t, routed_experts_prompt_start=start)
            )
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        written = write_outputs(client, outputs, run=run, step=step)
        for s, out, segs in zip(samples, outputs, written, strict=True):
            (c,) = out.outputs
            (mine,) = segs
            p = len(out.prompt_token_ids)
            s.segments += mine
            s.deltas.append(np.array(c.routed_experts, copy=True))
            s.cached.append(out.num_cached_tokens)
            s.masks.update({p + j: list(ids) for j, ids in enumerate(c.sampling_mask.token_ids)})
            s.tokens = [*out.prompt_token_ids, *c.token_ids]
    return samples


def inline_micro_batch(
    samples: Sequence[Sample], lengths: Sequence[int], padded: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """The inline path's tensors of a micro batch: each sample truncated to ``lengths[i]``
    tokens and packed after the previous ones, then padded to ``padded`` positions.

    Returns
    -------
    routing : numpy.ndarray
        ``uint8 [padded, layers, top_k]``: each sample's inline routing rows at its tokens,
        0 (expert 0) where no row is (a sample's last token, padding).
    labels : numpy.ndarray
        ``int32 [padded, width]``: the mask tensor (the support set of the token at each
        position, -1 where none) shifted left by one, its last position -1: the masks of the
        predictions made at each position.
    """
    routing = np.zeros((padded, LAYERS, TOP_K), np.uint8)
    masks = np.full((padded + 1, width), -1, np.int32)
    at = 0
    for s, n in zip(samples, lengths, strict=True):
        rows = s.routing()[:n]
        routing[at : at + len(rows)] = rows
        for pos, ids in s.masks.items():
            if pos < n:
                masks[at + pos, : len(ids)] = ids
        at += n
    return routing, masks[1:]
