"""``out=`` given as a CPU torch tensor: read into through its numpy view (the same memory),
returned itself; other tensors refused in words. Skipped where torch is not installed
(``make test``'s ``.venv``); ``make check-vllm`` runs it in ``.venv-vllm``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    CoveredRead,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    Window,
    shift_segments,
)

torch: Any = pytest.importorskip("torch")

MASK = np.array([[1, 2, 3], [4, 5, -1], [6, -1, -1]], np.int32)  # positions [2, 5)
ROUTED = np.arange(6 * 48 * 8, dtype=np.uint8).reshape(6, 48, 8)  # positions [0, 6)


@pytest.fixture
def segs(client: PayloadClient) -> list[PayloadSegment]:
    routed, mask = client.append_many(
        [("routed_experts", ROUTED, 0), ("sampling_mask", MASK, 2)], run="torch", step=0
    )
    return routed + mask


def expected_mask(lo: int, hi: int, width: int) -> np.ndarray:
    want = np.full((hi - lo, width), -1, np.int32)
    for p in range(max(lo, 2), min(hi, 5)):
        want[p - lo, : MASK.shape[1]] = MASK[p - 2]
    return want


def test_read_field_fills_the_tensor_and_returns_it(
    client: PayloadClient, segs: list[PayloadSegment]
) -> None:
    t = torch.full((6, 4), 7, dtype=torch.int32)  # wider than the rows: the rest is fill
    view = t.numpy()  # taken before the read: the same memory as the tensor
    assert np.shares_memory(view, t.numpy()) and view.ctypes.data == t.data_ptr()
    got = client.read_field(segs, "sampling_mask", 0, 6, -1, out=t)
    assert got is t
    assert np.array_equal(t.numpy(), expected_mask(0, 6, 4))
    assert np.array_equal(view, expected_mask(0, 6, 4))  # what was read is in the view too
    assert t.tolist() == expected_mask(0, 6, 4).tolist()  # and in torch's own reading of it
    # the stored dtype, from the tensor's: the stored bytes, bit for bit
    ids = torch.empty((6, 48, 8), dtype=torch.uint8)
    assert client.read_field(segs, "routed_experts", 0, 6, 0, out=ids) is ids
    assert bytes(ids.numpy()) == ROUTED.tobytes()


def test_a_slice_of_a_reused_tensor_and_read_many_with_coverage(
    client: PayloadClient, segs: list[PayloadSegment]
) -> None:
    buffer = torch.zeros((8, 5), dtype=torch.int32)  # allocated once, reused every step
    part = buffer[1:5, :3]  # not contiguous: rows of 5, 3 used
    routed = torch.empty((4, 48, 8), dtype=torch.int64)  # int64 for indexing
    got = client.read_many(
        [
            Window(segs, "sampling_mask", 1, 5, -1, out=part),
            Window(segs, "routed_experts", 2, 6, 0, out=routed),
        ],
        coverage=True,
    )
    assert got[0] == CoveredRead(part, got[0].covered) and got[0].array is part
    assert got[0].covered.tolist() == [False, True, True, True]
    assert np.array_equal(buffer[1:5, :3].numpy(), expected_mask(1, 5, 3))
    assert (buffer[0] == 0).all() and (buffer[5:] == 0).all() and (buffer[:, 3:] == 0).all()
    assert np.array_equal(routed.numpy(), ROUTED[2:6].astype(np.int64))
    assert got[1].array is routed  # Window.out is typed numpy: `is` narrows it, so last


def test_read_cp_into_a_tensor(client: PayloadClient, segs: list[PayloadSegment]) -> None:
    packed = shift_segments(segs, 2)  # a sample at offset 2 of a micro batch of 8: masks at [4, 7)
    labels = np.full((8, 3), -1, np.int32)  # the inline mask shifted left by one
    labels[3:6] = MASK
    for lb, positions in ((True, [2, 3, 4, 5]), (False, [4, 5, 6, 7])):  # rank 1 of CP 2
        t = torch.full((4, 3), 9, dtype=torch.int32)
        got = client.read_cp(packed, "sampling_mask", 8, 2, 1, -1, labels=True,
                             load_balanced=lb, out=t)  # fmt: skip
        assert got is t
        assert np.array_equal(t.numpy(), labels[positions])


@pytest.mark.asyncio
async def test_the_async_client_returns_the_tensor(
    aclient: AsyncPayloadClient, run_name: str
) -> None:
    [seg] = await aclient.append("sampling_mask", MASK, 2, run=run_name, step=1)
    t = torch.zeros((3, 3), dtype=torch.int32)
    assert await aclient.read_field([seg], "sampling_mask", 2, 5, -1, out=t) is t
    assert np.array_equal(t.numpy(), MASK)
    lb = torch.zeros((2, 3), dtype=torch.int32)
    got = await aclient.read_cp([seg], "sampling_mask", 4, 2, 0, -1, load_balanced=True, out=lb)
    assert got is lb and np.array_equal(lb.numpy(), expected_mask(0, 4, 3)[[0, 3]])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: torch.zeros((6, 3), dtype=torch.float32, requires_grad=True),
         r"requires grad: pass out.detach\(\)"),
        (lambda: torch.zeros((6, 3), dtype=torch.int32, device="meta"),
         r'tensor on meta: pass a CPU tensor .*\.to\("meta", non_blocking=True\)'),
        (lambda: torch.zeros((6, 3), dtype=torch.bfloat16), "numpy cannot view"),
    ],
    ids=["requires-grad", "meta-device", "bfloat16"],
)  # fmt: skip
def test_tensors_numpy_cannot_share_are_refused_in_words(
    client: PayloadClient, segs: list[PayloadSegment], make: Any, message: str
) -> None:
    out = make()
    for read in (
        lambda: client.read_field(segs, "sampling_mask", 0, 6, -1, out=out),
        lambda: client.read_cp(segs, "sampling_mask", 12, 2, 0, -1, load_balanced=True, out=out),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            read()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_a_pinned_tensor_then_to_the_gpu(client: PayloadClient, segs: list[PayloadSegment]) -> None:
    pinned = torch.empty((6, 3), dtype=torch.int32, pin_memory=True)
    assert client.read_field(segs, "sampling_mask", 0, 6, -1, out=pinned) is pinned
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert np.array_equal(on_gpu.cpu().numpy(), expected_mask(0, 6, 3))
