"""The daemon's fields table: which dtypes and row widths each field takes.

Shared by the daemon (it checks HTTP appends and reservations) and the client (it checks
data-plane appends, whose rows the daemon never sees, against the table it fetched once).
Every check is O(1) per item: no look at the row values.
"""

from __future__ import annotations

from ._errors import InvalidRequestError
from ._wire import AppendItem, FieldSpec, FieldsTable

__all__ = ["DEFAULT_FIELDS", "FieldSpec", "FieldsTable", "check_field", "check_item"]


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
    return spec


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
