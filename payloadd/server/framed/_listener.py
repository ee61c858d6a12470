"""`Listener`: what the daemon's two servers of frames share, the data plane (Unix socket)
and the peer port (TCP): an accept loop in a thread of its own, a thread per connection,
blocking sockets, frames read with `FrameReader`.

What it bounds, for both:

- **Connections.** Beyond the server's share (`Listener.limit`), or a subclass's rule for one
  more (`Listener.admits`: the peer port's per-host limit), a connection is closed at once.
- **Descriptors.** The accept loop never stops on its own: out of descriptors (``EMFILE``)
  it takes the connection at the head of the queue with a spare descriptor kept for that,
  answers it with `BusyError` and closes it, waits a moment and goes on; `Listener.state`
  says so (``/healthz``).
- **Time.** Each connection's sends and receives are bounded in the kernel
  (``SO_SNDTIMEO``, ``SO_RCVTIMEO``): a client that stops reading or stops sending mid-frame
  is dropped (`Listener.recv_part`).
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
from typing import Any

from payload_client import BusyError
from payload_client.protocol import ErrorReply, FrameReader, encode_frame
from payloadd.server._errors import wire_error
from payloadd.server._metrics import Metrics
from payloadd.store._budget import out_of_descriptors

__all__ = [
    "EXHAUSTED",
    "RETRY_ACCEPT_S",
    "SMALL_FRAME",
    "Listener",
    "StalledError",
    "error_reply",
    "set_timeouts",
]

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` errors that mean "out of a resource for now", not "broken"."""
RETRY_ACCEPT_S = 0.1
"""Seconds the accept loop waits after running out of descriptors (it never stops)."""
SMALL_FRAME = 64 << 10
"""Frames up to this size are read without asking `InFlight` (leases, notes, commits,
most reads)."""


class StalledError(Exception):
    """A frame stopped arriving mid-way: the connection is dropped."""


