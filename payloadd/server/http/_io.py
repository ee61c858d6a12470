"""Request bodies in and large answers out over HTTP, each bounded in time and memory.

A body's chunks must keep coming within ``request_timeout_s`` (`next_chunk`, `read_body`),
else it is answered `RequestTimeoutError`; what a route holds of a body in memory counts
against ``max_inflight_bytes`` (`Buffered`). An append's rows are written to the store as
they arrive (`stream_append`), after its header frame (`read_append_header`, with the data
plane's `FrameReader`); a large read is answered chunk by chunk (`ReadStream`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import AsyncIterator, Callable

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Send

from payload_client import (
    InvalidRequestError,
    PayloadSegment,
    PayloadTooLargeError,
    RequestTimeoutError,
)
from payload_client.protocol import AppendItem, Extent, FrameReader
from payloadd.store._budget import Descriptors, InFlight
from payloadd.store._readers import ExtentReader
from payloadd.store._store import Store

__all__ = [
    "READ_CHUNK",
    "SMALL_APPEND",
    "THREAD_BYTES",
    "THREAD_PARTS",
    "Buffered",
    "ReadStream",
    "content_length",
    "media_type",
    "next_chunk",
    "read_append_header",
    "read_body",
    "read_response",
    "stream_append",
]

log = logging.getLogger("payloadd")

THREAD_BYTES = 1 << 20
"""Reads of more bytes than this run in the thread pool, so the event loop keeps serving."""
THREAD_PARTS = 64
"""So do reads of more extents and appends of more items than this."""
READ_CHUNK = 1 << 20
"""Bytes of a large read the daemon reads (in the thread pool) and sends at a time."""
SMALL_APPEND = 4 << 20
"""Rows of an append up to this size (4 MiB) go to the shared files, written as they arrive;
larger ones to files of the append's own, so that a reservation a client may keep waiting
long is never inside a shared file (given up, its files go; a small one given up leaves at
most this many unreferenced bytes, which count until its step is collected)."""


def media_type(request: Request) -> str:
    """The request's ``Content-Type``, without parameters, lower case (``""``: none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def content_length(request: Request, limit: int) -> int:
    """The request's ``Content-Length``.

    Raises
    ------
    InvalidRequestError
        There is none (or it is no number).
    PayloadTooLargeError
        It is above ``limit``.
    """
    raw = request.headers.get("content-length")
    if raw is None or not raw.isdigit():
        raise InvalidRequestError("Content-Length is required")
    n = int(raw)
    if n > limit:
        raise PayloadTooLargeError(f"body of {n} bytes is above the limit of {limit}")
    return n


class Buffered:
    """Bytes of a request held in memory, counted against ``max_inflight_bytes`` (`InFlight`)
    until `release`, or the end of a ``with`` block; against ``host``'s share when the request
    came over the network (`remote_host`)."""

    def __init__(self, inflight: InFlight, host: str | None = None) -> None:
        self.inflight, self.host, self.nbytes = inflight, host, 0

    def __enter__(self) -> Buffered:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def add(self, n: int) -> None:
        """Count ``n`` more bytes, or raise `BusyError` (nothing more counted)."""
        self.inflight.try_acquire(n, self.host)
        self.nbytes += n

    def release(self) -> None:
        """Stop counting them (again: nothing)."""
        self.inflight.release(self.nbytes, self.host)
        self.nbytes = 0


async def next_chunk(
    chunks: AsyncIterator[bytes], timeout: float, what: str, deadline: float | None = None
) -> bytes | None:
    """The next chunk of a request body, ``None`` at its end.

    Raises
    ------
    RequestTimeoutError
        No byte of it came for ``timeout`` seconds, or (with ``deadline``, a time of the
        event loop's clock) it did not come whole by then.
    """
    at = asyncio.get_running_loop().time() + timeout
    if deadline is not None:
        at = min(at, deadline)
    try:
        async with asyncio.timeout_at(at):  # no task a chunk, as wait_for makes
            return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise RequestTimeoutError(
            f"{what} stalled: not received within {timeout:g} s (request_timeout_s); dropped"
        ) from None


async def read_body(
    request: Request, limit: int, buffered: Buffered, timeout: float, what: str
) -> bytes:
    """The whole body (its ``Content-Length``, at most ``limit``, counted in ``buffered``)
    within ``timeout`` seconds.

    Raises
    ------
    InvalidRequestError, PayloadTooLargeError
        As `content_length`; or the body is not as long as announced.
    BusyError
        Over ``max_inflight_bytes``.
    RequestTimeoutError
        As `next_chunk`.
    """
    length = content_length(request, limit)
    buffered.add(length)
    deadline = asyncio.get_running_loop().time() + timeout
    chunks = request.stream().__aiter__()
    parts = bytearray()
    while (chunk := await next_chunk(chunks, timeout, what, deadline)) is not None:
        parts += chunk
    if len(parts) != length:
        raise InvalidRequestError(f"{what} is {len(parts)} bytes, not the {length} announced")
    return bytes(parts)


