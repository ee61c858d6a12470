"""``payloadd soak``: run payloadd as a busy node does, for a while; fail on wrong data or on a
resource that grows.

1. A daemon starts on a temporary root and socket (a real ``payloadd serve``, node ``soak``),
   with the extra flags of ``--daemon-arg``.
2. Writers (threads and processes; sync and async clients; data plane and HTTP) write
   multi-turn samples step by step: per turn a ``routed_experts`` segment ``uint8 [t, 48, 8]``
   and a ``sampling_mask`` segment ``int32 [c, w]``. Rows are regenerated from the seed for
   the checks (`payloadd.soak._check`). A step is finished when every writer wrote its part.
3. The orchestrator packs each finished step into micro batches (`clip_segments`,
   `shift_segments`) and hands each to every trainer rank (threads and processes). The ranks
   wait on one barrier and read their CP windows of the same micro batch at the same moment:
   files nobody read before. Every window is compared bit for bit; truncated tails too.
4. A GC thread collects the steps read, a few steps behind (``gc(run=, through_step=)``), then
   reads a sample of the collected segments: each must raise `FileGoneError` (410).
5. With ``--kill-every``, the daemon is SIGKILLed under load and started again on the same
   root and socket; transport errors around a restart are expected, nothing else is.
6. Every ``--sample-every`` seconds: the daemon's RSS, threads, descriptors and descriptors of
   removed files (/proc), and its counters (``stats()``). The samples go to ``--json`` and
   are drawn in ``--plot``.
7. With ``--hostile``, the daemon also serves a TCP port and a peer port with an admin
   token, and hostile neighbours press on them while probes of the node's own socket run
   (`payloadd.soak._pressure`); they stop once every rank is done.
8. Once every client of a worker is closed, the daemon's counted root bytes are compared
   with the files' sizes (`payloadd.soak._bytes`), as in every sample.
9. The verdict (`payloadd.soak._verdict`): counts, errors by class, and the checks. Exit
   status 0 when every check passed, 1 otherwise, 2 for bad flags.

The load ends at ``--duration``; then the writers finish their step, the ranks read every
finished step, every worker closes its client, the final GC collects every step, and the
daemon settles ``--settle`` seconds before the last sample. All of it must end within
``--drain`` seconds after the load, or the soak stops and fails.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing as mp
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from payload_client import FileGoneError, PayloadClient, PayloadError, TransportError, Window
from payloadd.soak import _verdict
from payloadd.soak._bytes import at_rest, lease_bytes, measure
from payloadd.soak._check import (
    MASK,
    MASK_FILL,
    ROUTED,
    ROUTED_FILL,
    SoakShape,
    Written,
    compare,
    expected_region,
    expected_window,
    pack,
    tail_batch,
)
from payloadd.soak._daemon import NODE, SoakDaemon
from payloadd.soak._hostile import NeighbourPlan
from payloadd.soak._pressure import HostileSetup, Pressure
from payloadd.soak._report import STATS_KEPT, proc_sample
from payloadd.soak._state import Kill, RunState, since
from payloadd.soak._workers import (
    CLIENT_TIMEOUT,
    RUN,
    GaveUpError,
    Tally,
    rank_main,
    retry,
    taken,
    writer_main,
)

__all__ = ["Soak"]

AHEAD = 2
"""Steps the writers may be ahead of the trainer."""
GONE_PER_STEP = 4
"""Collected segments read back per collected step (each must answer 410)."""


# -- the soak --------------------------------------------------------------------------------


@dataclass
class _Crew:
    """The workers of a run (threads and processes, not started) and their queues: the
    commands to each, the reports of the writers and of the ranks."""

    writer_results: Any
    rank_results: Any
    writers: list[Any] = field(default_factory=list)
    writer_cmds: list[Any] = field(default_factory=list)
    ranks: list[Any] = field(default_factory=list)
    rank_cmds: list[Any] = field(default_factory=list)


class Soak:
    """One soak run (see the module docstring): start ``daemon``, then `run`, `verdict` and
    `document`.

    Parameters
    ----------
    args : argparse.Namespace
        The flags of ``payloadd soak``.
    tmp : Path
        Folder of the root (``root``) and the socket.
    log : file
        Where the daemon's stderr goes.
    """

    def __init__(self, args: argparse.Namespace, tmp: Path, log: IO[bytes]) -> None:
        self.args = args
        self.shape = SoakShape(args.seed, args.max_tokens, args.max_turns, args.seq_len, args.ranks)
        self.socket = tmp / "payloadd.sock"
        self.hostile = HostileSetup.make(tmp) if getattr(args, "hostile", False) else None
        extra = list(args.daemon_arg) + (self.hostile.daemon_flags() if self.hostile else [])
        self.daemon = SoakDaemon(tmp / "root", self.socket, extra, log)
        self.token = self.hostile.token if self.hostile is not None else None
        self.node_dir = tmp / "root" / NODE
        self.lease = lease_bytes(args.daemon_arg)
        self.pressure: Pressure | None = None
        self.tally = Tally()
        self.state = RunState()
        self.cond = threading.Condition()
        self.abort = threading.Event()
        self.t0 = time.monotonic()
        self.until = self.t0
        self.ctx = mp.get_context("spawn")
        self.barrier: Any = None

    def _t(self, at: float) -> float:
        """Seconds since the load started."""
        return since(self.t0, at)

    def _going(self) -> bool:
        """Whether the soak goes on (not aborted)."""
        return not self.abort.is_set()

    def _abort(self, why: str) -> None:
        with self.cond:
            if self.state.aborted is None:
                self.state.aborted = why
            self.abort.set()
            self.cond.notify_all()

    def _join(self, workers: list[Any], what: str) -> None:
        """Wait for threads or processes until the drain deadline; abort past it."""
        for w in workers:
            w.join(max(0.0, self.until - time.monotonic()) + 1)
            if w.is_alive():
                self._abort(f"{what} did not end within --drain {self.args.drain:g} s")

    def run(self) -> None:
        """Run the load for ``--duration`` seconds on the started daemon, drain, collect,
        settle."""
        a = self.args
        self.t0 = time.monotonic()
        self.state.load_end = self.t0 + a.duration
        self.until = self.state.load_end + a.drain
        crew = self._crew()
        finished: queue.Queue[tuple[int, list[Written]] | None] = queue.Queue()
        gc_q: queue.Queue[tuple[str, int]] = queue.Queue()
        stop_sampling = threading.Event()
        sampler = self._thread(self._sampler, stop_sampling)
        driver = self._thread(self._driver, crew.writer_cmds)
        n_writers = len(crew.writers)
        gatherer = self._thread(self._gather_reports, crew.writer_results, n_writers, finished)
        trainer = self._thread(self._trainer, finished, crew.rank_cmds, crew.rank_results, gc_q)
        garbage_collector = self._thread(self._collect_garbage, gc_q)
        killer = [self._thread(self._killer)] if a.kill_every else []
        parent = [sampler, driver, gatherer, trainer, garbage_collector, *killer]
        try:
            for w in [*crew.writers, *crew.ranks, *parent]:
                w.start()
            self._start_pressure()
            self._join([driver, gatherer, *crew.writers], "the writers")
            self._join([trainer], "the trainer")
            for cmds in crew.rank_cmds:
                cmds.put(None)
            self._join(crew.ranks, "the ranks")
            self._join(killer, "the killer")
            self._finish(gc_q, garbage_collector)
        except KeyboardInterrupt:
            self._abort("interrupted")
        finally:
            self.abort.set()  # every thread of the parent ends at its next wait
            self._stop_pressure()
            stop_sampling.set()
            self._wind_down(crew, sampler)

    def _crew(self) -> _Crew:
        """The writers and trainer ranks of ``--writers``, ``--writer-processes``,
        ``--ranks`` and ``--reader-processes`` (not started), their queues, and the ranks'
        barrier."""
        a = self.args
        crew = _Crew(self.ctx.Queue(), self.ctx.Queue())
        self.barrier = (
            self.ctx.Barrier(a.ranks) if a.reader_processes else threading.Barrier(a.ranks)
        )
        sock, n_writers = str(self.socket), a.writers + a.writer_processes
        for w in range(n_writers):
            where = "thread" if w < a.writers else "process"
            cmds = self._queue(where)
            args = (w, n_writers, where, sock, self.shape, a.samples_per_step, cmds,
                    crew.writer_results, self.until)  # fmt: skip
            crew.writer_cmds.append(cmds)
            crew.writers.append(self._worker(where, writer_main, args))
        for r in range(a.ranks):
            where = "thread" if r < a.ranks - a.reader_processes else "process"
            cmds = self._queue(where)
            rargs = (r, where, sock, self.shape, self.barrier, cmds, crew.rank_results, self.until)
            crew.rank_cmds.append(cmds)
            crew.ranks.append(self._worker(where, rank_main, rargs))
        return crew

    def _start_pressure(self) -> None:
        """Start the hostile neighbours and the probes (``--hostile``)."""
        if self.hostile is not None:
            a = self.args
            plan = NeighbourPlan.of(a.hostile_idle, a.hostile_trickle, a.hostile_stalled)
            self.pressure = Pressure(
                self.hostile, str(self.socket), self.daemon.root, self.node_dir, plan, self.tally
            )
            self.pressure.start()

    def _finish(self, gc_q: queue.Queue[tuple[str, int]], garbage_collector: Any) -> None:
        """Once every worker is done: stop the pressure, measure the bytes at rest, run the
        final GC, let the daemon settle."""
        self._stop_pressure()
        if not self.abort.is_set():  # every client of a worker is closed
            self.state.at_rest = at_rest(str(self.socket), self.node_dir, self.lease, self.until)
        if self.pressure is not None:  # the stragglers' run, compared at rest: now it goes
            self.pressure.clean_up()
        gc_q.put(("final", self.state.last_finished))
        self._join([garbage_collector], "the final GC")
        if not self.abort.is_set():  # let the daemon settle, then the last sample
            self.abort.wait(self.args.settle)

    def _wind_down(self, crew: _Crew, sampler: threading.Thread) -> None:
        """End the workers and the sampler (aborted), take the last sample, merge what the
        workers reported last, close the queues."""
        for cmds in crew.writer_cmds + crew.rank_cmds:
            cmds.put(None)
        sampler.join(10)
        self._sample()
        for p in crew.writers + crew.ranks:
            if isinstance(p, mp.process.BaseProcess):
                p.join(10)
                if p.is_alive():
                    p.kill()  # a worker of ours, by its pid
                    p.join(5)
        for results in (crew.writer_results, crew.rank_results):
            self._merge_rest(results)
        for q in (crew.writer_results, crew.rank_results, *crew.writer_cmds, *crew.rank_cmds):
            if not isinstance(q, queue.Queue):  # a pipe: never wait on it at exit
                q.close()
                q.cancel_join_thread()

    def _stop_pressure(self) -> None:
        """Stop the neighbours and the probes (``--hostile``); keep what they saw."""
        if self.pressure is not None and self.state.probes is None:
            self.state.neighbours = self.pressure.stop(self.until)
            self.state.probes = self.pressure.probes

    def _thread(self, target: Any, *args: Any) -> threading.Thread:
        return threading.Thread(target=target, args=args, daemon=True)

    def _queue(self, where: str) -> Any:
        """A queue of commands to a worker in a thread, or in a process."""
        return queue.Queue() if where == "thread" else self.ctx.Queue()

    def _worker(self, where: str, target: Any, args: tuple[Any, ...]) -> Any:
        if where == "thread":
            return threading.Thread(target=target, args=args, daemon=True)
        return self.ctx.Process(target=target, args=args, daemon=True)

    def _merge_rest(self, results: Any) -> None:
        """Merge what workers reported after nobody listened (their last tallies)."""
        while True:
            try:
                item = msgspec.msgpack.decode(results.get(timeout=0.2))
            except (queue.Empty, OSError, ValueError):
                return
            self.tally.merge(item[-1])

    def _driver(self, writer_cmds: list[Any]) -> None:
        """Issue steps to the writers, at most every ``--step-every`` seconds, while the
        trainer is at most `AHEAD` steps behind; stop at the end of the load."""
        step, next_at = 0, time.monotonic()
        try:
            while True:
                with self.cond:
                    while (
                        not self.abort.is_set()
                        and time.monotonic() < self.state.load_end
                        and (step - self.state.read_done > AHEAD or time.monotonic() < next_at)
                    ):
                        self.cond.wait(0.05)
                if self.abort.is_set() or time.monotonic() >= self.state.load_end:
                    return
                with self.cond:
                    self.state.issued[step] = time.monotonic()
                    self.cond.notify_all()
                for cmds in writer_cmds:
                    cmds.put(step)
                step += 1
                next_at = time.monotonic() + self.args.step_every
        finally:
            for cmds in writer_cmds:
                cmds.put(None)

    def _gather_reports(self, results: Any, n_writers: int, finished: Any) -> None:
        """Gather the writers' reports; a step every writer reported is finished."""
        by_step: dict[int, list[Written]] = {}
        reported: Counter[int] = Counter()
        done = 0
        decoder = msgspec.msgpack.Decoder(tuple[str, int, int, list[Written], dict[str, Any]])
        try:
            for report in taken(results, self._going, 0.2):
                kind, _, step, written, part = decoder.decode(report)
                self.tally.merge(part)
                if kind == "done":
                    done += 1
                    if done == n_writers:  # (--writers is at least 1)
                        break
                    continue
                by_step.setdefault(step, []).extend(written)
                reported[step] += 1
                if reported[step] == n_writers:
                    self.tally.add("steps")
                    finished.put((step, sorted(by_step.pop(step), key=lambda w: w.sample)))
        finally:
            finished.put(None)

    def _trainer(self, finished: Any, rank_cmds: list[Any], results: Any, gc_q: Any) -> None:
        """Pack each finished step, hand every micro batch to every rank, check the truncated
        tails, wait for the ranks' reports, then pass the step to GC."""
        who = "orchestrator (sync data plane, thread)"
        try:
            with PayloadClient(self.socket, timeout=CLIENT_TIMEOUT) as client:
                for step, written in taken(finished, self._going, 0.2):
                    self._train(client, step, written, rank_cmds, results, who)
                    gc_q.put(("step", step))
        except Exception as exc:
            self.tally.error("trainer", exc, time.monotonic(), who)
            self._abort(f"the orchestrator failed: {type(exc).__name__}: {exc}")

    def _train(
        self,
        client: PayloadClient,
        step: int,
        written: list[Written],
        rank_cmds: list[Any],
        results: Any,
        who: str,
    ) -> None:
        """The trainer's work on one finished step (`_trainer`), but for passing it to GC."""
        with self.cond:
            self.state.records[step] = written
        batches = pack(self.shape, step, written)
        for mb in batches:
            message = msgspec.msgpack.encode(mb)
            for cmds in rank_cmds:
                cmds.put(message)
        self.tally.add("micro_batches", len(batches))
        for w in written:
            self._check_tail(client, w, who)
        if self._rank_reports(results, len(batches) * len(rank_cmds)):
            self.barrier.reset()
        with self.cond:
            self.state.read_done = self.state.last_finished = step
            self.state.read[step] = time.monotonic()
            self.cond.notify_all()

    def _rank_reports(self, results: Any, want: int) -> bool:
        """Wait for ``want`` reports of the ranks (or the abort); whether a barrier broke."""
        decoder = msgspec.msgpack.Decoder(tuple[str, int, int, bool, dict[str, Any]])
        broken = False
        for report in itertools.islice(taken(results, self._going, 0.2), want):
            what, _, _, was_broken, part = decoder.decode(report)
            self.tally.merge(part)
            if what != "rank":  # it will not report again
                self._abort("a trainer rank ended before the soak did")
            broken |= was_broken
        return broken

    def _check_tail(self, client: PayloadClient, w: Written, who: str) -> None:
        """A truncated sample's tail ``[seq_len, tokens)``: `clip_segments` at the front, read
        at its own positions, compared like a window."""
        tb = tail_batch(self.shape, w)
        if tb is None:
            return
        lo, hi = tb.members[0].lo, tb.members[0].hi
        region = expected_region(self.shape, tb, lo, hi)
        ws = [
            Window(tb.segments, ROUTED, lo, hi, ROUTED_FILL),
            Window(tb.segments, MASK, lo, hi, MASK_FILL),
        ]
        try:
            got = retry(lambda: client.read_many(ws), "read_many", self.tally, who, self.until)
        except GaveUpError:
            return
        what = f"step {w.step} writer {w.writer} sample {w.sample} tail"
        for name, g in ((ROUTED, got[0]), (MASK, got[1])):
            bad = compare(g, expected_window(region, name, lo, hi), f"{what} {name} [{lo}, {hi})")
            if bad:
                self.tally.mismatch(bad)
        self.tally.add("tail_windows", 2)
        self.tally.add("rows_checked", 2 * (hi - lo))

    def _collect_garbage(self, gc_q: Any) -> None:
        """Collect the steps read, ``--gc-lag`` steps behind; then read a sample of each
        collected step's segments, which must raise `FileGoneError`. The final item collects
        every step."""
        who = "gc (sync, thread)"
        done = -1
        rng = random.Random(self.args.seed)
        with (
            PayloadClient(self.socket, token=self.token, timeout=CLIENT_TIMEOUT) as dp,
            PayloadClient(
                self.socket, token=self.token, timeout=CLIENT_TIMEOUT, data_plane=False
            ) as http,
        ):
            while True:
                try:
                    what, step = gc_q.get(timeout=0.2)
                except queue.Empty:
                    if self.abort.is_set():
                        return
                    continue
                while what != "final":  # one call for every step finished meanwhile (a GC
                    try:  # on a distributed root takes its grace, 2.5 s, each time)
                        what, step = gc_q.get_nowait()
                    except queue.Empty:
                        break
                final = what == "final"
                mark = step if final else step - self.args.gc_lag
                if mark > done:
                    fn = functools.partial(dp.gc, run=RUN, through_step=mark)
                    try:
                        report = retry(fn, "gc", self.tally, who, self.until)
                    except GaveUpError:
                        report = None
                    if report is not None:
                        self.tally.add("gc_calls")
                        self.tally.add("gc_files", report.files)
                        for s in range(done + 1, mark + 1):
                            self._check_gone(s, rng, (dp, http), who)
                        done = mark
                if final:
                    self.state.final_gc = time.monotonic()
                    return

    def _check_gone(
        self, step: int, rng: random.Random, clients: tuple[PayloadClient, ...], who: str
    ) -> None:
        """Read back a few segments of a collected step: each must raise `FileGoneError`."""
        with self.cond:
            written = self.state.records.pop(step, [])
        segs = [s for w in written for s in w.segments() if s.rows]
        for k, seg in enumerate(rng.sample(segs, min(GONE_PER_STEP, len(segs)))):
            client = clients[k % len(clients)]
            fill = ROUTED_FILL if seg.field == ROUTED else MASK_FILL
            window = Window([seg], seg.field, seg.pos, seg.pos + seg.rows, fill)
            read = functools.partial(_outcome, client, window)
            try:
                outcome = retry(read, "read collected", self.tally, who, self.until)
            except GaveUpError:
                continue
            if outcome == "gone":
                self.tally.add("gone_checked")
            else:
                self.tally.mismatch(
                    f"step {step} collected: a read of {seg.file} gave {outcome}, not 410 Gone"
                )

    def _killer(self) -> None:
        """SIGKILL the daemon every ``--kill-every`` seconds of the load, start it again.

        Each kill waits for the next step to begin, then 10-100 ms more (drawn from the
        seed), so that it lands while the writers append and the ranks read.
        """
        rng = random.Random(self.args.seed + 1)
        k = 1
        while True:
            at = self.t0 + k * self.args.kill_every
            if at >= self.state.load_end or self.abort.wait(max(0.0, at - time.monotonic())):
                return
            with self.cond:
                steps = len(self.state.issued)
                deadline = time.monotonic() + 2 * self.args.step_every + 1
                while len(self.state.issued) == steps and not self.abort.is_set():
                    if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                        break
            if self.abort.wait(rng.uniform(0.01, 0.1)) or time.monotonic() >= self.state.load_end:
                return
            kill = Kill(time.monotonic())
            with self.cond:
                self.state.kills.append(kill)
            self.daemon.restarting = True
            kill.old_pid = self.daemon.kill()
            try:
                self.daemon.start()
            except RuntimeError as exc:
                self.tally.error("restart", exc, kill.at, "killer")
                self._abort(f"the daemon did not start again after a kill: {exc}")
                return
            self.daemon.restarting = False
            kill.ready = time.monotonic()
            kill.new_pid = self.daemon.pid or 0
            self.tally.add("restarts")
            k += 1

    def _sample(self) -> None:
        """One sample of the daemon (none while it is down)."""
        pid = self.daemon.pid
        now = time.monotonic()
        got = proc_sample(pid) if pid is not None else None
        if got is None:
            return
        stats = nbytes = None
        measured = measure(str(self.socket), self.node_dir, self.lease)
        if measured is not None:
            nbytes, answer = measured
            stats = {k: getattr(answer, k) for k in STATS_KEPT}
        final = self.state.final_gc
        phase = "load" if now < self.state.load_end else "drain"
        if final is not None and now >= final:
            phase = "settle"
        epoch = len(self.daemon.starts) - 1
        sample = {"t": self._t(now), "epoch": epoch, "phase": phase, **got, "stats": stats,
                  "bytes": nbytes}  # fmt: skip
        with self.cond:
            self.state.samples.append(sample)

    def _sampler(self, stop: threading.Event) -> None:
        """Sample every ``--sample-every`` seconds; stop the soak when the daemon exits by
        itself (not killed by the soak)."""
        while not stop.is_set():
            began = time.monotonic()
            proc = self.daemon.proc
            if not self.daemon.restarting and proc is not None and proc.poll() is not None:
                why = f"the daemon (pid {proc.pid}) exited by itself with status {proc.returncode}"
                self.tally.error("daemon", RuntimeError(why), began, "daemon")
                self._abort(why)
                return
            self._sample()
            stop.wait(max(0.0, self.args.sample_every - (time.monotonic() - began)))

    # -- the verdict

    def _expected(self, event: list[Any]) -> bool:
        """An error is expected when it is a transport error around a kill."""
        return _verdict.is_expected(event, self.state.kills)

    def verdict(self) -> dict[str, Any]:
        """Counts, errors by class and the checks, as the JSON file holds them."""
        return _verdict.verdict(self.args, self.state, self.tally, self.daemon.starts, self.t0)

    def document(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """The JSON file: settings, verdict, kills and samples."""
        starts = self.daemon.starts
        return _verdict.document(self.args, self.shape, self.state, starts, self.t0, verdict)


def _outcome(client: PayloadClient, window: Window) -> str:
    """What a read of a collected segment gave: ``gone`` (410), ``rows``, or another error;
    transport errors are raised (to be retried)."""
    try:
        client.read_many([window])
    except FileGoneError:
        return "gone"
    except TransportError:
        raise
    except PayloadError as exc:
        return f"{type(exc).__name__} ({exc})"
    return "rows"
