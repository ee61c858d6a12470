"""The segment model (docs/contract.md, "The segment model"): a handle to fixed-width rows of one field in one file."""

from __future__ import annotations

import functools
import math
import posixpath
import re
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import msgspec
import numpy as np

from .._errors import InvalidRequestError, InvalidSegmentError

__all__ = [
    "INT64_MAX",
    "FirstSeen",
    "NAME_PATTERN",
    "SUPPORTED_DTYPES",
    "PayloadSegment",
    "SegmentColumns",
    "bounded_prod",
    "check_int",
    "check_name",
    "check_relative_path",
    "check_shift",
    "check_window",
    "row_nbytes",
    "segment_columns",
    "segment_end",
    "validate_segment",
    "validate_segments",
]

INT64_MAX = 2**63 - 1
"""Largest value any position, row count, byte offset or byte length may take."""

SUPPORTED_DTYPES: frozenset[str] = frozenset(
    {"uint8", "int8", "uint16", "int16", "int32", "float16", "float32"}
)
"""numpy dtype names a segment may carry (one element of a row; little-endian on disk)."""

_ITEMSIZE = {name: np.dtype(name).itemsize for name in SUPPORTED_DTYPES}

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""Pattern of run names and of the field names an append may use (a path component)."""


class PayloadSegment(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A handle to ``rows`` consecutive rows of one field stored in one file.

    Encoded on the wire as an array in this field order (docs/contract.md, "The segment model"); new fields
    may only be appended at the end, with defaults.

    Parameters
    ----------
    field : str
        Field name, e.g. ``"routed_experts"`` or ``"sampling_mask"``.
    file : str
        Data file, relative to the payload root (POSIX, normalised, no ``..``).
    offset : int
        Byte offset of the first row in ``file``.
    pos : int
        Absolute token position of the first row; the segment covers token positions
        ``[pos, pos + rows)`` (end exclusive).
    rows : int
        Number of rows; 0 makes a placeholder that only carries a width.
    dtype : str
        numpy dtype name of one element, one of `SUPPORTED_DTYPES`.
    shape : list of int
        Shape of one row, e.g. ``[48, 8]`` or ``[width]``.

    Notes
    -----
    The segment's bytes are ``[offset, offset + rows * row_nbytes(segment))`` of ``file``.
    Construction does not validate; `validate_segment` does, and every operation of this
    package calls it.

    Instances are not tracked by the cycle collector (``gc=False``): a segment holds only
    strings, integers and a list of integers, which cannot form a cycle. Lists of many
    segments then cost the collector nothing (decoding 100,000 is about twice as fast).
    """

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


def bounded_prod(values: Iterable[int], limit: int = INT64_MAX) -> int:
    """The product of ``values`` (integers > 0), or ``limit + 1`` as soon as it passes
    ``limit``: a shape of many large entries costs its length, not its product's digits."""
    product = 1
    for v in values:
        product *= v
        if product > limit:
            return limit + 1
    return product


