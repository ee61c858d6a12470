"""The daemon around the store, by concern.

Shared by both sides: `_daemon.Daemon` (load, start, serve, shutdown), the run under uvicorn
(`_serve`), one error-to-wire mapping (`_errors`), `_metrics`, `_logs`, the admin tokens
(`_tokens`), sockets (`_sockets`, `_activation`).

- `http`: the FastAPI app (`_app`), its routes (`_routes`, `_answers`, `_openapi`), HTTP I/O
  (`_io`), the HTTP protocol's limits (`_protocol`), the token guard (`_auth`) and the
  access middleware (`_access`).
- `framed`: the framed protocols (frames read and written with the client's codec,
  `payload_client.protocol.FrameReader` and `encode_frame`): one listener
  (`_listener`), the data plane (`_dataplane_server`, `_dataplane_requests`) and the peer
  port (`_peer_server`).
"""

__all__: list[str] = []
