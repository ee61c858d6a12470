"""What every ``payloadd bench`` measurement shares: timing, page-aligned buffers, percentiles,
and the callback that records a sample (`Add`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from payload_client.protocol import PAGE, page_matched

__all__ = ["Add", "page_aligned", "pct", "rotated", "timed"]


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
