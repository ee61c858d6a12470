"""Test scaffolding for vLLM's Model Runner V2 on a CPU-only machine (no ``triton-cpu``).

Two entry points, nothing else: `vllm_cpu_scaffold.triton_cpu` (a placeholder ``cpu`` backend
for Triton, whose kernels then run in Triton's interpreter, ``TRITON_INTERPRET=1``) and
`vllm_cpu_scaffold.plugin.register` (a vLLM general plugin sending top-k/top-p to vLLM's own
PyTorch implementation, which the interpreter cannot stand in for). On a GPU none of it is needed.
"""

__all__: list[str] = []
