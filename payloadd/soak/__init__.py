"""``payloadd soak``: the soak and race harness (`_run.Soak`), its workers (`_workers`), data
and checks (`_check`), daemon (`_daemon`), shared state (`_state`), verdict (`_verdict`) and
report (`_report`)."""

__all__: list[str] = []
