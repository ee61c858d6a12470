"""The settings table of docs/operations.md is the one `Settings` makes (`settings_table`):
a setting added, renamed, given another default or described anew shows in the docs once
the table is written anew, and this test says how."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic.fields import FieldInfo

from payloadd.cli._serve import ENV_ONLY
from payloadd.settings._settings import Settings
from payloadd.settings._table import (
    END,
    REGENERATE,
    START,
    _default,
    env_only,
    main,
    settings_table,
    table_in,
    with_table,
)

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"


def test_the_docs_table_is_the_one_settings_makes() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert table_in(text), f"docs/operations.md has no {START} ... {END} lines"
    assert table_in(text) == settings_table(), (
        "the settings table of docs/operations.md is not the one Settings makes: "
        f"run `{REGENERATE}` (from the checkout) and look at the diff"
    )
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    assert START in section  # under its heading, where the links to #settings lead


def test_a_row_per_setting_with_its_flag_and_variable() -> None:
    rows = settings_table().splitlines()[2:]
    assert len(rows) == len(Settings.model_fields)
    for name, row in zip(Settings.model_fields, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")][:3]
        flag = "none" if name in ENV_ONLY else f"`--{name.replace('_', '-')}`"
        assert cells == [f"`{name}`", flag, f"`PAYLOADD_{name.upper()}`"], row


def test_the_settings_without_a_flag_are_those_serve_refuses() -> None:
    assert env_only() == ENV_ONLY == {"admin_token"}


def test_defaults_and_meanings_are_markdown() -> None:
    table = settings_table()
    assert (
        "| `max_file_bytes` | `--max-file-bytes` | `PAYLOADD_MAX_FILE_BYTES` | `1073741824` (1 GiB) |"
        in table
    )
    assert "| `socket_mode` | `--socket-mode` | `PAYLOADD_SOCKET_MODE` | `0660` |" in table
    assert "| `node` | `--node` | `PAYLOADD_NODE` | the host name |" in table  # not this host's
    assert "`<socket>.data`" in table  # not an HTML tag
    assert "Capped like `max_connections`." in table  # setting names as code


def test_a_default_decided_at_start_may_say_what_to_show() -> None:
    said = FieldInfo.from_field(None, json_schema_extra={"shown_default": "by the file system"})
    assert _default("foreign_wait_s", said) == "by the file system"
    assert _default("foreign_wait_s", FieldInfo.from_field(None)) == "none"


def test_with_table_writes_between_the_markers_only() -> None:
    doc = f"# T\n\nbefore\n{START}\nold\n{END}\nafter\n"
    assert with_table(doc) == f"# T\n\nbefore\n{START}\n{settings_table()}{END}\nafter\n"
    assert table_in(with_table(doc)) == settings_table()
    assert with_table(with_table(doc)) == with_table(doc)
    for bad in ("no markers\n", f"{END}\n{START}\n", f"{START}\n{START}\n{END}\n"):
        with pytest.raises(ValueError, match="settings-table"):
            with_table(bad)
        assert table_in(bad) == ""


def test_write_rewrites_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text(f"x\n{START}\n{END}\n")
    assert main(["--write", str(doc)]) == 0
    assert table_in(doc.read_text()) == settings_table()
    doc.write_text("x\n")
    assert main(["--write", str(doc)]) == 1
    assert "no <!-- settings-table:start --> line" in capsys.readouterr().err
    assert doc.read_text() == "x\n"  # left alone


def test_the_module_prints_the_table() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "payloadd.settings._table"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == settings_table()
