"""The user guide's examples, run as the guide says they were: every ``python`` block of
``docs/guide.md`` followed by a ``text`` block is run in order, in a new interpreter, against
real daemons (``--node node0`` on ``/tmp/docs2/s.sock`` as ``$PAYLOADD_SOCKET``, and the
guide's small one, ``--max-file-bytes 4096`` on ``/tmp/docs2/small.sock``; the folder is a
temporary one here), and what it prints must be the ``text`` block.

What differs from run to run is written alike on both sides first (`normalized`): a daemon's
instance id in file names, the temporary folder, uptimes, free space, times of day.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from payloadd.bench._daemon_process import start_daemon

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDE = DOCS / "guide.md"
FOLDER = "/tmp/docs2"  # the guide's folder, replaced by a temporary one

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
_VOLATILE = [
    (re.compile(r"-[0-9a-f]{8}-(\d{6})\.bin"), r"-<instance>-\1.bin"),
    (re.compile(r"uptime_s=[0-9.e+-]+"), "uptime_s=<s>"),
    (re.compile(r"free_bytes=\d+"), "free_bytes=<n>"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "<time>"),
]


@dataclass(frozen=True)
class Example:
    """A ``python`` block of a document and the ``text`` block it prints."""

    doc: str
    line: int
    code: str
    prints: str


def examples(doc: str) -> list[Example]:
    """Every ``python`` block of ``docs/<doc>`` followed (blank lines aside) by a ``text``
    block."""
    text = (DOCS / doc).read_text()
    blocks = list(_BLOCK.finditer(text))
    return [
        Example(doc, text.count("\n", 0, a.start()) + 1, a.group(2), b.group(2))
        for a, b in itertools.pairwise(blocks)
        if a.group(1) == "python" and b.group(1) == "text" and not text[a.end() : b.start()].strip()
    ]


def normalized(out: str) -> str:
    """``out`` with what differs from run to run written alike."""
    for pattern, alike in _VOLATILE:
        out = pattern.sub(alike, out)
    return out


EXAMPLES = examples("guide.md") + examples("http-api.md")  # in this order: http-api.md's
# examples go on from the guide's (its first append lands after the guide's files)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guide's two daemons, in a temporary folder standing for ``/tmp/docs2``."""
    tmp = tmp_path_factory.mktemp("docs2")
    with (
        start_daemon(tmp / "root", tmp / "s.sock", "--node", "node0"),
        start_daemon(
            tmp / "small-root", tmp / "small.sock", "--node", "node0", "--max-file-bytes", "4096"
        ),
    ):
        yield tmp


def test_the_guide_has_its_examples() -> None:
    assert len(EXAMPLES) >= 15  # a parser that finds nothing checks nothing
    assert all(e.code.strip() and e.prints.strip() for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{e.doc}:{e.line}")
def test_a_guide_example_prints_what_the_guide_says(folder: Path, example: Example) -> None:
    env = dict(os.environ, PAYLOADD_SOCKET=str(folder / "s.sock"))
    done = subprocess.run(
        [sys.executable, "-c", example.code.replace(FOLDER, str(folder))],
        env=env,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = (done.stdout + done.stderr).replace(str(folder), FOLDER)
    assert normalized(out) == normalized(example.prints), f"docs/{example.doc} line {example.line}"


def test_the_root_after_the_guide_is_as_index_md_shows(folder: Path) -> None:
    """docs/index.md lists the files the guide's examples leave, with their sizes."""
    text = (GUIDE.parent / "index.md").read_text()
    listing = next(b.group(2) for b in _BLOCK.finditer(text) if "node0/" in b.group(2))
    root = folder / "root"
    files = sorted(p for p in root.rglob("*.bin"))
    got = "".join(f"{p.relative_to(root)}  {p.stat().st_size} bytes\n" for p in files)
    assert normalized(got) == normalized(listing)


_NUMBER = re.compile(r"\d[\d,.]*")


def _counts(out: str) -> list[int]:
    """The demo's appends, leases and data-plane requests."""
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("daemon "))
    found = re.search(r"(\d+) appends \((\d+) leases\), (\d+) data-plane requests", line)
    assert found is not None, line
    return [int(n) for n in found.groups()]


def test_index_md_shows_what_the_demo_prints() -> None:
    """The demo's lines as docs/index.md shows them: the same lines, numbers aside (times and
    rates vary), and its appends, leases and data-plane requests near those of a run (they
    vary a little with the writers' timing)."""
    text = (GUIDE.parent / "index.md").read_text()
    shown = next(
        b.group(2) for b in _BLOCK.finditer(text) if b.group(2).startswith("payloadd demo")
    )
    run = subprocess.run(
        [sys.executable, "-m", "payloadd", "demo"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr

    def shape(out: str) -> list[str]:
        out = re.sub(r"/tmp/payloadd-demo-\w+", "/tmp/payloadd-demo-X", out)
        return [_NUMBER.sub("N", ln) for ln in out.splitlines()]

    assert shape(run.stdout) == shape(shown)
    for doc, now in zip(_counts(shown), _counts(run.stdout), strict=True):
        assert abs(doc - now) <= max(2, now // 5), (doc, now)
