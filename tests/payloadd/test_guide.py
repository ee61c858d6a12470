"""The user guide's examples, run as the guide says they were, against real daemons
(``--node node0`` on ``/tmp/docs2/s.sock`` as ``$PAYLOADD_SOCKET``, and the guide's small one,
``--max-file-bytes 4096`` on ``/tmp/docs2/small.sock``; the folder is a temporary one here).

Every ``python`` block of ``docs/guide.md`` and ``docs/http-api.md`` runs, in order, each in a
new interpreter: on its own, or, when its first line says ``# continues the example above``,
after the block before it, in the same interpreter (a block with no ``python`` block before
it cannot say so). What it prints must be the ``text`` block right after it, or nothing when
none follows. So a block that neither runs on its own nor says that it continues the one
before fails. http-api.md's curl examples (the ``sh`` blocks of its "Examples" section) run
in bash in the same order, and its descriptions of ``/healthz`` and ``/v1/stats`` name the
keys a daemon answers.

What differs from run to run is written alike on both sides first (`normalized`): a daemon's
instance id in file names, the temporary folder, uptimes, free space, times of day, and the
data-plane requests a client's timing adds (notes of the runs in use).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemons, default_env

DOCS = Path(__file__).resolve().parents[2] / "docs"
GUIDE = DOCS / "guide.md"
FOLDER = "/tmp/docs2"  # the guide's folder, replaced by a temporary one
CONTINUES = "# continues the example above"
"""The first line of a ``python`` block that goes on from the block before it."""
RUN_SH = {"http-api.md": "Examples"}
"""The sections whose ``sh`` blocks (followed by a ``text`` block) run, by document."""

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
_HEADING = re.compile(r"^## (.+)$", re.M)
_VOLATILE = [
    (re.compile(r"-[0-9a-f]{8}-(\d{6})\.bin"), r"-<instance>-\1.bin"),
    (re.compile(r"uptime_s=[0-9.e+-]+"), "uptime_s=<s>"),
    (re.compile(r"free_bytes=\d+"), "free_bytes=<n>"),
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), "<time>"),
    (re.compile(r'"uptime_s":[0-9.e+-]+'), '"uptime_s":<s>'),
    (re.compile(r'"free_bytes":\d+'), '"free_bytes":<n>'),
    (re.compile(r'"data_plane_requests":\d+'), '"data_plane_requests":<n>'),
]


@dataclass(frozen=True)
class Block:
    """A fenced block of a document, and the ``text`` block right after it (``None``: none)."""

    doc: str
    line: int
    lang: str
    code: str
    prints: str | None
    section: str


@dataclass(frozen=True)
class Example:
    """What runs in one interpreter (or one bash): a block, and the blocks that continue it."""

    doc: str
    line: int
    lang: str
    code: str
    prints: str


def blocks(doc: str, text: str) -> list[Block]:
    """Every fenced block of ``text`` (the document ``doc``), in order."""
    found = list(_BLOCK.finditer(text))
    headings = [(h.start(), h.group(1)) for h in _HEADING.finditer(text)]
    out = []
    for a, b in itertools.zip_longest(found, found[1:]):
        follows = b is not None and b.group(1) == "text" and not text[a.end() : b.start()].strip()
        section = next((name for at, name in reversed(headings) if at < a.start()), "")
        line = text.count("\n", 0, a.start()) + 1
        prints = b.group(2) if follows else None
        out.append(Block(doc, line, a.group(1), a.group(2), prints, section))
    return out


def examples(doc: str, text: str | None = None) -> tuple[list[Example], list[str]]:
    """The examples of ``docs/<doc>`` (or of ``text``), in order, and what breaks the rule of
    this module's docstring (a block that says it continues nothing)."""
    text = (DOCS / doc).read_text() if text is None else text
    out: list[Example] = []
    wrong: list[str] = []
    last_python: int | None = None  # index in out of the example the last python block is in
    for b in blocks(doc, text):
        if b.lang == "python":
            if b.code.startswith(CONTINUES):
                if last_python is None:
                    wrong.append(f"docs/{doc} line {b.line}: continues no python block")
                    continue
                e = out[last_python]
                out[last_python] = Example(
                    e.doc, e.line, e.lang, e.code + b.code, e.prints + (b.prints or "")
                )
            else:
                last_python = len(out)
                out.append(Example(doc, b.line, "python", b.code, b.prints or ""))
        elif b.lang == "sh" and b.prints is not None and RUN_SH.get(doc) == b.section:
            out.append(Example(doc, b.line, "sh", b.code, b.prints))
    return out, wrong


def normalized(out: str) -> str:
    """``out`` with what differs from run to run written alike."""
    for pattern, alike in _VOLATILE:
        out = pattern.sub(alike, out)
    return out


