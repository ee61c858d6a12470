"""A packed micro batch of multi-turn samples read by CP window, against a direct reader
(part of ``payloadd bench``).

The batch: 8 samples of 2,048 tokens, each written turn by turn by inference (30 turns of
random lengths; per turn one ``routed_experts`` append ``uint8 [t, 48, 8]`` and one
``sampling_mask`` append ``int32 [t, w]`` at the turn's own width ``w <= 64``), each sample in
a step of its own, then packed back to back by the orchestrator with ``shift_segments``:
16,384 tokens, 240 routing segments (and 240 mask segments). A trainer reads it by window
(docs/contract.md, "Context-parallel windows"): routing over the CP 1 window ``[0, 16384)`` and over each of the 4 CP-4 ranks'
windows ``[lo, hi)``; the mask over each CP-4 rank's ``[lo + 1, hi + 1)`` (labels).

Baselines, on the same stored bytes, files opened once beforehand (`DirectReader`):

- ``uint8``: per routing segment that meets the window, one ``os.preadv`` straight into its
  rows of a preallocated ``uint8`` output (fill where no segment is);
- ``int32``: that, plus the widening into a preallocated ``int32`` output (``out32[...] =
  out8``);
- the mask: per segment one ``os.preadv`` into a scratch buffer, copied into its rows' leading
  ``w`` columns of a preallocated ``int32 [window, 64]`` output, fill in the other columns and
  rows.

payloadd: ``read_field`` of the micro batch's segments (both fields, as a trainer holds them)
into the same kind of preallocated output, ``dtype=np.uint8`` and the default ``int32`` for
routing, on the data plane and over HTTP. Reads rotate over distinct stored copies of the
batch, each window (each rank's, too) from the next copy: as a rank reads its window of a new
micro batch, no read is of a list the client has just read (the client keeps what it worked
out of the last two lists, for the several windows a rank reads of one). The rows "list read
before" read one copy over and over: a rank's second window of a micro batch (its mask after
its routing, or another window of the same list). Throughput counts the stored bytes of the
window's rows.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import ClusterClient, PayloadClient, PayloadSegment, shift_segments
from payloadd.bench._measure import Add, Op, measure_gbps, page_aligned
from payloadd.bench._rl_batch import (
    EXPERTS,
    LAYERS,
    MASK,
    MASK_FILL,
    ROUTED,
    ROUTED_FILL,
    TOP_K,
    VOCAB,
)

__all__ = [
    "MAX_WIDTH",
    "DirectReader",
    "PackedBatch",
    "bench_packed",
    "client_reads",
    "covering",
    "direct_reads",
    "measure_reads",
    "routed_outputs",
    "stored_bytes",
    "stored_copies",
    "write_packed",
]

MAX_WIDTH = 64
"""Widest sampling-mask row: the mask outputs are ``int32 [window, 64]``."""
RUN = "bench-packed"
_ITEMSIZE = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "int32": 4, "float16": 2,
             "float32": 4}  # fmt: skip


@dataclass(frozen=True)
class PackedBatch:
    """Shape of the packed micro batch.

    Attributes
    ----------
    samples : int
        Samples packed back to back.
    tokens : int
        Tokens per sample.
    turns : int
        Turns per sample, each of a random length (at least 1 token).
    cp : int
        Context-parallel ranks of the CP-N windows.
    seed : int
        Seed of the turn lengths, widths and rows.
    """

    samples: int = 8
    tokens: int = 2048
    turns: int = 30
    cp: int = 4
    seed: int = 0

    @property
    def length(self) -> int:
        """Tokens of the micro batch."""
        return self.samples * self.tokens

    @property
    def label(self) -> str:
        """The size column of its rows: ``8x2k`` (``str(length)`` under 1,024 tokens a sample)."""
        return f"{self.samples}x{self.tokens // 1024}k" if self.tokens >= 1024 else str(self.length)

    def windows(self, cp: int) -> list[tuple[int, int]]:
        """The CP windows ``[lo, hi)`` of the micro batch (docs/contract.md, "Context-parallel windows"):
        ``lo = r * L // cp``, ``hi = lo + L // cp``."""
        n = self.length
        return [(r * n // cp, r * n // cp + n // cp) for r in range(cp)]

    def turns_of(self, i: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Sample ``i``'s turns: ``(pos, routed uint8 [t, 48, 8], mask int32 [t, w])``,
        positions relative to the sample; the same in every process."""
        rng = np.random.default_rng((self.seed, i))
        cuts = np.sort(rng.choice(np.arange(1, self.tokens), self.turns - 1, replace=False))
        bounds = [0, *cuts.tolist(), self.tokens]
        for a, b in itertools.pairwise(bounds):
            w = int(rng.integers(1, MAX_WIDTH + 1))
            routed = rng.integers(0, EXPERTS, (b - a, LAYERS, TOP_K), dtype=np.uint8)
            yield a, routed, rng.integers(0, VOCAB, (b - a, w), dtype=np.int32)


def write_packed(
    spec: PackedBatch,
    client: PayloadClient | Sequence[PayloadClient],
    run: str,
    first_step: int,
) -> list[PayloadSegment]:
    """Inference writes every sample turn by turn (sample ``i`` in step ``first_step + i``);
    the orchestrator packs them back to back with ``shift_segments``.

    Parameters
    ----------
    spec : PackedBatch
        The batch.
    client : PayloadClient or sequence of PayloadClient
        Client of the daemon the rows go to; several: sample ``i`` goes through client
        ``i % len(client)`` (inference on several nodes).
    run : str
        Run of the appends.
    first_step : int
        Step of sample 0.

    Returns
    -------
    list of PayloadSegment
        The micro batch's segments, both fields, in writing order.
    """
    clients = [client] if isinstance(client, PayloadClient) else list(client)
    packed: list[PayloadSegment] = []
    for i in range(spec.samples):
        c = clients[i % len(clients)]
        sample: list[PayloadSegment] = []
        for pos, routed, mask in spec.turns_of(i):
            sample += c.append(ROUTED, routed, pos, run=run, step=first_step + i)
            sample += c.append(MASK, mask, pos, run=run, step=first_step + i)
        packed += shift_segments(sample, i * spec.tokens)
    return packed


class DirectReader:
    """The per-segment direct reader: one ``os.preadv`` per segment that meets the window.

    It reads the files under ``root`` straight (as payloadd's own data plane does through the
    daemon's descriptors), all opened once here. It assumes what a packed micro batch is:
    segments of a field in position order, none overlapping another.

    Parameters
    ----------
    root : Path
        The daemon's payload root.
    segments : sequence of PayloadSegment
        Every segment it will be asked to read (their files are opened).
    """

    def __init__(self, root: Path, segments: Sequence[PayloadSegment]) -> None:
        self.fds: dict[str, int] = {}
        try:
            for f in dict.fromkeys(s.file for s in segments):
                self.fds[f] = os.open(root / f, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every file."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def _pread(self, s: PayloadSegment, dest: Any, offset: int, nbytes: int) -> None:
        if os.preadv(self.fds[s.file], [dest], offset) != nbytes:
            raise OSError(f"short read of {s.file}")

    def read_rows(
        self, segments: Sequence[PayloadSegment], field: str, lo: int, hi: int,
        out: np.ndarray, fill: int,
    ) -> None:  # fmt: skip
        """Read ``field`` over ``[lo, hi)`` into ``out`` (C-contiguous ``[hi - lo, *row]``,
        the stored dtype and row shape), each segment's rows with one ``preadv``.

        Parameters
        ----------
        segments : sequence of PayloadSegment
            The micro batch's segments (any fields).
        field : str
            Field to read.
        lo, hi : int
            The window.
        out : numpy.ndarray
            The output; rows no segment covers are set to ``fill``.
        fill : int
            Value of rows no segment covers.
        """
        flat = out.reshape(-1).view(np.uint8)
        row = out[0].nbytes if len(out) else 0
        for s, a, b in _meeting(segments, field, lo, hi, out, fill):
            self._pread(s, flat[(a - lo) * row : (b - lo) * row], s.offset + (a - s.pos) * row,
                        (b - a) * row)  # fmt: skip

    def read_ragged(
        self, segments: Sequence[PayloadSegment], field: str, lo: int, hi: int,
        out: np.ndarray, fill: int, scratch: np.ndarray,
    ) -> None:  # fmt: skip
        """Read ragged rows (``shape [w]``, each segment its own ``w``) of ``field`` over
        ``[lo, hi)`` into the leading ``w`` columns of ``out`` (``[hi - lo, W]``, the stored
        dtype), fill elsewhere: per segment one ``preadv`` into ``scratch``, then a copy.

        Parameters
        ----------
        segments, field, lo, hi
            As in `read_rows`.
        out : numpy.ndarray
            The output, ``W`` at least every segment's width.
        fill : int
            Value of entries no row covers.
        scratch : numpy.ndarray
            ``uint8``, at least ``out.nbytes`` bytes.
        """
        for s, a, b in _meeting(segments, field, lo, hi, out, fill):
            w = math.prod(s.shape)
            nb = w * _ITEMSIZE[s.dtype]
            buf = scratch[: (b - a) * nb]
            self._pread(s, buf, s.offset + (a - s.pos) * nb, len(buf))
            dest = out[a - lo : b - lo]
            dest[:, :w] = buf.view(out.dtype).reshape(b - a, w)
            if w < out.shape[1]:
                dest[:, w:] = fill


def _meeting(
    segments: Sequence[PayloadSegment], field: str, lo: int, hi: int, out: np.ndarray, fill: int
) -> Iterator[tuple[PayloadSegment, int, int]]:
    """`covering`, the rows of ``out`` (the window's) no segment covers set to ``fill``: those
    before a segment as it is yielded, those after the last at the end."""
    done = 0  # rows of out covered so far
    for s, a, b in covering(segments, field, lo, hi):
        if a - lo > done:
            out[done : a - lo] = fill
        yield s, a, b
        done = b - lo
    if done < len(out):
        out[done:] = fill


def covering(
    segments: Sequence[PayloadSegment], field: str, lo: int, hi: int
) -> Iterator[tuple[PayloadSegment, int, int]]:
    """Each segment of ``field`` that meets ``[lo, hi)``, in the order of ``segments``, with
    ``[a, b)`` the part of the window it covers.

    Parameters
    ----------
    segments : sequence of PayloadSegment
        Segments of any fields.
    field : str
        The field.
    lo, hi : int
        The window.

    Yields
    ------
    tuple
        ``(segment, a, b)``, ``lo <= a < b <= hi``.
    """
    for s in segments:
        if s.field != field:
            continue
        a, b = max(lo, s.pos), min(hi, s.pos + s.rows)
        if a < b:
            yield s, a, b


def stored_bytes(segments: Sequence[PayloadSegment], field: str, lo: int, hi: int) -> int:
    """Stored bytes of ``field``'s rows over ``[lo, hi)``."""
    return sum((b - a) * math.prod(s.shape) * _ITEMSIZE[s.dtype]
               for s, a, b in covering(segments, field, lo, hi))  # fmt: skip


@contextmanager
def stored_copies(
    spec: PackedBatch,
    client: PayloadClient | Sequence[PayloadClient],
    run: str,
    root: Path,
    copies: int,
) -> Iterator[tuple[list[list[PayloadSegment]], DirectReader]]:
    """Write ``copies`` copies of the batch (`write_packed`, copy ``c`` from step ``c *
    samples``), and open the direct reader of them all under ``root``; closed at the end.

    Parameters
    ----------
    spec : PackedBatch
        The batch.
    client : PayloadClient or sequence of PayloadClient
        As in `write_packed`.
    run : str
        Run of the appends.
    root : Path
        The folder the segments' files are relative to (the daemon's payload root).
    copies : int
        Stored copies.

    Yields
    ------
    tuple
        The copies' segments (one list a copy), and the `DirectReader`.
    """
    batches = [write_packed(spec, client, run, c * spec.samples) for c in range(copies)]
    reader = DirectReader(root, [s for b in batches for s in b])
    try:
        yield batches, reader
    finally:
        reader.close()


def routed_outputs(
    spec: PackedBatch, cp: int, batches: list[list[PayloadSegment]]
) -> tuple[list[tuple[int, int]], np.ndarray, int]:
    """The CP ``cp`` windows of the batch, a page-aligned ``uint8 [n, 48, 8]`` output of a
    window's routing, and the stored routing bytes of all the windows (of one copy)."""
    wins = spec.windows(cp)
    n = wins[0][1] - wins[0][0]
    out8 = page_aligned(n * LAYERS * TOP_K).reshape(n, LAYERS, TOP_K)
    return wins, out8, sum(stored_bytes(batches[0], ROUTED, lo, hi) for lo, hi in wins)


def measure_reads(add: Add, ops: list[Op], spec: PackedBatch, repeat: int, quick: bool) -> None:
    """`measure_gbps` of reads of the batch, a sample the calls that move 24 MiB (``quick``)
    or 64 MiB of CP-1 windows (at least 2)."""
    window = spec.length * LAYERS * TOP_K  # stored bytes of a CP-1 read
    k = max(2, ((24 << 20) if quick else (64 << 20)) // window)
    measure_gbps(add, ops, spec.label, k, repeat)


def bench_packed(
    add: Add, socket: Path, root: Path, repeat: int, quick: bool, spec: PackedBatch | None = None
) -> None:
    """Measure the packed micro batch's window reads against the direct reader.

    Parameters
    ----------
    add, socket, root, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`); the direct reader opens
        the files under ``root``.
    quick : bool
        Fewer stored copies and calls.
    spec : PackedBatch, optional
        The batch (default: 8 x 2,048 tokens, 30 turns, CP 4).
    """
    spec = spec or PackedBatch()
    copies = 3 if quick else 8  # more than the client keeps plans of (2 lists)
    with (
        PayloadClient(socket) as fast,
        PayloadClient(socket, data_plane=False) as http,
        stored_copies(spec, fast, RUN, root, copies) as (batches, reader),
    ):
        measure_reads(add, _ops(spec, batches, reader, fast, http), spec, repeat, quick)


def _ops(
    spec: PackedBatch,
    batches: list[list[PayloadSegment]],
    reader: DirectReader,
    fast: PayloadClient,
    http: PayloadClient,
) -> list[Op]:
    """The measured methods: ``(name, call, stored bytes a call, baseline)``."""
    turn = itertools.cycle(batches)
    ops: list[Op] = []
    for cp in (1, spec.cp):
        wins, out8, nbytes = routed_outputs(spec, cp, batches)
        out32 = page_aligned(out8.size * 4).view(np.int32).reshape(out8.shape)
        direct8, direct32 = (
            f"packed direct reader uint8, CP {cp}",
            f"packed direct + int32, CP {cp}",
        )

        ops += [(direct8, direct_reads(reader, turn, wins, out8, None), nbytes, None),
                (direct32, direct_reads(reader, turn, wins, out8, out32), nbytes, None)]  # fmt: skip
        for label, c in (("data plane", fast), ("http", http)):
            for dtype, out, base in (("uint8", out8, direct8), ("int32", out32, direct32)):
                ops.append((f"packed read {dtype} out=, CP {cp} ({label})",
                            client_reads(c, turn, ROUTED, wins, out, ROUTED_FILL), nbytes, base))  # fmt: skip
                # a rank's second window of the same micro batch (its mask after its
                # routing): the client has the list's columns already
                if label == "data plane":
                    again = itertools.repeat(batches[0])
                    ops.append((f"packed read {dtype} out=, CP {cp}, list read before ({label})",
                                client_reads(c, again, ROUTED, wins, out, ROUTED_FILL), nbytes, base))  # fmt: skip
    labels = [(lo + 1, hi + 1) for lo, hi in spec.windows(spec.cp)]
    n = labels[0][1] - labels[0][0]
    outm = page_aligned(n * MAX_WIDTH * 4).view(np.int32).reshape(n, MAX_WIDTH)
    scratch = page_aligned(outm.nbytes)
    nbytes = sum(stored_bytes(batches[0], MASK, lo, hi) for lo, hi in labels)
    base = f"packed mask direct reader, CP {spec.cp}"

    def direct_mask() -> None:
        for lo, hi in labels:
            reader.read_ragged(next(turn), MASK, lo, hi, outm, MASK_FILL, scratch)

    ops.append((base, direct_mask, nbytes, None))
    for label, c in (("data plane", fast), ("http", http)):
        ops.append((f"packed mask read out=, CP {spec.cp} ({label})",
                    client_reads(c, turn, MASK, labels, outm, MASK_FILL), nbytes, base))  # fmt: skip
    return ops


def direct_reads(
    reader: DirectReader,
    turn: Iterator[list[PayloadSegment]],
    wins: list[tuple[int, int]],
    out8: np.ndarray,
    out32: np.ndarray | None,
) -> Callable[[], None]:
    def read() -> None:
        for lo, hi in wins:
            reader.read_rows(next(turn), ROUTED, lo, hi, out8, ROUTED_FILL)
            if out32 is not None:
                out32[...] = out8

    return read


def client_reads(
    c: PayloadClient | ClusterClient,
    turn: Iterator[list[PayloadSegment]],
    field: str,
    wins: list[tuple[int, int]],
    out: np.ndarray,
    fill: int,
) -> Callable[[], None]:
    def read() -> None:
        for lo, hi in wins:
            c.read_field(next(turn), field, lo, hi, fill, dtype=out.dtype, out=out)

    return read
