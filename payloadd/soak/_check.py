"""The data of ``payloadd soak``: samples regenerable from a seed, packing, the bit-for-bit checker.

Every row the soak writes is a function of ``(seed, writer, step, sample, turn)``: the checker
regenerates what it needs for a window and never keeps written data in memory. A sample's
shape (its tokens, turns, mask widths) is a function of ``(seed, writer, step, sample)``.

A writer keeps, per turn, the segments of its acknowledged appends (`Written`); an append that
failed or is in doubt has none, so its positions are expected to be fill. The orchestrator
packs samples into micro batches with `clip_segments` and `shift_segments` (`pack`); the
expected arrays of a window come from the regenerated rows placed where the sample's *plan*
says, never from the segments' own metadata, so a segment with a wrong ``pos``, ``offset`` or
``file`` reads as a mismatch (`expected_region`, `expected_window`, `compare`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np

from payload_client import PayloadSegment, clip_segments, shift_segments
from payloadd.bench._rl_batch import (
    EXPERTS,
    LAYERS,
    MASK,
    MASK_FILL,
    ROUTED,
    ROUTED_FILL,
    TOP_K,
    VOCAB,
)

__all__ = [
    "MASK",
    "MASK_FILL",
    "ROUTED",
    "ROUTED_FILL",
    "MicroBatch",
    "Member",
    "Region",
    "SoakShape",
    "TurnPlan",
    "Written",
    "compare",
    "expected_region",
    "expected_window",
    "pack",
    "plan_sample",
    "tail_batch",
    "turn_rows",
]


class SoakShape(msgspec.Struct, frozen=True):
    """Sizes of the soak's samples and micro batches (the same in every process).

    Attributes
    ----------
    seed : int
        Seed of every sample's shape and rows (``>= 0``).
    max_tokens : int
        Tokens of a sample, at most (at least an eighth of it, and 2).
    max_turns : int
        Turns (requests) of a sample, at most.
    seq_len : int
        Micro-batch length: longer samples are truncated (their tail is checked apart).
    cp : int
        Context-parallel degree: micro batches are padded to a multiple of it.
    """

    seed: int
    max_tokens: int
    max_turns: int
    seq_len: int
    cp: int


class TurnPlan(NamedTuple):
    """One turn of a sample: routing rows at ``[pos, end)``, mask rows at ``[mask_pos, end)``,
    each mask row ``width`` ids wide (``-1`` padded)."""

    pos: int
    mask_pos: int
    end: int
    width: int


def plan_sample(shape: SoakShape, writer: int, step: int, sample: int) -> list[TurnPlan]:
    """The turns of one sample, from ``(seed, writer, step, sample)``."""
    rng = np.random.default_rng([shape.seed, writer, step, sample])
    tokens = int(rng.integers(max(2, shape.max_tokens // 8), shape.max_tokens + 1))
    n_turns = min(int(rng.integers(1, shape.max_turns + 1)), tokens)
    cuts = rng.choice(np.arange(1, tokens), size=n_turns - 1, replace=False)
    bounds = [0, *sorted(int(c) for c in cuts), tokens]
    out = []
    for a, b in itertools.pairwise(bounds):
        c = b - max(1, (b - a) // 5)  # the completion: the last fifth of the turn
        out.append(TurnPlan(a, c, b, int(rng.integers(1, 65))))
    return out


def turn_rows(
    shape: SoakShape, writer: int, step: int, sample: int, turn: int, plan: TurnPlan
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of one turn: routing ``uint8 [end - pos, 48, 8]`` and mask
    ``int32 [end - mask_pos, width]`` (each row 1 to ``width`` ids, then ``-1``)."""
    rng = np.random.default_rng([shape.seed, writer, step, sample, turn])
    routed = rng.integers(0, EXPERTS, (plan.end - plan.pos, LAYERS, TOP_K), dtype=np.uint8)
    n = plan.end - plan.mask_pos
    kept = rng.integers(1, plan.width + 1, size=n)
    mask = rng.integers(0, VOCAB, (n, plan.width), dtype=np.int32)
    mask[np.arange(plan.width) >= kept[:, None]] = MASK_FILL
    return routed, mask


