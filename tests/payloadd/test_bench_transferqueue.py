"""The RL job on TransferQueue and on payloadd (the TransferQueue runs only where it is
installed, and, as Ray's, only when asked to: it runs on Ray)."""

from __future__ import annotations

import os
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from payload_client import PayloadClient
from payloadd.bench._ray import Key, Outputs, _check, _ranks
from payloadd.bench._rl_batch import MASK_FILL, ROUTED_FILL, RLBatch
from payloadd.bench._transferqueue import (
    PAYLOADD,
    TQ,
    TQ_MEASURES,
    TURNS,
    _payloadd_job,
    _sample_fields,
    _started,
    _tq_job,
    bench_transferqueue,
    transferqueue_available,
)
from tests.conftest import Daemon

SPECS = [
    # two samples a micro batch; the last CP window and the labels' window run past its end
    RLBatch(samples=3, tokens=1000, turns=3, seq_len=2500, dp=2, cp=3),
    # truncated to 700 of 1000 tokens: the last two turns' masks are cut; a sample a micro batch
    RLBatch(samples=3, tokens=1000, turns=4, seq_len=700, dp=2, cp=4, seed=3),
]


def test_transferqueue_available_says_how_to_install_it_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transfer_queue", None)  # `import` now raises ImportError
    assert transferqueue_available() == (
        "transferqueue is not installed: pip install 'payloadd[peers]'"
    )


def test_transferqueue_available_is_none_when_it_imports() -> None:
    pytest.importorskip("transfer_queue")
    assert transferqueue_available() is None


def test_a_sample_row_holds_every_turn_at_its_positions() -> None:
    spec = SPECS[1]
    turns = list(spec.turns_of(1))
    fields = _sample_fields(turns)
    routed, mask, table = fields["routed_experts"], fields["sampling_mask"], fields[TURNS]
    assert routed.dtype == np.uint8 and routed.shape == (spec.tokens, 48, 8)
    assert np.array_equal(routed, np.concatenate([t.routed for t in turns]))
    widths = [t.mask.shape[1] for t in turns]
    assert mask.dtype == np.int32 and mask.shape == (spec.tokens, max(widths))
    covered = np.zeros(spec.tokens, bool)
    for t, (pos, rows, width) in zip(turns, table.tolist(), strict=True):
        assert (pos, rows, width) == (t.mask_pos, *t.mask.shape)
        assert np.array_equal(mask[pos : pos + rows, :width], t.mask)
        assert (mask[pos : pos + rows, width:] == MASK_FILL).all()  # padded to the widest
        covered[pos : pos + rows] = True
    assert (mask[~covered] == MASK_FILL).all()  # prompt positions have no mask row


def test_the_check_names_the_rank_whose_rows_differ() -> None:
    a = np.zeros((4, 48, 8), np.int32)
    ours: Outputs = {(0, 0, 0): (a, None), (1, 1, 2): (a, a[:, 0, :2])}
    _check({k: (r, m) for k, (r, m) in ours.items()}, ours, "TransferQueue")
    wrong = a[:, 0, :2].copy()
    wrong[3, 1] = 7
    with pytest.raises(RuntimeError, match=r"DP rank 1, micro batch 1, CP rank 2: mask differs "
                       r"between TransferQueue and payloadd"):  # fmt: skip
        _check({(0, 0, 0): (a, None), (1, 1, 2): (a, wrong)}, ours, "TransferQueue")


def _expected(spec: RLBatch) -> dict[Key, tuple[np.ndarray, np.ndarray]]:
    """Every rank's windows made straight from the batch's turns (payloadd's rules: docs/contract.md, "Context-parallel windows")."""
    turns = [list(spec.turns_of(i)) for i in range(spec.samples)]
    batches = spec.micro_batches()
    out: dict[Key, tuple[np.ndarray, np.ndarray]] = {}
    for key, lo, hi in _ranks(spec, batches):
        mb = batches[key[1]]
        routed = np.full((hi - lo, 48, 8), ROUTED_FILL, np.int32)
        rows = []  # (packed position, mask row) of every mask row kept after truncation
        for i, off, n in mb:
            sample = np.concatenate([t.routed for t in turns[i]])[:n]
            for p in range(max(lo, off), min(hi, off + len(sample))):
                routed[p - lo] = sample[p - off]
            rows += [(t.mask_pos + j + off, r) for t in turns[i] for j, r in enumerate(t.mask)
                     if t.mask_pos + j < n]  # fmt: skip
        inside = [(p, r) for p, r in rows if lo + 1 <= p < hi + 1]
        width = max(len(r) for _, r in inside or rows)
        mask = np.full((hi - lo, width), MASK_FILL, np.int32)
        for p, r in inside:
            mask[p - lo - 1, : len(r)] = r
        out[key] = (routed, mask)
    return out


