"""The ``payloadd`` command (`_main.main`): a table of commands, each in a module of its own
(`_serve`, `_demo`, `_bench`, `_soak`, `_gc`, `_stat`, `_inspect`, `_health`), and what they
share (`_common`: flag errors, one error-to-exit path, one table printer)."""

__all__: list[str] = []
