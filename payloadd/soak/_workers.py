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
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import msgspec
import numpy as np

from payload_client import (
    AppendInDoubtError,
    AsyncPayloadClient,
    CoveredRead,
    PayloadClient,
    PayloadError,
    PayloadSegment,
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
    TurnPlan,
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
    "taken",
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


class _Tries:
    """The failures of one operation being retried (`retry`, `aretry`): each is recorded; a
    transport error is retried after a pause (doubling, up to 1 s) for up to `RETRY_FOR`
    seconds and never past ``until``, another error is given up at once."""

    def __init__(self, op: str, tally: Tally, who: str, until: float) -> None:
        self.op, self.tally, self.who = op, tally, who
        self.give_up_at = min(until, time.monotonic() + RETRY_FOR)
        self.pause = 0.05

    def failed(self, exc: Exception, t0: float) -> float:
        """Record ``exc``, of the try begun at ``t0``; return the pause before the next try.

        Raises
        ------
        GaveUpError
            When the operation is given up.
        """
        self.tally.error(self.op, exc, t0, self.who)
        if not isinstance(exc, TransportError):
            raise GaveUpError from exc
        if isinstance(exc, AppendInDoubtError):
            self.tally.add("in_doubt")
        pause = self.pause
        if time.monotonic() + pause > self.give_up_at:
            raise GaveUpError from exc
        self.pause = min(pause * 2, 1.0)
        return pause


def retry(fn: Callable[[], T], op: str, tally: Tally, who: str, until: float) -> T:
    """Call ``fn`` until it succeeds; a transport error (an append in doubt included: it is
    appended again, which returns new segments) is retried for up to `RETRY_FOR` seconds.

    Every failure is recorded. Raises `GaveUpError` when giving up, or at once on another
    error.
    """
    tries = _Tries(op, tally, who, until)
    while True:
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            pause = tries.failed(exc, t0)
        time.sleep(pause)


async def aretry(
    fn: Callable[[], Awaitable[T]], op: str, tally: Tally, who: str, until: float
) -> T:
    """`retry` for coroutines."""
    tries = _Tries(op, tally, who, until)
    while True:
        began = time.monotonic()
        try:
            return await fn()
        except Exception as exc:
            pause = tries.failed(exc, began)
        await asyncio.sleep(pause)


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


def taken(q: Any, go_on: Callable[[], bool], timeout: float) -> Iterator[Any]:
    """The items put on ``q`` while ``go_on()``, up to a ``None``; ``q`` is polled every
    ``timeout`` seconds (so that ``go_on`` is asked again)."""
    while go_on():
        try:
            item = q.get(timeout=timeout)
        except queue.Empty:
            continue
        if item is None:
            return
        yield item


def _work(
    role: str,
    number: int,
    where: str,
    socket: str,
    queues: tuple[Any, Any],
    until: float,
    handle: Callable[[_Clients, Any, Tally, str], list[Any]],
    last: list[Any],
) -> None:
    """Run worker ``number`` of ``role`` (a thread or a process, ``where``): with a client of
    its kind, hand each command of ``queues[0]`` (up to ``None`` or ``until``) to ``handle``,
    which returns its report; put the report and the tally since the last on ``queues[1]``.
    An error no call raised is recorded; ``last`` and the tally are the worker's last
    report."""
    commands, results = queues
    kind = KINDS[number % len(KINDS)]
    who = f"{role} {number} ({kind_name(kind)}, {where})"
    tally = Tally()
    encoder = msgspec.msgpack.Encoder()
    clients: _Clients | None = None
    try:
        clients = _Clients(socket, kind)
        for command in taken(commands, lambda: time.monotonic() < until, 0.5):
            results.put(encoder.encode([*handle(clients, command, tally, who), tally.take()]))
    except Exception as exc:
        tally.error(role, exc, time.monotonic(), who)
    finally:
        if clients is not None:
            clients.close()
        results.put(encoder.encode([*last, tally.take()]))


# -- writers -------------------------------------------------------------------------------


def _count_append(tally: Tally, rows: np.ndarray) -> None:
    tally.add("appends")
    tally.add("rows", len(rows))
    tally.add("bytes", rows.nbytes)


class _Append(NamedTuple):
    """One append of a turn: what it calls on a client (sync or async), and where its
    segments go (``kept``: a field's acknowledged turns) with the rows they hold."""

    op: str
    call: Callable[[Any], Any]
    turn: int
    kept: tuple[dict[int, list[PayloadSegment]], ...]
    rows: tuple[np.ndarray, ...]

    def keep(self, got: Any, tally: Tally) -> None:
        """Keep the segments ``got`` of an acknowledged append, and count it."""
        for kept, segments, rows in zip(
            self.kept, got if len(self.kept) > 1 else [got], self.rows, strict=True
        ):
            kept[self.turn] = segments
            _count_append(tally, rows)


def _turn_appends(shape: SoakShape, w: Written, t: int, turn: TurnPlan) -> list[_Append]:
    """The appends of turn ``t`` of the sample ``w``, in order (one given up ends the turn):
    alternately one `append_many` of both fields, or one append each."""
    routed, mask = turn_rows(shape, w.writer, w.step, w.sample, t, turn)
    step = w.step
    if (w.sample + t) % 2:
        items = [(ROUTED, routed, turn.pos), (MASK, mask, turn.mask_pos)]
        both = (w.routed, w.mask)
        call = functools.partial(_append_many, items=items, step=step)
        return [_Append("append_many", call, t, both, (routed, mask))]
    first = functools.partial(_append, field=ROUTED, rows=routed, pos=turn.pos, step=step)
    then = functools.partial(_append, field=MASK, rows=mask, pos=turn.mask_pos, step=step)
    return [
        _Append("append", first, t, (w.routed,), (routed,)),
        _Append("append", then, t, (w.mask,), (mask,)),
    ]


def _append(client: Any, field: str, rows: np.ndarray, pos: int, step: int) -> Any:
    """``client.append`` of one field's rows to the soak's run."""
    return client.append(field, rows, pos, run=RUN, step=step)


def _append_many(client: Any, items: list[tuple[str, np.ndarray, int]], step: int) -> Any:
    """``client.append_many`` of ``items`` to the soak's run."""
    return client.append_many(items, run=RUN, step=step)


def _sample_appends(shape: SoakShape, w: Written) -> Iterator[list[_Append]]:
    """The appends of each turn of the sample ``w`` (`_turn_appends`)."""
    for t, turn in enumerate(plan_sample(shape, w.writer, w.step, w.sample)):
        yield _turn_appends(shape, w, t, turn)


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
    for appends in _sample_appends(shape, w):
        with contextlib.suppress(GaveUpError):
            for a in appends:
                a.keep(retry(functools.partial(a.call, client), a.op, tally, who, until), tally)
    return w


async def _awrite_samples(
    client: AsyncPayloadClient,
    shape: SoakShape,
    ws: list[Written],
    tally: Tally,
    who: str,
    until: float,
) -> list[Written]:
    """`write_sample` of the samples ``ws`` with an async client, all at once."""

    async def one(w: Written) -> Written:
        for appends in _sample_appends(shape, w):
            with contextlib.suppress(GaveUpError):
                for a in appends:
                    got = await aretry(functools.partial(a.call, client), a.op, tally, who, until)
                    a.keep(got, tally)
        return w

    return list(await asyncio.gather(*(one(w) for w in ws)))


def _write_step(
    writer: int,
    writers: int,
    shape: SoakShape,
    samples_per_step: int,
    until: float,
    clients: _Clients,
    step: int,
    tally: Tally,
    who: str,
) -> list[Any]:
    """Write the samples of ``step`` that are ``writer``'s (``k % writers == writer``);
    return the writer's report of them."""
    mine = range(writer, samples_per_step, writers)
    done: list[Written] = []
    try:
        if clients.sync is not None:
            for k in mine:
                done.append(write_sample(clients.sync, shape, writer, step, k, tally, who, until))
        else:
            assert clients.aio is not None and clients.loop is not None
            ws = [Written(writer, step, k) for k in mine]
            done = clients.loop.run_until_complete(
                _awrite_samples(clients.aio, shape, ws, tally, who, until)
            )
    except Exception as exc:  # a bug of the soak or an error no call raised
        tally.error("write", exc, time.monotonic(), who)
    return ["step", writer, step, done]


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
    write = functools.partial(_write_step, writer, writers, shape, samples_per_step, until)
    last = ["done", writer, 0, []]
    _work("writer", writer, where, socket, (commands, results), until, write, last)


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


def _read_micro_batch(
    rank: int,
    shape: SoakShape,
    barrier: Any,
    until: float,
    clients: _Clients,
    command: bytes,
    tally: Tally,
    who: str,
) -> list[Any]:
    """Work out the windows of ``rank`` in the micro batch ``command``, wait on the barrier
    with the other ranks, read, compare; return the rank's report (whether the barrier
    broke)."""
    mb = msgspec.msgpack.decode(command, type=MicroBatch)
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
        got = _read(clients, _reads(mb, lo, hi, how), tally, who, until)
    except GaveUpError:
        got = None
    except Exception as exc:
        tally.error("read", exc, time.monotonic(), who)
        got = None
    if got is not None:
        what = f"step {mb.step} micro batch {mb.index} rank {rank} ({kind_name(clients.kind)})"
        for bad in check_windows(got[0], got[1], region, lo, hi, what):
            tally.mismatch(bad)
        tally.add("windows", 2)
        tally.add("rows_checked", 2 * (hi - lo))
    return ["rank", rank, mb.step, broken]


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
    read = functools.partial(_read_micro_batch, rank, shape, barrier, until)
    last = ["done", rank, -1, False]
    _work("rank", rank, where, socket, (commands, results), until, read, last)


def _reads(mb: MicroBatch, lo: int, hi: int, how: int) -> list[tuple[str, Callable[[Any], Any]]]:
    """The calls that read a rank's two windows the ``how``-th way: ``(op, call of a
    client)``, giving the routing window and the mask window, or both at once."""
    ws = _windows(mb, lo, hi, how)
    if how == 1:
        return [
            ("read_field", lambda c: c.read_field(*ws[0][:5])),
            ("read_field", lambda c: c.read_field(*ws[1][:5])),
        ]
    return [("read_many", lambda c: c.read_many(ws, coverage=None))]


def _read(
    clients: _Clients,
    calls: list[tuple[str, Callable[[Any], Any]]],
    tally: Tally,
    who: str,
    until: float,
) -> tuple[object, object]:
    """A rank's two windows, read by ``calls`` (`_reads`)."""
    if clients.sync is not None:
        c = clients.sync
        got = [retry(functools.partial(fn, c), op, tally, who, until) for op, fn in calls]
    else:
        assert clients.aio is not None and clients.loop is not None
        a = clients.aio

        async def each() -> list[Any]:
            return [
                await aretry(functools.partial(fn, a), op, tally, who, until) for op, fn in calls
            ]

        got = clients.loop.run_until_complete(each())
    both = got[0] if len(got) == 1 else got
    return both[0], both[1]
