"""The checks of a segment list given as columns (`payload_client.SegmentList.from_columns`):
the rules of `payload_client.validate_segment`, column by column, and its error for the
first invalid segment."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import InvalidSegmentError
from ._segment import (
    INT64_MAX,
    SUPPORTED_DTYPES,
    PayloadSegment,
    bounded_prod,
    check_relative_path,
    validate_segment,
)

__all__ = ["Kind", "check_columns", "int_column", "kinds_table"]

Kind = tuple[str, tuple[int, ...]]
_ITEMSIZE = {name: np.dtype(name).itemsize for name in SUPPORTED_DTYPES}


def int_column(column: Any, dtype: type[np.integer[Any]]) -> np.ndarray:
    """``column`` as an array of ``dtype``, if it holds integers that fit int64."""
    try:
        a = np.asarray(column)
    except (ValueError, TypeError) as exc:  # ragged nesting, ...
        raise InvalidSegmentError(f"segment columns must be integer arrays: {exc}") from None
    if not a.size:
        return np.zeros(a.shape, dtype)
    if a.dtype.kind not in "iu":
        raise InvalidSegmentError(
            f"segment columns must be integer arrays, got {a.dtype} (an entry beyond int64?)"
        )
    if a.dtype.kind == "u" and int(a.max()) > INT64_MAX:
        raise InvalidSegmentError(f"a segment column entry {int(a.max())} is beyond int64")
    return a.astype(dtype)  # a copy: the caller's array stays the caller's


_TUPLE = frozenset((tuple,))
_STR = frozenset((str,))
_PAIR = frozenset((2,))
_SHAPE = operator.itemgetter(1)


def kinds_table(
    kinds: Sequence[Any], typed: bool = False
) -> tuple[list[Kind | Any], list[int | None]]:
    """The kinds as ``(dtype, tuple of int)`` where they have that form (others as given: a
    segment that uses one is refused by `check_columns`), and their row sizes (``None``:
    not a valid kind). ``typed``: decoded by msgspec as ``(str, tuple of int)``, so that a
    kind equal to one seen before is that kind (``True == 1``, ``2.0 == 2`` otherwise)."""
    if (
        typed
        and set(map(type, kinds)) <= _TUPLE
        and set(map(len, kinds)) <= _PAIR
        and set(map(type, map(_SHAPE, kinds))) <= _TUPLE
    ):  # as msgspec decodes them: taken as they are (at C speed)
        known: list[int | None] = list(map(_SIZES.get, kinds))  # seen before: at C speed
        if None in known:
            known = list(map(_kind_size, kinds))
        return list(kinds), known
    out: list[Kind | Any] = []
    sizes: list[int | None] = []
    for k in kinds:
        if not (type(k) is tuple and len(k) == 2 and type(k[1]) is tuple):
            try:
                d, shape = k
                k = (d, tuple(shape)) if isinstance(shape, list | tuple) else k
            except (TypeError, ValueError):
                pass
        out.append(k)
        sizes.append(_size_of(k))
    return out, sizes


_SIZES: dict[Kind, int] = {}
"""Row sizes of the valid kinds seen (at most `_KEPT`)."""
_KEPT = 4096


def _kind_size(k: Any) -> int | None:
    """The row size (bytes) of a valid kind, ``None`` for an invalid one."""
    try:
        size = _SIZES.get(k)
    except TypeError:  # unhashable: not a kind
        return None
    if size is None:
        size = _size_of(k)
        if size is not None:
            if len(_SIZES) >= _KEPT:
                _SIZES.clear()
            _SIZES[k] = size
    return size


def _size_of(k: Any) -> int | None:
    if not isinstance(k, tuple) or len(k) != 2:
        return None
    d, shape = k
    if not isinstance(d, str) or d not in SUPPORTED_DTYPES:
        return None
    if (
        not isinstance(shape, tuple)
        or not shape
        or any(type(x) is not int or x <= 0 for x in shape)
    ):
        return None
    size = _ITEMSIZE[d] * bounded_prod(shape)
    return None if size > INT64_MAX else size


def _bad_field(f: Any) -> bool:
    return not isinstance(f, str) or not f


def _bad_file(f: Any) -> bool:
    if f in _GOOD_FILES:
        return False
    try:
        check_relative_path(f)
    except ValueError:
        return True
    if len(_GOOD_FILES) >= _KEPT:
        _GOOD_FILES.clear()
    _GOOD_FILES.add(f)
    return False


_GOOD_FILES: set[str] = set()
"""Files found valid (at most `_KEPT`): a trainer reads the same files step after step."""


def _valid_sizes(
    fields: tuple[Any, ...],
    files: tuple[Any, ...],
    size: list[int | None],
    codes: list[np.ndarray],
    ints: list[np.ndarray],
) -> np.ndarray | None:
    """Each segment's row size when coarse checks (a few reductions, no array a check) show
    every segment valid; ``None`` when they cannot tell (`check_columns` then looks at
    each segment)."""
    tables = (fields, files, size)
    for table, code in zip(tables, codes, strict=True):
        if int(code.min()) < 0 or int(code.max()) >= len(table):
            return None
    if None in size or any(map(_bad_field, fields)) or any(map(_bad_file, files)):
        return None
    if min(int(a.min()) for a in ints) < 0:
        return None
    known = [n for n in size if n is not None]
    rb: np.ndarray = np.array(known, np.int64)[codes[2]]
    max_offset, max_pos, max_rows = (int(a.max()) for a in ints)
    if max_pos + max_rows > INT64_MAX or max_offset + max_rows * max(known) > INT64_MAX:
        return None  # (int, not numpy: no overflow) exactly, per segment, by the caller
    return rb


def check_columns(
    fields: tuple[Any, ...],
    files: tuple[Any, ...],
    kinds: list[Any],
    size: list[int | None],
    codes: list[np.ndarray],
    ints: list[np.ndarray],
) -> np.ndarray:
    """Each segment's row size (``int64 [n]``) when every segment is valid; else raise for
    the first invalid one, as `validate_segment` would."""
    field, file, kind = codes
    offset, pos, rows = ints
    if not offset.size:
        return np.zeros(0, np.int64)
    rb = _valid_sizes(fields, files, size, codes, ints)
    if rb is not None:
        return rb
    bad = np.zeros(offset.size, bool)
    checks: tuple[tuple[Sequence[Any], np.ndarray, list[bool]], ...] = (
        (fields, field, [_bad_field(f) for f in fields]),
        (files, file, [_bad_file(f) for f in files]),
        (kinds, kind, [s is None for s in size]),
    )
    for table, code, verdict in checks:
        if int(code.min()) >= 0 and int(code.max()) < len(table):
            if any(verdict):
                bad |= np.array(verdict, bool)[code]
        else:
            inside = (code >= 0) & (code < len(table))
            bad |= np.array([*verdict, True], bool)[np.where(inside, code, len(table))]
    sizes = np.array([s or 1 for s in size] + [1], np.int64)
    rb = sizes[np.where((kind >= 0) & (kind < len(kinds)), kind, len(kinds))]
    bad |= (offset < 0) | (pos < 0) | (rows < 0)
    r, o = np.maximum(rows, 0), np.maximum(offset, 0)
    bad |= (pos > INT64_MAX - r) | (r > (INT64_MAX - o) // rb)
    if not bad.any():
        return rb
    i = int(np.argmax(bad))
    for name, table, code in (("field", fields, field), ("file", files, file),
                              ("kind", kinds, kind)):  # fmt: skip
        c = int(code[i])
        if not 0 <= c < len(table):
            raise InvalidSegmentError(
                f"{name} code {c} is outside the list's {len(table)} {name}s",
                index=i,
                field="dtype" if name == "kind" else name,
            )
    k = kinds[int(kind[i])]
    d, shape = k if isinstance(k, tuple) and len(k) == 2 else (k, [])
    seg = PayloadSegment(fields[int(field[i])], files[int(file[i])], int(offset[i]),
                         int(pos[i]), int(rows[i]), d, list(shape) if isinstance(
                             shape, list | tuple) else shape)  # fmt: skip
    validate_segment(seg, i)
    raise InvalidSegmentError("invalid segment", index=i)  # not reached: validate_segment raised
