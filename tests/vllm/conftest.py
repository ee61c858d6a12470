"""Fixtures of the checks on a real vLLM engine (``make check-vllm``, the ``.venv-vllm``
environment). Where vLLM is not installed (``make test``'s ``.venv``) nothing here is collected.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent


def _vllm_installed() -> bool:
    """vLLM importable, and not this folder standing in for it."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None and HERE not in Path(spec.origin).parents


if not _vllm_installed():
    collect_ignore_glob = ["*"]
else:
    from tests.vllm.engine import ServerURL, api_server, apply_env, offline_engine
    from tests.vllm.tiny_model import make_tiny_model

    apply_env()  # before any test module imports vLLM (Triton reads it when kernels are defined)

    def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
        """vLLM, torch and transformers warn (deprecations) on import: shown, not errors, here."""
        for item in items:
            if HERE in item.path.parents:
                item.add_marker(pytest.mark.filterwarnings("default"))

    @pytest.fixture(scope="session")
    def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The tiny Qwen3-MoE model and tokenizer (`tests.vllm.tiny_model`), written once."""
        return make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-qwen3-moe")

    @pytest.fixture(scope="session")
    def offline_llm(tiny_model_dir: Path) -> Iterator[Any]:
        """One in-process ``vllm.LLM`` for the session (`tests.vllm.engine.offline_engine`)."""
        llm = offline_engine(tiny_model_dir)
        yield llm
        llm.llm_engine.engine_core.shutdown()

    @pytest.fixture(scope="session")
    def openai_server(tiny_model_dir: Path) -> Iterator[ServerURL]:
        """vLLM's OpenAI-compatible server with ``--enable-scale-out`` on 127.0.0.1, its
        base URL (`tests.vllm.engine.api_server`)."""
        from tests.conftest import free_port

        with api_server(tiny_model_dir, free_port(), ["--enable-scale-out"]) as url:
            yield url
