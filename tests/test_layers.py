"""The house's layers: which package may import which, no import circle, small modules.

Read from the source (every ``import``, at module level, in functions and under
``TYPE_CHECKING`` alike), not from what happens to be imported at run time.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"payloadd": ROOT / "payloadd", "payload_client": ROOT / "client" / "payload_client"}
MAX_LINES = 600

# package -> the packages of the project it must not import (its layer is below theirs)
_CLIENT_LAYERS = ("segments", "wire", "reads", "transports", "clients", "vllm")
FORBIDDEN = {
    "payload_client": ("payloadd",),
    # the client's packages, each below the ones after it (and below protocol, its surface)
    **{
        f"payload_client.{below}": tuple(
            f"payload_client.{above}" for above in (*_CLIENT_LAYERS[i + 1 :], "protocol")
        )
        for i, below in enumerate(_CLIENT_LAYERS[:-1])
    },
    "payloadd.settings": ("payloadd.store", "payloadd.server", "payloadd.cli"),
    "payloadd.store": ("payloadd.server", "payloadd.cli", "payloadd.bench", "payloadd.soak"),
    "payloadd.server": ("payloadd.cli", "payloadd.bench", "payloadd.soak"),
    "payloadd.bench": ("payloadd.server", "payloadd.store", "payloadd.cli", "payloadd.soak"),
    "payloadd.soak": ("payloadd.server", "payloadd.store", "payloadd.cli"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for top, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((top, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _package(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module of the project, line) for every import statement of ``module``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(module, path).split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            # ``from pkg import mod`` needs ``pkg.mod``; ``from pkg import name``, ``pkg`` itself
            names = [
                f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
                for a in node.names
            ]
        else:
            continue
        seen = set()
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and name not in seen:
                seen.add(name)
                yield name, node.lineno


GRAPH = {m: {dep for dep, _ in _imports(m, p)} for m, p in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_package_imports_a_layer_above_it() -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {module} imports {dep}"
        for module, path in MODULES.items()
        for package, above in FORBIDDEN.items()
        if _within(module, package)
        for dep, line in _imports(module, path)
        if any(_within(dep, a) for a in above)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_daemon_imports_only_the_client_s_public_names() -> None:
    private = [
        f"{path.relative_to(ROOT)}:{line}: {dep}"
        for module, path in MODULES.items()
        if _within(module, "payloadd")
        for dep, line in _imports(module, path)
        if _within(dep, "payload_client")
        and dep not in ("payload_client", "payload_client.protocol")
    ]
    assert not private, "\n".join(private)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    # a package's __init__ re-exporting its modules is not a circle with them
    assert _cycles() == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_small(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)}: {lines} lines"


def test_the_layer_check_sees_a_circle() -> None:
    """The check itself can fail: a made-up circle is found."""
    GRAPH["payloadd.store._fake_a"] = {"payloadd.store._fake_b"}
    GRAPH["payloadd.store._fake_b"] = {"payloadd.store._fake_a"}
    try:
        assert ["payloadd.store._fake_a", "payloadd.store._fake_b"] in _cycles()
    finally:
        del GRAPH["payloadd.store._fake_a"], GRAPH["payloadd.store._fake_b"]


def test_the_client_is_in_packages_by_concern() -> None:
    """Every client module but the error tree, size formatting and the public surfaces sits in
    a package of its concern."""
    top = sorted(
        m.removeprefix("payload_client.")
        for m, path in MODULES.items()
        if m.count(".") == 1 and m.startswith("payload_client.") and path.name != "__init__.py"
    )
    assert top == ["_errors", "_sizes", "protocol"]


def test_segments_reads_and_the_wire_load_without_httpx() -> None:
    """An orchestrator imports segments, their operations, the codec and the planner without
    the HTTP stack: httpx is refused at import, and only the clients need it."""
    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "import payload_client.segments, payload_client.reads, payload_client.wire\n"
        "from payload_client import (SegmentList, clip_segments, decode_segments, plan_window,\n"
        "    merge_pd_responses, PayloadError)\n"
        "try:\n"
        "    from payload_client import PayloadClient\n"
        "except ImportError:\n"
        "    print('clients need httpx')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "client")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "clients need httpx\n"
