"""A trainer rank's reads: its context-parallel chunks, and CPU torch tensors as outputs.

`cp_chunks` says which token positions a context-parallel (CP) rank holds, in the contiguous
or the load-balanced layout (docs/contract.md, "Context-parallel windows"). `cp_read` turns a
rank's read of one field into the windows of its chunks, whose outputs are consecutive row
slices of one array, before any I/O; the clients' ``read_cp`` reads them with ``read_many``'s
machinery. `host_array` is the numpy view of a CPU torch tensor given as ``out=``, without
importing torch. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import InvalidRequestError
from ..segments._segment import PayloadSegment, check_window
from ._checks import checked_field, row_shape_of
from ._plan import Piece, PieceTable, in_file_order
from ._windows import ReadResult, Window, WindowPlan, plan_window

__all__ = [
    "CPRank",
    "CPRead",
    "Spans",
    "cp_chunks",
    "cp_read",
    "host_array",
    "join_plans",
    "plan_spans",
]

_COLUMNS = PieceTable._fields[2:]  # the array columns, after the files and kinds


def _integer(value: Any, what: str, minimum: int, hint: str) -> int:
    """``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``."""
    if type(value) is not int and not isinstance(value, np.integer):
        raise InvalidRequestError(
            f"{what} must be an integer, got {type(value).__name__} {value!r}: pass int(...)"
        )
    number = int(value)
    if number < minimum:
        raise InvalidRequestError(f"{what} must be >= {minimum} ({hint}), got {number}")
    return number


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise InvalidRequestError(f"{what} must be True or False, got {type(value).__name__}")
    return bool(value)


def cp_chunks(
    length: int, cp_size: int, rank: int, *, load_balanced: bool = False
) -> list[tuple[int, int]]:
    """The token ranges context-parallel rank ``rank`` holds, in the order its tensor has them.

    Parameters
    ----------
    length : int
        ``L``, the micro batch's token positions, padded (padding adds no segment: padded
        positions read as fill) to a multiple of ``cp_size``, or of ``2 * cp_size`` when
        ``load_balanced``.
    cp_size : int
        Ranks of the CP group, >= 1 (1: no context parallelism).
    rank : int
        This rank within its CP group, in ``[0, cp_size)``.
    load_balanced : bool, default False
        ``False``: the contiguous layout, one range ``[r * L // cp_size, (r + 1) * L //
        cp_size)``. ``True``: the load-balanced layout of Megatron-LM, Transformer Engine and
        ring attention with a causal mask: ``L`` is cut into ``2 * cp_size`` chunks of ``c = L
        // (2 * cp_size)`` positions, and rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1
        - r``, in that order: ``[r * c, (r + 1) * c)`` then ``[(2 * cp_size - 1 - r) * c, (2 *
        cp_size - r) * c)``.

    Returns
    -------
    list of (int, int)
        ``(start, end)`` ranges, end exclusive: one (contiguous) or two (load-balanced), each
        ``L // cp_size`` (contiguous) or ``L // (2 * cp_size)`` positions long. The ranges of
        all ranks tile ``[0, L)``.

    Raises
    ------
    InvalidRequestError
        ``length``, ``cp_size`` or ``rank`` not an integer (a bool is none); ``cp_size < 1``;
        ``length < 0``; ``rank`` outside ``[0, cp_size)``; ``length`` not a multiple of
        ``cp_size`` (of ``2 * cp_size`` when ``load_balanced``), naming the length to pad to;
        ``load_balanced`` not a bool.

    Examples
    --------
    >>> cp_chunks(16, 2, 0, load_balanced=True)
    [(0, 4), (12, 16)]
    >>> cp_chunks(16, 2, 1)
    [(8, 16)]
    """
    cp_size = _integer(cp_size, "cp_size", 1, "1: no context parallelism")
    length = _integer(length, "length", 0, "the micro batch's token positions")
    rank = _integer(rank, "rank", 0, "this process's rank within its CP group")
    balanced = _flag(load_balanced, "load_balanced")
    if rank >= cp_size:
        raise InvalidRequestError(
            f"rank {rank} is outside [0, cp_size) = [0, {cp_size}): pass this process's rank "
            "within its context-parallel group"
        )
    parts = 2 * cp_size if balanced else cp_size
    if length % parts:
        named = f"2 * cp_size = {parts}" if balanced else f"cp_size = {parts}"
        padded = -(-length // parts) * parts
        raise InvalidRequestError(
            f"length {length} is not a multiple of {named}: pad the micro batch to {padded} "
            "positions (padding adds no segment: padded positions read as fill)"
        )
    c = length // parts
    if not balanced:
        return [(rank * c, (rank + 1) * c)]
    mirror = parts - 1 - rank
    return [(rank * c, (rank + 1) * c), (mirror * c, (mirror + 1) * c)]


class Spans(NamedTuple):
    """Several ranges of token positions of one field read into one output, their rows one
    after another (a CP rank's chunks): a window of ``read_many`` planned by `plan_spans`.

    Attributes
    ----------
    segments, field, fill, out, dtype, coverage, required
        As `Window`'s; ``out`` has the rows of every span.
    spans : tuple of (int, int)
        The ranges ``[a, b)``, in the output's order.
    """

    segments: Sequence[PayloadSegment]
    field: str
    spans: tuple[tuple[int, int], ...]
    fill: int | float
    out: Any = None
    dtype: Any = None
    coverage: bool = False
    required: bool = False

    @property
    def lo(self) -> int:
        """0: the output's first row (its rows are counted from there, over every span)."""
        return 0

    @property
    def hi(self) -> int:
        """The output's rows, of every span."""
        return sum(b - a for a, b in self.spans)


def plan_spans(
    segments: Sequence[PayloadSegment],
    field: str,
    spans: Sequence[tuple[int, int]],
    fill: int | float,
    dtype: Any = None,
    ragged: bool | None = None,
) -> WindowPlan | None:
    """Plan the read of ``field`` over several ranges into one output (`join_plans` of each
    range's `plan_window`; ``None`` when no segment has the field).

    Raises
    ------
    InvalidRequestError, InvalidSegmentError
        As `plan_window`, for the first range that has them.
    """
    short = isinstance(segments, list | tuple) and len(segments) <= 8
    if len(spans) > 1 and not short:
        for a, b in spans:
            check_window(a, b)
        got = checked_field(segments, field, fill, dtype, ragged)
        if got is None:
            return None
        lc, fc, out_dtype, fill = got
        if fc.disjoint:  # one plan of every window's pieces (the usual list)
            table, ends, hit_kinds, missed = fc.table_spans(spans)
            kinds = [*hit_kinds, *fc.kind_codes] if missed else hit_kinds  # (as one window)
            row_shape, narrow = row_shape_of(lc, fc, kinds)
            rows = sum(b - a for a, b in spans)
            return WindowPlan(0, rows, row_shape, out_dtype, fill, table, ends, narrow)
    plans = [plan_window(segments, field, a, b, fill, dtype, ragged) for a, b in spans]
    if plans[0] is None:
        return None
    return join_plans([p for p in plans if p is not None])


def join_plans(plans: Sequence[WindowPlan]) -> WindowPlan:
    """One plan of several windows' plans (of one field, fill and dtype) whose outputs are
    one array, their rows one after another: positions ``[0, rows of all)`` of the output,
    row shape the element-wise maximum of theirs, pieces moved to their rows (sorted by
    file and offset), the files' ends the largest of each."""
    at, moved = 0, []
    for p in plans:
        moved.append(at)
        at += p.hi - p.lo
    shapes = {p.row_shape for p in plans}
    row_shape = plans[0].row_shape
    if len(shapes) > 1:
        row_shape = tuple(map(max, zip(*shapes, strict=True)))
    narrow = len(shapes) > 1 or any(p.narrow for p in plans)
    ends: dict[str, int] = {}
    for p in plans:
        for f, e in p.ends.items():
            if ends.get(f, -1) < e:
                ends[f] = e
    first = plans[0]
    parts: PieceTable | tuple[Piece, ...] | None = _joined_table(plans, moved)
    if parts is None:  # pieces as tuples (a short list's plans): moved one by one
        parts = tuple(sorted(c._replace(dst=c.dst + m)
                             for p, m in zip(plans, moved, strict=True) for c in p.pieces))  # fmt: skip
    return WindowPlan(0, at, row_shape, first.dtype, first.fill, parts, ends, narrow)


def _joined_table(plans: Sequence[WindowPlan], moved: list[int]) -> PieceTable | None:
    """The plans' piece tables as one (``None`` unless each is a table of the same files
    and kinds), sorted by file and offset."""
    tables = [p.parts for p in plans if isinstance(p.parts, PieceTable)]
    if len(tables) < len(plans):
        return None
    head = tables[0]
    if not all(t.files == head.files and t.kinds == head.kinds for t in tables):
        return None
    cols = [np.concatenate([getattr(t, c) for t in tables]) for c in _COLUMNS]
    cols[4] = np.concatenate([t.dst + m for t, m in zip(tables, moved, strict=True)])
    if cols[0].size > 1 and not in_file_order(cols[0], cols[1]):
        order = np.lexsort((cols[1], cols[0]))
        cols = [a[order] for a in cols]
    return PieceTable(head.files, head.kinds, *cols)


class CPRead(NamedTuple):
    """A CP rank's read of one field, planned (`cp_read`): the windows to read, in one call.

    Attributes
    ----------
    windows : list of Window or Spans
        One `Window` (one chunk), or one `Spans` of the rank's chunks, in its order.
    out : numpy.ndarray, torch.Tensor or None
        What the read returns once the field is present: the caller's ``out`` as given, or
        the array the client allocated; ``None`` for one chunk without ``out`` (the read
        returns the window's own result, as ``read_field``).
    """

    windows: list[Window | Spans]
    out: Any

    def result(self, results: Sequence[ReadResult]) -> Any:
        """What ``read_cp`` returns, given the results of `windows` read: ``None`` when no
        segment has the field (no output was touched), else `out` or the one window's."""
        if all(r is None for r in results):
            return None
        return results[0] if self.out is None else self.out


class CPRank(NamedTuple):
    """The positions of a context-parallel rank's read (`cp_read`): `cp_chunks`'s
    arguments, and whether they are read at label positions, one later (``labels``)."""

    length: int
    cp_size: int
    rank: int
    load_balanced: bool = False
    labels: bool = False


def cp_read(
    segments: Sequence[PayloadSegment],
    field: str,
    fill: int | float,
    cp: CPRank,
    out: Any = None,
    dtype: Any = None,
) -> CPRead:
    """Plan a CP rank's read of ``field`` into one array (``PayloadClient.read_cp``), no I/O.

    Each chunk ``[a, b)`` of `cp_chunks` is read at ``[a, b)``, or at ``[a + 1, b + 1)``
    with ``labels`` (the label shift of sampling masks, across each chunk boundary). One
    chunk is one window, exactly as ``read_field`` reads it. Several are one `Spans` window,
    planned as one (`plan_spans`: every chunk's pieces in one plan) into consecutive rows of
    one array: the caller's ``out`` (a torch tensor through `host_array`), else one the
    client allocates, ``[L // cp_size, *row_shape]`` of the read's dtype, with ``row_shape``
    the element-wise maximum of the chunks' row shapes, each that of one window (the shapes
    of the field's segments that intersect the chunk, of all of them when none does): every
    chunk's rows then fit.

    Parameters
    ----------
    segments, field, fill, dtype
        As ``read_field``.
    cp : CPRank
        The rank's positions: ``length``, ``cp_size``, ``rank``, ``load_balanced`` as
        `cp_chunks` takes them; ``labels``: read each chunk one position later (label
        positions: sampling masks).
    out : numpy.ndarray or torch.Tensor, optional
        ``[L // cp_size, *dims]``, as ``read_field``'s ``out`` for the rank's positions.

    Returns
    -------
    CPRead
        The windows to read in one ``read_many`` call, and what the read returns.

    Raises
    ------
    InvalidRequestError
        As `cp_chunks`; ``labels`` not a bool; an ``out`` of another number of rows, or one
        `host_array` refuses; a window's errors (``fill``, ``dtype``, ``out`` narrower than
        the widest row of the rank's chunks). An output too large to allocate.
    InvalidSegmentError
        Any invalid segment in the list.
    """
    chunks = cp_chunks(cp.length, cp.cp_size, cp.rank, load_balanced=cp.load_balanced)
    shift = 1 if _flag(cp.labels, "labels") else 0
    spans = [(a + shift, b + shift) for a, b in chunks]
    if len(spans) == 1:  # one window, as read_field reads it (a torch out: in plan_reads)
        (lo, hi) = spans[0]
        return CPRead([Window(segments, field, lo, hi, fill, out, dtype)], None)
    rows = sum(b - a for a, b in spans)
    if out is not None:
        arr = host_array(out)
        if not isinstance(arr, np.ndarray):
            raise InvalidRequestError(
                f"out must be a numpy.ndarray or a CPU torch.Tensor, got {type(out).__name__}"
            )
        if arr.ndim < 1 or arr.shape[0] != rows:
            raise InvalidRequestError(
                f"out has shape {arr.shape}, rank {cp.rank}'s positions need {rows} rows "
                f"(length // cp_size = {cp.length} // {cp.cp_size})"
            )
    # one window of every chunk: one plan, one output (the caller's, else one the read
    # allocates, as read_field's)
    return CPRead([Spans(segments, field, tuple(spans), fill, out, dtype)], out)


def _is_torch(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (without importing torch)."""
    return type(obj).__module__.partition(".")[0] == "torch" and callable(
        getattr(obj, "numpy", None)
    )


def host_array(out: Any) -> Any:
    """The numpy array an ``out=`` stands for: a CPU torch tensor's numpy view, else ``out``.

    Parameters
    ----------
    out : numpy.ndarray, torch.Tensor or any
        A read's ``out``. A torch tensor (its type's module is ``torch``, it has
        ``.numpy()``) must be on the CPU (pinned or not) and must not require grad.

    Returns
    -------
    numpy.ndarray or any
        ``out.numpy()`` for a torch tensor: the same memory, so what is read into it is in
        the tensor; anything else as given (``None``, an array, or what the read then
        refuses).

    Raises
    ------
    InvalidRequestError
        A tensor on another device (read into a CPU tensor, then copy it with
        ``.to(device, non_blocking=True)``), one that requires grad (pass
        ``out.detach()``), or one numpy cannot view (a dtype such as ``bfloat16``, a sparse
        tensor).
    """
    if out is None or isinstance(out, np.ndarray) or not _is_torch(out):
        return out
    device = getattr(out, "device", None)
    if getattr(device, "type", "cpu") != "cpu":
        raise InvalidRequestError(
            f"out is a torch tensor on {device}: pass a CPU tensor (pinned for a fast copy: "
            f"torch.empty(shape, dtype=..., pin_memory=True)), then copy it with "
            f'.to("{device}", non_blocking=True)'
        )
    if getattr(out, "requires_grad", False):
        raise InvalidRequestError(
            "out is a torch tensor that requires grad: pass out.detach() (the same memory) "
            "or a tensor made with requires_grad=False"
        )
    try:
        return out.numpy()
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"out is a torch tensor numpy cannot view ({exc}): pass a dense CPU tensor of a "
            "dtype numpy has (e.g. torch.int32, torch.uint8)"
        ) from None
