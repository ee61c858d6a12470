"""The framed protocols, beside HTTP: the data plane (``<socket>.data``, descriptors over a
Unix socket) and the peer port (reads by other nodes over TCP), one `Listener` and one frame
reader for both."""

__all__: list[str] = []