def check_int(value: Any, what: str, *, minimum: int = 0) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``) in ``[minimum, INT64_MAX]``.

    Raises
    ------
    InvalidRequestError
        Naming ``what`` when ``value`` is not such an integer.
    """
    if type(value) is not int and not isinstance(value, np.integer):
        raise InvalidRequestError(f"{what} must be an integer, got {type(value).__name__}")
    number = int(value)
    if not minimum <= number <= INT64_MAX:
        raise InvalidRequestError(f"{what} must be in [{minimum}, 2**63 - 1], got {number}")
    return number


def check_window(lo: Any, hi: Any) -> tuple[int, int]:
    """Return ``(lo, hi)`` if both are integers with ``0 <= lo <= hi``.

    Raises
    ------
    InvalidRequestError
        Naming the bound that is not such an integer, or ``lo > hi``.
    """
    lo = check_int(lo, "lo")
    hi = check_int(hi, "hi")
    if lo > hi:
        raise InvalidRequestError(f"window [lo, hi) needs lo <= hi, got lo={lo} > hi={hi}")
    return lo, hi


def check_shift(pos: int, end: int, delta: int, index: int) -> None:
    """Refuse a shift of segment ``index`` (``[pos, end)``) that leaves ``[0, INT64_MAX]``.

    Raises
    ------
    InvalidRequestError
        Naming the segment, when ``pos + delta < 0`` or ``end + delta > INT64_MAX``.
    """
    if pos + delta < 0:
        raise InvalidRequestError(f"segment {index}: shift by {delta} makes pos {pos + delta} < 0")
    if end + delta > INT64_MAX:
        raise InvalidRequestError(f"segment {index}: shift by {delta} overflows int64")


def check_name(value: Any, what: str) -> str:
    """Return ``value`` if it matches `NAME_PATTERN` and is not ``.`` or ``..``.

    Raises
    ------
    InvalidRequestError
        Naming ``what`` otherwise.
    """
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value) or value in (".", ".."):
        raise InvalidRequestError(
            f"{what} must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..', got {value!r}"
        )
    return value


def check_relative_path(path: Any) -> str:
    """Return ``path`` if it is a normalised POSIX path relative to the payload root.

    Raises
    ------
    ValueError
        When ``path`` is empty, absolute, holds NUL, ``..``, ``.``, empty components or
        backslashes.
    """
    if not isinstance(path, str) or not path:
        raise ValueError("must be a non-empty string")
    # cached: reads name few files; long paths (rare, and bad ones) are not kept
    problem = _path_problem(path) if len(path) <= _CACHED_PATH else _path_problem.__wrapped__(path)
    if problem is not None:
        raise ValueError(problem)
    return path


_CACHED_PATH = 256
"""Longest path whose verdict is cached (4096 of them: at most about 2 MiB)."""


@functools.lru_cache(maxsize=4096)
def _path_problem(path: str) -> str | None:
    """What is wrong with a non-empty ``path``, or ``None``."""
    if "\x00" in path:
        return "must not contain NUL"
    if path.startswith("/"):
        return f"must be relative to the payload root, got {path!r}"
    if "\\" in path or posixpath.normpath(path) != path or path.split("/")[0] in ("..", "."):
        return f"must be a normalised path inside the payload root, got {path!r}"
    if ".." in path.split("/"):
        return f"must not contain '..', got {path!r}"
    return None


def _check_seg_int(value: Any, name: str, index: int | None) -> int:
    if type(value) is not int:
        raise InvalidSegmentError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}",
            index=index,
            field=name,
        )
    if not 0 <= value <= INT64_MAX:
        raise InvalidSegmentError(
            f"{name} must be in [0, 2**63 - 1], got {value}", index=index, field=name
        )
    return value


def validate_segment(seg: Any, index: int | None = None) -> PayloadSegment:
    """Check ``seg`` against the segment contract (docs/contract.md, "The segment model") and return it.

    Parameters
    ----------
    seg : PayloadSegment
        The segment to check.
    index : int, optional
        Its position in a list, quoted in the error message.

    Returns
    -------
    PayloadSegment
        ``seg`` itself.

    Raises
    ------
    InvalidSegmentError
        Naming the first bad field: ``field`` empty; ``file`` absolute, un-normalised,
        holding ``..`` or NUL; ``offset``/``pos``/``rows`` not integers >= 0; ``dtype``
        unsupported; ``shape`` empty or with an entry <= 0; ``pos + rows``, the row size or
        ``offset + rows * row_nbytes`` beyond int64.
    """
    if not isinstance(seg, PayloadSegment):
        raise InvalidSegmentError(
            f"expected a PayloadSegment, got {type(seg).__name__}", index=index
        )
    if not isinstance(seg.field, str) or not seg.field:
        raise InvalidSegmentError("field must be a non-empty string", index=index, field="field")
    try:
        check_relative_path(seg.file)
    except ValueError as exc:
        raise InvalidSegmentError(f"file {exc}", index=index, field="file") from None
    offset = _check_seg_int(seg.offset, "offset", index)
    pos = _check_seg_int(seg.pos, "pos", index)
    rows = _check_seg_int(seg.rows, "rows", index)
    if not isinstance(seg.dtype, str) or seg.dtype not in SUPPORTED_DTYPES:
        raise InvalidSegmentError(
            f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {seg.dtype!r}",
            index=index,
            field="dtype",
        )
    shape = seg.shape
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or any(type(d) is not int or d <= 0 for d in shape)
    ):
        raise InvalidSegmentError(
            f"shape must be a non-empty list of integers > 0, got {shape!r}",
            index=index,
            field="shape",
        )
    nbytes = _ITEMSIZE[seg.dtype] * bounded_prod(shape)
    if nbytes > INT64_MAX:
        raise InvalidSegmentError("row size overflows int64", index=index, field="shape")
    if pos + rows > INT64_MAX:
        raise InvalidSegmentError("pos + rows overflows int64", index=index, field="rows")
    if offset + rows * nbytes > INT64_MAX:
        raise InvalidSegmentError(
            "offset + rows * row_nbytes overflows int64", index=index, field="offset"
        )
    return seg


def validate_segments(segments: Sequence[PayloadSegment]) -> list[PayloadSegment]:
    """Validate every segment of ``segments`` (see `validate_segment`); return them as a list.

    Parameters
    ----------
    segments : sequence of PayloadSegment
        The segments to check, in order.

    Returns
    -------
    list of PayloadSegment
        A new list of the same segment objects.

    Raises
    ------
    InvalidSegmentError
        For the first invalid segment, naming its index and field (as `validate_segment`
        would), or, without an index, when ``segments`` is not a sequence of segments.

    Notes
    -----
    Long lists are checked column by column (one type check a column, each distinct file,
    dtype and row shape once, numpy for the ranges and int64 bounds); on any doubt the
    segments are checked one by one, so the error is always that of the first bad segment.
    """
    segs = _as_list(segments)
    if len(segs) >= _BULK_MIN and _bulk_check(segs) is not None:
        return segs
    for i, seg in enumerate(segs):
        validate_segment(seg, i)
    return segs


class SegmentColumns(NamedTuple):
    """A validated segment list, column by column (see `segment_columns`).

    Every array has one entry a segment, in list order; ``n = len(segments)``.

    Attributes
    ----------
    segments : list of PayloadSegment
        The validated segments (a new list of the same objects).
    field : list of str
        Each segment's ``field``.
    file : list of str
        Each segment's ``file``.
    offset : numpy.ndarray
        int64 [n], each segment's byte offset.
    pos : numpy.ndarray
        int64 [n], each segment's first token position.
    rows : numpy.ndarray
        int64 [n], each segment's row count.
    row_nbytes : numpy.ndarray
        int64 [n], each segment's row size in bytes (``itemsize * prod(shape)``).
    kind : numpy.ndarray
        intp [n], each segment's index into ``kinds``.
    kinds : list of tuple of (str, tuple of int)
        The distinct ``(dtype, shape)`` pairs, in the order they first occur.

    Notes
    -----
    Validation guarantees ``pos + rows`` and ``offset + rows * row_nbytes`` fit in int64,
    so that arithmetic on these arrays does not overflow.
    """

    segments: list[PayloadSegment]
    field: list[str]
    file: list[str]
    offset: np.ndarray
    pos: np.ndarray
    rows: np.ndarray
    row_nbytes: np.ndarray
    kind: np.ndarray
    kinds: list[tuple[str, tuple[int, ...]]]


def segment_columns(segments: Sequence[PayloadSegment]) -> SegmentColumns:
    """Validate (as validate_segments, same errors) and return the columns.

    Parameters
    ----------
    segments : sequence of PayloadSegment
        The segments, in order.

    Returns
    -------
    SegmentColumns
        The segments as a list, their fields and files as lists, their offsets, positions,
        row counts and row sizes as int64 arrays [n], and their kinds: an intp array [n] of
        indices into the list of distinct ``(dtype, shape)`` pairs.

    Raises
    ------
    InvalidSegmentError
        As `validate_segments`: for the first invalid segment, naming its index and field.
    """
    cols = _checked_columns(segments)
    kind, kinds = _kinds(cols)
    sizes = np.array([_ITEMSIZE[d] * math.prod(sh) for d, sh in kinds], dtype=np.int64)
    return SegmentColumns(
        cols.segments,
        cols.field,
        cols.file,
        cols.offset_a,
        cols.pos_a,
        cols.rows_a,
        sizes[kind],
        kind,
        kinds,
    )


# -- bulk validation ---------------------------------------------------------------------

_BULK_MIN = 24
"""Shortest list checked column by column; shorter ones are checked segment by segment."""

_SEGMENT_TYPE = {PayloadSegment}
_STR_TYPE = {str}
_INT_TYPE = {int}
_LIST_TYPE = {list}
_SHAPE_TYPES = frozenset({list, tuple})


class _Checked(NamedTuple):
    """Columns of a validated segment list, for the operations of this package (private).

    ``shapes`` holds the distinct row shapes and ``dtypes`` the distinct dtypes when the
    bulk check found them (``None`` otherwise); ``lists``: every shape is a plain list.
    """

    segments: list[PayloadSegment]
    field: list[str]
    file: list[str]
    offset: list[int]
    pos: list[int]
    rows: list[int]
    dtype: list[str]
    shape: list[list[int]]
    offset_a: np.ndarray
    pos_a: np.ndarray
    rows_a: np.ndarray
    dtypes: set[str] | None
    shapes: set[tuple[int, ...]] | None
    lists: bool


def _as_list(segments: Sequence[PayloadSegment]) -> list[PayloadSegment]:
    if isinstance(segments, PayloadSegment | str | bytes) or not isinstance(segments, Sequence):
        raise InvalidSegmentError(
            f"segments must be a list of PayloadSegment, got {type(segments).__name__}"
        )
    return list(segments)


def _checked_columns(segments: Sequence[PayloadSegment]) -> _Checked:
    """Validate ``segments`` (as `validate_segments`, same errors) and return its columns."""
    segs = _as_list(segments)
    if len(segs) >= _BULK_MIN:
        cols = _bulk_check(segs)
        if cols is not None:
            return cols
    for i, seg in enumerate(segs):
        validate_segment(seg, i)
    return _columns_of(segs)


def _checked_list(
    segments: Sequence[PayloadSegment], minimum: int = _BULK_MIN
) -> list[PayloadSegment] | _Checked:
    """Validate ``segments`` (as `validate_segments`): a list shorter than ``minimum`` as it
    is, a longer one as columns."""
    segs = _as_list(segments)
    if len(segs) >= minimum:
        return _checked_columns(segs)
    for i, seg in enumerate(segs):
        validate_segment(seg, i)
    return segs


def _columns_of(segs: list[PayloadSegment]) -> _Checked:
    """The columns of an already validated list."""
    field, file, offset, pos, rows, dtype, shape = _lists(segs)
    n = len(segs)
    offset_a, pos_a, rows_a = np.fromiter(chain(offset, pos, rows), np.int64, 3 * n).reshape(3, n)
    return _Checked(
        segs, field, file, offset, pos, rows, dtype, shape, offset_a, pos_a, rows_a,
        None,
        None,
        set(map(type, shape)) <= _LIST_TYPE,
    )  # fmt: skip


def _lists(segs: list[PayloadSegment]) -> tuple[list[Any], ...]:
    return (
        [s.field for s in segs],
        [s.file for s in segs],
        [s.offset for s in segs],
        [s.pos for s in segs],
        [s.rows for s in segs],
        [s.dtype for s in segs],
        [s.shape for s in segs],
    )


def _bulk_check(segs: list[Any]) -> _Checked | None:
    """Check a non-empty list column by column: its columns if it is valid, else ``None``.

    ``None`` means only that something is unusual (an invalid segment, a subclass, a
    bound the coarse checks cannot settle): the caller then checks segment by segment.
    """
    n = len(segs)
    if set(map(type, segs)) != _SEGMENT_TYPE:
        return None
    field, file, offset, pos, rows, dtype, shape = _lists(segs)
    if (
        set(map(type, field)) != _STR_TYPE
        or "" in field
        or set(map(type, file)) != _STR_TYPE
        or set(map(type, offset)) != _INT_TYPE
        or set(map(type, pos)) != _INT_TYPE
        or set(map(type, rows)) != _INT_TYPE
        or set(map(type, dtype)) != _STR_TYPE
        or not (shape_types := set(map(type, shape))) <= _SHAPE_TYPES
        or set(map(type, chain.from_iterable(shape))) != _INT_TYPE
    ):
        return None
    dtypes = set(dtype)
    if not dtypes <= SUPPORTED_DTYPES:
        return None
    for path in set(file):
        try:
            check_relative_path(path)
        except ValueError:
            return None
    # one row shape is the usual case (its entries are ints, so == is exact)
    shapes = {tuple(shape[0])} if shape.count(shape[0]) == n else set(map(tuple, shape))
    if () in shapes or min(map(min, shapes)) <= 0:
        return None
    try:  # one array [3, n]: offsets, positions, row counts
        ints = np.fromiter(chain(offset, pos, rows), np.int64, 3 * n).reshape(3, n)
    except OverflowError:  # beyond int64
        return None
    if ints.min() < 0:
        return None
    offset_a, pos_a, rows_a = ints
    cols = _Checked(
        segs, field, file, offset, pos, rows, dtype, shape, offset_a, pos_a, rows_a,
        dtypes, shapes, shape_types == _LIST_TYPE,
    )  # fmt: skip
    # the int64 bounds, coarsely first (Python ints: no overflow), exactly when that fails
    max_offset, max_pos, max_rows = ints.max(axis=1).tolist()
    max_nbytes = max(_ITEMSIZE[d] for d in dtypes) * max(map(bounded_prod, shapes))
    if max_pos + max_rows > INT64_MAX and bool((pos_a > INT64_MAX - rows_a).any()):
        return None
    if max_nbytes > INT64_MAX or max_offset + max_rows * max_nbytes > INT64_MAX:
        kind, kinds = _kinds(cols)
        sizes = [_ITEMSIZE[d] * bounded_prod(sh) for d, sh in kinds]
        if max(sizes) > INT64_MAX:
            return None
        nbytes = np.array(sizes, dtype=np.int64)[kind]
        # offset + rows * nbytes <= INT64_MAX  <=>  rows <= (INT64_MAX - offset) // nbytes
        if bool((rows_a > (INT64_MAX - offset_a) // nbytes).any()):
            return None
    return cols


class FirstSeen(dict[Any, int]):
    """Numbers its keys 0, 1, 2, ... in the order they are first looked up."""

    def __missing__(self, key: Any) -> int:
        self[key] = number = len(self)
        return number


def _kinds(cols: _Checked) -> tuple[np.ndarray, list[tuple[str, tuple[int, ...]]]]:
    """Each segment's index into the distinct ``(dtype, shape)`` pairs, and the pairs."""
    n = len(cols.segments)
    if n == 0:
        return np.zeros(0, dtype=np.intp), []
    n_dtypes, n_shapes = len(cols.dtypes or ()), len(cols.shapes or ())  # 0: not known
    if n_dtypes == 1 == n_shapes:
        return np.zeros(n, dtype=np.intp), [(cols.dtype[0], tuple(cols.shape[0]))]
    seen = FirstSeen()
    if n_dtypes == 1:
        kind = np.fromiter(map(seen.__getitem__, map(tuple, cols.shape)), np.intp, n)
        return kind, [(cols.dtype[0], shape) for shape in seen]
    if n_shapes == 1:
        kind = np.fromiter(map(seen.__getitem__, cols.dtype), np.intp, n)
        return kind, [(dtype, tuple(cols.shape[0])) for dtype in seen]
    keys = zip(cols.dtype, map(tuple, cols.shape), strict=True)
    return np.fromiter(map(seen.__getitem__, keys), np.intp, n), list(seen)


def row_nbytes(segment: PayloadSegment) -> int:
    """Return the size of one row of ``segment`` in bytes: ``itemsize * prod(shape)``.

    Raises
    ------
    InvalidSegmentError
        If the segment is invalid (see `validate_segment`).
    """
    validate_segment(segment)
    return _row_nbytes(segment)


def _row_nbytes(segment: PayloadSegment) -> int:
    return _ITEMSIZE[segment.dtype] * math.prod(segment.shape)


def segment_end(segment: PayloadSegment) -> int:
    """Return the byte offset just past the segment's last row (``offset + rows * row_nbytes``).

    The segment must already be valid.
    """
    return segment.offset + segment.rows * _row_nbytes(segment)
