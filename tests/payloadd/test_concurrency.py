"""Many async writers and readers on one real daemon at once."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from payload_client import AsyncPayloadClient, PayloadSegment, Window
from tests.conftest import Daemon

R, M = "routed_experts", "sampling_mask"


@pytest.mark.asyncio
async def test_async_round_trip(aclient: AsyncPayloadClient, run_name: str) -> None:
    rows = np.arange(6 * 48 * 8, dtype=np.uint32).reshape(6, 48, 8).astype(np.uint8)
    segs = await aclient.append(R, rows, 3, run=run_name, step=0)
    got = await aclient.read_field(segs, R, 0, 9, 0)
    assert got is not None
    np.testing.assert_array_equal(got[3:], rows)
    assert (got[:3] == 0).all()
    (m,) = await aclient.append_many([(M, np.full((2, 5), 4, np.int32), 3)], run=run_name, step=0)
    windows = [Window(segs + m, R, 3, 4, 0), Window(segs + m, M, 3, 6, -1)]
    both = await aclient.read_many(windows)
    assert both[0] is not None and both[1] is not None
    np.testing.assert_array_equal(both[1][:, :5], [[4] * 5, [4] * 5, [-1] * 5])
    assert (await aclient.stats()).appends >= 2


@pytest.mark.asyncio
async def test_sixteen_concurrent_writers_and_readers(daemon: Daemon) -> None:
    writers, appends = 16, 12
    written: dict[int, list[tuple[np.ndarray, list[PayloadSegment]]]] = {}

    async def writer(w: int, client: AsyncPayloadClient) -> None:
        rng = np.random.default_rng(w)
        out: list[tuple[np.ndarray, list[PayloadSegment]]] = []
        for k in range(appends):
            n = int(rng.integers(1, 300))
            rows = rng.integers(0, 128, (n, 48, 8)).astype(np.uint8)
            mask = rng.integers(0, 5000, (n, 1 + w)).astype(np.int32)
            segs = await client.append_many([(R, rows, k * 1000), (M, mask, k * 1000)],
                                            run=f"conc{w % 4}", step=k % 3)  # fmt: skip
            out.append((rows, segs[0]))
            out.append((mask, segs[1]))
        written[w] = out

    async def reader(w: int, client: AsyncPayloadClient) -> int:
        checked = 0
        while w not in written or checked < len(written[w]):
            await asyncio.sleep(0)
            done = written.get(w, [])
            for rows, segs in done[checked:]:
                got = await client.read_field(
                    segs, segs[0].field, segs[0].pos, segs[0].pos + len(rows), -7
                )
                assert got is not None
                np.testing.assert_array_equal(got, rows.astype(np.int32))
                checked += 1
            if w not in written:
                await asyncio.sleep(0.005)
        return checked

    async with AsyncPayloadClient(daemon.socket) as wc, AsyncPayloadClient(daemon.socket) as rc:
        results = await asyncio.gather(
            *(writer(w, wc) for w in range(writers)), *(reader(w, rc) for w in range(writers))
        )
    assert results[writers:] == [2 * appends] * writers
    spans = sorted((s.file, s.offset, s.offset + s.rows * 384) for out in written.values()
                   for rows, segs in out for s in segs if s.field == R)  # fmt: skip
    for (f1, _, e1), (f2, s2, _) in itertools.pairwise(spans):
        assert f1 != f2 or e1 <= s2, "two appends were given overlapping bytes"
