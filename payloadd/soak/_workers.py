"""The workers of ``payloadd soak``: writers and trainer ranks, each a thread or a process.

Both kinds run the same function in a thread or in a spawned process: they take commands
from a queue (a step to write, a micro batch to read; ``None`` ends them) and put msgpack
reports on a results queue, each with the worker's `Tally` since its last report. A worker's
client is one of `KINDS` (sync or async, data plane or HTTP), dealt by its number; an async
client runs on an event loop of the worker's own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np

from payload_client import (
    AppendInDoubtError,
    AsyncPayloadClient,
    CoveredRead,
    PayloadClient,
    PayloadError,
    TransportError,
    Window,
)
from payloadd.soak._check import (
    MASK,
    MASK_FILL,
    ROUTED,
    ROUTED_FILL,
    MicroBatch,
    Region,
    SoakShape,
    Written,
    compare,
    expected_region,
    expected_window,
    plan_sample,
    turn_rows,
)

__all__ = [
    "CLIENT_TIMEOUT",
    "KINDS",
    "RUN",
    "GaveUpError",
    "Tally",
    "check_windows",
    "kind_name",
    "rank_main",
    "retry",
    "write_sample",
    "writer_main",
]

T = TypeVar("T")

RUN = "soak"
"""The run every soak append goes to."""
KINDS = (("sync", True), ("sync", False), ("async", True), ("async", False))
"""Client kinds, dealt round robin to writers and ranks: (sync or async, data plane)."""
CLIENT_TIMEOUT = 10.0
"""Seconds of every client limit: a daemon that stops answering fails calls, not the soak."""
RETRY_FOR = 30.0
"""An operation that keeps failing with transport errors is given up after this long."""
BARRIER_TIMEOUT = 60.0
MAX_KEPT = 20
"""Mismatch messages kept for the report."""


# -- tallies: what each worker counts and saw, merged by the parent ------------------------


class Tally:
    """Counters, error events and mismatch messages of one worker (merged by the parent).

    An error event is ``[t0, t1, op, class name, message, who]`` (``time.monotonic``, which
    all processes of a machine share); whether it was expected is decided at the end, against
    the kills.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: list[list[Any]] = []
        self.mismatches: list[str] = []
        self._lock = threading.Lock()

    def error(self, op: str, exc: BaseException, t0: float, who: str) -> None:
        """Record an error of ``op`` that started at ``t0``."""
        event = [t0, time.monotonic(), op, type(exc).__name__, str(exc)[:300], who]
        with self._lock:
            self.errors.append(event)

    def add(self, key: str, n: int = 1) -> None:
        """Count ``n`` more of ``key``."""
        with self._lock:
            self.counts[key] += n

    def mismatch(self, message: str) -> None:
        """Record a wrong answer."""
        with self._lock:
            self.counts["mismatches"] += 1
            if len(self.mismatches) < MAX_KEPT:
                self.mismatches.append(message)

    def take(self) -> dict[str, Any]:
        """Everything recorded since the last take, as plain data (for a queue)."""
        with self._lock:
            out = {
                "counts": dict(self.counts),
                "errors": self.errors,
                "mismatches": self.mismatches,
            }
            self.counts, self.errors, self.mismatches = Counter(), [], []
        return out

    def merge(self, part: dict[str, Any]) -> None:
        """Add what another tally took."""
        with self._lock:
            self.counts.update(part["counts"])
            self.errors += part["errors"]
            room = MAX_KEPT - len(self.mismatches)
            self.mismatches += part["mismatches"][: max(room, 0)]


class GaveUpError(Exception):
    """An operation failed and its errors are recorded."""


