"""Checks against a real vLLM engine (``make check-vllm``): never collected by ``make test``.

The package is ``tests.vllm``: run it from the repository root so that ``import vllm`` finds
the installed vLLM, never this folder.
"""
