"""The bench's trainer step (a new segment list every micro batch, routing + mask) is what it
claims: the raw reader, the direct reader and payloadd read the same bytes, bit for bit, the
rows inference wrote; a small run reports every figure, its ratios those of its times."""

from __future__ import annotations

import os

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, encode_segments
from payloadd.bench._bench import Result, report
from payloadd.bench._packed import MAX_WIDTH, DirectReader, PackedBatch, write_packed
from payloadd.bench._rl_batch import MASK_FILL
from payloadd.bench._trainer_step import (
    BALANCED,
    CONTIGUOUS,
    DIRECT,
    PAYLOADD,
    PAYLOADD_ARRAYS,
    RAW,
    VS_CONTIGUOUS,
    VS_DIRECT,
    VS_RAW,
    StepOutputs,
    balanced_step,
    bench_trainer_step,
    direct_step,
    format_trainer_summary,
    payloadd_step,
    raw_extents,
    raw_step,
    stored_mask_rows,
    trainer_summary,
)
from tests.conftest import Daemon

SPEC = PackedBatch(samples=3, tokens=64, turns=5, cp=4)


def written(spec: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
    """Routing ``uint8 [L + 1, 48, 8]`` and mask ``int32 [L + 1, 64]`` (one row past the
    batch: zeros, fill) as inference wrote them."""
    routed = np.zeros((spec.length + 1, 48, 8), np.uint8)
    mask = np.full((spec.length + 1, MAX_WIDTH), MASK_FILL, np.int32)
    for i in range(spec.samples):
        for pos, r, m in spec.turns_of(i):
            at = i * spec.tokens + pos
            routed[at : at + len(r)] = r
            mask[at : at + len(m), : m.shape[1]] = m
    return routed, mask


@pytest.fixture(scope="module")
def batch(daemon: Daemon) -> list[PayloadSegment]:
    with PayloadClient(daemon.socket) as c:
        return write_packed(SPEC, c, "bench-trainer-step-test", 40)


def test_the_three_readers_read_the_same_bytes_the_rows_inference_wrote(
    daemon: Daemon, batch: list[PayloadSegment]
) -> None:
    assert len(batch) == 2 * SPEC.samples * SPEC.turns  # 480 at 8 x 30: both fields
    want_r, want_m = written(SPEC)
    wire = encode_segments(batch)  # as from the orchestrator: arrays of segments
    columns = encode_segments(batch, "columns")  # and as columns
    reader = DirectReader(daemon.root, batch)
    try:
        with PayloadClient(daemon.socket) as c:
            for lo, hi in [*SPEC.windows(1), *SPEC.windows(4)]:
                raw, direct, mine, arrays = (StepOutputs(hi - lo) for _ in range(4))
                for o in (raw, direct, mine, arrays):  # garbage a reader must overwrite
                    o.routed[...], o.mask[...], o.scratch[...] = 77, 12345, 99
                raw_step(raw_extents(batch, reader.fds, lo, hi, raw))
                direct_step(reader, wire, lo, hi, direct)
                payloadd_step(c, columns, lo, hi, mine)
                payloadd_step(c, wire, lo, hi, arrays)
                np.testing.assert_array_equal(arrays.routed, want_r[lo:hi])
                np.testing.assert_array_equal(arrays.mask, want_m[lo + 1 : hi + 1])
                np.testing.assert_array_equal(raw.routed, want_r[lo:hi])
                np.testing.assert_array_equal(direct.routed, want_r[lo:hi])
                np.testing.assert_array_equal(mine.routed, want_r[lo:hi])
                # labels: [lo + 1, hi + 1), fill past the batch
                np.testing.assert_array_equal(direct.mask, want_m[lo + 1 : hi + 1])
                np.testing.assert_array_equal(mine.mask, want_m[lo + 1 : hi + 1])
                stored = stored_mask_rows(batch, lo + 1, hi + 1, mine.mask)
                assert 0 < len(stored) < mine.mask.nbytes
                assert raw.scratch[: len(stored)].tobytes() == stored  # the raw bytes
                assert (raw.scratch[len(stored) :] == 99).all()  # and no more
    finally:
        reader.close()


def test_the_load_balanced_step_reads_each_rank_its_two_chunks(
    daemon: Daemon, batch: list[PayloadSegment]
) -> None:
    want_r, want_m = written(SPEC)
    columns = encode_segments(batch, "columns")
    c2 = SPEC.length // (2 * SPEC.cp)  # chunk r and 2 cp - 1 - r of 2 cp
    with PayloadClient(daemon.socket) as c:
        for rank in range(SPEC.cp):
            outs = StepOutputs(2 * c2)
            outs.routed[...], outs.mask[...] = 77, 12345  # garbage the read must overwrite
            balanced_step(c, columns, rank, SPEC.length, SPEC.cp, outs)
            chunks = [(rank * c2, (rank + 1) * c2), ((2 * SPEC.cp - 1 - rank) * c2,
                                                     (2 * SPEC.cp - rank) * c2)]  # fmt: skip
            routed = np.concatenate([want_r[a:b] for a, b in chunks])
            mask = np.concatenate([want_m[a + 1 : b + 1] for a, b in chunks])  # labels
            np.testing.assert_array_equal(outs.routed, routed)
            np.testing.assert_array_equal(outs.mask, mask)
            balanced_step(c, columns, rank, SPEC.length, SPEC.cp, outs, balanced=False)
            lo, hi = SPEC.windows(SPEC.cp)[rank]  # the contiguous window, the same calls
            np.testing.assert_array_equal(outs.routed, want_r[lo:hi])
            np.testing.assert_array_equal(outs.mask, want_m[lo + 1 : hi + 1])


def test_the_raw_reads_are_one_extent_a_sample_file(
    daemon: Daemon, batch: list[PayloadSegment]
) -> None:
    reader = DirectReader(daemon.root, batch)
    try:
        outs = StepOutputs(SPEC.length)
        reads = raw_extents(batch, reader.fds, 0, SPEC.length, outs)
        # each sample's turns lie back to back in its file: one read a sample and field
        assert len(reads) == 2 * SPEC.samples
        assert sum(len(b) for _, b, _ in reads[: SPEC.samples]) == outs.routed.nbytes
        assert {fd for fd, _, _ in reads} == set(reader.fds.values())
        assert all(os.fstat(fd).st_size >= off + len(b) for fd, b, off in reads)
    finally:
        reader.close()


def test_a_small_run_reports_every_figure_and_its_ratios(daemon: Daemon) -> None:
    results: dict[tuple[str, str], Result] = {}

    def add(name: str, size: str, unit: str, value: float, baseline: str | None) -> None:
        results.setdefault((name, size), Result(name, size, unit, baseline=baseline))
        results[name, size].samples.append(value)

    bench_trainer_step(add, daemon.socket, daemon.root, 2, True, SPEC)
    rows = {r["name"]: r for r in report(list(results.values()))}
    for cp in (1, 4):
        times = [rows[f.format(cp=cp)] for f in (RAW, DIRECT, PAYLOADD, PAYLOADD_ARRAYS)]
        assert all(r["unit"] == "ms" and len(r["samples"]) == 2 for r in times)
        assert all(s > 0 for r in times for s in r["samples"])
        raw, direct, mine, _ = (r["samples"] for r in times)
        vs_direct, vs_raw = rows[VS_DIRECT.format(cp=cp)], rows[VS_RAW.format(cp=cp)]
        assert vs_direct["unit"] == vs_raw["unit"] == "x"
        # per repetition: the baseline's time over payloadd's (payloadd's speed over it)
        assert vs_direct["samples"] == pytest.approx(
            [d / m for d, m in zip(direct, mine, strict=True)]
        )
        assert vs_raw["samples"] == pytest.approx([r / m for r, m in zip(raw, mine, strict=True)])
        assert "higher is better" in vs_direct["name"] and "higher is better" in vs_raw["name"]
    balanced, vs_contiguous = rows[BALANCED.format(cp=4)], rows[VS_CONTIGUOUS.format(cp=4)]
    contiguous = rows[CONTIGUOUS.format(cp=4)]["samples"]
    assert vs_contiguous["samples"] == pytest.approx(
        [m / b for m, b in zip(contiguous, balanced["samples"], strict=True)]
    )
    assert BALANCED.format(cp=1) not in rows  # one rank: no layout to balance
    assert {r["size"] for r in rows.values()} == {"192"}
    summary = trainer_summary(list(rows.values()))
    assert [s["cp"] for s in summary] == [1, 4]
    assert summary[1]["payloadd_ms"] == rows[PAYLOADD.format(cp=4)]["median"]
    assert summary[0]["payloadd_vs_raw_higher_is_better"] == rows[VS_RAW.format(cp=1)]["median"]
    table = format_trainer_summary(summary)
    assert "higher is better" in table and "CP 4 (each rank in turn)" in table
    assert trainer_summary([]) == [] and format_trainer_summary([]) == ""
