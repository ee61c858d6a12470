"""A placeholder ``cpu`` backend for Triton: enough to be discovered, never asked to compile.

vLLM's CPU build counts Triton as present only when Triton has a ``cpu`` backend; with
``TRITON_INTERPRET=1`` every ``@triton.jit`` kernel runs in Triton's interpreter (NumPy), so
neither the compiler nor the driver here is used beyond discovery.
"""

__all__: list[str] = []
