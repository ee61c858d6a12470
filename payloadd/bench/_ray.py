"""One RL job end to end on Ray's object store and on payloadd (part of ``payloadd bench``).

The job is the same for both systems, on the batch of `RLBatch`:

1. Inference: every turn of every sample stores its routing rows ``uint8 [n, 48, 8]`` and
   its sampling-mask rows ``int32 [c, width]``. payloadd: one ``append_many`` per turn,
   keeping the segments; Ray: one ``ray.put`` per array, keeping the refs and positions.
2. Orchestrator: samples are truncated and packed into micro batches
   (`RLBatch.micro_batches`), micro batch ``k`` going to DP rank ``k % dp``. payloadd:
   ``clip_segments`` and ``shift_segments``; Ray: refs plus row offsets.
3. Trainer: every (DP, CP) rank materialises routing ``int32 [hi - lo, 48, 8]`` over its
   window ``[lo, hi)`` (fill 0) and the mask ``int32 [hi - lo, W]`` over ``[lo + 1, hi + 1)``
   (fill -1), ``W`` the widest mask row intersecting that window (payloadd's rule: docs/contract.md, "Reading a window").
   payloadd: one ``read_many``; Ray: one ``ray.get`` of the needed refs (zero-copy numpy
   views of the shared-memory store), then slicing and widening into new int32 arrays.

The ranks run one after the other in the driver process, for both systems: a zero-copy
``ray.get`` in the process that put the objects is Ray's best case (a real trainer rank is
another process, possibly on another node). The batch is generated once before any timing;
process start-up, ``ray.init`` and the daemon's start are not timed. An untimed first run of
each system, whose outputs must be equal rank by rank, comes before the timed repetitions:
holding those outputs (about twice the batch's routing as int32) while timing would add
first-touch page faults to that repetition (seconds on a VM), and it warms both systems up.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from payload_client import PayloadClient, PayloadSegment, Window, clip_segments, shift_segments
from payloadd.bench._rl_batch import MASK, MASK_FILL, ROUTED, ROUTED_FILL, RLBatch, Turn

__all__ = ["PAYLOADD", "RAY", "alternated", "bench_ray", "ray_available", "restored_environ"]

RAY, PAYLOADD = "ray object store", "payloadd"
Key = tuple[int, int, int]
"""A rank's output: (DP rank, micro batch, CP rank)."""
Outputs = dict[Key, tuple[np.ndarray | None, np.ndarray | None]]
"""Routing and mask of every rank (empty unless asked to keep them)."""


class _Piece(NamedTuple):
    """Rows ``[src, src + rows)`` of one Ray object, at token positions ``[pos, pos + rows)``."""

    ref: Any  # ray.ObjectRef
    src: int
    pos: int
    rows: int
    shape: tuple[int, ...]


def ray_available() -> str | None:
    """``None`` when ``import ray`` works, else a one-line note of why not."""
    try:
        importlib.import_module("ray")
    except ImportError:
        return "ray is not installed: pip install 'payloadd[ray]'"
    except Exception as exc:  # a broken install fails in many ways; say which
        return f"ray cannot be imported: {type(exc).__name__}: {exc}"
    return None


def _ranks(
    spec: RLBatch, batches: list[list[tuple[int, int, int]]]
) -> Iterator[tuple[Key, int, int]]:
    """Every rank's key and routing window ``[lo, hi)`` (token positions), DP rank by DP rank."""
    for d in range(spec.dp):
        for k in range(d, len(batches), spec.dp):
            length = sum(n for _, _, n in batches[k])
            for r, (lo, hi) in enumerate(spec.windows(length)):
                yield (d, k, r), lo, hi


def _payloadd_put(
    client: PayloadClient, turns: list[list[Turn]], run: str
) -> list[list[PayloadSegment]]:
    """Inference on payloadd: one ``append_many`` per turn into ``run``, step 0; each sample's
    segments."""
    segs: list[list[PayloadSegment]] = []
    for sample in turns:
        mine: list[PayloadSegment] = []
        for t in sample:
            items = [(ROUTED, t.routed, t.pos), (MASK, t.mask, t.mask_pos)]
            for got in client.append_many(items, run=run, step=0):
                mine += got
        segs.append(mine)
    return segs


