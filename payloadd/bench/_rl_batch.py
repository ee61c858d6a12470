"""The seed's synthetic RL batch, scaled to one machine: what the RL benchmarks move.

Every sample is a multi-turn conversation of ``tokens`` tokens in ``turns`` turns. Each turn
is a prompt (80 % of its tokens) then a completion (20 %). Inference writes, per turn:

- router-replay ids ``uint8 [turn tokens, 48, 8]`` (Qwen3-30B-A3B: 48 MoE layers, top-8 of 128
  experts), field ``routed_experts``;
- a sampling mask ``int32 [completion tokens, width]`` (token ids kept by the sampler, at most
  64 a position; each turn its own width), field ``sampling_mask``;
- token ids for every position and a log-probability for every completion token (these travel
  inline in both transports).

The orchestrator packs samples first-fit into micro batches of ``seq_len`` tokens and deals
them to ``dp`` data-parallel ranks; each rank has ``cp`` context-parallel ranks, and CP rank
``r`` of a micro batch of length ``L`` (padded to a multiple of ``cp``) needs routing over
``[r L / cp, (r + 1) L / cp)`` and the mask over that window plus one (labels).

Everything is deterministic in ``(seed, sample index)``, so two processes generate the very
same rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

__all__ = [
    "EXPERTS",
    "LAYERS",
    "MASK",
    "MASK_FILL",
    "ROUTED",
    "ROUTED_FILL",
    "TOP_K",
    "VOCAB",
    "RLBatch",
    "Turn",
]

ROUTED = "routed_experts"
MASK = "sampling_mask"
LAYERS, TOP_K, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B
VOCAB = 151_936
ROUTED_FILL, MASK_FILL = 0, -1


@dataclass(frozen=True)
class Turn:
    """One request of a sample: its rows, at token positions relative to the sample.

    Attributes
    ----------
    pos : int
        First token position of the turn.
    routed : numpy.ndarray
        ``uint8 [n, 48, 8]``: router-replay ids of the turn's ``n`` tokens.
    mask_pos : int
        First token position of the completion (the masked positions run on from it).
    mask : numpy.ndarray
        ``int32 [c, width]``: sampling-mask ids of the ``c`` completion tokens.
    token_ids : list of int
        The turn's ``n`` token ids.
    logprobs : list of float
        One log-probability per completion token.
    """

    pos: int
    routed: np.ndarray
    mask_pos: int
    mask: np.ndarray
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class RLBatch:
    """Shape of the synthetic batch (defaults: a batch sized for a 2-vCPU machine).

    Attributes
    ----------
    samples : int
        Samples in the batch.
    tokens : int
        Tokens per sample.
    turns : int
        Turns (requests) per sample.
    seq_len : int
        Micro-batch length in tokens (samples longer are truncated).
    dp, cp : int
        Data-parallel ranks, and context-parallel ranks per DP rank.
    seed : int
        Seed of every random row.
    """

    samples: int = 16
    tokens: int = 32_768
    turns: int = 30
    seq_len: int = 65_536
    dp: int = 2
    cp: int = 4
    seed: int = 0

    def _bounds(self) -> list[tuple[int, int, int]]:
        """``(start, completion start, end)`` of every turn."""
        cuts = np.linspace(0, self.tokens, self.turns + 1).astype(int).tolist()
        return [(a, b - max(1, (b - a) // 5), b) for a, b in itertools.pairwise(cuts)]

    def token_lists(self, i: int) -> list[tuple[list[int], list[float]]]:
        """Per turn of sample ``i``: its token ids and its completion's log-probabilities.

        Generated from their own stream, so that a holder of segments never makes rows.
        """
        rng = np.random.default_rng((self.seed, i, 1))
        return [
            (rng.integers(0, VOCAB, b - a).tolist(), (-rng.random(b - c)).tolist())
            for a, c, b in self._bounds()
        ]

    def turns_of(self, i: int) -> Iterator[Turn]:
        """The turns of sample ``i``, generated from ``(seed, i)``."""
        rng = np.random.default_rng((self.seed, i, 0))
        lists = self.token_lists(i)
        for (a, c, b), (ids, lps) in zip(self._bounds(), lists, strict=True):
            width = int(rng.integers(1, 65))
            yield Turn(
                pos=a,
                routed=rng.integers(0, EXPERTS, (b - a, LAYERS, TOP_K), dtype=np.uint8),
                mask_pos=c,
                mask=rng.integers(0, VOCAB, (b - c, width), dtype=np.int32),
                token_ids=ids,
                logprobs=lps,
            )

    def micro_batches(self) -> list[list[tuple[int, int, int]]]:
        """First-fit packing: per micro batch, ``(sample, offset, length)`` of its members."""
        n = min(self.tokens, self.seq_len)
        bins: list[list[tuple[int, int, int]]] = []
        for i in range(self.samples):
            for b in bins:
                used = sum(m for _, _, m in b)
                if used + n <= self.seq_len:
                    b.append((i, used, n))
                    break
            else:
                bins.append([(i, 0, n)])
        return bins

    def windows(self, length: int) -> list[tuple[int, int]]:
        """The CP windows ``[lo, hi)`` of a micro batch of ``length`` tokens (padded to cp)."""
        padded = -(-length // self.cp) * self.cp
        size = padded // self.cp
        return [(r * size, (r + 1) * size) for r in range(self.cp)]

    @property
    def label(self) -> str:
        """The size column of its rows: samples x thousands of tokens a sample (``16x32k``)."""
        return f"{self.samples}x{self.tokens // 1024}k"

    @property
    def routed_bytes(self) -> int:
        """Bytes of routing rows in the whole batch."""
        return self.samples * self.tokens * LAYERS * TOP_K