GUIDE_EXAMPLES, GUIDE_WRONG = examples("guide.md")
API_EXAMPLES, API_WRONG = examples("http-api.md")
EXAMPLES = GUIDE_EXAMPLES + API_EXAMPLES  # in this order: http-api.md's examples go on from
# the guide's (its first append lands after the guide's files)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The guide's two daemons, in a temporary folder standing for ``/tmp/docs2``, started as
    the guide says: with the default fields table (not the tests' own)."""
    env = default_env()
    with Daemons(tmp_path_factory.mktemp("docs2")) as d:
        d.start("--node", "node0", env=env)
        small = ("--node", "node0", "--max-file-bytes", "4096")
        d.start(*small, root=d.folder / "small-root", socket=d.folder / "small.sock", env=env)
        yield d.folder


def test_the_guide_has_its_examples() -> None:
    assert len(EXAMPLES) >= 15  # a parser that finds nothing checks nothing
    assert all(e.code.strip() for e in EXAMPLES)
    assert [e.lang for e in API_EXAMPLES].count("sh") >= 1  # the curl examples run too
    assert GUIDE_WRONG == [] and API_WRONG == []


def test_every_python_block_runs_on_its_own_or_continues_the_one_before() -> None:
    doc = (
        "```python\nx = 1\n```\n\n"  # line 1: prints nothing
        f"```python\n{CONTINUES}: x as there\nprint(x + 1)\n```\n\n```text\n2\n```\n"
        "```sh\necho not run\n```\n\n```text\nnot run\n```\n"  # not in a RUN_SH section
        "```python\nprint(x)\n```\n```text\n1\n```\n"  # line 20: on its own (fails)
    )
    found, wrong = examples("x.md", doc)
    assert wrong == []
    assert [(e.line, e.code, e.prints) for e in found] == [
        (1, f"x = 1\n{CONTINUES}: x as there\nprint(x + 1)\n", "2\n"),
        (20, "print(x)\n", "1\n"),
    ]
    # a block that says it continues, with no python block before it (a text block is none)
    _, wrong = examples("x.md", f"```text\n1\n```\n```python\n{CONTINUES}\nprint(x)\n```\n")
    assert wrong == ["docs/x.md line 4: continues no python block"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"{e.doc}:{e.line}")
def test_a_guide_example_prints_what_the_guide_says(folder: Path, example: Example) -> None:
    env = dict(os.environ, PAYLOADD_SOCKET=str(folder / "s.sock"))
    code = example.code.replace(FOLDER, str(folder))
    if example.lang == "sh":
        if shutil.which("curl") is None or shutil.which("xxd") is None:
            pytest.skip("the curl examples need curl and xxd")
        cmd = ["bash", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    done = subprocess.run(cmd, env=env, cwd=folder, capture_output=True, text=True, timeout=120)
    out = (done.stdout + done.stderr).replace(str(folder), FOLDER)
    assert normalized(out) == normalized(example.prints), f"docs/{example.doc} line {example.line}"


def _answer(folder: Path, path: str) -> dict[str, object]:
    transport = httpx.HTTPTransport(uds=str(folder / "s.sock"))
    with httpx.Client(transport=transport, base_url="http://payloadd") as http:
        answer: dict[str, object] = http.get(path).raise_for_status().json()
        return answer


def _section(name: str) -> str:
    text = (DOCS / "http-api.md").read_text()
    return text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]


def test_http_api_names_the_keys_of_healthz_and_stats(folder: Path) -> None:
    """The answer http-api.md shows for ``GET /healthz``, and its table of ``Stats``, have the
    keys a daemon answers, in its order."""
    shown = _section("GET /healthz").split("`Health`: `", 1)[1].split("`", 1)[0]
    assert re.findall(r'"(\w+)":', shown) == list(_answer(folder, "/healthz"))
    table = re.findall(r"^\| `(\w+)` \|", _section("GET /v1/stats"), re.M)
    assert table == list(_answer(folder, "/v1/stats"))
    # the curl example's answers too (their values are checked where it runs)
    curl = next(e for e in API_EXAMPLES if e.lang == "sh" and "/healthz" in e.code)
    lines = curl.prints.splitlines()
    answers = [json.loads(ln) for ln in lines if ln.startswith('{"') and ln.endswith("}")]
    keys = {tuple(a) for a in answers}
    assert tuple(_answer(folder, "/healthz")) in keys and tuple(table) in keys


def test_the_root_after_the_guide_is_as_index_md_shows(folder: Path) -> None:
    """docs/index.md lists the files the guide's examples leave, with their sizes, and names
    every file of the daemon's own beside the runs (``node0/@...``)."""
    text = (GUIDE.parent / "index.md").read_text()
    at = next(b for b in _BLOCK.finditer(text) if "node0/" in b.group(2))
    listing = at.group(2)
    root = folder / "root"
    files = sorted(p for p in root.rglob("*.bin"))
    got = "".join(f"{p.relative_to(root)}  {p.stat().st_size} bytes\n" for p in files)
    assert normalized(got) == normalized(listing)
    prose = text[: at.start()].rstrip().rsplit("\n\n", 1)[1]  # the paragraph before the list
    named = set(re.findall(r"`node0/(@[^`]+)`", prose))
    assert named == {p.name for p in (root / "node0").iterdir() if p.name.startswith("@")}


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
