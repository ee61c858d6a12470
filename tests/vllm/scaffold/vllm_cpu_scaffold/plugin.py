"""The vLLM general plugin: top-k/top-p through vLLM's PyTorch implementation on a CPU.

With the placeholder Triton backend vLLM believes Triton can run, and picks its Triton top-k/
top-p kernel, which Triton's interpreter cannot run. `register` rebinds ``apply_top_k_top_p``,
where Model Runner V2 and the V1 sampler look it up, to vLLM's own
``apply_top_k_top_p_pytorch`` (what vLLM's CPU build uses without Triton). Nothing happens on
a machine that is not vLLM's CPU platform, nor without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

__all__ = ["PATCHED_MODULES", "register"]

PATCHED_MODULES = (
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.v1.worker.gpu.sample.states",
    "vllm.v1.worker.gpu.sample.sampler",
)
"""The modules whose ``apply_top_k_top_p`` is rebound (each imported it by name)."""

_log = logging.getLogger("vllm.payloadd_cpu_scaffold")  # under vLLM's configured logger


def _top_k_top_p_pytorch(logits: Any, k: Any, p: Any) -> Any:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # type: ignore[import-not-found, unused-ignore]

    if k is None and p is None:
        return logits
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def register() -> None:
    """Rebind ``apply_top_k_top_p`` in `PATCHED_MODULES` (vLLM calls this in each process)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from vllm.platforms import current_platform  # type: ignore[import-not-found, unused-ignore]

    if not current_platform.is_cpu():
        return
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "apply_top_k_top_p", None) is None:
            raise RuntimeError(f"{name} has no apply_top_k_top_p: the scaffold needs a look")
        setattr(module, "apply_top_k_top_p", _top_k_top_p_pytorch)  # noqa: B010
    _log.info(
        "payloadd CPU scaffold: top-k/top-p through PyTorch in %s", ", ".join(PATCHED_MODULES)
    )
