"""By-handle reads through a real daemon equal the inline path bit for bit (docs/contract.md, "Context-parallel windows").

24 random samples carry router-replay ids and ragged sampling masks inline, and the same rows
by handle. An orchestrator emulated here (independently of ``payloadd.bench._demo``) truncates them
at ``SEQ_LEN``, packs them into micro batches, pads each to the CP degree and deals the micro
batches to ``DP`` ranks. Every (DP rank, CP rank, micro batch) window read by handle must equal
the shard of the dense inline tensors: ``routing[lo:hi]`` and ``shift_left(mask)[lo:hi]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, Window, clip_segments, shift_segments

SEQ_LEN = 32
N_SAMPLES = 24
DP = 2
LAYERS, TOPK, EXPERTS = 48, 8, 128
MAX_WIDTH, VOCAB = 64, 151_936
RE, SM = "routed_experts", "sampling_mask"


@dataclass
class Sample:
    """One sample: its inline arrays and the segments holding the same rows by handle.

    Attributes
    ----------
    routing : numpy.ndarray
        ``uint8 [n, 48, 8]`` router-replay ids.
    mask : numpy.ndarray
        ``int32 [n, width]`` allowed ids, leading entries of each row, ``-1`` = no entry.
    segments : list of PayloadSegment
        The same rows by handle; positions relative to the sample's first token.
    """

    routing: np.ndarray
    mask: np.ndarray
    segments: list[PayloadSegment] = field(default_factory=list)


@dataclass
class MicroBatch:
    """A packed micro batch: ``(sample index, offset, kept tokens)`` parts and their segments."""

    length: int
    parts: list[tuple[int, int, int]]
    segments: list[PayloadSegment]


def make_samples(rng: np.random.Generator) -> list[Sample]:
    """Draw the samples; sample 0 has mask rows only at positions that truncation cuts away."""
    samples = []
    for i in range(N_SAMPLES):
        n = 48 if i == 0 else int(rng.integers(5, 61))
        masked = np.arange(n) >= 40 if i == 0 else rng.random(n) < 0.2
        widths = np.where(masked, rng.integers(1, MAX_WIDTH + 1, n), 0)
        mask = np.full((n, int(widths.max(initial=0))), -1, np.int32)
        for p in np.flatnonzero(masked):
            mask[p, : widths[p]] = rng.integers(0, VOCAB, widths[p])
        routing = rng.integers(0, EXPERTS, (n, LAYERS, TOPK), dtype=np.uint8)
        samples.append(Sample(routing, mask))
    return samples


def write_by_handle(
    client: PayloadClient, samples: list[Sample], rng: np.random.Generator, step: int
) -> None:
    """Append every sample's rows: routing in two parts, masks one row per masked position."""
    items: list[tuple[str, np.ndarray, int]] = []
    owners: list[int] = []
    for i, s in enumerate(samples):
        cut = int(rng.integers(1, len(s.routing)))
        items += [(RE, s.routing[:cut], 0), (RE, s.routing[cut:], cut)]
        for p, w in enumerate((s.mask != -1).sum(axis=1)):
            if w:
                items.append((SM, s.mask[p : p + 1, :w], p))  # row shape [w], its own width
        owners += [i] * (len(items) - len(owners))
    for i, segs in zip(owners, client.append_many(items, run="parity", step=step), strict=True):
        samples[i].segments += segs
    for s in samples:
        assert sum(seg.field == RE for seg in s.segments) == 2


