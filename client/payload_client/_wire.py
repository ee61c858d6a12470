"""Wire types of the HTTP control plane (msgspec Structs) and the append body framing.

Evolution rule: a Struct only ever gains fields appended at the end, each with a default, so
an older peer decodes a newer message (unknown trailing fields are ignored) and a newer peer
decodes an older one (missing fields take their defaults).

Append body (``POST /v1/append``, ``Content-Type: application/x-payload-append``)::

    u32 little-endian N | N bytes: msgpack AppendRequest | row bytes of item 0 | item 1 | ...

Row bytes are raw little-endian C-order rows, never JSON lists or base64.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from ._segment import INT64_MAX, PayloadSegment

__all__ = [
    "APPEND_CONTENT_TYPE",
    "FRAME_PREFIX",
    "MSGPACK_CONTENT_TYPE",
    "AppendItem",
    "AppendRequest",
    "AppendResponse",
    "ErrorBody",
    "Extent",
    "Health",
    "ReadRequest",
    "Stats",
]

APPEND_CONTENT_TYPE = "application/x-payload-append"
MSGPACK_CONTENT_TYPE = "application/msgpack"
FRAME_PREFIX = struct.Struct("<I")
"""Length prefix of the msgpack header in an append body."""

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]


class AppendItem(msgspec.Struct, forbid_unknown_fields=False):
    """Header of one block of rows in an append body.

    Attributes
    ----------
    field : str
        Field name, ``[A-Za-z0-9._-]{1,128}``.
    dtype : str
        Element dtype name (DESIGN §2 supported set).
    shape : list of int
        Shape of one row; every entry > 0.
    rows : int
        Number of rows; the item's bytes are ``rows * row_nbytes``.
    pos : int
        Token position of the first row.
    run : str
        Run name, ``[A-Za-z0-9._-]{1,128}``, not ``.`` or ``..``.
    step : int
        Training step the rows belong to (>= 0); GC removes whole steps.
    """

    field: str
    dtype: str
    shape: list[int]
    rows: NonNegInt
    pos: NonNegInt
    run: str
    step: NonNegInt


class AppendRequest(msgspec.Struct):
    """The msgpack header of an append body: one entry per block of rows that follows."""

    items: list[AppendItem]


class AppendResponse(msgspec.Struct):
    """Segments of an append, one list per item, covering ``[pos, pos + rows)`` in order."""

    segments: list[list[PayloadSegment]]


class Extent(msgspec.Struct, array_like=True):
    """A byte range to read: ``nbytes`` bytes of ``file`` from ``offset``.

    ``end`` is the end of the whole segment the range belongs to: the daemon refuses the read
    when the file is shorter than that, even if the range itself is present.
    """

    file: str
    offset: NonNegInt
    nbytes: NonNegInt
    end: NonNegInt


class ReadRequest(msgspec.Struct):
    """Body of ``POST /v1/read``: the answer is the extents' bytes, concatenated in order."""

    extents: list[Extent]


class Stats(msgspec.Struct):
    """Counters of a running daemon (``GET /v1/stats``); bytes in bytes, times in seconds."""

    node: str
    root: str
    uptime_s: float
    appends: int
    rows_appended: int
    bytes_appended: int
    reads: int
    bytes_read: int
    files_open_for_append: int
    max_file_bytes: int


class Health(msgspec.Struct):
    """Answer of ``GET /healthz``."""

    status: str
    node: str
    version: str


class ErrorBody(msgspec.Struct):
    """Body of every 4xx/5xx answer: the error class name (see `STATUS_BY_ERROR`) and a message."""

    error: str
    message: str