def _payloadd_pack(
    spec: RLBatch, segs: list[list[PayloadSegment]]
) -> tuple[list[list[tuple[int, int, int]]], list[list[PayloadSegment]]]:
    """The orchestrator on payloadd: the micro batches and each one's shifted segments."""
    batches = spec.micro_batches()
    packed = [
        [s for i, off, n in mb for s in shift_segments(clip_segments(segs[i], 0, n), off)]
        for mb in batches
    ]
    return batches, packed


def _payloadd_read(
    client: PayloadClient,
    spec: RLBatch,
    batches: list[list[tuple[int, int, int]]],
    packed: list[list[PayloadSegment]],
    keep: bool,
    laps: list[float] | None = None,
) -> Outputs:
    """The trainer ranks on payloadd, one ``read_many`` each; ``laps`` gets each rank's seconds."""
    out: Outputs = {}
    for key, lo, hi in _ranks(spec, batches):
        t0 = time.perf_counter()
        seg = packed[key[1]]
        routed, mask = client.read_many(
            [Window(seg, ROUTED, lo, hi, ROUTED_FILL), Window(seg, MASK, lo + 1, hi + 1, MASK_FILL)]
        )
        if laps is not None:
            laps.append(time.perf_counter() - t0)
        if keep:
            out[key] = (routed, mask)
    return out


def _payloadd_job(
    client: PayloadClient, spec: RLBatch, turns: list[list[Turn]], run: str, keep: bool
) -> Outputs:
    """The job on payloadd; the rows go to ``run``, step 0."""
    batches, packed = _payloadd_pack(spec, _payloadd_put(client, turns, run))
    return _payloadd_read(client, spec, batches, packed, keep)


def _window(
    mine: Sequence[_Piece],
    hits: Sequence[_Piece],
    arrays: Sequence[np.ndarray],
    lo: int,
    hi: int,
    fill: int,
) -> np.ndarray | None:
    """payloadd's window rule on Ray's arrays: ``int32 [hi - lo, *row_shape]``, or ``None``.

    ``mine`` are all pieces of the field in the micro batch, ``hits`` those intersecting
    ``[lo, hi)`` (token positions, end exclusive) and ``arrays`` their objects. The row shape is
    the element-wise maximum over ``hits`` (over ``mine`` when none intersects); each row a
    piece covers is written whole (values first, ``fill`` after), the others are ``fill``.
    """
    if not mine:
        return None
    row_shape = tuple(max(dims) for dims in zip(*(p.shape for p in hits or mine), strict=True))
    out = np.empty((hi - lo, *row_shape), np.int32)
    covered = np.zeros(hi - lo, bool)
    for p, a in zip(hits, arrays, strict=True):
        start, stop = max(p.pos, lo), min(p.pos + p.rows, hi)
        src = a[p.src + start - p.pos : p.src + stop - p.pos]
        dst = out[start - lo : stop - lo]
        if p.shape != row_shape:
            dst[...] = fill
            dst = dst[(slice(None), *(slice(0, d) for d in p.shape))]
        dst[...] = src
        covered[start - lo : stop - lo] = True
    if not covered.all():
        out[~covered] = fill
    return out


def _ray_job(ray: Any, spec: RLBatch, turns: list[list[Turn]], keep: bool) -> Outputs:
    """The job on Ray's object store (``ray`` is the initialised module)."""
    stored: list[list[tuple[str, _Piece]]] = []
    for sample in turns:
        mine: list[tuple[str, _Piece]] = []
        for t in sample:
            for field, rows, pos in ((ROUTED, t.routed, t.pos), (MASK, t.mask, t.mask_pos)):
                mine.append((field, _Piece(ray.put(rows), 0, pos, len(rows), rows.shape[1:])))
        stored.append(mine)
    batches = spec.micro_batches()
    packed: list[dict[str, list[_Piece]]] = []
    for mb in batches:
        fields: dict[str, list[_Piece]] = {ROUTED: [], MASK: []}
        for i, off, n in mb:
            for field, p in stored[i]:
                a, b = max(p.pos, 0), min(p.pos + p.rows, n)  # clip to [0, n), then shift
                if a < b:
                    fields[field].append(p._replace(src=a - p.pos, pos=a + off, rows=b - a))
        packed.append(fields)
    out: Outputs = {}
    for key, lo, hi in _ranks(spec, batches):
        routed, mask = packed[key[1]][ROUTED], packed[key[1]][MASK]
        r_hits = [p for p in routed if max(p.pos, lo) < min(p.pos + p.rows, hi)]
        m_hits = [p for p in mask if max(p.pos, lo + 1) < min(p.pos + p.rows, hi + 1)]
        arrays = ray.get([p.ref for p in r_hits + m_hits])
        got = (
            _window(routed, r_hits, arrays[: len(r_hits)], lo, hi, ROUTED_FILL),
            _window(mask, m_hits, arrays[len(r_hits) :], lo + 1, hi + 1, MASK_FILL),
        )
        del arrays  # unpin the objects
        if keep:
            out[key] = got
    return out


