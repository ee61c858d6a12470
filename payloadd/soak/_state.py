"""What the threads of one soak run share, and what the verdict is made of: the kills, the
samples, when each step began and was read (`RunState`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from payloadd.soak._check import Written

__all__ = ["Kill", "Probes", "RunState", "since"]


@dataclass
class Kill:
    """One SIGKILL and restart (``time.monotonic``; ``ready`` once the new daemon answers)."""

    at: float
    ready: float | None = None
    old_pid: int = 0
    new_pid: int = 0


@dataclass
class Probes:
    """What the probes of the node's own socket saw (``--hostile``,
    `payloadd.soak._probes`).

    Attributes
    ----------
    health : int
        Health probes made.
    health_failed : list
        Error events of the failed ones (as a `Tally`'s: ``[t0, t1, op, class, message,
        who]``; class ``HealthStatus`` for an answer other than ``ok``).
    calls : Counter
        State-changing calls by ``"<call> <unix|tcp> <ok|refused|failed>"``.
    checked : Counter
        Refused calls checked, by ``"<call> <unix|tcp>"``.
    executed : list of str
        Refused calls that were carried out: what was found.
    """

    health: int = 0
    health_failed: list[list[Any]] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    checked: Counter[str] = field(default_factory=Counter)
    executed: list[str] = field(default_factory=list)


@dataclass
class RunState:
    """What the parent's threads share (under `payloadd.soak._run.Soak.cond`)."""

    read_done: int = -1  # the last step every rank read
    last_finished: int = -1
    records: dict[int, list[Written]] = field(default_factory=dict)  # until collected
    issued: dict[int, float] = field(default_factory=dict)  # when each step began
    read: dict[int, float] = field(default_factory=dict)  # when every rank had read it
    kills: list[Kill] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    final_gc: float | None = None
    load_end: float = 0.0
    aborted: str | None = None
    probes: Probes | None = None  # with --hostile
    neighbours: dict[str, Any] | None = None  # with --hostile: what they did
    at_rest: dict[str, Any] | None = None  # counted and real bytes once every client closed


def since(t0: float, at: float) -> float:
    """Seconds from ``t0`` (the start of the load) to ``at``, both ``time.monotonic``, to the
    millisecond: how the document gives every time."""
    return round(at - t0, 3)