def pack(samples: list[Sample], cp: int) -> list[MicroBatch]:
    """Truncate at ``SEQ_LEN``, pack first fit, shift segments, pad lengths to ``cp``."""
    bins: list[list[tuple[int, int, int]]] = []
    used: list[int] = []
    for i, s in enumerate(samples):
        t = min(len(s.routing), SEQ_LEN)
        j = next((j for j, u in enumerate(used) if u + t <= SEQ_LEN), len(used))
        if j == len(used):
            bins.append([])
            used.append(0)
        bins[j].append((i, used[j], t))
        used[j] += t
    out = []
    for parts, u in zip(bins, used, strict=True):
        segs = [
            seg
            for i, off, _ in parts
            for seg in shift_segments(clip_segments(samples[i].segments, 0, SEQ_LEN), off)
        ]
        out.append(MicroBatch(-(-u // cp) * cp, parts, segs))  # padding = no segment
    return out


def inline_tensors(mb: MicroBatch, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """Dense inline tensors of a micro batch: routing ``[L, 48, 8]`` and mask ``[L, Wmb]``.

    ``Wmb`` is the widest mask row among the kept tokens (0 when there is none).
    """
    widths = [(samples[i].mask[:t] != -1).sum(axis=1) for i, _, t in mb.parts]
    wmb = max(int(w.max(initial=0)) for w in widths)
    routing = np.zeros((mb.length, LAYERS, TOPK), np.int32)
    mask = np.full((mb.length, wmb), -1, np.int32)
    for i, off, t in mb.parts:
        routing[off : off + t] = samples[i].routing[:t]
        m = samples[i].mask[:t]
        w = min(wmb, m.shape[1])
        assert (m[:, w:] == -1).all()
        mask[off : off + t, :w] = m[:, :w]
    return routing, mask


def shift_left(mask: np.ndarray) -> np.ndarray:
    """Move rows up by one (labels), padding the last row with ``-1``."""
    out = np.full_like(mask, -1)
    out[:-1] = mask[1:]
    return out


def pad_width(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    """Pad the last axis of a 2-d array to ``width`` with ``fill``."""
    return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)


def mismatch(got: np.ndarray | None, want: np.ndarray, pad: int | None = None) -> str | None:
    """Describe how ``got`` (by handle) differs from ``want`` (inline); ``None`` if bitwise equal.

    Parameters
    ----------
    got, want : numpy.ndarray
        By-handle and inline arrays.
    pad : int, optional
        When given, both are first padded to the same width with this fill (masks).
    """
    if got is None:
        return "by handle is None"
    if pad is not None:
        width = max(got.shape[1], want.shape[1])
        got, want = pad_width(got, width, pad), pad_width(want, width, pad)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{got.shape} != {want.dtype}{want.shape}"
    if got.tobytes() != want.tobytes():
        at = tuple(int(x) for x in np.argwhere(got != want)[0])
        return f"first difference at {at}: {got[at]} != {want[at]}"
    return None


def flip_one_byte(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Return a copy of ``a`` with one random byte inverted."""
    out = a.copy()
    raw = out.reshape(-1).view(np.uint8)
    raw[int(rng.integers(raw.size))] ^= 0xFF
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_payload_by_handle_matches_inline(client: PayloadClient, cp: int) -> None:
    """Every CP window of every micro batch on every DP rank matches the inline shard."""
    rng = np.random.default_rng(20261006)
    samples = make_samples(rng)
    write_by_handle(client, samples, rng, step=cp)
    batches = pack(samples, cp)
    ranks = [batches[r::DP] for r in range(DP)]  # dealt round robin
    assert sum(len(s.routing) > SEQ_LEN for s in samples) >= 3  # truncation really happens
    assert all(ranks), "each DP rank needs micro batches"

    compared = nones = 0
    for dp, mbs in enumerate(ranks):
        for k, mb in enumerate(mbs):
            routing, mask = inline_tensors(mb, samples)
            labels = shift_left(mask)
            if cp == 1:
                whole = client.read_field(mb.segments, RE, 0, mb.length, 0)
                assert mismatch(whole, routing) is None
            for r in range(cp):
                lo = r * mb.length // cp
                hi = lo + mb.length // cp
                where = f"dp={dp} mb={k} cp_rank={r} window=[{lo},{hi})"
                windows = [
                    Window(mb.segments, RE, lo, hi, 0),
                    Window(mb.segments, SM, lo + 1, hi + 1, -1),
                ]
                got_re, got_sm = client.read_many(windows)
                diff = mismatch(got_re, routing[lo:hi])
                assert diff is None, f"routing {where}: {diff}"
                # No mask row at all in the micro batch: the inline mask has width Wmb == 0,
                # i.e. no entry anywhere (all -1 at any padded width), which the trainer treats
                # as "no mask". By handle that is None (no sampling_mask segment survived).
                # Both sides must agree on it, in both directions.
                assert (got_sm is None) == (mask.shape[1] == 0), where
                if got_sm is None:
                    nones += 1
                else:
                    assert got_sm.shape[1] <= mask.shape[1], where  # may only be narrower
                    diff = mismatch(got_sm, labels[lo:hi], pad=-1)
                    assert diff is None, f"mask {where}: {diff}"
                if compared == 0:  # the harness sees a single flipped byte
                    assert mismatch(got_re, flip_one_byte(routing[lo:hi], rng)) is not None
                    assert mismatch(None, routing[lo:hi]) is not None
                if got_sm is not None and got_sm.size and labels[lo:hi].size:
                    flipped = flip_one_byte(labels[lo:hi], rng)
                    assert mismatch(got_sm, flipped, pad=-1) is not None
                compared += 1

    assert compared == cp * len(batches) > 0
    assert nones > 0, "the micro batch whose mask rows were all truncated away was not seen"
    assert compared > nones