async def read_append_header(
    chunks: AsyncIterator[bytes], limit: int, buffered: Buffered, timeout: float
) -> tuple[FrameReader, memoryview]:
    """The header frame of an append body (``APPEND_CONTENT_TYPE``), whole within
    ``timeout`` seconds and counted in ``buffered`` once its length is known (the caller
    releases it once decoded), and the bytes of the rows received with it.

    Raises
    ------
    InvalidRequestError
        The body ends inside the header.
    PayloadTooLargeError
        The header is above ``limit`` (``max_control_bytes``).
    BusyError
        Over ``max_inflight_bytes``.
    RequestTimeoutError
        As `next_chunk`.
    """
    frame = FrameReader(limit, "append header")
    rest = memoryview(b"")
    deadline = asyncio.get_running_loop().time() + timeout
    while not frame.done():
        if not rest:
            chunk = await next_chunk(chunks, timeout, "append header", deadline)
            if chunk is None:
                raise InvalidRequestError("append body ends inside its header")
            rest = memoryview(chunk)
        known = frame.length is not None
        rest = frame.feed(rest)
        if not known and frame.length is not None:  # the prefix is whole: count the frame
            buffered.add(frame.size)
    return frame, rest


async def stream_append(
    store: Store,
    fds: Descriptors,
    items: list[AppendItem],
    nbytes: int,
    rows: memoryview,
    chunks: AsyncIterator[bytes],
    timeout: float,
    remote: bool = False,
) -> list[list[PayloadSegment]]:
    """Append ``items``, ``nbytes`` bytes of rows: ``rows``, then the rest of ``chunks``,
    written as they arrive; their segments once committed (a failure gives it back). Its
    descriptors come from the network's part of the share when ``remote``."""
    private = nbytes > SMALL_APPEND  # its reservation may wait long on the client
    files = store.files_needed(items)
    with fds.held(files, f"an append of {len(items)} items", remote=remote):
        if len(items) > THREAD_PARTS:
            pending = await run_in_threadpool(store.begin_append, items, private)
        else:
            pending = store.begin_append(items, private=private)
        try:
            pending.write(rows)
            del rows
            while (chunk := await next_chunk(chunks, timeout, "append body")) is not None:
                pending.write(chunk)
            return pending.commit()
        finally:
            pending.close()


async def read_response(
    store: Store, fds: Descriptors, extents: list[Extent], timeout: float, remote: bool = False
) -> Response:
    """The answer to a read of ``extents``: their bytes, at once when the read is small,
    else streamed chunk by chunk (`ReadStream`), once every extent is checked and open
    (errors are still answers). The store counts the read (`Counts.read`). Its descriptors
    come from the network's part of the share when ``remote``."""
    files = len({e.file for e in extents})
    big = len(extents) > THREAD_PARTS or sum(e.nbytes for e in extents) > THREAD_BYTES
    if not big:
        with fds.held(files, f"a read of {files} files", remote=remote):
            if store.reads.may_wait(extents):  # for another node's file: not on the loop
                data = await run_in_threadpool(store.read_extents, extents)
            else:
                data = store.read_extents(extents)
        return Response(memoryview(data), media_type="application/octet-stream")
    # the daemon holds READ_CHUNK bytes of it at a time, and sending starts at once
    fds.take(files, f"a read of {files} files", remote=remote)
    try:
        reader = await run_in_threadpool(store.open_extents, extents)
    except BaseException:
        fds.give(files, remote=remote)
        raise
    return ReadStream(reader, functools.partial(fds.give, files, remote=remote), timeout)


async def _chunks(reader: ExtentReader) -> AsyncIterator[memoryview]:
    """The read's bytes, a chunk at a time, each read in the thread pool (the reader counts
    the read before it hands over the last chunk)."""
    chunks = reader.chunks(READ_CHUNK)
    while (chunk := await run_in_threadpool(next, chunks, None)) is not None:
        yield memoryview(chunk)


class ReadStream(StreamingResponse):
    """A large read's answer, streamed chunk by chunk from ``reader``, whose client must take
    each chunk within ``timeout`` seconds: one that stops reading is cut off (its connection
    closed). However it ends, even unstarted, the reader is closed and ``release`` called
    once (its per-request descriptors)."""

    def __init__(self, reader: ExtentReader, release: Callable[[], None], timeout: float) -> None:
        super().__init__(
            _chunks(reader),
            media_type="application/octet-stream",
            headers={"Content-Length": str(reader.total)},
        )
        self.timeout = timeout
        self._done = weakref.finalize(self, _finish, reader, release)

    async def stream_response(self, send: Send) -> None:
        """Send the answer, each message within the timeout (then the connection closes)."""

        async def timed(message: Message) -> None:
            async with asyncio.timeout(self.timeout):  # no task a chunk, as wait_for makes
                await send(message)

        try:
            await super().stream_response(timed)
        except TimeoutError:
            log.warning("a client took no byte of a read answer for %g s (request_timeout_s); "
                        "its connection is closed", self.timeout)  # fmt: skip
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._done()


def _finish(reader: ExtentReader, release: Callable[[], None]) -> None:
    reader.close()
    release()
