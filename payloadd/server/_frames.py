"""The daemon's one reader of frames: a `FRAME_PREFIX` length, then that many bytes of body.

Two paths read frames: the header of an HTTP append (``APPEND_CONTENT_TYPE``: its rows
follow the frame) and every data-plane request. Both fill a `FrameReader` part by part, the
prefix first, then the body, as the client reads its data-plane replies (a frame being
received, asked what it still misses). The reader does no I/O: the data plane receives into
`FrameReader.buffer` (``recv_into``, no copy); the HTTP append gives it the chunks of its
body (`FrameReader.feed`). Between the two parts the caller learns the body's length,
checked against the limit, to count it in flight before any of it is held.
"""

from __future__ import annotations

from payload_client import PayloadTooLargeError
from payload_client.protocol import FRAME_PREFIX

__all__ = ["FrameReader"]


class FrameReader:
    """One frame, received part by part: its prefix, then its body.

    Parameters
    ----------
    limit : int
        Largest body accepted, in bytes.
    what : str
        What the frame is, for the error of one above ``limit`` (``"append header"``).

    Attributes
    ----------
    length : int or None
        The body's length once the prefix is whole, ``None`` before.
    """

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self.length: int | None = None
        self._prefix = bytearray(FRAME_PREFIX.size)
        self._body: bytearray | None = None  # allocated once asked for (counted first)
        self._got = 0  # bytes of the current part

    @property
    def size(self) -> int:
        """Prefix and body, in bytes (the body's length must be known)."""
        assert self.length is not None
        return FRAME_PREFIX.size + self.length

    def missing(self) -> int:
        """Bytes still missing of the current part: of the prefix, then of the body."""
        if self.length is None:
            return FRAME_PREFIX.size - self._got
        return self.length - self._got

    def done(self) -> bool:
        """Whether the whole frame is here."""
        return self.length is not None and self._got == self.length

    def buffer(self) -> memoryview:
        """Where the current part's missing bytes go (`missing` of them), for ``recv_into``;
        the first call after the prefix allocates the body."""
        if self.length is None:
            return memoryview(self._prefix)[self._got :]
        if self._body is None:
            self._body = bytearray(self.length)
        return memoryview(self._body)[self._got :]

    def received(self, n: int) -> None:
        """``n`` more bytes were written at the start of `buffer`.

        Raises
        ------
        PayloadTooLargeError
            The prefix, now whole, gives a body above ``limit``.
        """
        self._got += n
        if self.length is None and self._got == FRAME_PREFIX.size:
            (length,) = FRAME_PREFIX.unpack(self._prefix)
            if length > self.limit:
                raise PayloadTooLargeError(
                    f"{self.what} of {length} bytes is above the limit of {self.limit}"
                )
            self.length, self._got = length, 0

    def feed(self, data: memoryview) -> memoryview:
        """Take what ``data`` holds of the current part (never past it); return the rest.

        Raises
        ------
        PayloadTooLargeError
            As `received`.
        """
        view = self.buffer()
        n = min(len(view), len(data))
        view[:n] = data[:n]
        self.received(n)
        return data[n:]

    def body(self) -> bytearray:
        """The whole frame's body (`done` must be true)."""
        assert self.done()
        if self._body is None:  # a body of no bytes
            self._body = bytearray()
        return self._body
