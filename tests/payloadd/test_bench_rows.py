"""The bench's measurements against their baselines compute the right things: the packed micro
batch and its CP windows, the direct reader, the one-row windows, the segment lists, the bare
HTTP app and the RL batch's mode with no payload."""

from __future__ import annotations

import itertools
import queue
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, merge_pd_segments, validate_segments
from payloadd.bench._http_ceiling import start_bare
from payloadd.bench._one_row import contiguous_runs, write_one_rows
from payloadd.bench._packed import MAX_WIDTH, DirectReader, PackedBatch, write_packed
from payloadd.bench._rl import _bare_sample, _handle_sample, _hold_bare
from payloadd.bench._rl_batch import MASK, MASK_FILL, ROUTED, ROUTED_FILL, RLBatch
from payloadd.bench._seg_ops import _ops, segment_list
from tests.conftest import Daemon

SPEC = PackedBatch(samples=3, tokens=64, turns=5, cp=4)


def dense(spec: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
    """The packed batch's routing ``uint8 [L, 48, 8]`` and mask ``int32 [L, 64]`` (fill -1),
    from the rows inference wrote."""
    routed, mask = [], np.full((spec.length, MAX_WIDTH), MASK_FILL, np.int32)
    for i in range(spec.samples):
        for pos, r, m in spec.turns_of(i):
            routed.append(r)
            at = i * spec.tokens + pos
            mask[at : at + len(m), : m.shape[1]] = m
    return np.concatenate(routed), mask


@pytest.fixture(scope="module")
def packed(daemon: Daemon) -> list[PayloadSegment]:
    with PayloadClient(daemon.socket) as c:
        return write_packed(SPEC, c, "bench-rows-packed", 10)


def test_the_packed_batch_is_its_samples_back_to_back_each_in_its_own_step(
    packed: list[PayloadSegment],
) -> None:
    routed = [s for s in packed if s.field == ROUTED]
    masks = [s for s in packed if s.field == MASK]
    assert len(routed) == len(masks) == SPEC.samples * SPEC.turns  # 240 at 8 x 30
    assert [s.pos for s in routed] == [s.pos for s in masks]
    ends = [s.pos + s.rows for s in routed]
    assert routed[0].pos == 0 and ends[-1] == SPEC.length
    assert all(b.pos == e for b, e in zip(routed[1:], ends, strict=False))  # no gap, no overlap
    for i in range(SPEC.samples):  # file = node/run/step/...: sample i in step 10 + i
        mine = [s for s in packed if i * SPEC.tokens <= s.pos < (i + 1) * SPEC.tokens]
        assert {s.file.split("/")[2] for s in mine} == {str(10 + i)}
    assert all(1 <= s.shape[0] <= MAX_WIDTH for s in masks)


def test_cp_windows_split_the_micro_batch_in_equal_chunks() -> None:
    assert PackedBatch().windows(4) == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 16384)]
    assert PackedBatch().windows(1) == [(0, 16384)]
    assert SPEC.windows(4) == [(0, 48), (48, 96), (96, 144), (144, 192)]


def test_the_direct_reader_reads_what_read_field_reads(
    daemon: Daemon, packed: list[PayloadSegment]
) -> None:
    want_r, want_m = dense(SPEC)
    reader = DirectReader(daemon.root, packed)
    try:
        with (
            PayloadClient(daemon.socket) as fast,
            PayloadClient(daemon.socket, data_plane=False) as http,
        ):
            for lo, hi in [*SPEC.windows(1), *SPEC.windows(4), (150, 200)]:  # the last past the end
                n = hi - lo
                out8 = np.full((n, 48, 8), 7, np.uint8)
                reader.read_rows(packed, ROUTED, lo, hi, out8, ROUTED_FILL)
                expect = np.zeros((n, 48, 8), np.uint8)
                expect[: max(0, min(hi, SPEC.length) - lo)] = want_r[lo:hi]
                np.testing.assert_array_equal(out8, expect)
                for c in (fast, http):
                    got8 = np.empty_like(out8)
                    c.read_field(packed, ROUTED, lo, hi, ROUTED_FILL, dtype=np.uint8, out=got8)
                    np.testing.assert_array_equal(got8, out8)
                    got32 = np.empty(out8.shape, np.int32)
                    c.read_field(packed, ROUTED, lo, hi, ROUTED_FILL, out=got32)
                    np.testing.assert_array_equal(got32, out8.astype(np.int32))  # the widening
            scratch = np.empty(64 * MAX_WIDTH * 4, np.uint8)
            for lo, hi in SPEC.windows(4):  # labels: the mask at [lo + 1, hi + 1)
                outm = np.full((hi - lo, MAX_WIDTH), 5, np.int32)
                reader.read_ragged(packed, MASK, lo + 1, hi + 1, outm, MASK_FILL, scratch)
                expect = np.full_like(outm, MASK_FILL)
                inside = want_m[lo + 1 : hi + 1]
                expect[: len(inside)] = inside
                np.testing.assert_array_equal(outm, expect)
                for c in (fast, http):
                    got = np.empty_like(outm)
                    c.read_field(packed, MASK, lo + 1, hi + 1, MASK_FILL, out=got)
                    np.testing.assert_array_equal(got, outm)
    finally:
        reader.close()


