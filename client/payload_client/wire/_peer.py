"""Wire types of the peer port: row bytes between nodes without HTTP.

A daemon with ``peer_port`` set serves reads of its files to other nodes on a TCP port of its
own (docs/contract.md, "Reads across nodes"), and names it in a `PEER_PORT_HEADER` on every HTTP answer (and in
`Health.peer_port`); `payload_client.ClusterClient` and any `PayloadClient` with a
``base_url`` and a token read over it once an answer named it, and over HTTP otherwise. Frames are the data plane's: ``u32 little-endian N | N bytes of msgpack``.
Nothing of descriptor passing crosses it::

    client                                  daemon
    PeerHello(token)                  ->                   first frame, at most HELLO_BYTES,
                                      <-    PeerWelcome    within request_timeout_s; a wrong
                                                           token: ErrorReply, then closed
    PeerRead(extents)                 ->                   as POST /v1/read's body
                                      <-    PeerBytes(n)   then n raw bytes: the extents'
                                                           bytes in order (os.sendfile)
                                      <-    ErrorReply     or the read's error, before any
                                                           byte; the connection stays open

A read that fails after its `PeerBytes` (a file shrank under it) has its connection closed:
the client sees a short answer and asks again, and that read answers the error.
"""

from __future__ import annotations

import msgspec

from ._dataplane import ErrorReply
from ._http import Extent

__all__ = [
    "HELLO_BYTES",
    "PEER_PORT_HEADER",
    "PEER_VERSION",
    "PeerBytes",
    "PeerHello",
    "PeerRead",
    "PeerReply",
    "PeerRequest",
    "PeerWelcome",
]

PEER_VERSION = 1
"""Version of the peer protocol a `PeerHello` speaks."""
HELLO_BYTES = 4096
"""Largest frame a daemon takes before the token is checked (the hello)."""
PEER_PORT_HEADER = b"payloadd-peer-port"
"""HTTP answer header naming the daemon's peer port (absent: none)."""


class PeerHello(msgspec.Struct, tag="hello", array_like=True):
    """The first frame of a peer connection: the daemon's admin token, compared in constant
    time before anything of the root is touched."""

    token: str
    version: int = PEER_VERSION


class PeerWelcome(msgspec.Struct, tag="welcome", array_like=True):
    """The token was right: the daemon's node and the limits of one `PeerRead`.

    Attributes
    ----------
    node : str
        The daemon's node prefix.
    max_frame : int
        Largest request frame, in bytes (``max_control_bytes``).
    max_read_bytes : int
        Largest answer, in bytes (``max_request_bytes``).
    max_extents : int
        Most extents one `PeerRead` may list.
    """

    node: str
    max_frame: int
    max_read_bytes: int
    max_extents: int


class PeerRead(msgspec.Struct, tag="read", array_like=True):
    """Read ``extents`` (checked as ``POST /v1/read`` checks them)."""

    extents: list[Extent]


class PeerBytes(msgspec.Struct, tag="bytes", array_like=True):
    """The read is checked and its files open: ``nbytes`` raw bytes follow this frame."""

    nbytes: int


PeerRequest = PeerHello | PeerRead
PeerReply = PeerWelcome | PeerBytes | ErrorReply
