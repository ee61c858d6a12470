"""The placeholder backend's driver: active, the CPU its device, no launcher."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget  # type: ignore[import-not-found, unused-ignore]
from triton.backends.driver import DriverBase  # type: ignore[import-not-found, unused-ignore]

__all__ = ["CPUPlaceholderDriver"]


class CPUPlaceholderDriver(DriverBase):  # type: ignore[misc, unused-ignore]
    """Reports itself active (vLLM's CPU build and Triton skip a ``cpu`` driver unless asked)."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the placeholder Triton cpu backend has no launcher")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self) -> Any:
        import torch  # type: ignore[import-not-found, unused-ignore]

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_benchmarker(self) -> Any:
        raise RuntimeError("the placeholder Triton cpu backend does not benchmark")
