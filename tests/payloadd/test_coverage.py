"""Coverage through a real daemon, on both transports, sync and async."""

from __future__ import annotations

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    CoveredRead,
    PayloadClient,
    PayloadSegment,
    Window,
    clip_segments,
    shift_segments,
)
from tests.reference import dense_coverage

R, M = "routed_experts", "sampling_mask"


def stored(client: PayloadClient, run: str) -> tuple[list[PayloadSegment], np.ndarray]:
    """Two overlapping routed blocks and a mask; and the routed rows a dense read expects."""
    a = np.full((6, 48, 8), 3, np.uint8)
    b = np.full((2, 48, 8), 5, np.uint8)
    (sa,), (sb,), (sm,) = client.append_many(
        [(R, a, 10), (R, b, 14), (M, np.ones((3, 4), np.int32), 10)], run=run, step=0
    )
    return [sa, sb, sm], np.concatenate([a[:4], b])  # b wins 14, 15


def test_read_field_coverage_marks_real_rows_not_fill(client: PayloadClient) -> None:
    segs, rows = stored(client, "cov")
    arr, covered = client.read_field(segs, R, 8, 20, 0, coverage=True)
    assert arr is not None and arr.shape == (12, 48, 8)
    assert covered.tolist() == [False] * 2 + [True] * 6 + [False] * 4
    np.testing.assert_array_equal(covered, dense_coverage(segs, R, 8, 20))
    np.testing.assert_array_equal(arr[covered], rows)
    assert (arr[~covered] == 0).all()  # fill: what would replay as expert 0
    plain = client.read_field(segs, R, 8, 20, 0)
    assert isinstance(plain, np.ndarray)
    np.testing.assert_array_equal(plain, arr)


def test_coverage_of_absent_fields_placeholders_and_empty_windows(
    client: PayloadClient, run_name: str
) -> None:
    segs, _ = stored(client, run_name)
    absent = client.read_field(segs, "weights", 10, 13, 0.0, coverage=True)
    assert absent.array is None and absent.covered.tolist() == [False] * 3
    (p,) = client.append(M, np.zeros((0, 4), np.int32), 30, run=run_name, step=0)
    arr, covered = client.read_field([p], M, 0, 3, -1, coverage=True)
    assert arr is not None and arr.shape == (3, 4) and (arr == -1).all() and not covered.any()
    arr, covered = client.read_field(segs, R, 12, 12, 0, coverage=True)
    assert arr is not None and arr.shape == (0, 48, 8) and covered.shape == (0,)


def test_read_many_mixes_windows_with_and_without_coverage(client: PayloadClient) -> None:
    segs, rows = stored(client, "cov-many")
    # an orchestrator's packing: the sample (rows at 10..15) moved to position 0
    packed = shift_segments(clip_segments(segs, 10, 17), -10)
    out = np.empty((9, 48, 8), np.uint8)
    got = client.read_many(
        [
            Window(packed, R, 0, 9, 0, out=out, coverage=True),
            Window(packed, M, 1, 5, -1),
            Window(packed, M, 1, 5, -1, coverage=True),
            Window(packed, "weights", 2, 4, 0.0, coverage=True),  # no segment of it
        ],
        coverage=None,  # each window as it asks
    )
    routed, mask, mask_cov, absent = got
    assert isinstance(routed, CoveredRead) and routed.array is out
    assert routed.covered.tolist() == [True] * 6 + [False] * 3
    np.testing.assert_array_equal(out[:6], rows)
    assert (out[6:] == 0).all()
    assert isinstance(mask, np.ndarray) and mask.shape == (4, 4)
    assert isinstance(mask_cov, CoveredRead) and mask_cov.covered.tolist() == [1, 1, 0, 0]
    np.testing.assert_array_equal(mask_cov.array, mask)
    assert isinstance(absent, CoveredRead) and absent.array is None and not absent.covered.any()


@pytest.mark.asyncio
async def test_async_coverage_matches_sync(aclient: AsyncPayloadClient, run_name: str) -> None:
    a = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    (s,) = await aclient.append(M, a, 2, run=run_name, step=0)
    arr, covered = await aclient.read_field([s], M, 0, 8, -1, coverage=True)
    assert covered.tolist() == [False, False, True, True, True, True, False, False]
    assert arr is not None
    np.testing.assert_array_equal(arr[covered], a)
    plain, with_cov = await aclient.read_many(
        [Window([s], M, 3, 7, -1), Window([s], M, 3, 7, -1, coverage=True)], coverage=None
    )
    assert isinstance(plain, np.ndarray) and isinstance(with_cov, CoveredRead)
    np.testing.assert_array_equal(with_cov.array, plain)
    assert with_cov.covered.tolist() == [True, True, True, False]
