"""One RL job end to end on TransferQueue and on payloadd (part of ``payloadd bench``).

TransferQueue (``transfer_queue``, the data system verl uses) keeps samples as rows of a
table whose columns are fields; its SimpleStorage backend holds them in the memory of
storage-unit processes (Ray actors that serve ZMQ sockets), and a controller actor keeps the
metadata. The job is the one of `payloadd.bench._ray`, on the batch of `RLBatch`:

1. Inference: when a sample's turns are done, the sample is put with TransferQueue's batch
   API, ``kv_batch_put`` (one key, ``sample-<i>``), as a ``TensorDict`` of three fields:
   routing ``uint8 [tokens, 48, 8]`` (every turn's rows at their positions), the sampling
   mask ``int32 [tokens, W_i]`` (dense over the sample's positions, ``W_i`` its widest turn,
   -1 where a position has no mask row or past a turn's width: a field is one tensor a
   sample, so ragged widths are padded) and a table ``int32 [turns, 3]`` of each turn's
   mask position, rows and width (what a rank needs to apply payloadd's width rule).
   payloadd: one ``append_many`` per turn, as in the Ray job.
2. Orchestrator: the same micro batches (`RLBatch.micro_batches`); TransferQueue: the keys of
   each micro batch's samples and their offsets; payloadd: shifted segments.
3. Trainer: every (DP, CP) rank gets its micro batch's samples with ``kv_batch_get`` (whole
   samples: TransferQueue addresses samples, not token ranges) and materialises routing
   ``int32 [hi - lo, 48, 8]`` over its window (fill 0) and the mask ``int32 [hi - lo, W]`` over
   ``[lo + 1, hi + 1)`` (fill -1), ``W`` the widest mask row intersecting that window: the very
   arrays payloadd's ``read_many`` returns (``_window`` of the Ray job, on the arrays got).

The ranks run one after the other in the driver process, which is also the TransferQueue
client; the rows travel over loopback TCP to and from the storage units, as they do in a real
job on one node. Timed per repetition, for each system: the whole job, the puts, the median
rank's get + window, and (not timed) the bytes stored and the median rank's bytes fetched.
Ray's and TransferQueue's start-up (about 20 s) and the daemon's are not timed; an untimed
first run, whose outputs must be equal rank by rank, comes first (see `payloadd.bench._ray`).
"""

from __future__ import annotations

import importlib
import logging
import os
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import PayloadClient, PayloadSegment, clip_segments, row_nbytes
from payloadd.bench._ray import (
    PAYLOADD,
    Outputs,
    _check,
    _payloadd_pack,
    _payloadd_put,
    _payloadd_read,
    _Piece,
    _ranks,
    _window,
    alternated,
    restored_environ,
)
from payloadd.bench._rl_batch import MASK, MASK_FILL, ROUTED, ROUTED_FILL, RLBatch, Turn

__all__ = [
    "PAYLOADD",
    "TQ",
    "TQ_MEASURES",
    "UNITS",
    "Stats",
    "bench_transferqueue",
    "transferqueue_available",
]

TQ = "transferqueue"
UNITS = 2
"""Storage units (TransferQueue's default ``num_data_storage_units``)."""
TURNS = "mask_turns"
"""The per-sample field of (mask position, rows, width) of every turn."""
TQ_MEASURES = {
    "job": ("RL job", "s"),
    "put": ("RL put, every sample", "s"),
    "get": ("RL get + window, a rank", "s"),
    "stored": ("RL bytes stored", "MiB"),
    "fetched": ("RL bytes fetched, a rank", "MiB"),
}
"""What `bench_transferqueue` measures for each system: its key, the label of the row and
the unit."""
Stats = dict[str, list[float]]
"""One system's samples: `TQ_MEASURES` key to one value per repetition."""
Batches = list[list[tuple[int, int, int]]]


def transferqueue_available() -> str | None:
    """``None`` when ``import transfer_queue`` works, else a one-line note of why not."""
    try:
        importlib.import_module("transfer_queue")
    except ImportError as exc:
        if exc.name == "transfer_queue":
            return "transferqueue is not installed: pip install 'payloadd[peers]'"
        return f"transferqueue cannot be imported: {type(exc).__name__}: {exc}"
    except Exception as exc:  # a broken install fails in many ways; say which
        return f"transferqueue cannot be imported: {type(exc).__name__}: {exc}"
    return None


def _key(i: int) -> str:
    return f"sample-{i}"


