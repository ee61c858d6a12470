"""The checks of a window read that depend on its field only, made once a list, and the row
shape of a window from the kinds of its segments (docs/contract.md, "Reading a window")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..segments._dtypes import check_kinds
from ..segments._segment import PayloadSegment
from ..wire._fields import check_patterns
from ._plan import FieldColumns, ListColumns, list_columns

__all__ = ["checked_field", "row_shape_of"]


def checked_field(
    segments: Sequence[PayloadSegment], field: str, fill: Any, dtype: Any, ragged: bool | None
) -> tuple[ListColumns, FieldColumns, np.dtype[Any], int | float] | None:
    """The list's and the field's columns, the output dtype and the fill of a read of
    ``field`` (`plan_window`'s checks, once a list for each fill and dtype); ``None`` when
    no segment has the field."""
    lc = list_columns(segments)
    fc = lc.field(field)
    if not fc.mine.size:
        return None
    try:  # the checks of the field's kinds, once a list for each fill and dtype
        key: Any = (ragged, type(fill), fill, type(dtype), dtype)
        checked = fc.checks.get(key)
    except TypeError:  # unhashable: checked every time
        key, checked = None, None
    if checked is None:
        if ragged is not None and len(fc.kinds) > 1:
            check_patterns(segments, field, [k[1] for k in fc.kinds], ragged)
        checked = check_kinds(field, fc.kinds, fill, dtype)
        if key is not None:
            fc.checks[key] = checked
    return lc, fc, *checked


def row_shape_of(
    lc: ListColumns, fc: FieldColumns, hit_kinds: Sequence[int]
) -> tuple[tuple[int, ...], bool]:
    """The row shape of a window whose segments have the kinds ``hit_kinds`` (of all the
    field's segments when none), and whether rows of several shapes meet it."""
    kinds = lc.kinds
    shapes = [kinds[k][1] for k in hit_kinds] or [k[1] for k in fc.kinds]
    row_shape = shapes[0] if len(shapes) == 1 else tuple(map(max, zip(*shapes, strict=True)))
    return row_shape, len(hit_kinds) > 1 and len(set(shapes)) > 1
