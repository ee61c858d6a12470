"""A read's windows planned before any I/O (`plan_reads`): what every client reads with.

`PayloadClient`, `AsyncPayloadClient` and the cluster clients plan a call's windows here, the
same way (docs/contract.md, "Reading a window"): each window checked, planned, its output
prepared and its result known; then the bytes are fetched (one daemon, or split by node).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import InvalidRequestError, PayloadError
from ..reads._cp import Spans, host_array, plan_spans
from ..reads._windows import (
    CoveredRead,
    ReadResult,
    Window,
    WindowLike,
    WindowPlan,
    coverage,
    plan_window,
    prepare_output,
)
from ..wire._fields import check_read_field, is_ragged
from ..wire._http import FieldsTable

__all__ = ["Planned", "covered", "plan_reads", "window_of"]


class Planned(NamedTuple):
    """A read's windows planned (`plan_reads`), before any I/O."""

    plans: list[WindowPlan | None]
    """Each window's plan (``None``: nothing to read, e.g. an empty window)."""
    outs: list[Any]
    """Each window's output, prepared (the arrays the pieces are read into)."""
    results: list[ReadResult]
    """Each window's result, known before the bytes are in (they fill ``outs`` in place)."""
    nbytes: int
    """Bytes the pieces need, over every window."""
    files: bool
    """Whether any window reads a file."""


def window_of(i: int, w: WindowLike) -> Window:
    """Window ``i`` of a call, as a `Window`."""
    try:
        segments, fld, lo, hi, fill, *rest = w
        return Window(segments, fld, lo, hi, fill, *rest)
    except (TypeError, ValueError):
        raise InvalidRequestError(
            f"window {i} must be (segments, field, lo, hi, fill[, out, dtype, coverage, required])"
        ) from None


def covered(w: Window | Spans, coverage: bool) -> Window | Spans:
    """``w`` read with the coverage of its call (`PayloadClient.read_many`)."""
    asked: object = w.coverage  # typed bool, but any value a caller passed
    if not isinstance(asked, bool | np.bool_):
        return w  # named by the window's own check
    if asked and not coverage:
        raise InvalidRequestError(
            "this window asks for coverage: pass coverage=True to read_many (every "
            "result a CoveredRead), or coverage=None (each window as it asks)"
        )
    return w._replace(coverage=coverage)


def plan_reads(
    windows: Sequence[WindowLike | Spans],
    cover: bool | None = None,
    table: FieldsTable | None = None,
) -> Planned:
    """The windows planned, their outputs prepared (before any I/O), the results.

    Parameters
    ----------
    windows : sequence of Window, Spans or (segments, field, lo, hi, fill[, ...])
        As `PayloadClient.read_many` takes them (a `Spans`: a CP rank's chunks).
    cover : bool or None
        The call's coverage for every window (`PayloadClient.read_many`); ``None``: each
        window's own.
    table : FieldsTable or None
        The daemon's fields table, whose fields and row shape rules the reads follow
        (`check_read_field`); ``None``: no table.

    Returns
    -------
    Planned
        An ``out`` given as a CPU torch tensor is read into its numpy view (`host_array`),
        and is its window's result.

    Raises
    ------
    InvalidRequestError, InvalidSegmentError
        As `PayloadClient.read_many`, the window named when there are several.
    """
    if isinstance(windows, tuple) or not isinstance(windows, Sequence):
        raise InvalidRequestError("windows must be a list of Window")
    plans: list[WindowPlan | None] = []
    outs: list[np.ndarray | None] = []
    results: list[ReadResult] = []  # the outs, filled in place by the I/O later
    total, files = 0, False
    for i, w in enumerate(windows):
        if not isinstance(w, Window | Spans):
            w = window_of(i, w)
        try:
            plan, arr, result = _plan_one(w if cover is None else covered(w, cover), table)
        except PayloadError as exc:
            if len(windows) > 1:  # name the window, keep the error's class and attributes
                exc.args = (f"window {i}: {exc}",)
            raise
        plans.append(plan)
        outs.append(arr)
        results.append(result)
        if plan is not None:
            total += plan.nbytes
            files = files or bool(plan.ends)
    return Planned(plans, outs, results, total, files)


def _plan_one(
    w: Window | Spans, table: FieldsTable | None
) -> tuple[WindowPlan | None, np.ndarray | None, ReadResult]:
    """One window's plan, its output (prepared) and its result (`plan_reads`)."""
    given = w.out  # a CPU torch tensor: read into its numpy view, return it
    if given is not None and type(given) is not np.ndarray:
        w = w._replace(out=host_array(given))
    dtype = getattr(w.out, "dtype", None) if w.dtype is None else w.dtype
    spec = None if table is None else table.fields.get(w.field)
    ragged = None if table is None else is_ragged(spec)
    if type(w) is Spans:  # a CP rank's chunks, into one output
        plan = plan_spans(w.segments, w.field, w.spans, w.fill, dtype, ragged)
    else:
        plan = plan_window(w.segments, w.field, w.lo, w.hi, w.fill, dtype, ragged)
    if table is not None and spec is None:  # after the checks of the list
        check_read_field(table, w.field, plan is not None)
    if plan is None and w.required:
        have = sorted({s.field for s in w.segments})
        raise InvalidRequestError(
            f"no segment of field {w.field!r} in the list (its fields: {have})"
        )
    arr = None if plan is None else prepare_output(plan, w.out)  # before I/O
    res = arr if given is None or arr is None else given  # out itself, as given
    if w.coverage is False:
        return plan, arr, res
    if not isinstance(w.coverage, bool | np.bool_):
        raise InvalidRequestError(
            f"coverage must be True or False, got {type(w.coverage).__name__}"
        )
    cov = coverage(plan, w.lo, w.hi) if w.coverage else None
    return plan, arr, res if cov is None else CoveredRead(res, cov)
