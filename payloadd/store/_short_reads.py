"""Reads that find less than they were told, and files ``sendfile`` does not serve: what
`payloadd.store._readers.ExtentReader` does then.

A checked file that a ``pread`` or ``sendfile`` finds shorter (`ShortRead`) is another
node's on a distributed root whose size this node sees late (waited for, briefly), or one
that shrank (an error). A file system that does not serve ``sendfile`` (some FUSE ones:
`NO_SENDFILE`) is sent by hand (`copy_out`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any

from payload_client import SegmentFileError

__all__ = ["NO_SENDFILE", "ShortRead", "copy_out"]

NO_SENDFILE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
"""What ``sendfile`` answers where a file system (some FUSE ones) does not serve it."""


def copy_out(
    out: int, fd: int, offset: int, n: int, buf: memoryview, wait: Callable[[], None]
) -> int:
    """``sendfile`` by hand: pread up to ``len(buf)`` bytes and write them all to ``out``."""
    got = os.preadv(fd, [buf[: min(n, len(buf))]], offset)
    sent = 0
    while sent < got:
        try:
            sent += os.write(out, buf[sent:got])
        except BlockingIOError:
            wait()
    return got


class ShortRead:
    """A pread or sendfile of a checked file that found its end before the segment's."""

    def __init__(self, readers: Any, file: str) -> None:
        self.readers, self.file = readers, file
        self.waited, self.pause = 0.0, 0.001

    def again(self, fd: int, n: int) -> bool:
        """Wait a little and say to try again (another node's file, on a root whose policy
        waits for them: this node's size may catch up, on GlusterFS rarely; such reads never
        run on the event loop), else raise `FileGoneError` (its step was collected) or
        `SegmentFileError` (it shrank)."""
        if n == 0 and self.waited < self.readers.short_read_wait(self.file):
            os.fstat(fd)
            time.sleep(self.pause)
            self.waited, self.pause = self.waited + self.pause, min(2 * self.pause, 0.1)
            return True
        self.readers._raise_if_collected(self.file)
        raise SegmentFileError(f"payload file {self.file!r} shrank during the read")
