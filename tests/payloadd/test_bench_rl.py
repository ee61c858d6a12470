"""The RL batch benchmark: its inline path materialises what payloadd reads by handle."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient, Window
from payloadd.bench._rl import (
    HandleMicroBatch,
    InlineMicroBatch,
    _handle_sample,
    _inline_sample,
    _materialise_inline,
    _pack_handle,
    _pack_inline,
    write_batch,
)
from payloadd.bench._rl_batch import MASK, MASK_FILL, ROUTED, ROUTED_FILL, RLBatch
from tests.conftest import Daemon


@pytest.mark.parametrize(
    ("spec", "bins"),
    [
        (RLBatch(samples=3, tokens=1000, turns=3, seq_len=2500, dp=2, cp=4), [2, 1]),
        # truncated to 7 tokens: every mask row is cut off, so neither path has a mask
        (RLBatch(samples=2, tokens=12, turns=1, seq_len=7, dp=1, cp=7), [1, 1]),
    ],
)
def test_inline_and_by_handle_give_every_rank_the_same_tensors(
    daemon: Daemon, spec: RLBatch, bins: list[int]
) -> None:
    with PayloadClient(daemon.socket) as c:
        segments = write_batch(spec, c, "rl-parity")
        inline = [_inline_sample(spec, i) for i in range(spec.samples)]
        handle = [_handle_sample(spec, i, segments[i]) for i in range(spec.samples)]
        batches = spec.micro_batches()
        assert [len(b) for b in batches] == bins  # first fit
        for members in batches:
            # both through msgpack, as over ZMQ
            im = msgspec.msgpack.decode(
                msgspec.msgpack.encode(_pack_inline(inline, members)), type=InlineMicroBatch
            )
            hm = msgspec.msgpack.decode(
                msgspec.msgpack.encode(_pack_handle(handle, members)), type=HandleMicroBatch
            )
            assert im.token_ids == hm.token_ids and im.logprobs == hm.logprobs
            for r, (lo, hi) in enumerate(spec.windows(hm.length)):
                routed, mask = _materialise_inline(spec, im, r)
                want_r, want_m = c.read_many(
                    [
                        Window(hm.segments, ROUTED, lo, hi, ROUTED_FILL),
                        Window(hm.segments, MASK, lo + 1, hi + 1, MASK_FILL),
                    ]
                )
                np.testing.assert_array_equal(routed, want_r)
                if want_m is None:
                    assert mask is None
                else:
                    np.testing.assert_array_equal(mask, want_m)


def test_the_rows_are_the_same_in_every_process() -> None:
    spec = RLBatch(samples=2, tokens=300, turns=2)
    a, b = list(spec.turns_of(1)), list(spec.turns_of(1))
    assert all(np.array_equal(x.routed, y.routed) for x, y in zip(a, b, strict=True))
    assert [t.token_ids for t in a] == [ids for ids, _ in spec.token_lists(1)]
    assert sum(len(t.routed) for t in a) == 300
    assert all(t.mask_pos + len(t.mask) == u.pos for t, u in itertools.pairwise(a))