def _assert_windows(got: Outputs, expected: dict[Key, tuple[np.ndarray, np.ndarray]]) -> None:
    """Every rank has the expected routing and mask, ``int32``."""
    assert list(got) == list(expected)
    for key, want in expected.items():
        for name, array, wanted in zip(("routing", "mask"), got[key], want, strict=True):
            assert array is not None and array.dtype == np.int32, (key, name)
            assert np.array_equal(array, wanted), (key, name)


class _Stack:
    """What TransferQueue's ``get`` returns a field as: a stack whose ``unbind`` gives each
    sample's tensor (only ``numpy()`` is used)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def unbind(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(numpy=lambda a=a: a) for a in self.arrays]


class _FakeTransferQueue:
    """``kv_batch_put`` and ``kv_batch_get`` of TransferQueue, in a dict: the bench's side of
    the job (rows, widths, windows) without Ray; the real thing is tested below."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: dict[str, Any]) -> None:
        for j, key in enumerate(keys):
            self.rows[partition_id, key] = {f: a[j].copy() for f, a in fields.items()}

    def kv_batch_get(
        self, keys: list[str], partition_id: str, select_fields: list[str]
    ) -> dict[str, _Stack]:
        return {f: _Stack([self.rows[partition_id, k][f] for k in keys]) for f in select_fields}


@pytest.mark.parametrize("spec", SPECS)
def test_the_job_on_a_stand_in_for_transferqueue_gets_every_ranks_windows(spec: RLBatch) -> None:
    mods = {
        "tq": _FakeTransferQueue(),
        "torch": SimpleNamespace(from_numpy=lambda a: a),
        "TensorDict": lambda fields, batch_size: fields,
    }
    turns = [list(spec.turns_of(i)) for i in range(spec.samples)]
    out, stats = _tq_job(mods, spec, turns, "p", keep=True)
    _assert_windows(out, _expected(spec))
    widest = [max(t.mask.shape[1] for t in sample) for sample in turns]
    assert stats["stored"] * 2**20 == sum(
        spec.tokens * (384 + 4 * w) + 4 * 3 * spec.turns for w in widest
    )


def _ray_for_tests() -> None:
    """TransferQueue runs on Ray, which starts servers on every network interface: as Ray's,
    its tests run only when asked to."""
    if os.environ.get("PAYLOADD_TEST_RAY") != "1":
        pytest.skip("TransferQueue runs on Ray; set PAYLOADD_TEST_RAY=1 to run it")
    pytest.importorskip("transfer_queue", reason="transferqueue is not installed")


def test_each_rank_gets_from_transferqueue_the_windows_payloadd_reads(daemon: Daemon) -> None:
    _ray_for_tests()
    with _started(256 << 20) as mods, PayloadClient(daemon.socket) as client:
        for n, spec in enumerate(SPECS):
            turns = [list(spec.turns_of(i)) for i in range(spec.samples)]
            partition = f"test-{uuid.uuid4().hex[:8]}"
            tq_out, tq_stats = _tq_job(mods, spec, turns, partition, keep=True)
            mods["tq"].get_client().clear_partition(partition)
            ours, our_stats = _payloadd_job(client, spec, turns, f"test-tq-{n}", keep=True)
            _assert_windows(tq_out, _expected(spec))
            _assert_windows(ours, _expected(spec))
            # TransferQueue pads the mask and ships whole samples to every CP rank
            assert tq_stats["stored"] > our_stats["stored"]
            assert tq_stats["fetched"] > our_stats["fetched"]


def test_bench_transferqueue_times_both_systems(daemon: Daemon) -> None:
    _ray_for_tests()
    spec = RLBatch(samples=4, tokens=2048, turns=4, seq_len=4096)
    environ = dict(os.environ)
    stats = bench_transferqueue(spec, daemon.socket, 1)  # raises if any rank's outputs differ
    assert dict(os.environ) == environ  # what Ray and TransferQueue set is undone
    assert list(stats) == [TQ, PAYLOADD]
    for measures in stats.values():
        assert list(measures) == list(TQ_MEASURES)
        for values in measures.values():
            assert len(values) == 1 and values[0] > 0
    # TransferQueue pads the mask and ships whole samples to every CP rank
    assert stats[TQ]["stored"][0] > stats[PAYLOADD]["stored"][0]
    assert stats[TQ]["fetched"][0] > stats[PAYLOADD]["fetched"][0]
