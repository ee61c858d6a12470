"""The seed's RL batch carried inline versus by handle (part of ``payloadd bench``).

The inline transport of an RL stack keeps every sample's rows inside the sample: the
orchestrator holds them, packs micro batches by copying them, encodes each DP rank's micro
batches with msgpack (msgspec structs, rows as raw bytes) and publishes one message per DP
rank over ZMQ to every consumer of that rank (its ``cp`` CP ranks). By handle, inference
appended the rows to payloadd; samples carry segments, packing shifts them, the message holds
segments, and each CP rank reads only its window with ``read_many``.

Both transports carry the same token ids and log-probabilities, and the same mask rows (ragged,
each turn at its own width). Per repetition and transport, in fresh processes:

- the orchestrator (one process) builds the samples (inline: it holds the rows; by handle: it
  holds the segments inference returned), then packs and encodes, then publishes; it reports
  the resident memory the samples take (RSS after building minus RSS before), the peak
  (highest RSS, ``VmHWM``, minus RSS before), the pack + encode time and the bytes sent
  (message bytes times subscribers);
- a third mode holds the same samples with **no payload at all** (token lists only) and
  reports only its resident memory: what the token lists take, so that by handle's payload
  share is ``(by handle - no payload) / (inline - no payload)``;
- ``dp x cp`` consumer processes subscribe (ZMQ over ``ipc://`` in the temporary folder), receive
  their DP rank's message and, one at a time (a lock keeps them off each other's CPU), time
  decode + materialise: routing ``int32 [window, 48, 8]`` and the mask ``int32 [window, width]``
  over the window plus one, for every micro batch of the DP rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from payload_client import PayloadClient, PayloadSegment, Window, clip_segments, shift_segments
from payloadd.bench._rl_batch import LAYERS, MASK, MASK_FILL, ROUTED, ROUTED_FILL, TOP_K, RLBatch

__all__ = ["BARE", "bench_rl", "write_batch"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
BARE = "bare"
"""The mode with no payload (token lists only)."""


def _rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _peak() -> int:
    """Highest resident bytes of this process so far: ``VmHWM`` of ``/proc/self/status``.

    Not ``ru_maxrss``: it keeps the resident size of the process image before ``exec``, so a
    child spawned by a large parent would report the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


# -- what travels ----------------------------------------------------------------------------


class InlineSample(msgspec.Struct):
    """A sample as the inline transport holds it: rows inside (mask rows ragged, CSR)."""

    token_ids: list[int]
    logprobs: list[float]
    routed: bytes  # uint8 [tokens, 48, 8]
    mask_pos: bytes  # int32 [masked]: position of each mask row
    mask_start: bytes  # int64 [masked + 1]: offset of each row's ids in mask_ids
    mask_ids: bytes  # int32 [sum of widths]


class InlineMicroBatch(msgspec.Struct):
    """A packed micro batch, inline: members' rows concatenated at their offsets."""

    length: int
    token_ids: list[int]
    logprobs: list[float]
    routed: bytes
    mask_pos: bytes
    mask_start: bytes
    mask_ids: bytes


class HandleSample(msgspec.Struct):
    """A sample by handle: token ids, log-probabilities, segments."""

    token_ids: list[int]
    logprobs: list[float]
    segments: list[PayloadSegment]


class BareSample(msgspec.Struct):
    """A sample with no payload: token ids and log-probabilities only."""

    token_ids: list[int]
    logprobs: list[float]


class HandleMicroBatch(msgspec.Struct):
    """A packed micro batch by handle: members' segments shifted to their offsets."""

    length: int
    token_ids: list[int]
    logprobs: list[float]
    segments: list[PayloadSegment]


# -- inference (by handle) and the samples --------------------------------------------------


def write_batch(spec: RLBatch, client: PayloadClient, run: str) -> list[list[PayloadSegment]]:
    """Inference: append every turn's routing and mask rows; return each sample's segments."""
    out = []
    for i in range(spec.samples):
        segs: list[PayloadSegment] = []
        for t in spec.turns_of(i):
            items = [(ROUTED, t.routed, t.pos), (MASK, t.mask, t.mask_pos)]
            for item_segs in client.append_many(items, run=run, step=0):
                segs += item_segs
        out.append(segs)
    return out


def _inline_sample(spec: RLBatch, i: int) -> InlineSample:
    ids: list[int] = []
    lps: list[float] = []
    routed, pos, widths, masks = [], [], [], []
    for t in spec.turns_of(i):
        ids += t.token_ids
        lps += t.logprobs
        routed.append(t.routed)
        pos.append(np.arange(t.mask_pos, t.mask_pos + len(t.mask), dtype=np.int32))
        widths.append(np.full(len(t.mask), t.mask.shape[1]))
        masks.append(t.mask.ravel())
    start = np.zeros(sum(map(len, widths)) + 1, np.int64)
    np.cumsum(np.concatenate(widths), out=start[1:])
    return InlineSample(
        ids,
        lps,
        np.concatenate(routed).tobytes(),
        np.concatenate(pos).tobytes(),
        start.tobytes(),
        np.concatenate(masks).tobytes(),
    )


