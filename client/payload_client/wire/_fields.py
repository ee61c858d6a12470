"""The daemon's fields table: which dtypes and row shapes each field takes.

Shared by the daemon (it checks HTTP appends and reservations) and the client (it checks
data-plane appends, whose rows the daemon never sees, and reads against the table it
fetched once). Every check is O(1) per item: no look at the row values.

A field's row shape is part of its contract (docs/contract.md, "Fields and row shapes"):
every dimension is fixed for a run by the field's first append in it, but the last one of
a ragged field (`is_ragged`), which may differ up to ``max_width``. `row_pattern` is what
must agree: the shape with a ragged last dimension written ``-1`` (``*`` in messages).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from .._errors import InvalidRequestError, InvalidSegmentError
from ..segments._segment import PayloadSegment
from ._http import AppendItem, FieldSpec, FieldsTable

__all__ = [
    "DECLARE",
    "DEFAULT_FIELDS",
    "TYPO_EDITS",
    "FieldSpec",
    "FieldsTable",
    "check_field",
    "check_item",
    "check_patterns",
    "check_read_field",
    "check_together",
    "is_ragged",
    "near_miss",
    "pattern_text",
    "row_pattern",
    "shape_mismatch",
]


DEFAULT_FIELDS: dict[str, FieldSpec] = {
    "routed_experts": FieldSpec(["uint8", "uint16"], 0, 0, "int32", ragged=False),
    "sampling_mask": FieldSpec(["int32"], -1, 1 << 16, "int32", ragged=True),
}
"""Router-replay ids (``uint8``, ``uint16`` past 256 experts; rows ``[layers, top_k]``, all
fixed) and sampling masks (``int32``, ``-1`` = no entry; rows of a ragged width, at most
65536)."""

DECLARE = (
    "declare it in the daemon's fields table (payloadd serve --fields JSON, "
    "PAYLOADD_FIELDS, or [fields] in the config file; the table given replaces the "
    "default one, so list every field), or start the daemon with --unknown-fields allow"
)
"""How a field that is in no table is declared (every refusal of one says it)."""


def _unknown(table: FieldsTable, field: str, where: str) -> InvalidRequestError:
    """The refusal of ``field``, a name in no table: the table's fields, the name meant
    when it is a near miss, and how to declare it."""
    meant = near_miss(table, field)
    hint = f"did you mean {meant!r}? " if meant is not None else ""
    return InvalidRequestError(
        f"{where}unknown field {field!r}: {hint}this daemon's fields are "
        f"{sorted(table.fields)}; to use another, {DECLARE}"
    )


def check_field(table: FieldsTable, field: str, where: str = "") -> FieldSpec | None:
    """The spec of ``field``, ``None`` for an unknown field the table allows.

    Raises
    ------
    InvalidRequestError
        ``field`` is unknown and the table refuses unknown fields, or it is a near miss
        of a table field (a typo, refused even where unknown fields are allowed).
    """
    spec = table.fields.get(field)
    if spec is None and table.unknown_fields == "refuse":
        raise _unknown(table, field, where)
    if spec is None and (meant := near_miss(table, field)) is not None:
        raise InvalidRequestError(
            f"{where}unknown field {field!r}: did you mean {meant!r}? A name this close to a "
            "field of the table is refused as a typo (its rows would be read by nobody); "
            "add it to the fields table to use it"
        )
    return spec


def check_read_field(table: FieldsTable, field: str, present: bool) -> FieldSpec | None:
    """The spec of ``field`` for a read; ``None`` for a field the table allows unknown.

    Parameters
    ----------
    table : FieldsTable
        The daemon's table.
    field : str
        The field read.
    present : bool
        Whether the segment list has a segment of ``field``.

    Raises
    ------
    InvalidRequestError
        ``field`` is in no table, and the table refuses unknown fields or the list has no
        segment of it (a name in no table and in no segment is a typo: it would read as
        ``None``, and the trainer would go on without the field).
    """
    spec = table.fields.get(field)
    if spec is None and (table.unknown_fields == "refuse" or not present):
        raise _unknown(table, field, "")
    return spec


def is_ragged(spec: FieldSpec | None) -> bool:
    """Whether the last row dimension of a field with this spec may differ from append to
    append; ``False`` for an unknown field (``None``): its every dimension is fixed."""
    if spec is None:
        return False
    return spec.ragged if spec.ragged is not None else spec.max_width > 0


_ALL_BUT_LAST = operator.itemgetter(slice(None, -1))


def row_pattern(shape: list[int] | tuple[int, ...], ragged: bool) -> tuple[int, ...]:
    """What a row shape must agree on within a run: the shape, its last dimension written
    ``-1`` when ``ragged``."""
    if ragged and shape:
        return (*shape[:-1], -1)
    return tuple(shape)


def shape_mismatch(
    where: str,
    run: str,
    field: str,
    have: tuple[int, ...],
    shape: Sequence[int],
    whose: str,
) -> InvalidRequestError:
    """The refusal of rows of ``shape`` where the pattern ``have`` is fixed for ``(run,
    field)`` (by ``whose``: the run's first append, an earlier item of the append)."""
    star = "; * is a ragged width" if -1 in have else ""
    return InvalidRequestError(
        f"{where}field {field!r} of run {run!r} has rows of shape {pattern_text(have)} "
        f"(fixed by {whose}{star}), got {list(shape)}: rows of another shape would read as "
        "garbage next to them. Reshape the rows, or write them to another run"
    )


def check_together(items: Sequence[AppendItem], table: FieldsTable) -> None:
    """Refuse an append whose items of one run and field disagree on their row shape.

    Raises
    ------
    InvalidRequestError
        Naming the item and both shapes.
    """
    seen: dict[tuple[str, str], tuple[int, ...]] = {}
    for i, it in enumerate(items):
        pattern = row_pattern(it.shape, is_ragged(table.fields.get(it.field)))
        have = seen.setdefault((it.run, it.field), pattern)
        if have != pattern:
            raise shape_mismatch(
                f"item {i}: ", it.run, it.field, have, it.shape, "an earlier item of this append"
            )


def pattern_text(pattern: tuple[int, ...] | list[int]) -> str:
    """A `row_pattern` for a message: ``[48, 8]``, ``[*]`` (a ragged width)."""
    return "[" + ", ".join("*" if d < 0 else str(d) for d in pattern) + "]"


_NEAR: dict[tuple[tuple[str, ...], str], str | None] = {}
"""Verdicts of `near_miss` (bounded): an unknown field appended to again is not compared
again."""


def near_miss(table: FieldsTable, field: str) -> str | None:
    """The field of ``table`` that ``field`` is most likely a typo of: within
    `TYPO_EDITS` edits (insertions, deletions, substitutions, swaps of neighbours) and not
    itself in the table; ``None`` when there is none."""
    key = (tuple(table.fields), field)
    if key in _NEAR:
        return _NEAR[key]
    found = None
    for name in table.fields:
        if (
            name != field
            and abs(len(name) - len(field)) <= TYPO_EDITS
            and (_edits(name, field) <= TYPO_EDITS)
        ):
            found = name
            break
    if len(_NEAR) >= 1024:
        _NEAR.clear()
    _NEAR[key] = found
    return found


TYPO_EDITS = 2
"""Edits within which an unknown field counts as a typo of a field of the table."""


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance of ``a`` and ``b`` (a swap of neighbours is one)."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def check_item(table: FieldsTable, item: AppendItem, index: int = 0) -> None:
    """Check an append item's field, dtype and row width against ``table``.

    Raises
    ------
    InvalidRequestError
        Naming the item, the field and what does not fit.
    """
    where = f"item {index}: "
    spec = check_field(table, item.field, where)
    if spec is None:
        return
    if item.dtype not in spec.dtypes:
        raise InvalidRequestError(
            f"{where}field {item.field!r} takes dtype {' or '.join(spec.dtypes)}, got "
            f"{item.dtype!r} (rows are never cast: cast them yourself once their values fit)"
        )
    if spec.max_width and item.shape and item.shape[-1] > spec.max_width:
        raise InvalidRequestError(
            f"{where}field {item.field!r} rows are at most {spec.max_width} wide, got "
            f"{item.shape[-1]} (rows are never cut)"
        )


def check_patterns(
    segments: Sequence[PayloadSegment],
    field: str,
    shapes: Sequence[Sequence[int]],
    ragged: bool,
) -> None:
    """Refuse a read over segments of ``field`` whose fixed row dimensions disagree.

    Parameters
    ----------
    segments : sequence of PayloadSegment
        The read's list (searched only when the check fails, for the two to name).
    shapes : sequence of sequence of int
        The distinct row shapes of the field's segments.
    ragged : bool
        Whether the field's last row dimension may differ.

    Raises
    ------
    InvalidSegmentError
        Naming two segments (index, file, positions, shape) that disagree.
    """
    patterns: set[tuple[int, ...] | tuple[int, tuple[int, ...]]]
    if ragged:  # rank and every dimension but the last (at C speed)
        patterns = set(zip(map(len, shapes), map(_ALL_BUT_LAST, shapes), strict=True))
    else:
        patterns = set(map(tuple, shapes))
    if len(patterns) <= 1:
        return
    first: tuple[int, PayloadSegment] | None = None
    for i, s in enumerate(segments):
        if s.field != field:
            continue
        if first is None:
            first = (i, s)
        elif row_pattern(tuple(s.shape), ragged) != row_pattern(tuple(first[1].shape), ragged):
            j, t = first
            rule = "every dimension but the last" if ragged else "every dimension"
            raise InvalidSegmentError(
                f"segments {j} and {i} of field {field!r} disagree on their row shape "
                f"({rule} is fixed for a field): segment {j} ({t.file}, positions "
                f"[{t.pos}, {t.pos + t.rows})) has rows {list(t.shape)}, segment {i} "
                f"({s.file}, positions [{s.pos}, {s.pos + s.rows})) has {list(s.shape)}; "
                "a list mixing them would read as garbage",
                field="shape",
            )
