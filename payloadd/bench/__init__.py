"""``payloadd bench`` and ``payloadd demo``: throughput and latency against raw I/O (`_bench`),
the RL batch inline versus by handle (`_rl`, `_rl_batch`), Ray's object store (`_ray`), the
demo (`_demo`), and a real daemon as a child process (`_daemon_process`)."""

__all__: list[str] = []
