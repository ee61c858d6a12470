"""What every ``payloadd bench`` measurement shares: timing, page-aligned buffers, percentiles,
and the callback that records a sample (`Add`).

The ``bench_*`` functions of the measurements' modules name their common parameters alike:

- ``add`` (`Add`): records the samples (`Bench.add`);
- ``socket`` (Path): the control socket of the daemon measured;
- ``root`` (Path): its payload root, where the baselines open the files it stored;
- ``repeat`` (int): repetitions, each a sample of every row;
- ``quick`` (bool): fewer and smaller calls (each function says which).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from payload_client.protocol import PAGE, page_matched

__all__ = ["Add", "Op", "measure_gbps", "page_aligned", "pct", "rotated", "timed"]


class Add(Protocol):
    """Records one sample: ``add(name, size, unit, value, baseline)`` (`Bench.add`).

    ``baseline`` names the row (of the same ``size``) the sample's median is compared with,
    or is ``None`` for a row that is itself a baseline or compared with nothing.
    """

    def __call__(self, name: str, size: str, unit: str, value: float, baseline: str | None) -> None:
        """Record ``value`` as one sample of the row ``(name, size)``."""


def timed(op: Callable[[], Any], k: int) -> float:
    """Seconds per call of ``op``, over ``k`` calls.

    Parameters
    ----------
    op : callable
        What is timed; called ``k`` times in a row.
    k : int
        Calls.

    Returns
    -------
    float
        Mean seconds per call.
    """
    t0 = time.perf_counter()
    for _ in range(k):
        op()
    return (time.perf_counter() - t0) / k


Op = tuple[str, Callable[[], Any], int, str | None]
"""A method measured in GB/s: ``(row name, call, bytes a call moves, baseline row or None)``."""


def measure_gbps(add: Add, ops: list[Op], size: str, k: int, repeat: int) -> None:
    """Time each of ``ops`` in GB/s: ``repeat`` rounds, the order `rotated` each round, each
    method a warm call, then ``k`` timed calls (one sample of its row).

    Parameters
    ----------
    add : Add
        Records the samples.
    ops : list of Op
        The methods.
    size : str
        The size column of every row.
    k : int
        Timed calls a sample.
    repeat : int
        Rounds.
    """
    for r in range(repeat):
        for name, op, nbytes, base in rotated(ops, r):
            op()  # warm
            add(name, size, "GB/s", nbytes / timed(op, k) / 1e9, base)


def page_aligned(nbytes: int) -> np.ndarray:
    """A ``uint8 [nbytes]`` array that starts on a page boundary (as a pinned buffer does).

    Parameters
    ----------
    nbytes : int
        Bytes.

    Returns
    -------
    numpy.ndarray
        The array (a view of a slightly larger allocation).
    """
    return page_matched(np.empty(nbytes + PAGE, np.uint8), 0, nbytes)


def pct(samples: list[float], q: float) -> float:
    """Percentile ``q`` of ``samples`` (seconds), in milliseconds.

    Parameters
    ----------
    samples : list of float
        Durations in seconds.
    q : float
        Percentile, 0-100.

    Returns
    -------
    float
        Milliseconds.
    """
    return float(np.percentile(samples, q)) * 1e3


def rotated(ops: list[Any], r: int) -> list[Any]:
    """``ops`` rotated left by ``r``: a different method goes first in each repetition, so
    that whatever the kernel still does after the last one does not always hit the same one.

    Parameters
    ----------
    ops : list
        The methods of one repetition.
    r : int
        The repetition's index.

    Returns
    -------
    list
        The same methods, starting at index ``r % len(ops)``.
    """
    k = r % len(ops) if ops else 0
    return ops[k:] + ops[:k]
