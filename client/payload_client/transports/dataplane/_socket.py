"""The data plane's socket: reply frames received with the descriptors they carry, a look
for a connection the daemon closed, and the effects of one exchange (`Send`, `RecvFirst`,
`RecvMore`) that the sync and async transports perform their own way."""

from __future__ import annotations

import array
import os
import select
import socket
from dataclasses import dataclass
from typing import Any

import msgspec

from ..._errors import ProtocolError
from ...wire._dataplane import DataReply
from ...wire._frames import FrameReader, decode_frame
from ._steps import MAX_FDS

__all__ = [
    "ANCILLARY",
    "Poll",
    "RecvFirst",
    "RecvMore",
    "ReplyFrame",
    "Send",
    "answer_before_close",
    "closed_by_peer",
    "decode_reply",
    "fds_of",
]

_decoder = msgspec.msgpack.Decoder(DataReply)


def fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += array.array("i", data[:usable]).tolist()
    return fds


def decode_reply(body: bytes | bytearray | memoryview, fds: list[int]) -> DataReply:
    try:
        reply: DataReply = decode_frame(_decoder, body, "data plane reply")
        return reply
    except ProtocolError:
        for fd in fds:
            os.close(fd)
        raise


ANCILLARY = socket.CMSG_SPACE(MAX_FDS * 4)
ANY_LENGTH = (1 << 32) - 1
"""A reply frame's body may be as long as its prefix can say."""


class Poll:
    """Whether a socket has something to read (a reply, or its end): a look that never
    waits, safe from several threads at once (an epoll set; ``select`` where there is none).
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.epoll: Any = None
        try:
            self.epoll = select.epoll()
            self.epoll.register(sock.fileno(), select.EPOLLIN)
        except (AttributeError, OSError):  # no epoll here, or no descriptor left for one
            if self.epoll is not None:
                self.epoll.close()
            self.epoll = None

    def readable(self) -> bool:
        """Whether it has; ``True`` when it cannot tell (closed meanwhile)."""
        try:
            if self.epoll is not None:
                return bool(self.epoll.poll(0))
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        if self.epoll is not None:
            self.epoll.close()


def closed_by_peer(sock: socket.socket | None, poll: Poll | None) -> bool:
    """Whether the daemon closed ``sock`` (it restarted): a look that never waits (``poll``:
    the socket's)."""
    if sock is None or poll is None:
        return False
    if not poll.readable():
        return False  # open, nothing pending: the normal case
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable: end of stream, or an error
    except OSError:
        return True


class ReplyFrame:
    """One reply frame being received (a `FrameReader`'s), descriptors with it."""

    def __init__(self, first: bytes, fds: list[int]) -> None:
        self.fds = fds
        self.reader = FrameReader(ANY_LENGTH, "data plane reply", ProtocolError)
        if not first:
            self.close_fds()
            raise ConnectionResetError("data plane closed the connection")
        self.add(first)

    def missing(self) -> int:
        return self.reader.missing()

    def add(self, more: bytes) -> None:
        if not more:
            raise ConnectionResetError("data plane closed the connection")
        if self.reader.feed_all(memoryview(more)).nbytes:
            self.close_fds()
            raise ProtocolError("data plane reply longer than its frame")

    def reply(self) -> tuple[DataReply, list[int]]:
        return decode_reply(self.reader.body(), self.fds), self.fds

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def answer_before_close(sock: socket.socket) -> tuple[DataReply, list[int]] | None:
    """The reply a daemon sent before it closed ``sock`` (sending the request failed): a
    daemon out of descriptors answers `BusyError` at once and closes, before the request
    arrives. ``None`` when there is no whole frame."""
    try:
        msg, anc, _flags, _addr = sock.recvmsg(1 << 16, ANCILLARY, socket.MSG_DONTWAIT)
    except OSError:
        return None
    frame = ReplyFrame(msg, fds_of(anc)) if msg else None
    if frame is None or frame.missing() > 0:
        if frame is not None:
            frame.close_fds()
        return None
    return frame.reply()


@dataclass(slots=True)
class Send:
    """Effect: send all of ``data`` on ``sock``."""

    sock: socket.socket
    data: bytes


@dataclass(slots=True)
class RecvFirst:
    """Effect: receive the first part of a reply with its descriptors: ``(bytes, fds)``."""

    sock: socket.socket


@dataclass(slots=True)
class RecvMore:
    """Effect: receive at most ``n`` more bytes of a reply."""

    sock: socket.socket
    n: int
