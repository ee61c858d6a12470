"""The daemon around the store: `_daemon.Daemon` (load, start, serve, shutdown), the HTTP
app (`_app`, routes only, with `_http_io`, `_access`, `_auth`, `_openapi`, `_http_protocol`),
the data plane (`_dataplane_server`, `_dataplane_requests`), one error-to-wire mapping
(`_errors`), one frame reader (`_frames`), sockets (`_sockets`, `_activation`), `_metrics`,
`_logs`, and the uvicorn run (`_serve`)."""

__all__: list[str] = []
