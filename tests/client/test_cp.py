"""A context-parallel rank's reads (`cp_chunks`, ``read_cp``), both layouts, against the
inline path's tensors of a packed micro batch of multi-turn samples, on a real daemon."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    SegmentList,
    cp_chunks,
    plan_window,
    shift_segments,
)
from payload_client.reads._cp import join_plans, plan_spans
from tests.conftest import Daemon

ROUTED, MASK = "routed_experts", "sampling_mask"
ROUTED_FILL, MASK_FILL = 0, -1
CP_SIZES = [1, 2, 4]
# (tokens, mask width) of each turn of each sample; a turn's masks are on its last 2 tokens
SAMPLES = [
    [(5, 2), (7, 5), (4, 3)],
    [(3, 1), (9, 2)],
    [(6, 1), (2, 1), (3, 6)],
]
L = 48  # 39 tokens, padded to a multiple of 2 * 4 (padding adds no segment)


@dataclass(frozen=True)
class Batch:
    """A packed micro batch: its segments, and the inline path's tensors of it."""

    segments: list[PayloadSegment]
    routed: np.ndarray  # uint8 [L, 48, 8], fill 0
    labels_mask: np.ndarray  # int32 [L, 6]: the inline mask shifted left by one, fill -1
    label_width: np.ndarray  # [L]: the width of the mask row at each label position, 0: none


@pytest.fixture(scope="module")
def batch(daemon: Daemon) -> Batch:
    rng = np.random.default_rng(7)
    width = max(w for turns in SAMPLES for _, w in turns)
    routed = np.full((L, 48, 8), ROUTED_FILL, np.uint8)
    mask = np.full((L, width), MASK_FILL, np.int32)
    widths = np.zeros(L, np.int64)
    segments: list[PayloadSegment] = []
    offset = 0
    with PayloadClient(daemon.socket) as client:
        for k, turns in enumerate(SAMPLES):
            pos, sample = 0, []
            for n, w in turns:  # one append per turn: a segment per turn and field
                r = rng.integers(0, 256, size=(n, 48, 8), dtype=np.uint8)
                m = rng.integers(0, 151_936, size=(2, w), dtype=np.int32)
                r_segs, m_segs = client.append_many(
                    [(ROUTED, r, pos), (MASK, m, pos + n - 2)], run="cp", step=k
                )
                sample += r_segs + m_segs
                routed[offset + pos : offset + pos + n] = r
                mask[offset + pos + n - 2 : offset + pos + n, :w] = m
                widths[offset + pos + n - 2 : offset + pos + n] = w
                pos += n
            segments += shift_segments(sample, offset)  # packed at its offset
            offset += pos
    assert offset < L  # some padding at the end
    labels_mask = np.full_like(mask, MASK_FILL)  # inline: shift left by one, pad with fill
    labels_mask[:-1] = mask[1:]
    label_width = np.zeros_like(widths)
    label_width[:-1] = widths[1:]
    return Batch(segments, routed, labels_mask, label_width)


def rank_positions(cp_size: int, rank: int, load_balanced: bool) -> np.ndarray:
    """The rank's token positions, in its tensor's order (the layouts, independently)."""
    if not load_balanced:
        contiguous: np.ndarray = np.arange(L).reshape(cp_size, -1)[rank]
        return contiguous
    chunks = np.arange(L).reshape(2 * cp_size, -1)
    return np.concatenate([chunks[rank], chunks[2 * cp_size - 1 - rank]])


