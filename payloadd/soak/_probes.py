"""The probes of ``payloadd soak --hostile``: the node's liveness probe (`HealthProber`) and
state-changing calls whose refusals are checked (`RefusalProber`), while the hostile
neighbours press (`payloadd.soak._hostile`).

`HealthProber` asks ``GET /healthz`` over the Unix socket every `PROBE_EVERY` seconds, on a
new connection each time, as ``payloadd health`` (the liveness probe) does: a probe fails on
any error or a status other than ``ok``.

`RefusalProber` makes state-changing calls on a new connection each (a refusal happens when
a connection is taken), in turn over the Unix socket and over TCP with the admin token, to
runs of its own that nothing else touches (``soak-probe-unix``, ``soak-probe-tcp``, and a
``-del`` run of each): an append of one row to a step no call used before; every 4th call a
GC of its run a few steps behind; every 8th a deletion of its ``-del`` run after an append
to it. A call answered `BusyError` (503) says nothing was done, and is never sent again;
`CHECK_AFTER` seconds later (so that a call carried out after its 503 has landed), and
before any later call of the prober could undo what it did, it is checked:

- a refused append: its step's directory holds no file;
- a refused GC or deletion: every file of the steps it would have removed is still there.

A refused call whose effect is found is *executed*: the verdict fails on it. Nothing of the
soak's load writes to these runs, so no other worker can make or remove those files.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from payload_client import BusyError, PayloadClient, PayloadError
from payloadd.soak._check import ROUTED
from payloadd.soak._state import Probes
from payloadd.soak._workers import Tally

__all__ = ["CHECK_AFTER", "PROBE_EVERY", "PROBE_RUN", "HealthProber", "RefusalProber"]

PROBE_EVERY = 0.5
"""Seconds between two probes of each prober."""
CHECK_AFTER = 1.0
"""Seconds after its 503 a refused call is checked."""
HEALTH_TIMEOUT = 3.0
"""Seconds a health probe may take (``payloadd health``'s default)."""
CALL_TIMEOUT = 10.0
"""Seconds each of the refusal prober's calls may take."""
GC_LAG = 2
"""The prober's GC collects its run up to this many steps behind its last append."""
PROBE_RUN = "soak-probe"
"""Prefix of the prober's runs."""


class HealthProber:
    """Probe ``GET /healthz`` over ``socket`` every `PROBE_EVERY` seconds until ``stop``.

    Parameters
    ----------
    socket : str
        The daemon's Unix socket.
    probes : Probes
        Where probes and failures are recorded.
    """

    def __init__(self, socket: str, probes: Probes) -> None:
        self.socket, self.probes = socket, probes

    def run(self, stop: threading.Event) -> None:
        """The thread's body."""
        while not stop.is_set():
            began = time.monotonic()
            try:
                with PayloadClient(self.socket, timeout=HEALTH_TIMEOUT, data_plane=False) as c:
                    status = c.health().status
                error: tuple[str, str] | None = None
                if status != "ok":
                    error = ("HealthStatus", f"the daemon answered status {status!r}")
            except PayloadError as exc:
                error = (type(exc).__name__, str(exc)[:300])
            self.probes.health += 1
            if error is not None:
                event = [began, time.monotonic(), "health", *error, "health probe (Unix socket)"]
                self.probes.health_failed.append(event)
            stop.wait(max(0.0, PROBE_EVERY - (time.monotonic() - began)))


@dataclass
class _Refusal:
    """A call answered `BusyError`, to be checked once `CHECK_AFTER` has passed."""

    call: str
    target: str
    at: float
    run: str
    step: int = -1  # an append's step
    files: list[str] = field(default_factory=list)  # what a GC or deletion would remove


@dataclass
class _Target:
    """One way in (the Unix socket, or TCP with the token) and its runs."""

    name: str
    connect: Callable[[], PayloadClient]
    run: str
    step: int = 0  # the next append's
    collected: int = -1  # the run's steps up to this one were collected
    stored: dict[int, list[str]] = field(default_factory=dict)  # step -> files, not collected
    del_step: int = 0
    del_files: list[str] = field(default_factory=list)  # of the -del run, not deleted yet
    calls: int = 0


class RefusalProber:
    """State-changing calls whose refusals are checked (see the module docstring).

    Parameters
    ----------
    socket : str
        The daemon's Unix socket.
    tcp_url : str or None
        ``http://127.0.0.1:PORT`` of its TCP listener (``None``: the Unix socket only).
    token : str or None
        The admin token (GC and deletion need it; every call over TCP does).
    root : Path
        The payload root (files are checked there, by the segments' paths).
    node_dir : Path
        ``<root>/<node>``.
    probes : Probes
        Where calls, checks and executed refusals are recorded.
    tally : Tally
        Where errors other than `BusyError` are recorded (the verdict's unexpected errors).
    """

    def __init__(
        self,
        socket: str,
        tcp_url: str | None,
        token: str | None,
        root: Path,
        node_dir: Path,
        probes: Probes,
        tally: Tally,
    ) -> None:
        self.root, self.node_dir, self.probes, self.tally = root, node_dir, probes, tally
        self.t0 = time.monotonic()
        self.row = np.arange(48 * 8, dtype=np.uint8).reshape(1, 48, 8)
        self.pending: list[_Refusal] = []
        self.targets = [
            _Target(
                "unix",
                lambda: PayloadClient(socket, token=token, timeout=CALL_TIMEOUT, data_plane=False),
                f"{PROBE_RUN}-unix",
            )
        ]
        if tcp_url is not None:
            self.targets.append(
                _Target(
                    "tcp",
                    lambda: PayloadClient(
                        base_url=tcp_url, token=token, timeout=CALL_TIMEOUT, data_plane=False
                    ),
                    f"{PROBE_RUN}-tcp",
                )
            )

    # -- the thread ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Probe until ``stop``; then check every refusal still pending."""
        self.t0 = time.monotonic()
        n = 0
        while not stop.is_set():
            began = time.monotonic()
            tgt = self.targets[n % len(self.targets)]
            n += 1
            self._check_due(began)
            self._append(tgt, tgt.run, tgt.step)
            tgt.step += 1
            tgt.calls += 1
            if tgt.calls % 4 == 0:
                self._collect(tgt)
            if tgt.calls % 8 == 0:
                self._delete(tgt)
            stop.wait(max(0.0, PROBE_EVERY - (time.monotonic() - began)))
        if self.pending:
            time.sleep(max(0.0, max(r.at for r in self.pending) + CHECK_AFTER - time.monotonic()))
        self._check_due(float("inf"))

    def cleanup(self, until: float) -> bool:
        """Delete the prober's runs over the Unix socket (retried until ``until``); whether
        every deletion went through."""
        runs = [r for t in self.targets for r in (t.run, t.run + "-del")]
        while runs and time.monotonic() < until:
            try:
                with self.targets[0].connect() as c:
                    c.delete_run(runs[0])
                runs.pop(0)
            except PayloadError:
                time.sleep(0.5)
        return not runs

    # -- the calls -------------------------------------------------------------------------

    def _call(self, tgt: _Target, call: str, fn: Callable[[PayloadClient], Any]) -> Any:
        """``fn`` on a new connection; `BusyError` is returned, not raised; another error is
        recorded and returned."""
        t0 = time.monotonic()
        try:
            with tgt.connect() as client:
                out = fn(client)
            self.probes.calls[f"{call} {tgt.name} ok"] += 1
            return out
        except BusyError as exc:
            self.probes.calls[f"{call} {tgt.name} refused"] += 1
            return exc
        except PayloadError as exc:
            self.probes.calls[f"{call} {tgt.name} failed"] += 1
            self.tally.error(f"probe {call}", exc, t0, f"refusal prober ({tgt.name})")
            return exc

    def _append(self, tgt: _Target, run: str, step: int) -> list[str] | None:
        """One row to ``run`` at ``step``; its files, or ``None`` when it failed."""
        at = time.monotonic()
        got = self._call(tgt, "append", lambda c: c.append(ROUTED, self.row, 0, run=run, step=step))
        if isinstance(got, BusyError):
            self.pending.append(_Refusal("append", tgt.name, at, run, step))
        if isinstance(got, Exception):
            return None
        files = [s.file for s in got]
        if run == tgt.run:
            tgt.stored[step] = files
        return files

    def _collect(self, tgt: _Target) -> None:
        """GC of the target's run, `GC_LAG` steps behind, short of any step a refusal
        still to be checked concerns, and not while a refused GC is to be checked."""
        if any(r.target == tgt.name and r.call == "gc" for r in self.pending):
            return
        mark = tgt.step - 1 - GC_LAG
        unchecked = [r.step for r in self.pending if r.run == tgt.run and r.call == "append"]
        if unchecked:
            mark = min(mark, min(unchecked) - 1)
        files = [f for s, fs in sorted(tgt.stored.items()) if s <= mark for f in fs]
        if mark <= tgt.collected or not files:
            return
        at = time.monotonic()
        got = self._call(tgt, "gc", lambda c: c.gc(run=tgt.run, through_step=mark))
        if isinstance(got, BusyError):
            self.pending.append(_Refusal("gc", tgt.name, at, tgt.run, mark, files))
        elif not isinstance(got, Exception):
            tgt.collected = mark
            tgt.stored = {s: fs for s, fs in tgt.stored.items() if s > mark}

    def _delete(self, tgt: _Target) -> None:
        """An append to the target's ``-del`` run, then its deletion (not while a refused
        deletion is to be checked)."""
        run = tgt.run + "-del"
        files = self._append(tgt, run, tgt.del_step)
        tgt.del_step += 1
        if files:
            tgt.del_files += files
        if not tgt.del_files or any(r.run == run for r in self.pending):
            return  # (a deletion would undo what a refused call on the run might have done)
        at = time.monotonic()
        got = self._call(tgt, "delete_run", lambda c: c.delete_run(run))
        if isinstance(got, BusyError):
            self.pending.append(_Refusal("delete_run", tgt.name, at, run, -1, list(tgt.del_files)))
        elif not isinstance(got, Exception):
            tgt.del_files.clear()

    # -- the checks ------------------------------------------------------------------------

    def _check_due(self, now: float) -> None:
        """Check each refusal answered `CHECK_AFTER` seconds ago or more."""
        due = [r for r in self.pending if now - r.at >= CHECK_AFTER]
        self.pending = [r for r in self.pending if now - r.at < CHECK_AFTER]
        for r in due:
            self.probes.checked[f"{r.call} {r.target}"] += 1
            found = self._effect(r)
            if found:
                t = round(r.at - self.t0, 3)
                self.probes.executed.append(
                    f"{r.call} over {r.target} answered BusyError at {t} s of the probes and "
                    f"was carried out: {found}"
                )

    def _effect(self, r: _Refusal) -> str:
        """What a refused call did (empty: nothing)."""
        if r.call == "append":
            step_dir = self.node_dir / r.run / str(r.step)
            try:
                names = sorted(os.listdir(step_dir))
            except FileNotFoundError:
                return ""
            if not names:
                return ""
            return f"{r.run} step {r.step} holds {len(names)} file(s), e.g. {names[0]}"
        gone = [f for f in r.files if not (self.root / f).exists()]
        if not gone:
            return ""
        return f"{len(gone)} of the {len(r.files)} files it would remove are gone, e.g. {gone[0]}"