class Listener:
    """Accepts connections on a listening socket and serves each in a thread of its own.

    Parameters
    ----------
    name : str
        What it is, for logs and thread names (``"data plane"``, ``"peer port"``).
    transport : str
        Its ``transport`` label in the daemon's metrics.
    metrics : Metrics, optional
        Where refused connections are counted.
    request_timeout : float
        Seconds a started frame may take to arrive whole, and a send may wait for the
        client to take bytes; then the connection is dropped.
    """

    def __init__(
        self, name: str, transport: str, metrics: Metrics | None, request_timeout: float
    ) -> None:
        self.name, self.transport, self.metrics = name, transport, metrics
        self.request_timeout = request_timeout
        self.refused = {"connections": 0, "descriptors": 0}
        self.log = logging.getLogger(f"payloadd.{name.replace(' ', '')}")
        self._conns: dict[socket.socket, Any] = {}  # each open connection, its peer address
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._exhausted_since: float | None = None  # wall time accept() began to run out
        self._exhausted_last = 0.0  # monotonic time it last did
        self._wake: socket.socket
        self._woken: socket.socket

    # -- what a server says ----------------------------------------------------------------

    def limit(self) -> int:
        """Most connections open at once."""
        raise NotImplementedError

    def admits(self, address: Any, open_now: list[Any]) -> bool:
        """Whether a connection from ``address`` may open beside those from ``open_now``
        (under `limit`); called with the lock held."""
        return True

    def serve(self, sock: socket.socket, address: Any) -> None:
        """Serve one connection until it ends (the caller closes it)."""
        raise NotImplementedError

    # -- start, stop, state ----------------------------------------------------------------

    def listen(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` in a background thread."""
        self._listener = listener
        listener.setblocking(False)  # the accept loop waits in a selector
        self._wake, self._woken = socket.socketpair()
        self._thread = threading.Thread(
            target=self._accept, name=f"payloadd-{self.name.replace(' ', '-')}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting and end every connection.

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

    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._conns)

    def state(self) -> str:
        """``"serving"``, or what keeps it from serving now (for ``/healthz``): its accept
        thread ended, or the process has no descriptor left (a probe now, or a failed
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
                    conn, address = self._listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as exc:
                    spare = self._ran_out(exc, spare)
                    woken, _, _ = select.select([self._woken], [], [], RETRY_ACCEPT_S)
                    if woken:  # stop; else accept again (the queue waits meanwhile)
                        break
                    continue
                if self._exhausted_since is not None:
                    self.log.warning("%s: accepting connections again", self.name)
                    self._exhausted_since = None
                    if spare < 0:
                        spare = _spare()
                self._admit(conn, address)
        if spare >= 0:
            os.close(spare)

    def _ran_out(self, exc: OSError, spare: int) -> int:
        """``accept()`` failed: note it, shed the connection at the head of the queue (its
        client is answered `BusyError`), and return the spare descriptor."""
        self._exhausted_last = time.monotonic()
        if self._exhausted_since is None:
            self._exhausted_since = time.time()
            if exc.errno in EXHAUSTED:
                self.log.error("%s: accepting connections failed: %s; connections are "
                               "answered busy and closed at once until descriptors are "
                               "free", self.name, exc)  # fmt: skip
            else:
                self.log.error("%s: accepting connections failed: %s; retrying", self.name, exc)
        self.refused["descriptors"] += 1
        if self.metrics is not None:
            self.metrics.refused_one(self.transport, "descriptors")
        if spare >= 0:
            os.close(spare)
        with contextlib.suppress(OSError):
            assert self._listener is not None
            shed, _ = self._listener.accept()
            with shed:
                busy = out_of_descriptors(exc) or BusyError(
                    f"daemon busy ({exc}); try again", reason="descriptors"
                )
                shed.setblocking(False)
                shed.send(
                    encode_frame(error_reply(busy, self.name, self.log))
                )  # the answer to its request
                with contextlib.suppress(OSError):
                    shed.recv(1 << 16)  # what it sent: closed unread, it would be a reset
        return _spare()

    def _admit(self, conn: socket.socket, address: Any) -> None:
        """Serve ``conn`` in a thread of its own, or close it at once beyond the limits."""
        with self._lock:
            full = len(self._conns) >= self.limit() or not self.admits(
                address, list(self._conns.values())
            )
            if not full:
                self._conns[conn] = address
        if full:
            conn.close()  # its client falls back to HTTP
            self.refused["connections"] += 1
            if self.metrics is not None:
                self.metrics.refused_one(self.transport, "connections")
            n = self.refused["connections"]
            if n in (1, 10, 100) or n % 1000 == 0:
                self.log.warning("%s: a connection beyond its limits was closed at once "
                                 "(%d so far; %d open at most)", self.name, n,
                                 self.limit())  # fmt: skip
            return
        conn.setblocking(True)
        try:
            threading.Thread(target=self._run, args=(conn, address), daemon=True).start()
        except RuntimeError:  # no thread can be started now
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            self.log.error("%s: no thread for a new connection; it was closed", self.name)

    def _run(self, sock: socket.socket, address: Any) -> None:
        try:
            set_timeouts(sock, self.request_timeout)  # every wait is bounded, in the kernel
            self.serve(sock, address)
        except StalledError:
            self.log.warning("%s: a frame stalled for %.0f s mid-way; connection dropped",
                             self.name, self.request_timeout)  # fmt: skip
            if self.metrics is not None:
                self.metrics.refused_one(self.transport, "stalled")
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.pop(sock, None)
            sock.close()

    # -- frames ------------------------------------------------------------------------

    def recv_part(
        self, sock: socket.socket, frame: FrameReader, deadline: float | None, idle: Any = None
    ) -> float | None:
        """The current part of ``frame`` (its prefix, or its body) from ``sock``, and the
        frame's deadline; ``None`` if the connection ended first. Without a ``deadline``
        (the first bytes of a frame) the wait has no limit, but each ``SO_RCVTIMEO`` that
        passes calls ``idle()`` (which may raise to end the wait); the first byte sets the
        deadline, ``request_timeout`` later, by which the whole frame must have come.

        Raises
        ------
        StalledError
            The frame stopped arriving mid-way.
        PayloadTooLargeError
            The prefix gives a body above the frame's limit (`FrameReader.received`).
        """
        view = frame.buffer()
        n = len(view)
        got = 0
        while got < n:
            try:
                k = sock.recv_into(view[got:])
            except BlockingIOError:  # SO_RCVTIMEO elapsed
                if deadline is None:
                    if idle is not None:
                        idle()
                    continue
                raise StalledError from None
            if not k:
                return None
            got += k
            if deadline is None:
                deadline = time.monotonic() + self.request_timeout
            elif got < n and time.monotonic() > deadline:
                raise StalledError
        del view
        frame.received(got)
        assert deadline is not None
        return deadline


def error_reply(exc: Exception, where: str, logger: logging.Logger, suffix: str = "") -> ErrorReply:
    """The ``ErrorReply`` of ``exc`` (`wire_error`), its message followed by ``suffix``."""
    wire = wire_error(exc, where, logger)
    return ErrorReply(wire.error, wire.message + suffix)


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every receive and send of ``sock`` to ``seconds`` in the kernel
    (``SO_RCVTIMEO``, ``SO_SNDTIMEO``; a blocking call then raises `BlockingIOError`)."""
    timeout = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)


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
