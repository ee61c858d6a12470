"""The data plane server: hands out file descriptors over ``<socket>.data`` (SCM_RIGHTS).

One thread per connection, blocking sockets: a request, its reply, the next request. The
`Store` does all placement and checking, exactly as for HTTP; each request is served by its
handler in `DataPlaneRequests` (``payloadd.server.framed._dataplane_requests``); this
module only accepts connections and moves descriptors and frames (read with `FrameReader`,
as HTTP reads an append's header).

What each connection may hold is bounded, and all of it ends with the connection:

- **Its own files.** Its leases are placed in files private to the connection, and each
  reservation in fresh files of its own (`Store.lease`, `Store.begin_append`), so that the
  write descriptors it gets reach no other client's rows. When it ends, its lease files are
  sealed (their unused tails stop counting against the disk cap) and its uncommitted
  reservations are given back (their files removed).
- **Time.** A frame must arrive whole within ``request_timeout_s`` once it has started, and
  a reservation must be committed within ``reservation_timeout_s``; else the connection is
  dropped (a stalled frame) or the reservation given back (its commit then answers that no
  such reservation is open). An idle connection between requests is fine.
- **Memory.** A frame is at most ``max_frame`` bytes (the HTTP limit on control bodies,
  ``max_control_bytes``); the bytes of frames being received at once stay under
  ``max_inflight_bytes`` (`payloadd.store._budget.InFlight`).
- **Descriptors.** Connections beyond the daemon's share are closed at once (clients then
  fall back to HTTP); a request takes the descriptors it passes from the per-request share
  (`payloadd.store._budget.Descriptors`) and is refused with `BusyError` when they are short.

The accept loop, the thread a connection, the limits of connections and of time, and what
happens out of descriptors are `payloadd.server.framed._listener.Listener`'s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

from payload_client import BusyError, PayloadTooLargeError
from payload_client.protocol import CommitReply, DataReply, FrameReader, encode_frame
from payloadd.server._metrics import Metrics
from payloadd.server._sockets import bind_unix_socket
from payloadd.server.framed._dataplane_requests import Connection, DataPlaneRequests
from payloadd.server.framed._listener import SMALL_FRAME, Listener, error_reply
from payloadd.store._budget import Descriptors, InFlight
from payloadd.store._counts import DATA_PLANE
from payloadd.store._store import Store

__all__ = ["DataPlaneServer"]


class DataPlaneServer(Listener):
    """Serve descriptors of ``store``'s files on the Unix socket ``path``.

    Parameters
    ----------
    store : Store
        The storage core (placement, checks, counters).
    path : path
        The data socket; bound with ``mode`` like the control socket.
    mode : int
        File mode of the socket.
    lease_bytes : int
        Size of the byte ranges clients lease for small appends.
    metrics : Metrics, optional
        Where requests (by kind, with their latency), errors, descriptors, leases and the
        appends clients report in notes are counted.
    fds : Descriptors, optional
        The daemon's descriptor shares: connections beyond ``data_connections`` are closed
        at once, and requests take what they pass from the per-request share. Default: the
        shares of this process's limit.
    inflight : InFlight, optional
        Bytes of frames being received at once (default: a cap of 256 MiB).
    max_frame : int
        Largest request frame in bytes; a larger one is answered with
        `PayloadTooLargeError` and the connection dropped.
    request_timeout : float
        Seconds a started frame may take to arrive whole; then the connection is dropped.
    reservation_timeout : float
        Seconds a reservation may stay uncommitted; then it is given back.
    """

    def __init__(
        self,
        store: Store,
        path: str | os.PathLike[str],
        mode: int = 0o660,
        lease_bytes: int = 16 << 20,
        *,
        metrics: Metrics | None = None,
        fds: Descriptors | None = None,
        inflight: InFlight | None = None,
        max_frame: int = 16 << 20,
        request_timeout: float = 30.0,
        reservation_timeout: float = 600.0,
    ) -> None:
        super().__init__("data plane", DATA_PLANE, metrics, request_timeout)
        self.store = store
        self.lease_bytes = lease_bytes
        self.path = Path(path)
        self.mode = mode
        self.fds = fds or Descriptors.of_process(max_connections=1024, max_data_connections=1024)
        self.inflight = inflight or InFlight(256 << 20)
        self.max_frame = max_frame
        self.reservation_timeout = reservation_timeout
        self.requests = DataPlaneRequests(
            store, self.fds, lease_bytes, reservation_timeout, metrics
        )
        self._owned = True

    def start(self, listener: socket.socket | None = None) -> None:
        """Accept connections in a background thread, on ``listener`` (a listening socket
        bound to ``path``, owned by the caller) or on a socket bound now."""
        self._owned = listener is None
        self.listen(listener or bind_unix_socket(self.path, self.mode))
        self.log.info("data plane on %s", self.path)

    def stop(self) -> None:
        """Stop accepting, end every connection (`Listener.stop`); remove the socket file if
        `start` bound it."""
        super().stop()
        if self._owned:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def limit(self) -> int:
        """The data plane's share of descriptors for connections."""
        return self.fds.shares.data_connections

    # -- serving one connection ----------------------------------------------------------

    def serve(self, sock: socket.socket, address: object) -> None:
        """Answer the connection's requests, one after the other, until it ends."""
        conn = self.requests.connect(sock)
        try:
            while True:
                body = self._next_frame(conn)
                if body is None:
                    return
                try:
                    self._answer(conn, body)
                finally:
                    if len(body) > SMALL_FRAME:
                        self.inflight.release(len(body))
                    del body  # not kept while the connection idles
        finally:
            self.requests.end(conn)

    def _next_frame(self, conn: Connection) -> bytearray | None:
        """The next request frame's body (a `FrameReader`'s); ``None`` when the client is
        gone, or after a frame above the limit or beyond the memory in flight (the client
        is told why, and dropped). Expired reservations are given back while the
        connection idles, and before each frame.

        Raises
        ------
        StalledError
            A frame did not arrive whole within ``request_timeout`` of its first byte.
        """
        frame = FrameReader(self.max_frame, "data plane frame")
        too_large = None
        idle = lambda: self.requests.expire(conn)  # noqa: E731
        try:
            deadline = self.recv_part(conn.sock, frame, None, idle)  # the prefix
        except PayloadTooLargeError as exc:
            deadline, too_large = 0.0, exc
        if deadline is None:
            return None
        if conn.pending:
            self.requests.expire(conn)
        if too_large is not None:
            self._send(conn, error_reply(too_large, self.name, self.log, " (max_control_bytes)"))
            return None
        n = frame.missing()
        if n > SMALL_FRAME:
            try:
                self.inflight.acquire(n, max(0.0, deadline - time.monotonic()))
            except BusyError as exc:
                if self.metrics is not None:
                    self.metrics.refused_one(DATA_PLANE, "inflight")
                self._send(conn, error_reply(exc, self.name, self.log))
                return None
        try:
            whole = self.recv_part(conn.sock, frame, deadline)  # the body
        except BaseException:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            raise
        if whole is None:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            return None
        return frame.body()

    def _send(self, conn: Connection, reply: DataReply, fds: list[int] | None = None) -> None:
        data = encode_frame(reply)
        sent = socket.send_fds(conn.sock, [data], fds) if fds else 0  # SO_SNDTIMEO bounds both
        if sent < len(data):
            conn.sock.sendall(data[sent:])

    def _answer(self, conn: Connection, body: bytearray) -> None:
        start = time.perf_counter()
        self.store.count("data_plane_requests")
        note = self.requests.note_of(body)
        if note is not None:  # counters only; a reply only when asked for
            self.requests.count_note(note)
            if note.ack:
                self._send(conn, CommitReply([]))
            self._count_request("note", start)
            return
        answer = self.requests.answer(body, conn)
        try:
            self._send(conn, answer.reply, answer.fds)
        finally:
            for fd in answer.fds:
                os.close(fd)
            self.fds.give(answer.taken)
            self._count_request(answer.kind, start)
            self.requests.after(answer)  # while the client uses the reply

    def _count_request(self, kind: str, start: float) -> None:
        if self.metrics is not None:
            self.metrics.dataplane_request(kind, time.perf_counter() - start)
