"""Sizes in the settings: bytes, or a number with a unit, from a flag, a ``PAYLOADD_*``
variable or the config file (a TOML integer or string) alike.

``4096``, ``64KiB``, ``512 MiB``, ``1gib``, ``1.5GB``. The grammar and the units are
pydantic's `ByteSize`: ``B``; ``KB`` ``MB`` ``GB`` ``TB`` ``PB`` ``EB`` (and ``K`` ``M`` ``G``
... alike), powers of 1000; ``KiB`` ``MiB`` ``GiB`` ``TiB`` ``PiB`` ``EiB``, powers of 1024;
any case, a space allowed before the unit. `ByteSize` itself is not used as the type: it
truncates a fraction of a byte (``1.5B`` is 1), computes in floating point (``1.005KB`` is
1004) and takes trailing text (``1GiB/s`` is 1 GiB). `parse_size` matches the whole value
against its pattern and computes exactly, refusing a fraction of a byte; it refuses
`ByteSize`'s bit units (``8Gbit``) too: a size setting counts bytes.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated

from pydantic import BeforeValidator, ByteSize, Field
from pydantic_core import PydanticCustomError

from payload_client.protocol import INT64_MAX

__all__ = ["SIZE_FORMS", "Size", "parse_size"]

SIZE_FORMS = "give bytes (1073741824) or a number with a unit (512MiB, 1GiB, 1.5GB)"
"""What a size setting takes, as its error messages say it."""
_UNITS = (
    "units: B; KB, MB, GB, TB, PB, EB (powers of 1000); KiB, MiB, GiB, TiB, PiB, EiB "
    "(powers of 1024); any case"
)


def _refuse(kind: str, message: str, value: object) -> PydanticCustomError:
    # the value goes in as context: braces in it are never read as a template's
    return PydanticCustomError(kind, "{given} " + message, {"given": repr(value)})


def parse_size(value: object) -> object:
    """A size setting's value as bytes (an ``int``); other values are left to ``int``'s
    own validation (and its bounds).

    Parameters
    ----------
    value : object
        An ``int`` (bytes), a ``float`` holding a whole number of bytes (TOML ``1e9``), or a
        string: bytes or a number with a unit (see the module's notes).

    Returns
    -------
    object
        The bytes, exact (``1.5GiB`` is 1610612736).

    Raises
    ------
    PydanticCustomError
        ``value`` is a boolean, a string that is not a size (an unknown unit, a sign, text
        after the unit), or a fraction of a byte (``1.5B``, ``0.3KiB``). The message
        quotes the value and says what is taken; pydantic names the setting.
    """
    if isinstance(value, bool):
        raise _refuse("byte_size", f"is not a size: {SIZE_FORMS}", value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise _refuse("byte_size_fraction", "is not a whole number of bytes", value)
    if not isinstance(value, str):
        return value
    match = ByteSize.byte_string_re.fullmatch(value.strip())
    if match is None or not (match[2] or "b").isalpha():  # 1e9, 1_000: no unit
        raise _refuse("byte_size", f"is not a size: {SIZE_FORMS}", value)
    scalar, unit = match[1], match[2] or "b"
    mult = ByteSize.byte_sizes.get(unit.lower())
    if mult is None or unit.lower().endswith("bit"):
        raise _refuse(
            "byte_size_unit", f"is not a size: unknown unit {unit!r}: {SIZE_FORMS}; {_UNITS}", value
        )
    exact = Decimal(scalar) * Decimal(mult)
    if exact != exact.to_integral_value():
        raise _refuse(
            "byte_size_fraction",
            f"is not a whole number of bytes ({exact.normalize():f} bytes): give whole bytes "
            "(1536), or a number that makes whole bytes in its unit (1.5KiB)",
            value,
        )
    return int(exact)


Size = Annotated[int, BeforeValidator(parse_size), Field(le=INT64_MAX)]
"""The type of every size setting (``*_bytes``): bytes, or a number with a unit; at most
`INT64_MAX` (what the wire carries). A field adds its lower bound (``gt=0``, ``ge=0``)."""
