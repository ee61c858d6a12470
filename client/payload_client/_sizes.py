"""How sizes are written for people: one function, `format_size`, for every message and
table that shows a number of bytes (``payloadd stat``, the daemon's disk-limit refusals).

Binary units, one decimal at most, none when it is ``.0``: ``512 B``, ``64 KiB``,
``1.5 GiB``. Where the exact count matters (a limit a person compares with the value they
set) the bytes follow in parentheses: ``1 GiB (1073741824 bytes)``.
"""

from __future__ import annotations

__all__ = ["SIZE_UNITS", "format_size"]

SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
"""The units `format_size` writes, each 1024 times the one before."""


def format_size(n: float, *, exact: bool = False) -> str:
    """``n`` bytes for a person: ``0 B``, ``512 B``, ``64 KiB``, ``1.5 GiB``, ``-2 MiB``.

    Parameters
    ----------
    n : int or float
        Bytes; a float for a rate (bytes a second) or a mean, negative for a decrease.
    exact : bool
        Also give the exact count of an integer ``n`` of 1 KiB or more:
        ``1 GiB (1073741824 bytes)``. Below 1 KiB the text is exact already.

    Returns
    -------
    str
        The largest unit in which ``n`` is at least 1, with one decimal (rounded; dropped
        when it is 0); whole bytes below 1 KiB.
    """
    value, unit = float(abs(n)), 0
    while unit < len(SIZE_UNITS) - 1 and round(value, 1 if unit else 0) >= 1024:
        value /= 1024  # by what is shown: 1023.96 KiB is 1 MiB, not 1024 KiB
        unit += 1
    text = f"{value:.1f}".removesuffix(".0") if unit else f"{value:.0f}"
    sign = "-" if n < 0 and text != "0" else ""
    out = f"{sign}{text} {SIZE_UNITS[unit]}"
    if exact and unit > 0 and isinstance(n, int):
        out += f" ({n} bytes)"
    return out
