"""A trainer step: a new segment list every micro batch, routing + mask (part of ``payloadd
bench``).

The micro batch of `payloadd.bench._packed` (8 samples x 2,048 tokens, 30 turns each, each
sample in a step of its own, packed back to back): 480 segments in the list, routing ``uint8
[t, 48, 8]`` and the sampling mask ``int32 [t, w]`` (``w <= 64``) per turn. A trainer rank
receives each micro batch's list as bytes from the orchestrator (`encode_segments`, done once
beforehand: the array of segment arrays for the direct reader, the columnar form for
payloadd), and one measured call is the rank's step:

- decode the bytes (inside the timed call: nothing is kept of an earlier decode, the list is
  a new object every call);
- read routing over ``[lo, hi)`` into a preallocated ``uint8 [n, 48, 8]`` output;
- read the mask on the label positions ``[lo + 1, hi + 1)`` into a preallocated ``int32 [n,
  64]`` output (filled with -1 when allocated; every reader sets fill itself).

Windows: CP 1 ``[0, 16384)``; CP 4, each rank in turn (call ``i`` is rank ``i % 4``'s
window), so a CP-4 figure is one rank's step, averaged over the four ranks.

The three readers, measured alike, interleaved, each call on the next of several stored
copies of the batch (8; 3 with ``--quick``; more than the 2 lists the client keeps what it
worked out of, so no call starts on a list the client has read; its mask read reuses what
its routing read worked out of the list, as a rank's does):

- **raw**: per field, one ``os.preadv`` per contiguous extent of a file the window needs
  (one a sample: a sample's turns lie back to back in its file), the extents worked out
  beforehand and the files open: routing straight into its rows of the output, the mask's
  bytes into a scratch buffer (not placed by width). No decode. What the bytes cost.
- **direct reader** (`DirectReader`): `decode_segments` (msgspec's typed decoder, the
  garbage collector paused: about 4x cheaper than a plain msgpack decode into lists, which
  allocates a list a segment), then per segment that meets the
  window one ``os.preadv`` (routing into its rows; the mask into a scratch buffer, copied into
  its rows' leading ``w`` columns, fill in the others).
- **payloadd**: `decode_columns` of the columnar form (``encode_segments(segments,
  "columns")``: a `SegmentList`, no object a segment), then one ``read_many`` of both windows
  into their ``out=`` on the data plane (the client's descriptors of the files are kept
  between calls, as a rank's are), as docs/guide.md has a rank read its windows;
- **payloadd, arrays of segments** (its own row, no ratio): the same from the array-of-arrays
  form the direct reader decodes (`decode_columns` takes it into columns);
- **payloadd, load-balanced** and **contiguous, read_cp** (CP 4 only): the columnar list, then
  ``read_cp`` of each field at the rank's chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``
  (Megatron's layout), or at its contiguous window, into the same outputs; the ratio row is
  the contiguous one's time over the load-balanced one's (the same calls, only the layout
  differs).

Each sample is the mean time of a call over ``k`` calls (32 at CP 1, 64 at CP 4, a quarter
with ``--quick``) after two warm-up calls (then the lists the client keeps are of this
reader's calls, whatever ran before: none is the next call's); the ratio rows
are, per repetition, the baseline's time over payloadd's (payloadd's speed over the
baseline's: higher is better), their median the figure.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import (
    PayloadClient,
    PayloadSegment,
    Window,
    decode_columns,
    decode_segments,
    encode_segments,
)
from payloadd.bench._measure import Add, page_aligned, rotated, timed
from payloadd.bench._packed import MAX_WIDTH, DirectReader, PackedBatch, covering, stored_copies
from payloadd.bench._rl_batch import LAYERS, MASK, MASK_FILL, ROUTED, ROUTED_FILL, TOP_K

__all__ = [
    "DIRECT",
    "PAYLOADD",
    "PAYLOADD_ARRAYS",
    "BALANCED",
    "CONTIGUOUS",
    "VS_CONTIGUOUS",
    "RAW",
    "TRAINER",
    "VS_DIRECT",
    "VS_RAW",
    "Extent",
    "StepOutputs",
    "balanced_step",
    "bench_trainer_step",
    "direct_step",
    "format_trainer_summary",
    "payloadd_step",
    "raw_extents",
    "raw_step",
    "stored_mask_rows",
    "trainer_summary",
]

TRAINER = "trainer step"
"""Prefix of every row of this module (`payloadd.bench._plot` draws its ratio rows)."""
RAW = "trainer step raw preadv, CP {cp}"
DIRECT = "trainer step direct reader, CP {cp}"
PAYLOADD = "trainer step: new list, routing + mask, CP {cp} (data plane)"
PAYLOADD_ARRAYS = "trainer step: new list as arrays of segments, CP {cp} (data plane)"
BALANCED = "trainer step: new list, load-balanced CP {cp}, read_cp (data plane)"
CONTIGUOUS = "trainer step: new list, contiguous CP {cp}, read_cp (data plane)"
VS_CONTIGUOUS = "trainer step CP {cp}: load-balanced speed / contiguous (higher is better)"
VS_DIRECT = "trainer step CP {cp}: payloadd speed / direct (higher is better)"
VS_RAW = "trainer step CP {cp}: payloadd speed / raw (higher is better)"
RUN = "bench-trainer-step"

Extent = tuple[int, memoryview, int]
"""One raw read: ``(descriptor, destination bytes, file offset)``."""


class StepOutputs:
    """A rank's preallocated, page-aligned outputs for windows of ``n`` tokens.

    Attributes
    ----------
    routed : numpy.ndarray
        ``uint8 [n, 48, 8]``.
    mask : numpy.ndarray
        ``int32 [n, 64]``, filled with -1.
    scratch : numpy.ndarray
        ``uint8``, ``mask.nbytes`` bytes: the mask's stored bytes (raw reader, direct reader).
    """

    def __init__(self, n: int) -> None:
        self.routed = page_aligned(n * LAYERS * TOP_K).reshape(n, LAYERS, TOP_K)
        self.mask = page_aligned(n * MAX_WIDTH * 4).view(np.int32).reshape(n, MAX_WIDTH)
        self.mask[...] = MASK_FILL
        self.scratch = page_aligned(self.mask.nbytes)


def _extents(segments: Sequence[PayloadSegment], field: str, lo: int, hi: int,
             ) -> list[tuple[str, int, int]]:  # fmt: skip
    """``(file, offset, nbytes)`` of ``field``'s bytes over ``[lo, hi)``, in position order,
    a segment that continues the previous one in its file merged into its extent."""
    out: list[tuple[str, int, int]] = []
    for s, a, b in covering(segments, field, lo, hi):
        row = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        off, nbytes = s.offset + (a - s.pos) * row, (b - a) * row
        if out and out[-1][0] == s.file and out[-1][1] + out[-1][2] == off:
            out[-1] = (s.file, out[-1][1], out[-1][2] + nbytes)
        else:
            out.append((s.file, off, nbytes))
    return out


def raw_extents(
    segments: Sequence[PayloadSegment], fds: dict[str, int], lo: int, hi: int,
    outs: StepOutputs,
) -> list[Extent]:  # fmt: skip
    """The raw reads of a rank's step: routing over ``[lo, hi)`` into ``outs.routed``'s
    rows, the mask's bytes over ``[lo + 1, hi + 1)`` back to back into ``outs.scratch``.

    It assumes what the micro batch is: each field's segments in position order, back to
    back, none overlapping (the routing window is covered; no fill is written).

    Parameters
    ----------
    segments : sequence of PayloadSegment
        The micro batch's segments, both fields.
    fds : dict
        A descriptor open for reading of every file the segments name.
    lo, hi : int
        The window.
    outs : StepOutputs
        The destinations.

    Returns
    -------
    list of Extent
        One a contiguous extent of a file, routing's first.
    """
    reads: list[Extent] = []
    for field, a, b, dest in ((ROUTED, lo, hi, outs.routed.reshape(-1)),
                              (MASK, lo + 1, hi + 1, outs.scratch)):  # fmt: skip
        at = 0
        for file, off, nbytes in _extents(segments, field, a, b):
            reads.append((fds[file], dest[at : at + nbytes].data, off))
            at += nbytes
    return reads


def raw_step(reads: list[Extent]) -> None:
    """One ``os.preadv`` per extent."""
    for fd, buf, off in reads:
        if os.preadv(fd, [buf], off) != len(buf):
            raise OSError("short read")


def direct_step(reader: DirectReader, wire: bytes, lo: int, hi: int, outs: StepOutputs) -> None:
    """Decode the list; the direct reader's routing over ``[lo, hi)`` and mask over ``[lo +
    1, hi + 1)``, one ``preadv`` a segment."""
    segments = decode_segments(wire)
    reader.read_rows(segments, ROUTED, lo, hi, outs.routed, ROUTED_FILL)
    reader.read_ragged(segments, MASK, lo + 1, hi + 1, outs.mask, MASK_FILL, outs.scratch)


def payloadd_step(client: PayloadClient, wire: bytes, lo: int, hi: int,
                  outs: StepOutputs) -> None:  # fmt: skip
    """Decode the list into columns (`decode_columns`: either wire form); one ``read_many`` of
    routing over ``[lo, hi)`` and the mask over ``[lo + 1, hi + 1)``, into the outputs."""
    segments = decode_columns(wire)
    client.read_many([Window(segments, ROUTED, lo, hi, ROUTED_FILL, outs.routed),
                      Window(segments, MASK, lo + 1, hi + 1, MASK_FILL, outs.mask)])  # fmt: skip


def balanced_step(client: PayloadClient, wire: bytes, rank: int, length: int, cp: int,
                  outs: StepOutputs, balanced: bool = True) -> None:  # fmt: skip
    """Decode the list into columns; ``read_cp`` of routing and of the mask (at label
    positions) at rank ``rank``'s chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``
    (load-balanced context parallelism; ``balanced=False``: its contiguous window), into
    the outputs."""
    segments = decode_columns(wire)
    client.read_cp(segments, ROUTED, length, cp, rank, ROUTED_FILL, load_balanced=balanced,
                   out=outs.routed)  # fmt: skip
    client.read_cp(segments, MASK, length, cp, rank, MASK_FILL, labels=True,
                   load_balanced=balanced, out=outs.mask)  # fmt: skip


def stored_mask_rows(segments: Sequence[PayloadSegment], lo: int, hi: int,
                     mask: np.ndarray) -> bytes:  # fmt: skip
    """The stored bytes of the mask rows over ``[lo, hi)`` taken out of a placed ``mask``
    output (each row's leading ``w`` entries, ``w`` its segment's width), back to back: what
    the raw reader reads."""
    return b"".join(mask[a - lo : b - lo, : s.shape[0]].tobytes()
                    for s, a, b in covering(segments, MASK, lo, hi))  # fmt: skip


def bench_trainer_step(
    add: Add, socket: Path, root: Path, repeat: int, quick: bool, spec: PackedBatch | None = None
) -> None:
    """Measure a rank's step on a new list, CP 1 and CP 4, raw / direct / payloadd.

    Parameters
    ----------
    add, socket, root, repeat, spec
        As in `payloadd.bench._packed.bench_packed`; the raw reader, too, opens the files
        under ``root``.
    quick : bool
        3 stored copies instead of 8, a quarter of the calls.
    """
    spec = spec or PackedBatch()
    copies = 3 if quick else 8
    with (
        PayloadClient(socket) as client,
        stored_copies(spec, client, RUN, root, copies) as (batches, reader),
    ):
        wires = [(encode_segments(b), encode_segments(b, "columns")) for b in batches]
        ops = []
        for cp in (1, spec.cp):
            k = (32 if cp == 1 else 64) // (4 if quick else 1)
            ops += [(name, op, k) for name, op in
                    _ops(spec, cp, batches, wires, reader, client)]  # fmt: skip
        for r in range(repeat):
            took: dict[str, float] = {}
            for name, op, k in rotated(ops, r):
                op()  # warm; twice: the lists the client keeps are then this op's
                op()
                took[name] = timed(op, k)
                add(name, spec.label, "ms", took[name] * 1e3, None)
            _ratios(add, spec, took)


def _ratios(add: Add, spec: PackedBatch, took: dict[str, float]) -> None:
    """One repetition's ratio rows: the baselines' times over payloadd's, at each CP."""
    for cp in (1, spec.cp):
        mine = took[PAYLOADD.format(cp=cp)]
        add(VS_DIRECT.format(cp=cp), spec.label, "x", took[DIRECT.format(cp=cp)] / mine, None)
        add(VS_RAW.format(cp=cp), spec.label, "x", took[RAW.format(cp=cp)] / mine, None)
        if BALANCED.format(cp=cp) in took:
            add(VS_CONTIGUOUS.format(cp=cp), spec.label, "x",
                took[CONTIGUOUS.format(cp=cp)] / took[BALANCED.format(cp=cp)], None)  # fmt: skip


