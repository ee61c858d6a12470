"""Rows of an append, checked and put in their wire form (little-endian, C order) before
anything is sent; and names (runs, fields) checked once each."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import InvalidRequestError
from ..segments._segment import SUPPORTED_DTYPES, check_name
from ._fields import DEFAULT_FIELDS

__all__ = ["name_once", "rows_checked", "rows_for_wire"]

_DTYPE_NAMES = {np.dtype(name).newbyteorder("<"): name for name in SUPPORTED_DTYPES}


_WIRE: dict[np.dtype[Any], tuple[np.dtype[Any], str]] = {
    np.dtype(name): (np.dtype(name) if np.dtype(name) == little else little, name)
    for little, name in _DTYPE_NAMES.items()
}
"""Dtype of some rows -> (their dtype on the wire, its name): the supported dtypes in native
byte order to start with (`rows_for_wire` adds the others it meets)."""
_NAMES: set[str] = set()
"""Names (fields, runs) found valid: the pattern is not matched again (bounded)."""


def name_once(value: Any, what: str) -> str:
    """`check_name`, once per name."""
    if type(value) is str and value in _NAMES:
        return value
    check_name(value, what)
    if type(value) is str:
        if len(_NAMES) >= 4096:
            _NAMES.clear()
        _NAMES.add(value)
    return str(value)


def rows_for_wire(rows: Any, field: str = "") -> tuple[np.ndarray, str]:
    """``rows``, little-endian and C-contiguous, and their dtype's name; a copy only when
    they are not already so."""
    if type(rows) is np.ndarray:  # the common case, checked once, fast
        wire = _WIRE.get(rows.dtype)
        if wire is not None and rows.ndim >= 2 and 0 not in rows.shape[1:]:
            if wire[0] is rows.dtype and rows.flags.c_contiguous:
                return rows, wire[1]
            return np.ascontiguousarray(rows, dtype=wire[0]), wire[1]
    arr = rows_checked(rows, field)
    name = _DTYPE_NAMES[arr.dtype]
    _WIRE.setdefault(rows.dtype, (arr.dtype, name))
    return arr, name


def rows_checked(rows: Any, field: str = "") -> np.ndarray:
    if not isinstance(rows, np.ndarray):
        raise InvalidRequestError(f"rows must be a numpy.ndarray, got {type(rows).__name__}")
    if isinstance(rows, np.ma.MaskedArray):  # its mask would be dropped, its masked values kept
        raise InvalidRequestError("rows must not be a masked array: fill it first (rows.filled(v))")
    if rows.ndim < 2:
        raise InvalidRequestError(
            f"rows must have shape [n, *row_shape] with a non-empty row shape, got {rows.shape}"
        )
    little = rows.dtype.newbyteorder("<")
    if little not in _DTYPE_NAMES:
        spec = DEFAULT_FIELDS.get(field)
        takes = (
            f"field {field!r} takes dtype {' or '.join(spec.dtypes)}"
            if spec is not None
            else f"rows dtype must be one of {sorted(SUPPORTED_DTYPES)}"
        )
        raise InvalidRequestError(
            f"{takes}, got {rows.dtype}: rows are never cast; cast them yourself once their "
            "values fit (e.g. rows.astype(np.uint8) for expert ids below 256, np.uint16 "
            "above; np.int32 for token ids)"
        )
    if any(d == 0 for d in rows.shape[1:]):
        raise InvalidRequestError(f"rows row shape entries must be > 0, got {rows.shape[1:]}")
    return np.ascontiguousarray(rows, dtype=little)
