"""What the project cites is in the repository: no file of the docs, the code, the tests or
deploy/ refers to a design document or an issue tracker that a user does not have, and every
reference to ``docs/contract.md`` names a heading (or anchor) that exists there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "docs" / "contract.md"

SCANNED = ("README.md", "docs", "payloadd", "client", "tests", "deploy")
"""What is checked: README.md, every text file under the others."""
SKIPPED_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
DATA = ROOT / "docs" / "benchmarks"
"""Generated data (benchmark results, plots): not prose, not checked."""

# Built from pieces so that this file does not match itself.
_DOC_NAME = "DES" + "IGN"
_FORBIDDEN = [
    (re.compile(rf"\b{_DOC_NAME}\b"), "a design document users do not have"),
    (re.compile(r"\b[Ii]ssues? #?\d+"), "an issue number"),
    (re.compile(r"§\s*\d"), "a section of a design document users do not have"),
]
_QUOTED = re.compile(r'contract\.md,\s+\\?"([^"\\]+)\\?"')
"""The contract's file name, a comma and a heading in double quotes (in Python sources the
quotes may be escaped)."""
_ANCHOR = re.compile(r"contract\.md#([\w-]+)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*$")
_FENCE = re.compile(r"^(```|~~~)")


def scanned_files() -> list[Path]:
    """Every text file checked (UTF-8; binary files are left out)."""
    out = []
    for name in SCANNED:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            if SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                continue
            if DATA in path.parents or path.suffix in {".pyc", ".png", ".so"}:
                continue
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            out.append(path)
    return out


FILES = scanned_files()


def headings() -> list[str]:
    """The headings of docs/contract.md, outside code blocks, as written."""
    found, fenced = [], False
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            found.append(match.group(1))
    return found


def slug(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_the_scan_covers_the_tree() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    for expected in (
        "README.md",
        "docs/index.md",
        "docs/contract.md",
        "client/payload_client/reads/_windows.py",
        "payloadd/store/_store.py",
        "deploy/README.md",
    ):
        assert expected in names, expected


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_reference_to_what_users_do_not_have(path: Path) -> None:
    if path == Path(__file__).resolve():
        return
    bad = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for pattern, what in _FORBIDDEN:
            for match in pattern.finditer(line):
                bad.append(f"line {number}: {match.group(0)!r} cites {what}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_contract_headings_are_distinct() -> None:
    found = headings()
    assert len(found) >= 10, found
    assert len({slug(h) for h in found}) == len(found), found


def test_every_reference_to_the_contract_names_a_heading_of_it() -> None:
    found = headings()
    slugs = {slug(h) for h in found}
    refs, bad = 0, []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT).as_posix()
        for match in _QUOTED.finditer(text):
            refs += 1
            if match.group(1) not in found:
                bad.append(f'{where}: "{match.group(1)}" is no heading of docs/contract.md')
        for match in _ANCHOR.finditer(text):
            refs += 1
            if match.group(1) not in slugs:
                bad.append(f"{where}: #{match.group(1)} is no anchor of docs/contract.md")
    assert not bad, "\n".join(bad)
    assert refs >= 20, f"only {refs} references to docs/contract.md found"


def test_the_contract_is_linked_from_the_map_and_the_readme() -> None:
    assert "(contract.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert "docs/contract.md" in (ROOT / "README.md").read_text(encoding="utf-8")