class Written(msgspec.Struct):
    """What a writer returns for one sample: per turn, the segments of its acknowledged
    appends (a turn missing from ``routed`` or ``mask`` was not acknowledged)."""

    writer: int
    step: int
    sample: int
    routed: dict[int, list[PayloadSegment]] = {}
    mask: dict[int, list[PayloadSegment]] = {}

    def segments(self) -> list[PayloadSegment]:
        """Every acknowledged segment, turn by turn (routing, then mask)."""
        out: list[PayloadSegment] = []
        for t in sorted(set(self.routed) | set(self.mask)):
            out += self.routed.get(t, []) + self.mask.get(t, [])
        return out


class Member(msgspec.Struct):
    """A sample in a micro batch: its rows at ``[lo, hi)`` (sample positions), placed at
    ``shift + p``; ``routed`` and ``mask`` list its acknowledged turns."""

    writer: int
    step: int
    sample: int
    lo: int
    hi: int
    shift: int
    routed: list[int]
    mask: list[int]


class MicroBatch(msgspec.Struct):
    """A packed micro batch: ``length`` positions (padded to the CP degree), its segments and
    what they should hold."""

    step: int
    index: int
    length: int
    segments: list[PayloadSegment]
    members: list[Member]

    def windows(self, cp: int) -> list[tuple[int, int]]:
        """The CP windows ``[lo, hi)`` of the routing field (the mask's are one further)."""
        size = self.length // cp
        return [(r * size, (r + 1) * size) for r in range(cp)]


def _member(w: Written, lo: int, hi: int, shift: int) -> Member:
    return Member(w.writer, w.step, w.sample, lo, hi, shift, sorted(w.routed), sorted(w.mask))


def sample_tokens(shape: SoakShape, w: Written) -> int:
    """Tokens of a written sample."""
    return plan_sample(shape, w.writer, w.step, w.sample)[-1].end