def _ops(
    spec: PackedBatch,
    cp: int,
    batches: list[list[PayloadSegment]],
    wires: list[tuple[bytes, bytes]],
    reader: DirectReader,
    client: PayloadClient,
) -> list[tuple[str, Callable[[], Any]]]:
    """The three readers' steps at CP ``cp``, each call on the next copy and the next rank."""
    wins = spec.windows(cp)
    outs = StepOutputs(wins[0][1] - wins[0][0])
    n = len(batches)  # call i: copy i % n, rank i % cp; consecutive calls on distinct copies
    plan = [(i % n, *wins[i % cp]) for i in range(math.lcm(n, cp))]
    raws = itertools.cycle(
        [raw_extents(batches[c], reader.fds, lo, hi, outs) for c, lo, hi in plan]
    )
    arrays = [(wires[c][0], lo, hi) for c, lo, hi in plan]
    columns = [(wires[c][1], lo, hi) for c, lo, hi in plan]
    direct_turn, mine_turn = itertools.cycle(arrays), itertools.cycle(columns)
    arrays_turn = itertools.cycle(arrays)

    def raw() -> None:
        raw_step(next(raws))

    def direct() -> None:
        direct_step(reader, *next(direct_turn), outs)

    def mine() -> None:
        payloadd_step(client, *next(mine_turn), outs)

    def mine_arrays() -> None:
        payloadd_step(client, *next(arrays_turn), outs)

    ops = [(RAW.format(cp=cp), raw), (DIRECT.format(cp=cp), direct),
           (PAYLOADD.format(cp=cp), mine), (PAYLOADD_ARRAYS.format(cp=cp), mine_arrays)]  # fmt: skip
    if cp > 1:  # the same calls, each layout
        ranks = [(wires[i % n][1], i % cp) for i in range(math.lcm(n, cp))]
        turns, contiguous_turns = itertools.cycle(ranks), itertools.cycle(ranks)

        def balanced() -> None:
            balanced_step(client, *next(turns), spec.length, cp, outs)

        def contiguous() -> None:
            balanced_step(client, *next(contiguous_turns), spec.length, cp, outs, False)

        ops += [(CONTIGUOUS.format(cp=cp), contiguous), (BALANCED.format(cp=cp), balanced)]
    return ops