def test_one_row_segments_lie_back_to_back_in_one_file(daemon: Daemon) -> None:
    with PayloadClient(daemon.socket) as c:
        segs = write_one_rows(c, 40, "bench-rows-one", 0)
        ((file, offset, nbytes),) = contiguous_runs(segs)  # one pread covers them all
        assert file == segs[0].file and offset == segs[0].offset
        assert nbytes == sum(s.shape[0] * 4 for s in segs)
        assert [s.pos for s in segs] == list(range(40)) and all(s.rows == 1 for s in segs)
        out = np.empty((40, MAX_WIDTH), np.int32)
        c.read_field(segs, MASK, 0, 40, MASK_FILL, out=out)
        raw = np.fromfile(daemon.root / file, np.uint8)[offset : offset + nbytes].view(np.int32)
        starts = np.cumsum([0] + [s.shape[0] for s in segs])
        for i, s in enumerate(segs):
            w = s.shape[0]
            np.testing.assert_array_equal(out[i, :w], raw[starts[i] : starts[i] + w])
            assert (out[i, w:] == MASK_FILL).all()
    gap = PayloadSegment(MASK, file, offset + nbytes + 4, 40, 1, "int32", [1])
    assert len(contiguous_runs([*segs, gap])) == 2


def test_the_segment_list_and_its_operations() -> None:
    segs = segment_list(2_000)
    assert validate_segments(segs) == segs
    assert all(b.pos == a.pos + a.rows for a, b in itertools.pairwise(segs))
    by_file: dict[str, list[PayloadSegment]] = {}
    for s in segs:
        by_file.setdefault(s.file, []).append(s)
    assert len(by_file) == 2
    for mine in by_file.values():  # each file's rows back to back from offset 0
        assert mine[0].offset == 0
        assert all(b.offset == a.offset + a.rows * 384 for a, b in itertools.pairwise(mine))
    ops = {name: (op, n) for name, op, n in _ops(segs)}
    clipped = ops["segments: clip_segments"][0]()
    assert len(clipped) == len(segs) and clipped[0].rows == segs[0].rows - 1
    assert clipped[-1].rows == segs[-1].rows - 1
    assert [s.pos for s in ops["segments: shift_segments"][0]()][:2] == [
        65_536,
        65_536 + segs[0].rows,
    ]
    # the decode side starts with the prefill's last segment again: the merge drops it
    assert merge_pd_segments(segs[:1000], segs[999:]) == segs
    assert ops["segments: merge_pd_segments"][0]() == segs
    assert ops["segments: merge_pd_segments"][1] == len(segs) + 1
    assert ops["segments: msgpack decode"][0]() == segs
    assert ops["segments: msgpack decode + validate"][0]() == segs
    # the same operations on columns give the same segments
    assert ops["segments: clip_segments, columns"][0]() == clipped
    assert ops["segments: shift_segments, columns"][0]() == ops["segments: shift_segments"][0]()
    assert ops["segments: merge_pd_segments, columns"][0]() == segs
    assert ops["segments: decode_columns (validated)"][0]() == segs


def test_the_bare_app_answers_the_bytes_asked(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    (tmp_path / "d").mkdir()
    data.tofile(tmp_path / "d" / "f.bin")
    sock = tmp_path / "bare.sock"
    with (
        start_bare(sock, tmp_path) as proc,
        httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://bare") as hc,
    ):
        assert len(hc.get("/bytes?n=1000").content) == 1000
        assert hc.get("/pread?file=d/f.bin&offset=100&n=3000").content == data[100:3100].tobytes()
        assert hc.get("/healthz").content == b"ok"
        assert hc.get("/nothing").status_code == 404
    assert proc.returncode is not None  # stopped with the block


def test_the_rl_batch_with_no_payload_holds_the_same_token_lists() -> None:
    spec = RLBatch(samples=2, tokens=300, turns=2)
    bare, handle = _bare_sample(spec, 1), _handle_sample(spec, 1, [])
    assert bare.token_ids == handle.token_ids and bare.logprobs == handle.logprobs
    report: queue.Queue[tuple[str, int, int, int, float]] = queue.Queue()
    _hold_bare(spec, report)
    what, resident, peak, wire, seconds = report.get_nowait()
    assert peak >= 0 and seconds == 0.0
    assert what == "orchestrator" and isinstance(resident, int) and wire == 0
