"""The segment model (DESIGN §2): a handle to fixed-width rows of one field in one file."""

from __future__ import annotations

import functools
import math
import posixpath
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from ._errors import InvalidRequestError, InvalidSegmentError

__all__ = [
    "INT64_MAX",
    "NAME_PATTERN",
    "SUPPORTED_DTYPES",
    "PayloadSegment",
    "SegmentColumns",
    "check_int",
    "check_name",
    "check_relative_path",
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


class PayloadSegment(msgspec.Struct, array_like=True, frozen=True):
    """A handle to ``rows`` consecutive rows of one field stored in one file.

    Encoded on the wire as an array in this field order (contract, DESIGN §2); new fields
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
    """

    field: str
    file: str
    offset: int
    pos: int
    rows: int
    dtype: str
    shape: list[int]


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
    """Check ``seg`` against the segment contract (DESIGN §2) and return it.

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
    nbytes = _ITEMSIZE[seg.dtype] * math.prod(shape)
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

    Raises
    ------
    InvalidSegmentError
        For the first invalid segment, naming its index and field.
    """
    if isinstance(segments, PayloadSegment | str | bytes) or not isinstance(segments, Sequence):
        raise InvalidSegmentError(
            f"segments must be a list of PayloadSegment, got {type(segments).__name__}"
        )
    return [validate_segment(seg, i) for i, seg in enumerate(segments)]


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


class SegmentColumns(NamedTuple):
    """A validated segment list as columns (`segment_columns`).

    Attributes
    ----------
    segments : list of PayloadSegment
        The validated segments, as a list.
    field, file : list of str
        Each segment's field and file.
    offset, pos, rows, row_nbytes : numpy.ndarray
        ``int64 [n]``: each segment's byte offset, first token position, row count and
        bytes a row.
    kind : numpy.ndarray
        ``intp [n]``: each segment's index into ``kinds``.
    kinds : list of tuple
        The distinct ``(dtype, shape)`` pairs (shape a tuple), in first-seen order.
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
    """Validate ``segments`` (as `validate_segments`, the same errors) and return columns.

    Raises
    ------
    InvalidSegmentError
        For the first invalid segment, naming its index and field.
    """
    segs = validate_segments(segments)
    n = len(segs)
    codes: dict[tuple[str, tuple[int, ...]], int] = {}
    kind = np.fromiter(
        (codes.setdefault((s.dtype, tuple(s.shape)), len(codes)) for s in segs), np.intp, n
    )
    kinds = list(codes)
    nbytes = np.array([_ITEMSIZE[d] * math.prod(sh) for d, sh in kinds], np.int64)
    return SegmentColumns(
        segs,
        [s.field for s in segs],
        [s.file for s in segs],
        np.fromiter((s.offset for s in segs), np.int64, n),
        np.fromiter((s.pos for s in segs), np.int64, n),
        np.fromiter((s.rows for s in segs), np.int64, n),
        nbytes[kind] if n else np.zeros(0, np.int64),
        kind,
        kinds,
    )