def _check(peer_out: Outputs, ours: Outputs, peer: str = "Ray") -> None:
    """Raise `RuntimeError` naming the first rank whose outputs differ (same keys in both)."""
    for key, (routed, mask) in peer_out.items():
        for name, a, b in (("routing", routed, ours[key][0]), ("mask", mask, ours[key][1])):
            same = np.array_equal(a, b) if a is not None and b is not None else a is b
            if not same:
                d, k, r = key
                raise RuntimeError(
                    f"DP rank {d}, micro batch {k}, CP rank {r}: {name} differs between {peer} "
                    "and payloadd"
                )


@contextmanager
def restored_environ() -> Iterator[None]:
    """``os.environ`` as it was when the block began, again after it (importing and starting
    Ray both change it)."""
    environ = dict(os.environ)
    try:
        yield
    finally:
        for name in os.environ.keys() - environ.keys():  # PYTHONBREAKPOINT, RAY_AUTH_MODE, ...
            del os.environ[name]
        os.environ.update(environ)


def alternated(peer: str, repeat: int) -> Iterator[tuple[int, str]]:
    """The timed runs: ``(repetition, system)``, repetitions 1 to ``repeat``, each of both
    systems, ``peer`` first in the odd ones and payloadd in the even ones."""
    for rep in range(1, repeat + 1):
        yield from ((rep, name) for name in ((peer, PAYLOADD) if rep % 2 else (PAYLOADD, peer)))


def bench_ray(spec: RLBatch, socket: Path, repeat: int) -> dict[str, list[float]]:
    """Time the RL job on Ray's object store and on payloadd.

    Parameters
    ----------
    spec : RLBatch
        The batch (generated once, before any timing).
    socket : pathlib.Path
        Control socket of a running payloadd daemon; every repetition writes to a run of
        its own (``bench-ray-<id>-<n>``, step 0), left in the daemon's root.
    repeat : int
        Timed repetitions; within each, both systems run, alternately Ray and payloadd first.

    Returns
    -------
    dict of str to list of float
        ``{RAY: [...], PAYLOADD: [...]}``: seconds of the whole job (inference, orchestrator,
        every rank's reads) per repetition, in repetition order.

    Raises
    ------
    RuntimeError
        If the two systems' outputs of a rank differ (checked on an untimed first run).
    ImportError
        If Ray is not installed (see `ray_available`).

    Notes
    -----
    Starts a local Ray instance (2 CPUs, no dashboard, usage stats off; object store of 3x
    the batch's routing bytes, at least 256 MiB) and shuts it down at the end, restoring
    ``os.environ``. Refs are dropped between repetitions, which frees their objects.
    """
    turns = [list(spec.turns_of(i)) for i in range(spec.samples)]
    tag = uuid.uuid4().hex[:8]
    times: dict[str, list[float]] = {RAY: [], PAYLOADD: []}
    with restored_environ():
        ray: Any = importlib.import_module("ray")
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        try:
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",  # Ray 2.60 still binds its ports on every interface
                object_store_memory=max(3 * spec.routed_bytes, 256 << 20),
            )
            with PayloadClient(socket) as client:

                def job(name: str, rep: int, keep: bool) -> Outputs:
                    if name == RAY:
                        return _ray_job(ray, spec, turns, keep)
                    return _payloadd_job(client, spec, turns, f"bench-ray-{tag}-{rep}", keep)

                _check(job(RAY, 0, keep=True), job(PAYLOADD, 0, keep=True))  # untimed
                for rep, name in alternated(RAY, repeat):
                    t0 = time.perf_counter()
                    job(name, rep, keep=False)
                    times[name].append(time.perf_counter() - t0)
        finally:
            ray.shutdown()
    return times
