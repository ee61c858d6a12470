"""Frames, the one codec of every framed exchange: a `FRAME_PREFIX` length, then that many
bytes of msgpack; and the one way an error answer becomes an exception.

Frames carry the header of an HTTP append (``APPEND_CONTENT_TYPE``: its rows follow the
frame), every data-plane request and reply, and every peer-port request and reply. Both ends
use what is here: `encode_frame` writes one; `FrameReader` receives one part by part (the
prefix, then the body), with no I/O of its own, so the daemon's blocking listener, its HTTP
append and the client's receive loops all fill it their own way (``recv_into`` into
`FrameReader.buffer`, or chunks given to `FrameReader.feed`). Between the two parts the
body's length is known and checked against a limit before any of it is held.

An error travels as `ErrorBody` over HTTP (with the status) and as `ErrorReply` in frames;
`payload_client._errors.error_from_wire` turns either into the `PayloadError` it names.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from .._errors import PayloadTooLargeError, ProtocolError

__all__ = ["FRAME_PREFIX", "FrameReader", "decode_frame", "encode_frame"]

FRAME_PREFIX = struct.Struct("<I")
"""Length prefix of a frame's msgpack body (``u32`` little-endian)."""

_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: Any) -> bytes:
    """``message`` (a Struct) as one frame: its `FRAME_PREFIX` length, then its msgpack."""
    body = _encoder.encode(message)
    return FRAME_PREFIX.pack(len(body)) + body


def decode_frame(decoder: msgspec.msgpack.Decoder[Any], body: Any, what: str) -> Any:
    """The message of a frame's ``body``.

    Raises
    ------
    ProtocolError
        ``body`` is no message ``decoder`` takes (``what`` names the frame in the message).
    """
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from exc


class FrameReader:
    """One frame, received part by part: its prefix, then its body.

    Parameters
    ----------
    limit : int
        Largest body accepted, in bytes.
    what : str
        What the frame is, for the error of one above ``limit`` (``"append header"``).
    too_large : type of PayloadError
        Raised for a body above ``limit``: `PayloadTooLargeError` where the frame is a
        request (the daemon's side), `ProtocolError` where it is an answer (the client's).

    Attributes
    ----------
    length : int or None
        The body's length once the prefix is whole, ``None`` before.
    """

    def __init__(
        self, limit: int, what: str, too_large: type[Exception] = PayloadTooLargeError
    ) -> None:
        self.limit, self.what, self.too_large = limit, what, too_large
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
        PayloadTooLargeError or ProtocolError
            The prefix, now whole, gives a body above ``limit`` (``too_large``).
        """
        self._got += n
        if self.length is None and self._got == FRAME_PREFIX.size:
            (length,) = FRAME_PREFIX.unpack(self._prefix)
            if length > self.limit:
                raise self.too_large(
                    f"{self.what} of {length} bytes is above the limit of {self.limit}"
                )
            self.length, self._got = length, 0

    def feed(self, data: memoryview) -> memoryview:
        """Take what ``data`` holds of the current part (never past it); return the rest.

        Raises
        ------
        PayloadTooLargeError or ProtocolError
            As `received`.
        """
        view = self.buffer()
        n = min(len(view), len(data))
        view[:n] = data[:n]
        self.received(n)
        return data[n:]

    def feed_all(self, data: memoryview) -> memoryview:
        """`feed` until the frame is done or ``data`` is used up; return what is past it."""
        while data.nbytes and not self.done():
            data = self.feed(data)
        return data

    def body(self) -> bytearray:
        """The whole frame's body (`done` must be true)."""
        assert self.done()
        if self._body is None:  # a body of no bytes
            self._body = bytearray()
        return self._body