def _sample_fields(sample: list[Turn]) -> dict[str, np.ndarray]:
    """One sample as TransferQueue's row: routing, the dense mask and the turns' table."""
    end = max(t.pos + len(t.routed) for t in sample)
    routed = np.zeros((end, *sample[0].routed.shape[1:]), np.uint8)  # ROUTED_FILL
    mask = np.full((end, max(t.mask.shape[1] for t in sample)), MASK_FILL, np.int32)
    table = np.empty((len(sample), 3), np.int32)
    for j, t in enumerate(sample):
        routed[t.pos : t.pos + len(t.routed)] = t.routed
        c, w = t.mask.shape
        mask[t.mask_pos : t.mask_pos + c, :w] = t.mask
        table[j] = (t.mask_pos, c, w)
    return {ROUTED: routed, MASK: mask, TURNS: table}


def _tq_put(mods: dict[str, Any], turns: list[list[Turn]], partition: str) -> int:
    """Inference on TransferQueue: one ``kv_batch_put`` a sample; the bytes put."""
    tq, torch, tensordict = mods["tq"], mods["torch"], mods["TensorDict"]
    nbytes = 0
    for i, sample in enumerate(turns):
        fields = _sample_fields(sample)
        nbytes += sum(a.nbytes for a in fields.values())
        td = tensordict({k: torch.from_numpy(a[None]) for k, a in fields.items()}, batch_size=[1])
        tq.kv_batch_put(keys=[_key(i)], partition_id=partition, fields=td)
    return nbytes


def _tq_rank(
    tq: Any, mb: list[tuple[int, int, int]], partition: str, lo: int, hi: int
) -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """One rank on TransferQueue: its micro batch's samples, then its two windows, as payloadd
    reads them; and the bytes it got."""
    td = tq.kv_batch_get(
        keys=[_key(i) for i, _, _ in mb],
        partition_id=partition,
        select_fields=[ROUTED, MASK, TURNS],
    )
    got = [[t.numpy() for t in td[f].unbind()] for f in (ROUTED, MASK, TURNS)]
    r_all: list[_Piece] = []
    m_all: list[_Piece] = []
    r_src: list[np.ndarray] = []
    m_src: list[np.ndarray] = []
    for (_, off, n), routed, mask, table in zip(mb, *got, strict=True):
        if min(n, len(routed)) > 0:  # the sample clipped to [0, n), shifted by off
            r_all.append(_Piece(None, 0, off, min(n, len(routed)), routed.shape[1:]))
            r_src.append(routed)
        for mpos, c, w in table.tolist():
            a, b = max(mpos, 0), min(mpos + c, n)
            if a < b:
                m_all.append(_Piece(None, a, a + off, b - a, (w,)))
                m_src.append(mask[:, :w])

    def window(
        pieces: list[_Piece], arrays: list[np.ndarray], a: int, b: int, fill: int
    ) -> np.ndarray | None:
        hit = [j for j, p in enumerate(pieces) if max(p.pos, a) < min(p.pos + p.rows, b)]
        return _window(pieces, [pieces[j] for j in hit], [arrays[j] for j in hit], a, b, fill)

    routed_w = window(r_all, r_src, lo, hi, ROUTED_FILL)
    mask_w = window(m_all, m_src, lo + 1, hi + 1, MASK_FILL)
    return routed_w, mask_w, sum(a.nbytes for arrays in got for a in arrays)


def _tq_job(
    mods: dict[str, Any], spec: RLBatch, turns: list[list[Turn]], partition: str, keep: bool
) -> tuple[Outputs, dict[str, float]]:
    """The job on TransferQueue into ``partition``: the outputs (if ``keep``) and its samples."""
    t0 = time.perf_counter()
    stored = _tq_put(mods, turns, partition)
    t1 = time.perf_counter()
    batches = spec.micro_batches()
    out: Outputs = {}
    laps: list[float] = []
    fetched: list[int] = []
    for key, lo, hi in _ranks(spec, batches):
        r0 = time.perf_counter()
        routed, mask, nbytes = _tq_rank(mods["tq"], batches[key[1]], partition, lo, hi)
        laps.append(time.perf_counter() - r0)
        fetched.append(nbytes)
        if keep:
            out[key] = (routed, mask)
    t2 = time.perf_counter()
    return out, _stats(t2 - t0, t1 - t0, laps, stored, fetched)


def _stats(
    job: float, put: float, laps: list[float], stored: int, fetched: list[int]
) -> dict[str, float]:
    return {
        "job": job,
        "put": put,
        "get": statistics.median(laps),
        "stored": stored / 2**20,
        "fetched": statistics.median(fetched) / 2**20,
    }


def _payloadd_bytes(
    spec: RLBatch,
    segs: list[list[PayloadSegment]],
    batches: Batches,
    packed: list[list[PayloadSegment]],
) -> tuple[int, list[int]]:
    """Bytes payloadd stored, and the stored bytes of each rank's two windows."""
    stored = sum(s.rows * row_nbytes(s) for sample in segs for s in sample)
    fetched = []
    for key, lo, hi in _ranks(spec, batches):
        seg = packed[key[1]]
        routed = clip_segments([s for s in seg if s.field == ROUTED], lo, hi)
        mask = clip_segments([s for s in seg if s.field == MASK], lo + 1, hi + 1)
        fetched.append(sum(s.rows * row_nbytes(s) for s in routed + mask))
    return stored, fetched