def _handle_sample(spec: RLBatch, i: int, segments: list[PayloadSegment]) -> HandleSample:
    ids: list[int] = []
    lps: list[float] = []
    for turn_ids, turn_lps in spec.token_lists(i):  # the same lists as inline; no rows made
        ids += turn_ids
        lps += turn_lps
    return HandleSample(ids, lps, segments)


def _bare_sample(spec: RLBatch, i: int) -> BareSample:
    ids: list[int] = []
    lps: list[float] = []
    for turn_ids, turn_lps in spec.token_lists(i):  # the lists of the other two modes
        ids += turn_ids
        lps += turn_lps
    return BareSample(ids, lps)


# -- orchestrator -------------------------------------------------------------------------


def _hold_bare(spec: RLBatch, report: Any) -> None:
    """The orchestrator with no payload: it builds the samples and reports what they take."""
    base = _rss()
    samples = [_bare_sample(spec, i) for i in range(spec.samples)]
    resident = _rss() - base
    report.put(("orchestrator", resident, _peak() - base, 0, 0.0))
    del samples


def _pack_inline(samples: list[InlineSample], members: list[tuple[int, int, int]]) -> Any:
    ids: list[int] = []
    lps: list[float] = []
    routed, pos, starts, masks = [], [], [np.zeros(1, np.int64)], []
    base = 0
    for i, offset, n in members:
        s = samples[i]
        ids += s.token_ids[:n]
        lps += s.logprobs
        routed.append(s.routed[: n * LAYERS * TOP_K])
        p = np.frombuffer(s.mask_pos, np.int32)
        keep = int(np.searchsorted(p, n))
        st = np.frombuffer(s.mask_start, np.int64)
        pos.append(p[:keep] + offset)
        starts.append(st[1 : keep + 1] + base)
        masks.append(s.mask_ids[: int(st[keep]) * 4])
        base += int(st[keep])
    length = sum(n for _, _, n in members)
    return InlineMicroBatch(
        length,
        ids,
        lps,
        b"".join(routed),
        np.concatenate(pos).tobytes(),
        np.concatenate(starts).tobytes(),
        b"".join(masks),
    )


def _pack_handle(samples: list[HandleSample], members: list[tuple[int, int, int]]) -> Any:
    ids: list[int] = []
    lps: list[float] = []
    segs: list[PayloadSegment] = []
    for i, offset, n in members:
        s = samples[i]
        ids += s.token_ids[:n]
        lps += s.logprobs
        segs += shift_segments(clip_segments(s.segments, 0, n), offset)
    return HandleMicroBatch(sum(n for _, _, n in members), ids, lps, segs)


def _orchestrate(spec: RLBatch, mode: str, address: str, segments: bytes, report: Any) -> None:
    import zmq

    base = _rss()
    if mode == "inline":
        samples: list[Any] = [_inline_sample(spec, i) for i in range(spec.samples)]
    else:
        segs = msgspec.msgpack.decode(segments, type=list[list[PayloadSegment]])
        samples = [_handle_sample(spec, i, segs[i]) for i in range(spec.samples)]
        del segs
    resident = _rss() - base
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # one message per subscriber, even for one topic
    pub.bind(address)
    for _ in range(spec.dp * spec.cp):  # every consumer subscribed: nothing is dropped
        pub.recv()
    t0 = time.perf_counter()
    pack = _pack_inline if mode == "inline" else _pack_handle
    batches = spec.micro_batches()
    encoder = msgspec.msgpack.Encoder()
    messages = [
        encoder.encode([pack(samples, b) for k, b in enumerate(batches) if k % spec.dp == d])
        for d in range(spec.dp)
    ]
    seconds = time.perf_counter() - t0
    for d, message in enumerate(messages):
        pub.send_multipart([f"dp{d}".encode(), message], copy=False)
    pub.close(linger=-1)
    ctx.term()
    wire = sum(len(m) for m in messages) * spec.cp
    report.put(("orchestrator", resident, _peak() - base, wire, seconds))