def pack(shape: SoakShape, step: int, written: list[Written]) -> list[MicroBatch]:
    """The orchestrator: truncate to ``seq_len``, first-fit pack, pad to a multiple of ``cp``.

    Segments only: `clip_segments` then `shift_segments` of each member's segments.
    """
    bins: list[list[tuple[Written, int]]] = []
    for w in written:
        n = min(sample_tokens(shape, w), shape.seq_len)
        for b in bins:
            if sum(m for _, m in b) + n <= shape.seq_len:
                b.append((w, n))
                break
        else:
            bins.append([(w, n)])
    out = []
    for k, b in enumerate(bins):
        segs: list[PayloadSegment] = []
        members = []
        offset = 0
        for w, n in b:
            segs += shift_segments(clip_segments(w.segments(), 0, n), offset)
            members.append(_member(w, 0, n, offset))
            offset += n
        out.append(MicroBatch(step, k, -(-offset // shape.cp) * shape.cp, segs, members))
    return out


def tail_batch(shape: SoakShape, w: Written) -> MicroBatch | None:
    """The truncated tail ``[seq_len, tokens)`` of a sample, as a micro batch of one member
    at its own positions (`clip_segments` only); ``None`` when nothing was cut off."""
    tokens = sample_tokens(shape, w)
    if tokens <= shape.seq_len:
        return None
    segs = clip_segments(w.segments(), shape.seq_len, tokens)
    return MicroBatch(w.step, -1, tokens, segs, [_member(w, shape.seq_len, tokens, 0)])


@dataclass
class Region:
    """What a micro batch should hold at positions ``[a, b)``.

    Attributes
    ----------
    a, b : int
        The positions covered.
    routed : numpy.ndarray
        ``uint8 [b - a, 48, 8]``; fill where no row is expected.
    covered : numpy.ndarray
        ``bool [b - a]``: a routing row is expected there.
    mask : numpy.ndarray
        ``int32 [b - a, widest]``, ``-1`` beyond each row's width.
    width : numpy.ndarray
        ``int32 [b - a]``: the width of the mask row there, 0 for none.
    has_routed : bool
        Some routing segment is kept in the micro batch (else the read answers ``None``).
    mask_width : int
        Widest mask segment kept in the micro batch (0: none, the read answers ``None``).
    """

    a: int
    b: int
    routed: np.ndarray
    covered: np.ndarray
    mask: np.ndarray
    width: np.ndarray
    has_routed: bool
    mask_width: int


def expected_region(shape: SoakShape, mb: MicroBatch, a: int, b: int) -> Region:
    """Regenerate what ``mb`` should hold at positions ``[a, b)`` (only the turns there).

    A turn counts when its append was acknowledged (listed in the member) and some of its
    rows fall in the member's ``[lo, hi)``: then `clip_segments` kept a segment of it.
    """
    plans = {
        (m.writer, m.step, m.sample): plan_sample(shape, m.writer, m.step, m.sample)
        for m in mb.members
    }
    has_routed, mask_width = False, 0
    for m in mb.members:
        plan = plans[m.writer, m.step, m.sample]
        has_routed |= any(plan[t].pos < m.hi and plan[t].end > m.lo for t in m.routed)
        kept = [plan[t].width for t in m.mask if plan[t].mask_pos < m.hi and plan[t].end > m.lo]
        mask_width = max([mask_width, *kept])
    routed = np.full((b - a, LAYERS, TOP_K), ROUTED_FILL, np.uint8)
    covered = np.zeros(b - a, bool)
    mask = np.full((b - a, max(mask_width, 1)), MASK_FILL, np.int32)
    width = np.zeros(b - a, np.int32)
    for m in mb.members:
        plan = plans[m.writer, m.step, m.sample]
        for t, turn in enumerate(plan):
            want_r, want_m = t in m.routed, t in m.mask
            # sample positions of the turn that land in [a, b) and in the member's [lo, hi)
            p0 = max(turn.pos, m.lo, a - m.shift)
            p1 = min(turn.end, m.hi, b - m.shift)
            if p0 >= p1 or not (want_r or want_m):
                continue
            rows, ids = turn_rows(shape, m.writer, m.step, m.sample, t, turn)
            if want_r:
                routed[p0 + m.shift - a : p1 + m.shift - a] = rows[p0 - turn.pos : p1 - turn.pos]
                covered[p0 + m.shift - a : p1 + m.shift - a] = True
            q0 = max(p0, turn.mask_pos)
            if want_m and q0 < p1:
                at = slice(q0 + m.shift - a, p1 + m.shift - a)
                mask[at, : turn.width] = ids[q0 - turn.mask_pos : p1 - turn.mask_pos]
                width[at] = turn.width
    return Region(a, b, routed, covered, mask, width, has_routed, mask_width)


def expected_window(region: Region, field: str, lo: int, hi: int) -> np.ndarray | None:
    """What ``read_field(mb.segments, field, lo, hi, fill)`` must return (docs/contract.md, "Reading a window"): ``int32``,
    ``None`` when no segment of the field is kept, rows as wide as the widest intersecting
    row (else the widest of the field's segments)."""
    if not region.a <= lo <= hi <= region.b:
        raise ValueError(f"window [{lo}, {hi}) is outside the region [{region.a}, {region.b})")
    i, j = lo - region.a, hi - region.a
    if field == ROUTED:
        return region.routed[i:j].astype(np.int32) if region.has_routed else None
    if field != MASK:
        raise ValueError(f"unknown field {field!r}")
    if not region.mask_width:
        return None
    w = int(region.width[i:j].max()) if j > i and region.width[i:j].any() else region.mask_width
    return region.mask[i:j, :w].copy()


def compare(got: object, want: np.ndarray | None, what: str) -> str | None:
    """``None`` when ``got`` is ``want`` bit for bit (dtype, shape, values), else what differs.

    Parameters
    ----------
    got : numpy.ndarray or None
        What a read returned.
    want : numpy.ndarray or None
        What `expected_window` says it must be.
    what : str
        Names the window in the message (e.g. ``"step 3 mb 0 rank 1 routed_experts [0, 64)"``).
    """
    if want is None:
        return None if got is None else f"{what}: expected None (no segment), got an array"
    if not isinstance(got, np.ndarray):
        return f"{what}: expected {want.dtype} {list(want.shape)}, got {type(got).__name__}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return (
            f"{what}: expected {want.dtype} {list(want.shape)}, got {got.dtype} {list(got.shape)}"
        )
    bad = np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))
    if not len(bad):
        return None
    return f"{what}: {len(bad)} of {len(got)} rows differ, the first at window row {bad[0]}"
