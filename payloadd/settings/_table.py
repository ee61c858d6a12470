"""The settings table of ``docs/operations.md``, made from `Settings`: one row a field, with
its flag of ``payloadd serve``, its ``PAYLOADD_*`` variable, its default and its description
(the ``description`` of the field, as ``payloadd serve --help`` prints it).

The docs hold the table between `START` and `END`; a test fails when it differs from
`settings_table`. To write it anew after a change of `Settings`::

    python -m payloadd.settings._table --write docs/operations.md

(without ``--write``, the table is printed). A default is shown as ``payloadd serve --help``
shows it, in Markdown; a field whose default is decided at start (``None`` standing for "by
the file system") may say what to show instead, ``json_schema_extra={"shown_default": "..."}``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from pydantic import SecretStr
from pydantic.fields import FieldInfo

from payload_client.protocol import format_size
from payloadd.settings._config_file import DEFAULT_CONFIG
from payloadd.settings._settings import FieldRule, Settings, default_node

__all__ = [
    "END",
    "REGENERATE",
    "START",
    "env_only",
    "main",
    "settings_table",
    "table_in",
    "with_table",
]

START = "<!-- settings-table:start -->"
"""The line before the table in the docs."""
END = "<!-- settings-table:end -->"
"""The line after it."""
_HEADER = (
    "| Setting | Flag | Environment variable | Default | Meaning |",
    "|---|---|---|---|---|",
)
_ANGLED = re.compile(r"(?<![`\w])([\w./-]*<[\w-]+>[\w./<>-]*)")
"""A word with a ``<placeholder>`` in it (``<socket>.data``): Markdown would take it for HTML."""
REGENERATE = "python -m payloadd.settings._table --write docs/operations.md"
"""How to write the table anew (named by the test that compares it)."""


def env_only() -> frozenset[str]:
    """The settings that have no flag: the secrets (`SecretStr` fields), since every user can
    read a process's command line; ``payloadd serve`` refuses them as flags."""
    return frozenset(
        name
        for name, info in Settings.model_fields.items()
        if SecretStr in (info.annotation, *get_args(info.annotation))
    )


def _fields_default(rules: dict[str, FieldRule]) -> str:
    """The default fields table in words: each field's dtypes, fill, widest row, raggedness."""
    parts = []
    for name, rule in rules.items():
        words = ["/".join(f"`{d}`" for d in rule.dtypes), f"fill {rule.fill}"]
        if rule.max_width:
            words.append(f"`max_width` {rule.max_width}")
        words.append("ragged" if rule.is_ragged else "every row dimension fixed")
        parts.append(f"`{name}`: " + ", ".join(words))
    return "; ".join(parts)


def _default(name: str, info: FieldInfo) -> str:
    """The default of the setting ``name`` as the table shows it (the values
    ``payloadd serve --help`` shows, in Markdown)."""
    extra = info.json_schema_extra
    shown = extra.get("shown_default") if isinstance(extra, dict) else None
    if isinstance(shown, str):
        return shown  # a default no value says (decided at start)
    if name == "config":
        return f"`{DEFAULT_CONFIG}` if it exists"
    if info.default_factory is default_node:
        return "the host name"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"  # as the flag and the config file take it
    if isinstance(value, dict):
        return _fields_default(value)
    if name.endswith("_bytes"):  # a `Size`
        return f"`{value}` ({format_size(value)})" if value else "`0`"
    if name == "socket_mode":
        return f"`{value:04o}`"
    return f"`{value}`"


def _meaning(description: str | None) -> str:
    """A field's description as a table cell: setting names and ``<placeholders>`` as code,
    ``|`` escaped."""
    text = (description or "").replace("|", "\\|")
    text = _ANGLED.sub(r"`\1`", text)
    names = "|".join(n for n in Settings.model_fields if "_" in n)  # not plain words: root
    return re.sub(rf"(?<![`\w])({names})(?![`\w])", r"`\1`", text)


def settings_table() -> str:
    """The settings table in Markdown: a row per field of `Settings`, in their order.

    Returns
    -------
    str
        The header, its rule and the rows, each line ending in a newline: setting, flag
        (``none`` for `env_only` settings), environment variable, default, meaning.
    """
    secret = env_only()
    rows = list(_HEADER)
    for name, info in Settings.model_fields.items():
        flag = "none" if name in secret else f"`--{name.replace('_', '-')}`"
        cells = [f"`{name}`", flag, f"`PAYLOADD_{name.upper()}`", _default(name, info)]
        rows.append("| " + " | ".join([*cells, _meaning(info.description)]) + " |")
    return "".join(f"{row}\n" for row in rows)


def _markers(lines: list[str]) -> tuple[int, int] | None:
    """The indices of the `START` line and of the `END` line after it in ``lines``; ``None``
    unless each is there once, `START` first."""
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == START]
    ends = [i for i, line in enumerate(lines) if line.rstrip("\n") == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        return None
    return starts[0], ends[0]


def with_table(text: str) -> str:
    """``text`` (a Markdown document) with what lies between its `START` and `END` lines
    replaced by `settings_table`.

    Raises
    ------
    ValueError
        ``text`` does not hold a `START` line, then an `END` line, each once.
    """
    lines = text.splitlines(keepends=True)
    found = _markers(lines)
    if found is None:
        raise ValueError(f"no {START} line, then one {END} line, each once, to write between")
    start, end = found
    return "".join([*lines[: start + 1], settings_table(), *lines[end:]])


def table_in(text: str) -> str:
    """What lies between the `START` and `END` lines of ``text`` (empty when they are not
    there, each once), to compare with `settings_table`."""
    lines = text.splitlines(keepends=True)
    found = _markers(lines)
    return "" if found is None else "".join(lines[found[0] + 1 : found[1]])


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m payloadd.settings._table [--write FILE]``: print the table, or write it
    between the markers of ``FILE``. Returns the exit status: 0, or 1 when ``FILE`` has no
    markers (the message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m payloadd.settings._table", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--write", metavar="FILE", help="write the table into FILE")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(settings_table())
        return 0
    path = Path(args.write)
    try:
        path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    except ValueError as exc:
        print(f"{parser.prog}: {path}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
