"""The data plane server: hands out file descriptors over ``<socket>.data`` (SCM_RIGHTS).

One thread per connection, blocking sockets: a request, its reply, the next request. The
`Store` does all placement and checking, exactly as for HTTP; each request is served by its
handler in `DataPlaneRequests` (``payloadd.server._dataplane_requests``); this module only
accepts connections and moves descriptors and frames (read with `FrameReader`, as HTTP
reads an append's header).

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

The accept loop never stops on its own: out of descriptors (``EMFILE``), it takes the
connection at the head of the queue with a spare descriptor kept for that, answers it with
`BusyError` and closes it, waits a moment and goes on; `DataPlaneServer.state` says so for
``/healthz``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import selectors
import socket
import struct
import threading
import time
from pathlib import Path

import msgspec

from payload_client import BusyError, PayloadTooLargeError
from payload_client.protocol import FRAME_PREFIX, CommitReply, DataReply, ErrorReply
from payloadd.server._dataplane_requests import Connection, DataPlaneRequests
from payloadd.server._errors import wire_error
from payloadd.server._frames import FrameReader
from payloadd.server._metrics import Metrics
from payloadd.server._sockets import bind_unix_socket
from payloadd.store._budget import Descriptors, InFlight, out_of_descriptors
from payloadd.store._counts import DATA_PLANE
from payloadd.store._store import Store

__all__ = ["DataPlaneServer"]

log = logging.getLogger("payloadd.dataplane")

SMALL_FRAME = 64 << 10
"""Frames up to this size are read without asking `InFlight` (every lease, note, commit)."""
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` errors that mean "out of a resource for now", not "broken"."""
RETRY_ACCEPT_S = 0.1
"""Seconds the accept loop waits after running out of descriptors (it never stops)."""

_encoder = msgspec.msgpack.Encoder()


class _StalledError(Exception):
    """A frame stopped arriving mid-way: the connection is dropped."""


