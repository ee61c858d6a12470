"""The placeholder backend's compiler: refuses to compile (the interpreter runs the kernels)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget  # type: ignore[import-not-found, unused-ignore]

__all__ = ["CPUPlaceholderBackend"]

_WHY = "the placeholder Triton cpu backend cannot compile: set TRITON_INTERPRET=1"


class CPUPlaceholderBackend(BaseBackend):  # type: ignore[misc, unused-ignore]
    """Triton's view of the CPU target; every compile step raises (see `_WHY`)."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return bool(target.backend == "cpu")

    def hash(self) -> str:
        return "payloadd-cpu-placeholder"

    def parse_options(self, options: dict[str, Any]) -> object:
        raise RuntimeError(_WHY)

    def add_stages(self, stages: dict[str, Any], options: object, language: Any) -> None:
        raise RuntimeError(_WHY)

    def load_dialects(self, context: Any) -> None:
        return None

    def get_module_map(self) -> dict[str, ModuleType]:
        return {}