def _payloadd_job(
    client: PayloadClient, spec: RLBatch, turns: list[list[Turn]], run: str, keep: bool
) -> tuple[Outputs, dict[str, float]]:
    """The job on payloadd (as in the Ray job), its phases timed; the rows go to ``run``."""
    laps: list[float] = []
    t0 = time.perf_counter()
    segs = _payloadd_put(client, turns, run)
    t1 = time.perf_counter()
    batches, packed = _payloadd_pack(spec, segs)
    out = _payloadd_read(client, spec, batches, packed, keep, laps)
    t2 = time.perf_counter()
    stored, fetched = _payloadd_bytes(spec, segs, batches, packed)
    return out, _stats(t2 - t0, t1 - t0, laps, stored, fetched)


@contextmanager
def _quiet_transferqueue() -> Iterator[None]:
    """TransferQueue's loggers at ERROR while it runs (each put and get warns when its thread
    cap exceeds the physical cores); their levels restored after."""
    names = [n for n in logging.root.manager.loggerDict if n.startswith("transfer_queue")]
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


@contextmanager
def _started(object_store: int) -> Iterator[dict[str, Any]]:
    """A local Ray instance and TransferQueue on it (controller and `UNITS` storage units);
    yields the modules the job uses. Shuts both down and restores ``os.environ`` after."""
    with restored_environ():
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")  # read at import, here and in actors
        ray: Any = importlib.import_module("ray")
        tq: Any = importlib.import_module("transfer_queue")
        mods = {
            "tq": tq,
            "torch": importlib.import_module("torch"),
            "TensorDict": importlib.import_module("tensordict").TensorDict,
        }
        try:
            ray.init(
                num_cpus=1 + UNITS,  # logical CPUs: the controller and each unit ask for one
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",  # TransferQueue's ZMQ servers bind the node's address
                object_store_memory=object_store,
            )
            with _quiet_transferqueue():
                tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": UNITS}}})
                yield mods
        finally:
            try:
                tq.close()
            finally:
                ray.shutdown()


def bench_transferqueue(spec: RLBatch, socket: Path, repeat: int) -> dict[str, Stats]:
    """Time the RL job on TransferQueue and on payloadd.

    Parameters
    ----------
    spec, socket, repeat
        As in `payloadd.bench._ray.bench_ray`, TransferQueue in Ray's place; payloadd's runs
        are ``bench-tq-<id>-<n>``.

    Returns
    -------
    dict of str to Stats
        ``{TQ: {...}, PAYLOADD: {...}}``, each keyed by `TQ_MEASURES`: seconds of the whole job
        (``job``), of the puts (``put``), of the median rank's get and windows (``get``), the
        MiB stored (``stored``) and the median rank's MiB fetched (``fetched``): one value
        per repetition, in repetition order.

    Raises
    ------
    RuntimeError
        If the two systems' outputs of a rank differ (checked on an untimed first run).
    ImportError
        If TransferQueue or Ray is not installed (see `transferqueue_available`).

    Notes
    -----
    Starts a local Ray instance (``1 + UNITS`` logical CPUs, no dashboard, usage stats off,
    object store 256 MiB: TransferQueue keeps the rows in its storage units, not in Ray's
    object store) and TransferQueue (SimpleStorage, `UNITS` units) on it, and shuts both
    down at the end, restoring ``os.environ``. Each repetition puts into a partition of its
    own, cleared after it (untimed).
    """
    turns = [list(spec.turns_of(i)) for i in range(spec.samples)]
    tag = uuid.uuid4().hex[:8]
    stats: dict[str, Stats] = {name: {m: [] for m in TQ_MEASURES} for name in (TQ, PAYLOADD)}
    with _started(256 << 20) as mods, PayloadClient(socket) as client:

        def job(name: str, rep: int, keep: bool) -> tuple[Outputs, dict[str, float]]:
            if name == PAYLOADD:
                return _payloadd_job(client, spec, turns, f"bench-tq-{tag}-{rep}", keep)
            partition = f"bench-{tag}-{rep}"
            try:
                return _tq_job(mods, spec, turns, partition, keep)
            finally:
                mods["tq"].get_client().clear_partition(partition)

        _check(job(TQ, 0, True)[0], job(PAYLOADD, 0, True)[0], "TransferQueue")  # untimed
        for rep, name in alternated(TQ, repeat):
            for m, value in job(name, rep, keep=False)[1].items():
                stats[name][m].append(value)
    return stats