def check_rank(
    b: Batch, cp_size: int, rank: int, lb: bool, routed: Any, mask: Any, routed_dtype: Any
) -> int:
    """Compare a rank's two arrays with the inline tensors; return the mask's width."""
    idx = rank_positions(cp_size, rank, lb)
    want = b.routed[idx]
    assert routed.shape == (L // cp_size, 48, 8) and routed.dtype == routed_dtype
    assert routed.tobytes() == want.astype(routed_dtype).tobytes()  # bit for bit
    # the row shape rule of each chunk (the widest mask row in it; the field's widest when
    # it has none), the widest of the rank's chunks
    chunks = idx.reshape(2 if lb else 1, -1)
    width = max(int(b.label_width[c].max()) or b.labels_mask.shape[1] for c in chunks)
    assert mask.shape == (L // cp_size, width) and mask.dtype == np.int32
    assert mask.tobytes() == np.ascontiguousarray(b.labels_mask[idx, :width]).tobytes()
    assert (b.labels_mask[idx, width:] == MASK_FILL).all()  # the rest of the inline is fill
    return width


@pytest.mark.parametrize("load_balanced", [False, True], ids=["contiguous", "load-balanced"])
@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("routed_dtype", [None, np.uint8], ids=["int32", "uint8"])
def test_each_rank_reads_what_the_inline_path_gives(
    client: PayloadClient, batch: Batch, cp_size: int, load_balanced: bool, routed_dtype: Any
) -> None:
    for rank in range(cp_size):
        args = (L, cp_size, rank)
        routed = client.read_cp(batch.segments, ROUTED, *args, ROUTED_FILL,
                                load_balanced=load_balanced, dtype=routed_dtype)  # fmt: skip
        mask = client.read_cp(batch.segments, MASK, *args, MASK_FILL, labels=True,
                              load_balanced=load_balanced)  # fmt: skip
        check_rank(batch, cp_size, rank, load_balanced, routed, mask, routed_dtype or np.int32)


@pytest.mark.asyncio
@pytest.mark.parametrize("load_balanced", [False, True], ids=["contiguous", "load-balanced"])
@pytest.mark.parametrize("cp_size", CP_SIZES)
async def test_the_async_client_reads_the_same(
    aclient: AsyncPayloadClient, batch: Batch, cp_size: int, load_balanced: bool
) -> None:
    for rank in range(cp_size):
        args = (L, cp_size, rank)
        routed = await aclient.read_cp(batch.segments, ROUTED, *args, ROUTED_FILL,
                                       load_balanced=load_balanced)  # fmt: skip
        mask = await aclient.read_cp(batch.segments, MASK, *args, MASK_FILL, labels=True,
                                     load_balanced=load_balanced)  # fmt: skip
        check_rank(batch, cp_size, rank, load_balanced, routed, mask, np.int32)


def test_mask_windows_of_ranks_differ_in_width(client: PayloadClient, batch: Batch) -> None:
    """The micro batch makes the row shape rule matter: ranks' mask windows are narrower
    than the widest row, and one rank of CP 4 holds no mask row at all."""
    widths = set()
    for cp_size in CP_SIZES:
        for rank in range(cp_size):
            for lb in (False, True):
                mask = client.read_cp(batch.segments, MASK, L, cp_size, rank, MASK_FILL,
                                      labels=True, load_balanced=lb)  # fmt: skip
                assert mask is not None
                widths.add(mask.shape[1])
    assert len(widths) >= 3


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_the_contiguous_layout_is_read_field_of_the_contract_s_window(
    client: PayloadClient, batch: Batch, cp_size: int
) -> None:
    for rank in range(cp_size):
        lo = rank * L // cp_size
        hi = lo + L // cp_size
        for field, fill, shift in ((ROUTED, ROUTED_FILL, 0), (MASK, MASK_FILL, 1)):
            got = client.read_cp(batch.segments, field, L, cp_size, rank, fill, labels=bool(shift))
            want = client.read_field(batch.segments, field, lo + shift, hi + shift, fill)
            assert got is not None and want is not None
            assert got.shape == want.shape and got.dtype == want.dtype
            assert np.array_equal(got, want)


def test_a_rank_reads_into_its_own_out(client: PayloadClient, batch: Batch) -> None:
    cp_size, rank = 4, 1
    idx = rank_positions(cp_size, rank, True)
    buffer = np.full((2 * L // cp_size, 64), 7, np.int32)  # wider than any row; reused
    out = buffer[: L // cp_size]
    got = client.read_cp(batch.segments, MASK, L, cp_size, rank, MASK_FILL, labels=True,
                         load_balanced=True, out=out)  # fmt: skip
    assert got is out
    width = batch.labels_mask.shape[1]
    assert np.array_equal(out[:, :width], batch.labels_mask[idx])
    assert (out[:, width:] == MASK_FILL).all()  # entries past the rows: fill
    assert (buffer[L // cp_size :] == 7).all()  # rows outside out: untouched
    ids = np.empty((L // cp_size, 48, 8), np.uint8)  # dtype from out: the stored bytes
    assert client.read_cp(batch.segments, ROUTED, L, cp_size, rank, 0, out=ids,
                          load_balanced=True) is ids  # fmt: skip
    assert ids.tobytes() == batch.routed[idx].tobytes()


def test_a_field_no_segment_has_reads_as_none_and_leaves_out_alone(
    client: PayloadClient, batch: Batch
) -> None:
    routing_only = [s for s in batch.segments if s.field == ROUTED]
    out = np.full((L // 2, 3), 9, np.int32)
    for lb in (False, True):
        assert (
            client.read_cp(routing_only, MASK, L, 2, 0, -1, labels=True, load_balanced=lb) is None
        )
        got = client.read_cp(routing_only, MASK, L, 2, 1, -1, load_balanced=lb, out=out)
        assert got is None and (out == 9).all()
    with pytest.raises(InvalidRequestError, match="unknown field 'sampling_masks'"):
        client.read_cp(batch.segments, "sampling_masks", L, 2, 0, -1, load_balanced=True)


def test_read_cp_refuses_what_does_not_fit(client: PayloadClient, batch: Batch) -> None:
    segs = batch.segments
    with pytest.raises(InvalidRequestError, match=r"2 \* cp_size = 8: pad the micro batch to 16"):
        client.read_cp(segs, ROUTED, 12, 4, 0, 0, load_balanced=True)
    with pytest.raises(InvalidRequestError, match=r"out has shape \(5, 6\), rank 0's positions"):
        client.read_cp(segs, MASK, L, 8, 0, -1, load_balanced=True, out=np.zeros((5, 6), np.int32))
    with pytest.raises(
        InvalidRequestError, match=r"out has shape \(12, 1\), the window needs \(12, 6\)"
    ):  # too narrow for the widest row of the rank's two chunks
        client.read_cp(segs, MASK, L, 4, 0, -1, load_balanced=True, labels=True,
                       out=np.zeros((12, 1), np.int32))  # fmt: skip
    one: Any = 1
    with pytest.raises(InvalidRequestError, match="labels must be True or False"):
        client.read_cp(segs, MASK, L, 4, 0, -1, labels=one)
    with pytest.raises(InvalidRequestError, match="fill -1 does not fit"):
        client.read_cp(segs, ROUTED, L, 4, 0, -1, load_balanced=True, dtype=np.uint8)


# -- cp_chunks, pure -------------------------------------------------------------------------


def test_load_balanced_chunks_are_megatron_s() -> None:
    # 16 tokens, CP 2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_chunks(16, 2, 0, load_balanced=True) == [(0, 4), (12, 16)]
    assert cp_chunks(16, 2, 1, load_balanced=True) == [(4, 8), (8, 12)]
    assert cp_chunks(16, 2, 1) == [(8, 16)]
    assert cp_chunks(16, 1, 0) == [(0, 16)]
    assert cp_chunks(0, 4, 3, load_balanced=True) == [(0, 0), (0, 0)]
    numpy_ints: Any = (np.int64(8), np.int32(2), np.uint8(1))  # numpy integers are integers
    assert cp_chunks(*numpy_ints) == [(4, 8)]


@pytest.mark.parametrize("load_balanced", [False, True])
@pytest.mark.parametrize(("length", "cp_size"), [(8, 1), (16, 2), (48, 4), (64, 8)])
def test_the_ranks_chunks_tile_the_micro_batch(
    length: int, cp_size: int, load_balanced: bool
) -> None:
    seen = []
    for rank in range(cp_size):
        chunks = cp_chunks(length, cp_size, rank, load_balanced=load_balanced)
        assert len(chunks) == (2 if load_balanced else 1)
        assert sum(b - a for a, b in chunks) == length // cp_size
        seen += [p for a, b in chunks for p in range(a, b)]
        if not load_balanced:  # the contract's contiguous window
            lo = rank * length // cp_size
            assert chunks == [(lo, lo + length // cp_size)]
    assert sorted(seen) == list(range(length))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((12, 4, 0), {"load_balanced": True}, r"length 12 is not a multiple of 2 \* cp_size = 8: "
         "pad the micro batch to 16 positions"),
        ((10, 4, 0), {}, "length 10 is not a multiple of cp_size = 4: pad the micro batch to 12"),
        ((16, 4, 4), {}, r"rank 4 is outside \[0, cp_size\) = \[0, 4\)"),
        ((16, 4, -1), {}, "rank must be >= 0"),
        ((16, 0, 0), {}, r"cp_size must be >= 1 \(1: no context parallelism\), got 0"),
        ((-8, 2, 0), {}, "length must be >= 0"),
        ((16.0, 4, 0), {}, "length must be an integer, got float 16.0"),
        ((16, True, 0), {}, "cp_size must be an integer, got bool"),
        ((16, 4, "0"), {}, "rank must be an integer, got str"),
        ((16, 4, 0), {"load_balanced": "yes"}, "load_balanced must be True or False"),
    ],
)  # fmt: skip
def test_cp_chunks_refuses_bad_input_saying_what_to_do(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        cp_chunks(*args, **kwargs)


@pytest.fixture
def offline(tmp_path: Any) -> Iterator[PayloadClient]:
    with PayloadClient(tmp_path / "nobody.sock") as c:
        yield c


def test_bad_cp_arguments_are_refused_before_any_io(offline: PayloadClient) -> None:
    with pytest.raises(InvalidRequestError, match="rank 2 is outside"):
        offline.read_cp([], ROUTED, 16, 2, 2, 0)
    with pytest.raises(InvalidRequestError, match="not a multiple of 2 \\* cp_size"):
        offline.read_cp([], ROUTED, 6, 2, 0, 0, load_balanced=True)


def _packed_list(rng: np.random.Generator) -> list[PayloadSegment]:
    """Random samples of random turns packed back to back: routing and ragged masks, each
    sample's turns back to back in its files (a list every field of which is disjoint)."""
    segs, pos = [], 0
    for sample in range(int(rng.integers(1, 5))):
        off_r = off_m = 0
        for _ in range(int(rng.integers(1, 6))):
            n, w = int(rng.integers(1, 9)), int(rng.integers(1, 7))
            segs.append(PayloadSegment(ROUTED, f"n/r/{sample}/r.bin", off_r, pos, n, "uint8",
                                       [48, 8]))  # fmt: skip
            segs.append(PayloadSegment(MASK, f"n/r/{sample}/m.bin", off_m, pos + 1, n, "int32",
                                       [w]))  # fmt: skip
            off_r, off_m, pos = off_r + n * 384, off_m + n * 4 * w, pos + n
    return segs


def test_one_plan_of_a_ranks_chunks_is_the_plans_of_each_joined() -> None:
    """`plan_spans` plans a rank's chunks of a `SegmentList` in one pass over its columns;
    joining each chunk's own plan (`join_plans`, of the short lists' plain planner) gives the
    same pieces, ends, row shape and output rows, whatever the chunks meet."""
    rng = np.random.default_rng(5)
    for case in range(300):
        segs = _packed_list(rng)
        if case % 2:  # files first seen out of position order: windows found by a mask
            segs = [segs[i] for i in rng.permutation(len(segs))]
        cp = int(rng.choice([2, 4]))
        end = max(s.pos + s.rows for s in segs)
        length = -(-(end + 1) // (2 * cp)) * 2 * cp
        length += 2 * cp * int(rng.integers(0, 3))  # chunks past every segment too
        rank, labels = int(rng.integers(0, cp)), bool(rng.integers(0, 2))
        field, fill = (MASK, MASK_FILL) if labels else (ROUTED, ROUTED_FILL)
        spans = [
            (a + labels, b + labels) for a, b in cp_chunks(length, cp, rank, load_balanced=True)
        ]
        one = plan_spans(SegmentList(segs), field, spans, fill, None, labels)
        each = [plan_window(segs[:8], field, a, b, fill, None, labels) for a, b in spans]
        joined = join_plans([p for p in each if p is not None]) if each[0] else None
        if len(segs) > 8:  # the reference: each chunk over the whole list, object by object
            each = [plan_window(list(segs), field, a, b, fill, None, labels) for a, b in spans]
            joined = join_plans([p for p in each if p is not None]) if each[0] else None
        assert one is not None and joined is not None, case
        assert (one.lo, one.hi, one.row_shape, one.dtype, one.fill) == (
            joined.lo,
            joined.hi,
            joined.row_shape,
            joined.dtype,
            joined.fill,
        ), case
        assert dict(one.ends) == dict(joined.ends), case
        assert sorted(one.pieces) == sorted(joined.pieces), case
        assert list(one.pieces) == sorted(
            one.pieces, key=lambda p: (one.table.files.index(p.file), p.offset)
        ), case
        np.testing.assert_array_equal(one.covered(), joined.covered())
