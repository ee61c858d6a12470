"""The daemon's fields table: which dtypes and row widths each field takes.

Shared by the daemon (it checks HTTP appends and reservations) and the client (it checks
data-plane appends, whose rows the daemon never sees, against the table it fetched once).
Every check is O(1) per item: no look at the row values.
"""

from __future__ import annotations

from ._errors import InvalidRequestError
from ._wire import AppendItem, FieldSpec, FieldsTable

__all__ = [
    "DEFAULT_FIELDS",
    "TYPO_EDITS",
    "FieldSpec",
    "FieldsTable",
    "check_field",
    "check_item",
    "near_miss",
]


DEFAULT_FIELDS: dict[str, FieldSpec] = {
    "routed_experts": FieldSpec(["uint8", "uint16"], 0, 0, "int32"),
    "sampling_mask": FieldSpec(["int32"], -1, 1 << 16, "int32"),
}
"""Router-replay ids (``uint8``, ``uint16`` past 256 experts) and sampling masks (``int32``,
``-1`` = no entry, at most 65536 wide)."""


def check_field(table: FieldsTable, field: str, where: str = "") -> FieldSpec | None:
    """The spec of ``field``, ``None`` for an unknown field the table allows.

    Raises
    ------
    InvalidRequestError
        ``field`` is unknown and the table refuses unknown fields.
    """
    spec = table.fields.get(field)
    if spec is None and table.unknown_fields == "refuse":
        raise InvalidRequestError(
            f"{where}unknown field {field!r}: this daemon takes only {sorted(table.fields)} "
            "(unknown_fields=refuse)"
        )
    if spec is None and (meant := near_miss(table, field)) is not None:
        raise InvalidRequestError(
            f"{where}unknown field {field!r}: did you mean {meant!r}? A name this close to a "
            "field of the table is refused as a typo (its rows would be read by nobody); "
            "add it to the fields table to use it"
        )
    return spec


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
