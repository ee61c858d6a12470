"""The HTTP control plane: the app (`_app.create_app`), its routes, and what serves them over
HTTP (bodies, answers, the protocol's limits, the token guard, the access log)."""

__all__: list[str] = []
