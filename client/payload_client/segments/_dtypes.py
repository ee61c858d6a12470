"""The output dtype and fill of a window read (docs/contract.md, "Reading a window"), from
the row kinds of the field's segments."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import InvalidRequestError, InvalidSegmentError
from ._segment import SUPPORTED_DTYPES

__all__ = ["Kind", "check_kinds"]

_DTYPE, _SHAPE = operator.itemgetter(0), operator.itemgetter(1)
_KIND = {name: np.dtype(name).kind for name in SUPPORTED_DTYPES}

Kind = tuple[str, tuple[int, ...]]
"""A row kind: the stored dtype name and the shape of one row."""


def _check_fill(fill: Any, dtype: np.dtype[Any]) -> int | float:
    if type(fill) is int and dtype.kind in "iu":  # the usual case, quickly
        lo, hi = _int_range(dtype)
        if lo <= fill <= hi:
            return fill
        raise _bad_fill(fill, dtype)
    if isinstance(fill, bool) or not isinstance(fill, int | float | np.integer | np.floating):
        raise InvalidRequestError(f"fill must be a number, got {type(fill).__name__}")
    if dtype.kind in "iu":
        lo, hi = _int_range(dtype)  # an int fill is compared as it is, never through float
        if isinstance(fill, float | np.floating) and not float(fill).is_integer():
            raise _bad_fill(fill, dtype)
        if not lo <= fill <= hi:
            raise _bad_fill(fill, dtype)
        return int(fill)
    try:
        value = float(fill)
    except OverflowError:  # an int no float holds
        raise _bad_fill(fill, dtype) from None
    if math.isfinite(value) and abs(value) > _float_max(dtype):  # NaN and inf are values
        raise _bad_fill(fill, dtype)
    return value


def _bad_fill(fill: Any, dtype: np.dtype[Any]) -> InvalidRequestError:
    return InvalidRequestError(f"fill {str(fill)[:40]} does not fit the output dtype {dtype}")


@functools.lru_cache(maxsize=64)
def _float_max(dtype: np.dtype[Any]) -> float:
    return float(np.finfo(dtype).max)


@functools.lru_cache(maxsize=64)
def _int_range(dtype: np.dtype[Any]) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _output_dtype(field: str, stored: frozenset[str], dtype: Any) -> np.dtype[Any]:
    """The output dtype: int32/float32 by default (docs/contract.md, "Reading a window"), else ``dtype`` if it holds
    every stored dtype of the field without loss."""
    try:
        try:
            return _output_dtype_cached(stored, dtype)
        except TypeError:  # an unhashable dtype argument: not cached
            return _output_dtype_of(stored, dtype)
    except _NarrowDtypeError as exc:
        raise InvalidRequestError(
            f"dtype {exc.args[0]} cannot hold the {exc.args[1]} rows of field {field!r}"
        ) from None


class _NarrowDtypeError(Exception):
    """Raised (and cached nowhere) when an output dtype cannot hold a stored dtype."""


def _output_dtype_of(stored: frozenset[str], dtype: Any) -> np.dtype[Any]:
    float_field = any(_KIND[d] == "f" for d in stored)
    if dtype is None:
        return np.dtype(np.float32 if float_field else np.int32)
    try:
        out = np.dtype(dtype)
    except TypeError:
        raise InvalidRequestError(f"dtype {dtype!r} is not a numpy dtype") from None
    if out.kind not in "iuf":
        raise InvalidRequestError(f"dtype must be an integer or float dtype, got {out}")
    narrow = sorted(d for d in stored if not np.can_cast(d, out, "safe"))
    if narrow:
        raise _NarrowDtypeError(out, ", ".join(narrow))
    native: np.dtype[Any] = out.newbyteorder("=")
    return native


_output_dtype_cached = functools.lru_cache(maxsize=256)(_output_dtype_of)


def check_kinds(
    field: str, kinds: Iterable[Kind], fill: Any, dtype: Any
) -> tuple[np.dtype[Any], int | float]:
    """The output dtype and fill of a field whose segments have these row kinds.

    Raises
    ------
    InvalidSegmentError
        Row shapes of different ranks; integer and float dtypes mixed.
    InvalidRequestError
        A ``dtype`` or ``fill`` that does not fit.
    """
    kinds = list(kinds)
    if len(kinds) == 1:
        stored = frozenset((kinds[0][0],))
        out_dtype = _output_dtype(field, stored, dtype)
        return out_dtype, _check_fill(fill, out_dtype)
    ranks = set(map(len, map(_SHAPE, kinds)))
    if len(ranks) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} have row shapes of different ranks {sorted(ranks)}",
            field="shape",
        )
    stored = frozenset(map(_DTYPE, kinds))
    if len(stored) > 1 and len({_KIND[d] == "f" for d in stored}) > 1:
        raise InvalidSegmentError(
            f"segments of field {field!r} mix integer and float dtypes", field="dtype"
        )
    out_dtype = _output_dtype(field, stored, dtype)
    return out_dtype, _check_fill(fill, out_dtype)
