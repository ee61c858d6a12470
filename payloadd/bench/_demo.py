"""``payloadd demo``: one RL step end to end, checked bit for bit against the inline path.

1. A daemon starts on a temporary root and socket (a real ``payloadd serve`` process).
2. Inference: multi-turn samples write router-replay ids ``uint8 [tokens, 48, 8]`` and
   ragged sampling masks (``int32 [tokens, width]``, each request at its own width, on about
   20 % of the tokens), concurrently, and keep only the segments.
3. Orchestrator: truncates samples to the sequence length (`clip_segments`), packs them
   into micro batches (`shift_segments`), pads each micro batch to a multiple of the CP
   degree, deals micro batches to the DP ranks. Segments only; no row bytes.
4. Trainer: every (DP, CP) rank reads its routing window ``[lo, hi)`` and its mask window
   ``[lo + 1, hi + 1)`` in one round trip, and compares them with the same data carried
   inline (dense tensors packed the same way, the mask shifted left by one).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from payload_client import (
    AsyncClusterClient,
    AsyncPayloadClient,
    PayloadSegment,
    Window,
    clip_segments,
    shift_segments,
)
from payloadd.bench._rl_batch import EXPERTS, LAYERS, MASK, MASK_FILL, ROUTED, ROUTED_FILL, TOP_K

__all__ = [
    "CPResult",
    "MicroBatch",
    "Sample",
    "inline_tensors",
    "make_samples",
    "pack",
    "train_step",
    "write_samples",
]


@dataclass
class Sample:
    """One multi-turn sample: its inline rows and, once written, its segments.

    ``routed`` is ``uint8 [tokens, 48, 8]``; ``mask`` is ``int32 [tokens, width]`` (``-1``
    where a position has no mask row or fewer ids than the width); ``turns`` are the
    ``(start, end)`` token positions of each request.
    """

    routed: np.ndarray
    mask: np.ndarray
    turns: list[tuple[int, int]]
    mask_runs: list[tuple[int, int, int]]  # (start, end, width) of each masked span
    segments: list[PayloadSegment] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.routed)


def make_samples(n: int, max_tokens: int, seed: int) -> list[Sample]:
    """Random multi-turn samples of up to ``max_tokens`` tokens (deterministic in ``seed``)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = int(rng.integers(min(max(2, max_tokens // 8), max_tokens), max_tokens + 1))
        n_turns = int(rng.integers(1, 7))
        cuts = np.sort(
            rng.choice(np.arange(1, tokens), size=min(n_turns - 1, tokens - 1), replace=False)
        )
        bounds = [0, *map(int, cuts), tokens]
        turns = list(itertools.pairwise(bounds))
        routed = rng.integers(0, EXPERTS, (tokens, LAYERS, TOP_K), dtype=np.uint8)
        runs: list[tuple[int, int, int]] = []
        for a, b in turns:
            width = int(rng.integers(1, 65))  # each request at its own width, <= 64 ids
            start = a + (b - a) // 2  # masks fall in the completion half of the turn
            span = max(1, (b - a) // 5)  # ~20 % of the turn's tokens
            s = int(rng.integers(start, max(start + 1, b - span + 1)))
            runs.append((s, min(b, s + span), width))
        wmax = max(w for _, _, w in runs)
        mask = np.full((tokens, wmax), MASK_FILL, np.int32)
        for s, e, w in runs:
            k = rng.integers(1, w + 1, size=e - s)
            ids = rng.integers(0, 151_936, (e - s, w), dtype=np.int32)
            ids[np.arange(w) >= k[:, None]] = MASK_FILL
            mask[s:e, :w] = ids
        out.append(Sample(routed, mask, turns, runs))
    return out


async def write_samples(
    client: AsyncPayloadClient, samples: list[Sample], writers: int, run: str, step: int
) -> None:
    """Inference side: each request appends its routing rows and mask rows in one round trip."""
    queue: asyncio.Queue[Sample] = asyncio.Queue()
    for s in samples:
        queue.put_nowait(s)

    async def worker() -> None:
        while not queue.empty():
            s = queue.get_nowait()
            for a, b in s.turns:
                items = [(ROUTED, s.routed[a:b], a)]
                items += [
                    (MASK, s.mask[rs:re_, :w], rs) for rs, re_, w in s.mask_runs if a <= rs < b
                ]
                for segs in await client.append_many(items, run=run, step=step):
                    s.segments.extend(segs)

    await asyncio.gather(*(worker() for _ in range(writers)))


@dataclass
class MicroBatch:
    """A packed micro batch: segments shifted to their offsets, length padded to the CP degree."""

    length: int
    segments: list[PayloadSegment]
    members: list[tuple[int, int, int]]  # (sample index, offset, truncated length)


def pack(samples: list[Sample], seq_len: int, cp: int) -> list[MicroBatch]:
    """Orchestrator side: truncate, first-fit pack, pad to a multiple of ``cp``; segments only."""
    bins: list[list[tuple[int, int]]] = []  # (sample index, truncated length)
    for i, s in enumerate(samples):
        n = min(s.tokens, seq_len)
        for b in bins:
            if sum(m for _, m in b) + n <= seq_len:
                b.append((i, n))
                break
        else:
            bins.append([(i, n)])
    out = []
    for b in bins:
        segs: list[PayloadSegment] = []
        members = []
        offset = 0
        for i, n in b:
            segs += shift_segments(clip_segments(samples[i].segments, 0, n), offset)
            members.append((i, offset, n))
            offset += n
        length = -(-offset // cp) * cp
        out.append(MicroBatch(length, segs, members))
    return out


def inline_tensors(mb: MicroBatch, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray | None]:
    """The inline path's tensors of a micro batch: routing, and the mask shifted left by one."""
    routed = np.full((mb.length, LAYERS, TOP_K), ROUTED_FILL, np.int32)
    has_mask = any(any(s < n for s, _, _ in samples[i].mask_runs) for i, _, n in mb.members)
    width = max(samples[i].mask.shape[1] for i, _, _ in mb.members)
    mask = np.full((mb.length, width), MASK_FILL, np.int32)
    for i, off, n in mb.members:
        routed[off : off + n] = samples[i].routed[:n]
        m = samples[i].mask[:n]
        mask[off : off + n, : m.shape[1]] = m
    shifted = np.full_like(mask, MASK_FILL)
    shifted[:-1] = mask[1:]
    return routed, (shifted if has_mask else None)


def _same(got: np.ndarray | None, want: np.ndarray | None, fill: int) -> bool:
    """Equal after padding both to the same width with ``fill`` (by handle may be narrower)."""
    if got is None or want is None:
        return got is None and want is None
    if got.shape[0] != want.shape[0] or got.shape[2:] != want.shape[2:]:
        return False
    w = max(got.shape[1], want.shape[1])

    def pad(a: np.ndarray) -> np.ndarray:
        out = np.full((a.shape[0], w, *a.shape[2:]), fill, np.int32)
        out[:, : a.shape[1]] = a
        return out

    return bool(np.array_equal(pad(got), pad(want)))


@dataclass
class CPResult:
    cp: int
    windows: int = 0
    mismatches: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


async def train_step(
    client: AsyncPayloadClient | AsyncClusterClient,
    samples: list[Sample],
    seq_len: int,
    dp: int,
    cp: int,
) -> CPResult:
    """Trainer side: every (DP, CP) rank reads its windows (through one daemon, or through a
    cluster client over several); compare with the inline tensors."""
    batches = pack(samples, seq_len, cp)
    result = CPResult(cp)
    got: dict[tuple[int, int], list[np.ndarray | None]] = {}  # (micro batch, CP rank) -> reads

    async def rank(d: int, r: int) -> None:
        for b in range(d, len(batches), dp):
            mb = batches[b]
            chunk = mb.length // cp
            lo, hi = r * chunk, r * chunk + chunk
            got[b, r] = await client.read_many(
                [
                    Window(mb.segments, ROUTED, lo, hi, ROUTED_FILL),
                    Window(mb.segments, MASK, lo + 1, hi + 1, MASK_FILL),
                ]
            )

    t0 = time.perf_counter()
    await asyncio.gather(*(rank(d, r) for d in range(dp) for r in range(cp)))
    result.seconds = time.perf_counter() - t0
    for b, mb in enumerate(batches):
        want_routed, want_mask = inline_tensors(mb, samples)
        chunk = mb.length // cp
        for r in range(cp):
            lo, hi = r * chunk, r * chunk + chunk
            routed, mask = got[b, r]
            ok = _same(routed, want_routed[lo:hi], ROUTED_FILL) and _same(
                mask, None if want_mask is None else want_mask[lo:hi], MASK_FILL
            )
            result.windows += 1
            result.mismatches += not ok
            result.bytes_read += sum(a.nbytes for a in (routed, mask) if a is not None)
    return result