class DataPlaneServer:
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
        self.store = store
        self.metrics = metrics
        self.lease_bytes = lease_bytes
        self.path = Path(path)
        self.mode = mode
        self.fds = fds or Descriptors.of_process(max_connections=1024, max_data_connections=1024)
        self.inflight = inflight or InFlight(256 << 20)
        self.max_frame = max_frame
        self.request_timeout = request_timeout
        self.reservation_timeout = reservation_timeout
        self.refused = {"connections": 0, "descriptors": 0}
        self.requests = DataPlaneRequests(
            store, self.fds, lease_bytes, reservation_timeout, metrics
        )
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._owned = True
        self._thread: threading.Thread | None = None
        self._exhausted_since: float | None = None  # wall time accept() began to run out
        self._exhausted_last = 0.0  # monotonic time it last did
        self._wake: socket.socket
        self._woken: socket.socket

    def start(self, listener: socket.socket | None = None) -> None:
        """Accept connections in a background thread, on ``listener`` (a listening socket
        bound to ``path``, owned by the caller) or on a socket bound now."""
        self._owned = listener is None
        self._listener = listener or bind_unix_socket(self.path, self.mode)
        self._listener.setblocking(False)  # the accept loop waits in a selector
        self._wake, self._woken = socket.socketpair()
        self._thread = threading.Thread(target=self._accept, name="payloadd-dataplane", daemon=True)
        self._thread.start()
        log.info("data plane on %s", self.path)

    def stop(self) -> None:
        """Stop accepting, end every connection; remove the socket file if `start` bound it.

        The listening socket is closed, never shut down: systemd may hold it too (socket
        activation), and connections made from now on wait in its queue for the next daemon.
        """
        if self._thread is not None:
            self._wake.send(b"\0")
            self._thread.join(5)
            self._wake.close()
            self._woken.close()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self._owned:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def connections(self) -> int:
        """Data-plane connections open now."""
        with self._lock:
            return len(self._conns)

    def state(self) -> str:
        """``"serving"``, or what keeps the data plane from it now (for ``/healthz``): its
        accept thread ended, or the process has no descriptor left (a probe now, or a failed
        ``accept()`` within the last second)."""
        if self._thread is None or not self._thread.is_alive():
            return "stopped: its accept thread ended"
        probe = _spare()
        if probe < 0:
            return "refusing connections: out of file descriptors (EMFILE) now"
        os.close(probe)
        since = self._exhausted_since
        if since is not None and time.monotonic() - self._exhausted_last < 1.0:
            when = time.strftime("%H:%M:%SZ", time.gmtime(since))
            return f"refusing connections: out of file descriptors (EMFILE) since {when}"
        return "serving"

    # -- accepting ---------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        spare = _spare()  # given up to shed one queued connection when accept() runs out
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._woken, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in selector.select()]
                if self._woken in ready:
                    break
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as exc:
                    spare = self._ran_out(exc, spare)
                    woken, _, _ = select.select([self._woken], [], [], RETRY_ACCEPT_S)
                    if woken:  # stop; else accept again (the queue waits meanwhile)
                        break
                    continue
                if self._exhausted_since is not None:
                    log.warning("data plane: accepting connections again")
                    self._exhausted_since = None
                    if spare < 0:
                        spare = _spare()
                self._admit(conn)
        if spare >= 0:
            os.close(spare)

    def _ran_out(self, exc: OSError, spare: int) -> int:
        """``accept()`` failed: note it, shed the connection at the head of the queue (its
        client is answered `BusyError`: HTTP has no descriptor either), and return the spare
        descriptor."""
        self._exhausted_last = time.monotonic()
        if self._exhausted_since is None:
            self._exhausted_since = time.time()
            if exc.errno in EXHAUSTED:
                log.error("data plane: accepting connections failed: %s; connections are "
                          "answered busy and closed at once until descriptors are "
                          "free", exc)  # fmt: skip
            else:
                log.error("data plane: accepting connections failed: %s; retrying", exc)
        self.refused["descriptors"] += 1
        if self.metrics is not None:
            self.metrics.refused_one(DATA_PLANE, "descriptors")
        if spare >= 0:
            os.close(spare)
        with contextlib.suppress(OSError):
            assert self._listener is not None
            shed, _ = self._listener.accept()
            with shed:
                busy = out_of_descriptors(exc) or BusyError(f"daemon busy ({exc}); try again")
                shed.setblocking(False)
                shed.send(_framed(_error_reply(busy)))  # the answer to its request
                with contextlib.suppress(OSError):
                    shed.recv(1 << 16)  # what it sent: closed unread, it would be a reset
        return _spare()

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` in a thread of its own, or close it at once beyond the share."""
        with self._lock:
            full = len(self._conns) >= self.fds.shares.data_connections
            if not full:
                self._conns.add(conn)
        if full:
            conn.close()  # its client falls back to HTTP
            self.refused["connections"] += 1
            if self.metrics is not None:
                self.metrics.refused_one(DATA_PLANE, "connections")
            if (
                self.refused["connections"] in (1, 10, 100)
                or self.refused["connections"] % 1000 == 0
            ):
                log.warning("data plane: %d connections open, its share of descriptors: "
                            "connections beyond are closed at once (%d so far)",
                            self.fds.shares.data_connections,
                            self.refused["connections"])  # fmt: skip
            return
        conn.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
        except RuntimeError:  # no thread can be started now
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            log.error("data plane: no thread for a new connection; it was closed")

    # -- serving one connection ----------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        conn = self.requests.connect(sock)
        try:
            timeout = _timeval(self.request_timeout)  # every wait is bounded, in the kernel
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
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
        except _StalledError:
            log.warning("data plane: a frame stalled for %.0f s mid-way; connection dropped",
                        self.request_timeout)  # fmt: skip
            if self.metrics is not None:
                self.metrics.refused_one(DATA_PLANE, "stalled")
        except OSError:
            return
        finally:
            self.requests.end(conn)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _next_frame(self, conn: Connection) -> bytearray | None:
        """The next request frame's body (a `FrameReader`'s); ``None`` when the client is
        gone, or after a frame above the limit or beyond the memory in flight (the client
        is told why, and dropped). Expired reservations are given back while the
        connection idles, and before each frame.

        Raises
        ------
        _StalledError
            A frame did not arrive whole within ``request_timeout`` of its first byte.
        """
        frame = FrameReader(self.max_frame, "data plane frame")
        too_large = None
        try:
            deadline = self._recv(conn, frame, None)  # the prefix
        except PayloadTooLargeError as exc:
            deadline, too_large = 0.0, exc
        if deadline is None:
            return None
        if conn.pending:
            self.requests.expire(conn)
        if too_large is not None:
            self._send(conn, _error_reply(too_large, " (max_control_bytes)"))
            return None
        n = frame.missing()
        if n > SMALL_FRAME:
            try:
                self.inflight.acquire(n, max(0.0, deadline - time.monotonic()))
            except BusyError as exc:
                if self.metrics is not None:
                    self.metrics.refused_one(DATA_PLANE, "inflight")
                self._send(conn, _error_reply(exc))
                return None
        try:
            whole = self._recv(conn, frame, deadline)  # the body
        except BaseException:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            raise
        if whole is None:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            return None
        return frame.body()

    def _recv(self, conn: Connection, frame: FrameReader, deadline: float | None) -> float | None:
        """The current part of ``frame`` (its prefix, or its body) from the connection, and
        the frame's deadline; ``None`` if the connection ended first. Without a
        ``deadline`` (the first bytes of a frame) the wait has no limit, but wakes up every
        ``request_timeout`` to give back expired reservations; the first byte sets the
        deadline, ``request_timeout`` later, by which the whole frame must have come.

        Raises
        ------
        PayloadTooLargeError
            The prefix gives a body above the limit (`FrameReader.received`).
        """
        view = frame.buffer()
        n = len(view)
        got = 0
        while got < n:
            try:
                k = conn.sock.recv_into(view[got:])
            except BlockingIOError:  # SO_RCVTIMEO elapsed
                if deadline is None:
                    self.requests.expire(conn)
                    continue
                raise _StalledError from None
            if not k:
                return None
            got += k
            if deadline is None:
                deadline = time.monotonic() + self.request_timeout
            elif got < n and time.monotonic() > deadline:
                raise _StalledError
        del view
        frame.received(got)
        assert deadline is not None
        return deadline

    def _send(self, conn: Connection, reply: DataReply, fds: list[int] | None = None) -> None:
        data = _framed(reply)
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


def _framed(reply: DataReply) -> bytes:
    """``reply`` as a frame: its `FRAME_PREFIX` length, then its msgpack."""
    body = _encoder.encode(reply)
    return FRAME_PREFIX.pack(len(body)) + body


def _error_reply(exc: Exception, suffix: str = "") -> ErrorReply:
    """The ``ErrorReply`` of ``exc`` (`wire_error`), its message followed by ``suffix``."""
    wire = wire_error(exc, "data plane", log)
    return ErrorReply(wire.error, wire.message + suffix)


def _timeval(seconds: float) -> bytes:
    """``struct timeval`` of ``seconds``, for ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _spare() -> int:
    """A descriptor held in reserve for the accept loop (-1 if none can be had now)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