def retry(fn: Callable[[], T], op: str, tally: Tally, who: str, until: float) -> T:
    """Call ``fn`` until it succeeds; a transport error (an append in doubt included: it is
    appended again, which returns new segments) is retried for up to `RETRY_FOR` seconds.

    Every failure is recorded. Raises `GaveUpError` when giving up, or at once on another
    error.
    """
    began, pause = time.monotonic(), 0.05
    while True:
        t0 = time.monotonic()
        try:
            return fn()
        except TransportError as exc:
            tally.error(op, exc, t0, who)
            if isinstance(exc, AppendInDoubtError):
                tally.add("in_doubt")
            if time.monotonic() + pause > min(until, began + RETRY_FOR):
                raise GaveUpError from exc
        except Exception as exc:
            tally.error(op, exc, t0, who)
            raise GaveUpError from exc
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


async def aretry(
    fn: Callable[[], Awaitable[T]], op: str, tally: Tally, who: str, until: float
) -> T:
    """`retry` for coroutines."""
    began, pause = time.monotonic(), 0.05
    while True:
        t0 = time.monotonic()
        try:
            return await fn()
        except TransportError as exc:
            tally.error(op, exc, t0, who)
            if isinstance(exc, AppendInDoubtError):
                tally.add("in_doubt")
            if time.monotonic() + pause > min(until, began + RETRY_FOR):
                raise GaveUpError from exc
        except Exception as exc:
            tally.error(op, exc, t0, who)
            raise GaveUpError from exc
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)


def kind_name(kind: tuple[str, bool]) -> str:
    """``sync data plane``, ``async HTTP``, ..."""
    return f"{kind[0]} {'data plane' if kind[1] else 'HTTP'}"


class _Clients:
    """A sync or an async client, driven from one thread (an async one on its own loop)."""

    def __init__(self, socket: str, kind: tuple[str, bool]) -> None:
        self.kind = kind
        self.sync: PayloadClient | None = None
        self.aio: AsyncPayloadClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind[0] == "sync":
            self.sync = PayloadClient(socket, timeout=CLIENT_TIMEOUT, data_plane=kind[1])
        else:
            self.loop = asyncio.new_event_loop()

            async def make() -> AsyncPayloadClient:
                return AsyncPayloadClient(socket, timeout=CLIENT_TIMEOUT, data_plane=kind[1])

            self.aio = self.loop.run_until_complete(make())

    def close(self) -> None:
        with contextlib.suppress(PayloadError, OSError):
            if self.sync is not None:
                self.sync.close()
            if self.aio is not None and self.loop is not None:
                self.loop.run_until_complete(self.aio.close())
        if self.loop is not None:
            self.loop.close()


# -- writers -------------------------------------------------------------------------------


def _count_append(tally: Tally, rows: np.ndarray) -> None:
    tally.add("appends")
    tally.add("rows", len(rows))
    tally.add("bytes", rows.nbytes)


def write_sample(
    client: PayloadClient,
    shape: SoakShape,
    writer: int,
    step: int,
    sample: int,
    tally: Tally,
    who: str,
    until: float,
) -> Written:
    """Write one sample turn by turn (alternately two appends, or one `append_many`); keep the
    segments of the acknowledged appends."""
    w = Written(writer, step, sample)
    for t, turn in enumerate(plan_sample(shape, writer, step, sample)):
        routed, mask = turn_rows(shape, writer, step, sample, t, turn)
        try:
            if (sample + t) % 2:
                items = [(ROUTED, routed, turn.pos), (MASK, mask, turn.mask_pos)]
                fn = functools.partial(client.append_many, items, run=RUN, step=step)
                w.routed[t], w.mask[t] = retry(fn, "append_many", tally, who, until)
                _count_append(tally, routed)
                _count_append(tally, mask)
                continue
            one = functools.partial(client.append, ROUTED, routed, turn.pos, run=RUN, step=step)
            w.routed[t] = retry(one, "append", tally, who, until)
            _count_append(tally, routed)
        except GaveUpError:
            continue
        with contextlib.suppress(GaveUpError):
            one = functools.partial(client.append, MASK, mask, turn.mask_pos, run=RUN, step=step)
            w.mask[t] = retry(one, "append", tally, who, until)
            _count_append(tally, mask)
    return w


