"""``payloadd bench`` and ``payloadd demo``: throughput and latency against raw I/O (`_bench`),
the RL batch inline versus by handle (`_rl`, `_rl_batch`), Ray's object store (`_ray`), the
rows against physical baselines (`_packed`: a packed micro batch by CP window; `_one_row`:
windows of one-row segments; `_seg_ops`: segment operations; `_appends`: new-key and 16 MiB
appends; `_http_ceiling`: a bare uvicorn app), what they share (`_measure`), the plot
(`_plot`), the demo (`_demo`), and a real daemon as a child process (`_daemon_process`)."""

__all__: list[str] = []