def _consume(
    spec: RLBatch, mode: str, address: str, socket: str, d: int, r: int, report: Any, lock: Any
) -> None:
    import zmq

    client = PayloadClient(socket) if mode == "handle" else None
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(address)
    sub.setsockopt(zmq.SUBSCRIBE, f"dp{d}".encode())
    _, message = sub.recv_multipart(copy=False)
    with lock:
        t0 = time.perf_counter()
        if mode == "inline":
            for mb in msgspec.msgpack.decode(message.buffer, type=list[InlineMicroBatch]):
                _materialise_inline(spec, mb, r)
        else:
            assert client is not None
            for hb in msgspec.msgpack.decode(message.buffer, type=list[HandleMicroBatch]):
                lo, hi = spec.windows(hb.length)[r]
                client.read_many(
                    [
                        Window(hb.segments, ROUTED, lo, hi, ROUTED_FILL),
                        Window(hb.segments, MASK, lo + 1, hi + 1, MASK_FILL),
                    ]
                )
        seconds = time.perf_counter() - t0
    sub.close()
    ctx.term()
    if client is not None:
        client.close()
    report.put(("rank", d, r, seconds))


def _materialise_inline(
    spec: RLBatch, mb: InlineMicroBatch, r: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """What a CP rank of the inline path does: widen its window of every tensor."""
    lo, hi = spec.windows(mb.length)[r]
    routed = np.full((hi - lo, LAYERS, TOP_K), ROUTED_FILL, np.int32)
    rows = np.frombuffer(mb.routed, np.uint8).reshape(-1, LAYERS, TOP_K)[lo:hi]
    routed[: len(rows)] = rows
    pos = np.frombuffer(mb.mask_pos, np.int32)
    start = np.frombuffer(mb.mask_start, np.int64)
    ids = np.frombuffer(mb.mask_ids, np.int32)
    a, b = np.searchsorted(pos, [lo + 1, hi + 1])
    widths = np.diff(start[a : b + 1])
    every = np.diff(
        start
    )  # no row in the window: the widest of all (docs/contract.md, "Reading a window")
    if not len(every):  # no mask row left in the micro batch: no mask (as by handle)
        return routed, None
    width = int(widths.max()) if len(widths) else int(every.max()) if len(every) else 1
    mask = np.full((hi - lo, width), MASK_FILL, np.int32)
    if len(widths):
        rows_at = np.repeat(pos[a:b] - (lo + 1), widths)
        cols = np.arange(int(widths.sum())) - np.repeat(start[a:b] - start[a], widths)
        mask[rows_at, cols] = ids[start[a] : start[b]]
    return routed, mask


# -- driver ----------------------------------------------------------------------------------


def _once(spec: RLBatch, mode: str, tmp: Path, socket: Path, segments: bytes) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    report, lock = ctx.Queue(), ctx.Lock()
    address = f"ipc://{tmp}/rl-{mode}.ipc"
    if mode == BARE:  # no payload: nothing to send, nobody to receive
        consumers, orchestrator = [], ctx.Process(target=_hold_bare, args=(spec, report))
    else:
        consumers = [
            ctx.Process(
                target=_consume, args=(spec, mode, address, str(socket), d, r, report, lock)
            )
            for d in range(spec.dp)
            for r in range(spec.cp)
        ]
        orchestrator = ctx.Process(
            target=_orchestrate, args=(spec, mode, address, segments, report)
        )
    procs = [orchestrator, *consumers]
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + 900
        while len(got) < len(procs):
            try:
                got.append(report.get(timeout=0.5))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"an RL benchmark process failed (exit {failed or 'timeout'})"
                    ) from None
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    (orch,) = [g for g in got if g[0] == "orchestrator"]
    ranks = [g[3] for g in got if g[0] == "rank"]
    if mode == BARE:
        return {"resident": orch[1] / 2**20}
    return {
        "resident": orch[1] / 2**20,
        "peak": orch[2] / 2**20,
        "wire": orch[3] / 2**20,
        "encode": orch[4],
        "decode": statistics.median(ranks),
    }


def bench_rl(
    spec: RLBatch, socket: Path, tmp: Path, repeat: int
) -> dict[str, dict[str, list[float]]]:
    """Run the RL batch ``repeat`` times per transport, and the samples with no payload,
    rotating which goes first.

    Parameters
    ----------
    spec : RLBatch
        The batch.
    socket : Path
        Control socket of a running daemon (inference appends through it, ranks read).
    tmp : Path
        Folder for the ZMQ ``ipc://`` endpoints.
    repeat : int
        Repetitions.

    Returns
    -------
    dict
        ``{"inline" | "handle": {measure: [value per repetition]}}`` with measures
        ``resident``, ``peak``, ``wire`` (MiB) and ``encode``, ``decode`` (seconds; decode is
        the median over the ``dp x cp`` ranks of one repetition); and ``{"bare":
        {"resident": [...]}}``, the samples with no payload.
    """
    with PayloadClient(socket) as client:
        segments = msgspec.msgpack.encode(write_batch(spec, client, "bench-rl"))
    modes = ["inline", "handle", BARE]
    out: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    for k in range(repeat):
        for mode in modes[k % 3 :] + modes[: k % 3]:
            for name, value in _once(spec, mode, tmp, socket, segments).items():
                out[mode].setdefault(name, []).append(value)
    return out