async def awrite_sample(
    client: AsyncPayloadClient,
    shape: SoakShape,
    writer: int,
    step: int,
    sample: int,
    tally: Tally,
    who: str,
    until: float,
) -> Written:
    """`write_sample` with an async client."""
    w = Written(writer, step, sample)
    for t, turn in enumerate(plan_sample(shape, writer, step, sample)):
        routed, mask = turn_rows(shape, writer, step, sample, t, turn)
        try:
            if (sample + t) % 2:
                items = [(ROUTED, routed, turn.pos), (MASK, mask, turn.mask_pos)]
                fn = functools.partial(client.append_many, items, run=RUN, step=step)
                w.routed[t], w.mask[t] = await aretry(fn, "append_many", tally, who, until)
                _count_append(tally, routed)
                _count_append(tally, mask)
                continue
            one = functools.partial(client.append, ROUTED, routed, turn.pos, run=RUN, step=step)
            w.routed[t] = await aretry(one, "append", tally, who, until)
            _count_append(tally, routed)
        except GaveUpError:
            continue
        with contextlib.suppress(GaveUpError):
            one = functools.partial(client.append, MASK, mask, turn.mask_pos, run=RUN, step=step)
            w.mask[t] = await aretry(one, "append", tally, who, until)
            _count_append(tally, mask)
    return w


async def _gather(samples: Sequence[Awaitable[Written]]) -> list[Written]:
    """The samples of an async writer's step, written at once."""
    return list(await asyncio.gather(*samples))


def writer_main(
    writer: int,
    writers: int,
    where: str,
    socket: str,
    shape: SoakShape,
    samples_per_step: int,
    commands: Any,
    results: Any,
    until: float,
) -> None:
    """A writer (a thread or a process): for each step it is told, write its samples (those
    ``k`` with ``k % writers == writer``), then report them; ``None`` ends it."""
    kind = KINDS[writer % len(KINDS)]
    who = f"writer {writer} ({kind_name(kind)}, {where})"
    tally = Tally()
    encoder = msgspec.msgpack.Encoder()
    clients: _Clients | None = None
    try:
        clients = _Clients(socket, kind)
        while time.monotonic() < until:
            try:
                step = commands.get(timeout=0.5)
            except queue.Empty:
                continue
            if step is None:
                break
            mine = range(writer, samples_per_step, writers)
            done: list[Written] = []
            try:
                if clients.sync is not None:
                    for k in mine:
                        done.append(
                            write_sample(clients.sync, shape, writer, step, k, tally, who, until)
                        )
                else:
                    assert clients.aio is not None and clients.loop is not None
                    samples = [
                        awrite_sample(clients.aio, shape, writer, step, k, tally, who, until)
                        for k in mine
                    ]
                    done = clients.loop.run_until_complete(_gather(samples))
            except Exception as exc:  # a bug of the soak or an error no call raised
                tally.error("write", exc, time.monotonic(), who)
            results.put(encoder.encode(["step", writer, step, done, tally.take()]))
    except Exception as exc:
        tally.error("writer", exc, time.monotonic(), who)
    finally:
        if clients is not None:
            clients.close()
        results.put(encoder.encode(["done", writer, 0, [], tally.take()]))


# -- trainer ranks ---------------------------------------------------------------------------


def check_windows(
    got_routed: object,
    got_mask: object,
    region: Region,
    lo: int,
    hi: int,
    what: str,
) -> list[str]:
    """Compare a rank's two windows with what they must hold: routing at ``[lo, hi)``, the
    mask at ``[lo + 1, hi + 1)`` (docs/contract.md, "Context-parallel windows"); a `CoveredRead` of the routing window has its
    coverage checked too. Returns the mismatches (empty: bit for bit)."""
    out = []
    if isinstance(got_routed, CoveredRead):
        covered = region.covered[lo - region.a : hi - region.a]
        if not np.array_equal(got_routed.covered, covered):
            out.append(f"{what}: coverage of {ROUTED} [{lo}, {hi}) differs")
        got_routed = got_routed.array
    for got, name, a, b in ((got_routed, ROUTED, lo, hi), (got_mask, MASK, lo + 1, hi + 1)):
        bad = compare(got, expected_window(region, name, a, b), f"{what} {name} [{a}, {b})")
        if bad:
            out.append(bad)
    return out