def trainer_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainer-step rows of a report, a line per CP: the medians (ms a rank's step) and
    the ratios (payloadd's speed over the baseline's, median over repetitions).

    Parameters
    ----------
    rows : list of dict
        `payloadd.bench._bench.report`'s rows.

    Returns
    -------
    list of dict
        Keys ``cp``, ``size``, ``raw_ms``, ``direct_ms``, ``payloadd_ms``,
        ``payloadd_vs_direct_higher_is_better``, ``payloadd_vs_raw_higher_is_better``,
        ``payloadd_arrays_ms``, ``load_balanced_ms`` and
        ``load_balanced_vs_contiguous_higher_is_better`` (``None`` without their rows);
        empty when the report has no trainer-step row.
    """
    by = {r["name"]: r for r in rows if r["name"].startswith(TRAINER)}
    out = []
    for cp in sorted({int(m[1]) for n in by if (m := re.search(r"CP (\d+)", n))}):
        names = [f.format(cp=cp) for f in (RAW, DIRECT, PAYLOADD, VS_DIRECT, VS_RAW)]
        if not all(n in by for n in names):
            continue
        raw, direct, mine, vs_direct, vs_raw = (by[n]["median"] for n in names)
        extra = [by.get(f.format(cp=cp), {}).get("median")
                 for f in (PAYLOADD_ARRAYS, BALANCED, VS_CONTIGUOUS)]  # fmt: skip
        out.append({"cp": cp, "size": by[names[0]]["size"], "raw_ms": raw,
                    "direct_ms": direct, "payloadd_ms": mine,
                    "payloadd_vs_direct_higher_is_better": vs_direct,
                    "payloadd_vs_raw_higher_is_better": vs_raw,
                    "payloadd_arrays_ms": extra[0], "load_balanced_ms": extra[1],
                    "load_balanced_vs_contiguous_higher_is_better": extra[2]})  # fmt: skip
    return out


def format_trainer_summary(summary: list[dict[str, Any]]) -> str:
    """`trainer_summary` as a text table (empty string when empty)."""
    if not summary:
        return ""
    head = (f"{'trainer step, new list, routing + mask':40} {'raw':>8} {'direct':>8} "
            f"{'payloadd':>9}  {'payloadd/direct':>15}  {'payloadd/raw':>12}"
            f"  {'arrays':>8}  {'balanced':>8}  {'balanced/contiguous':>19}")  # fmt: skip
    lines = ["medians, ms a rank's step; ratios: speed, higher is better; arrays: the list "
             "sent as arrays of segments; balanced: load-balanced CP", head]  # fmt: skip
    for s in summary:
        what = f"CP {s['cp']} ({'whole batch' if s['cp'] == 1 else 'each rank in turn'})"
        arrays, balanced = s.get("payloadd_arrays_ms"), s.get("load_balanced_ms")
        vs = s.get("load_balanced_vs_contiguous_higher_is_better")
        lines.append(
            f"{what:40} {s['raw_ms']:>8.3g} {s['direct_ms']:>8.3g} {s['payloadd_ms']:>9.3g}"
            f"  {s['payloadd_vs_direct_higher_is_better']:>14.2f}x"
            f"  {s['payloadd_vs_raw_higher_is_better']:>11.2f}x"
            f"  {'-' if arrays is None else format(arrays, '.3g'):>8}"
            f"  {'-' if balanced is None else format(balanced, '.3g'):>8}"
            f"  {'-' if vs is None else format(vs, '.2f') + 'x':>19}"
        )
    return "\n".join(lines)