def _windows(mb: MicroBatch, lo: int, hi: int, how: int) -> list[Window]:
    return [
        Window(mb.segments, ROUTED, lo, hi, ROUTED_FILL, coverage=how == 2),
        Window(mb.segments, MASK, lo + 1, hi + 1, MASK_FILL),
    ]


def rank_main(
    rank: int,
    where: str,
    socket: str,
    shape: SoakShape,
    barrier: Any,
    commands: Any,
    results: Any,
    until: float,
) -> None:
    """A trainer rank (a thread or a process): for each micro batch it is given, work out its
    windows' expected rows, wait on the barrier with the other ranks, read, compare, report.
    ``None`` ends it."""
    kind = KINDS[rank % len(KINDS)]
    who = f"rank {rank} ({kind_name(kind)}, {where})"
    tally = Tally()
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(MicroBatch)
    clients: _Clients | None = None
    try:
        clients = _Clients(socket, kind)
        while time.monotonic() < until:
            try:
                command = commands.get(timeout=0.5)
            except queue.Empty:
                continue
            if command is None:
                break
            mb = decoder.decode(command)
            lo, hi = mb.windows(shape.cp)[rank]
            region = expected_region(shape, mb, lo, hi + 1)
            how = (mb.step + mb.index + rank) % 3  # read_many, two read_field, with coverage
            broken = False
            try:
                barrier.wait(BARRIER_TIMEOUT)
            except threading.BrokenBarrierError as exc:
                tally.error("barrier", exc, time.monotonic(), who)
                broken = True
            try:
                got = _read(clients, mb, lo, hi, how, tally, who, until)
            except GaveUpError:
                got = None
            except Exception as exc:
                tally.error("read", exc, time.monotonic(), who)
                got = None
            if got is not None:
                what = f"step {mb.step} micro batch {mb.index} rank {rank} ({kind_name(kind)})"
                for bad in check_windows(got[0], got[1], region, lo, hi, what):
                    tally.mismatch(bad)
                tally.add("windows", 2)
                tally.add("rows_checked", 2 * (hi - lo))
            results.put(encoder.encode(["rank", rank, mb.step, broken, tally.take()]))
    except Exception as exc:
        tally.error("rank", exc, time.monotonic(), who)
    finally:
        if clients is not None:
            clients.close()
        results.put(encoder.encode(["done", rank, -1, False, tally.take()]))


def _read(
    clients: _Clients,
    mb: MicroBatch,
    lo: int,
    hi: int,
    how: int,
    tally: Tally,
    who: str,
    until: float,
) -> tuple[object, object]:
    """A rank's two windows, the ``how``-th way."""
    ws = _windows(mb, lo, hi, how)
    if clients.sync is not None:
        c = clients.sync
        if how == 1:
            routed = retry(lambda: c.read_field(*ws[0][:5]), "read_field", tally, who, until)
            mask = retry(lambda: c.read_field(*ws[1][:5]), "read_field", tally, who, until)
            return routed, mask
        got = retry(lambda: c.read_many(ws, coverage=None), "read_many", tally, who, until)
        return got[0], got[1]
    assert clients.aio is not None and clients.loop is not None
    a = clients.aio

    async def both() -> tuple[object, object]:
        if how == 1:
            routed = await aretry(lambda: a.read_field(*ws[0][:5]), "read_field", tally, who, until)
            mask = await aretry(lambda: a.read_field(*ws[1][:5]), "read_field", tally, who, until)
            return routed, mask
        got = await aretry(lambda: a.read_many(ws, coverage=None), "read_many", tally, who, until)
        return got[0], got[1]

    return clients.loop.run_until_complete(both())
