"""The data plane server: hands out file descriptors over ``<socket>.data`` (SCM_RIGHTS).

One thread per connection, blocking sockets: a request, its reply, the next request. The
`Store` does all placement and checking, exactly as for HTTP; this module only moves
descriptors and frames.

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
import functools
import itertools
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from payload_client import (
    BusyError,
    InvalidRequestError,
    PayloadError,
    PayloadTooLargeError,
    ServerError,
)
from payload_client.protocol import (
    FRAME_PREFIX,
    LEASES,
    MAX_FDS,
    AbortRequest,
    CommitReply,
    CommitRequest,
    DataReply,
    DataRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    LeaseReply,
    LeaseRequest,
    NoteRequest,
    OpenReply,
    OpenRequest,
    ReservedExtent,
    ReserveReply,
    ReserveRequest,
    status_of,
)
from payloadd.server._metrics import DATA_PLANE, Metrics
from payloadd.server._sockets import bind_unix_socket
from payloadd.store._appends import LeasedRange, PendingAppend
from payloadd.store._budget import Descriptors, InFlight, out_of_descriptors
from payloadd.store._store import Store

__all__ = ["DataPlaneServer"]

log = logging.getLogger("payloadd.dataplane")

SMALL_FRAME = 64 << 10
"""Frames up to this size are read without asking `InFlight` (every lease, note, commit)."""
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` errors that mean "out of a resource for now", not "broken"."""
RETRY_ACCEPT_S = 0.1
"""Seconds the accept loop waits after running out of descriptors (it never stops)."""

_decoder = msgspec.msgpack.Decoder(DataRequest)
_note_decoder = msgspec.msgpack.Decoder(NoteRequest)
_encoder = msgspec.msgpack.Encoder()


class _StalledError(Exception):
    """A frame stopped arriving mid-way: the connection is dropped."""


class _Conn:
    """What one connection holds; all of it ends with the connection (`DataPlaneServer._serve`)."""

    def __init__(self, sock: socket.socket, owner: int) -> None:
        self.sock = sock
        self.owner = owner  # its lease files are private to it
        # txn -> (append, deadline, per-request descriptors it holds)
        self.pending: dict[int, tuple[PendingAppend, float, int]] = {}
        self.leases: dict[tuple[str, int, str], LeasedRange] = {}


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
        # reservation ids, unique across connections (a client shared by threads may send a
        # commit on a new connection) and, from a random start, across restarts
        self._txns = itertools.count(secrets.randbits(62))
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
                frame = _encoder.encode(ErrorReply("BusyError", str(busy)))
                shed.setblocking(False)
                shed.send(FRAME_PREFIX.pack(len(frame)) + frame)  # the answer to its request
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
        c = _Conn(sock, self.store.new_owner())
        try:
            timeout = _timeval(self.request_timeout)  # every wait is bounded, in the kernel
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
            while True:
                body = self._next_frame(c)
                if body is None:
                    return
                try:
                    self._answer(c, body)
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
            self._teardown(c)

    def _teardown(self, c: _Conn) -> None:
        """End everything ``c`` held; one failing step (an I/O error removing a file) is
        logged and the rest still ends."""
        ends: list[Callable[[], object]] = [
            *(functools.partial(self._give_back, c, txn) for txn in list(c.pending)),
            *(lease.release for lease in c.leases.values()),
            functools.partial(self.store.end_owner, c.owner),
        ]
        for end in ends:
            try:
                end()
            except Exception:
                log.exception("data plane: ending what a closed connection held")
        with self._lock:
            self._conns.discard(c.sock)
        c.sock.close()

    def _next_frame(self, c: _Conn) -> bytearray | None:
        """The next request frame's body; ``None`` when the client is gone, or after a frame
        above the limit or beyond the memory in flight (the client is told why, and
        dropped). Expired reservations are given back while the connection idles, and
        before each frame.

        Raises
        ------
        _StalledError
            A frame did not arrive whole within ``request_timeout`` of its first byte.
        """
        got = self._recv(c, FRAME_PREFIX.size, None)
        if got is None:
            return None
        head, deadline = got
        if c.pending:
            self._expire(c)
        (n,) = FRAME_PREFIX.unpack(head)
        if n > self.max_frame:
            message = f"data plane frame of {n} bytes is above the limit of {self.max_frame}"
            self._send(c, ErrorReply("PayloadTooLargeError", f"{message} (max_control_bytes)"))
            return None
        if n > SMALL_FRAME:
            try:
                self.inflight.acquire(n, max(0.0, deadline - time.monotonic()))
            except BusyError as exc:
                if self.metrics is not None:
                    self.metrics.refused_one(DATA_PLANE, "inflight")
                self._send(c, ErrorReply("BusyError", str(exc)))
                return None
        try:
            got = self._recv(c, n, deadline)
        except BaseException:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            raise
        if got is None:
            if n > SMALL_FRAME:
                self.inflight.release(n)
            return None
        return got[0]

    def _recv(self, c: _Conn, n: int, deadline: float | None) -> tuple[bytearray, float] | None:
        """``n`` bytes from the connection and the frame's deadline, or ``None`` if it ended
        first. Without a ``deadline`` (the first bytes of a frame) the wait has no limit,
        but wakes up every ``request_timeout`` to give back expired reservations; the first
        byte sets the deadline, ``request_timeout`` later, by which the whole frame must
        have come."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                k = c.sock.recv_into(view[got:])
            except BlockingIOError:  # SO_RCVTIMEO elapsed
                if deadline is None:
                    self._expire(c)
                    continue
                raise _StalledError from None
            if not k:
                return None
            got += k
            if deadline is None:
                deadline = time.monotonic() + self.request_timeout
            elif got < n and time.monotonic() > deadline:
                raise _StalledError
        assert deadline is not None
        return buf, deadline

    def _end_reservation(self, c: _Conn, txn: int) -> PendingAppend:
        """Take reservation ``txn`` off the connection, giving back its descriptors.

        Raises
        ------
        KeyError
            No such reservation is open.
        """
        p, _, held = c.pending.pop(txn)
        self.fds.give(held)
        return p

    def _give_back(self, c: _Conn, txn: int) -> None:
        """Give reservation ``txn`` of ``c`` back, uncommitted (its files go)."""
        self._end_reservation(c, txn).close()

    def _expire(self, c: _Conn) -> None:
        now = time.monotonic()
        for txn in [t for t, (_, deadline, _) in c.pending.items() if deadline <= now]:
            self._give_back(c, txn)
            log.warning("data plane: reservation %d not committed within %.0f s; given back",
                        txn, self.reservation_timeout)  # fmt: skip

    def _send(self, c: _Conn, reply: DataReply, fds: list[int] | None = None) -> None:
        frame = _encoder.encode(reply)
        data = FRAME_PREFIX.pack(len(frame)) + frame
        sent = socket.send_fds(c.sock, [data], fds) if fds else 0  # SO_SNDTIMEO bounds both
        c.sock.sendall(data[sent:])

    def _answer(self, c: _Conn, body: bytearray) -> None:
        start = time.perf_counter()
        self.store.count("data_plane_requests")
        note = self._note(body)
        if note is not None:  # counters only; a reply only when asked for
            self.store.counts.noted(note)
            for node, run in note.runs:  # runs in use: the GC age rule spares them
                if node == self.store.node:
                    self.store.touch(run)
            if note.ack:
                self._send(c, CommitReply([]))
            self._observe("note", start)
            return
        kind, reply, fds, taken = self._handle(body, c)
        try:
            self._send(c, reply, fds)
        finally:
            for fd in fds:
                os.close(fd)
            self.fds.give(taken)
            self._observe(kind, start)

    def _observe(self, kind: str, start: float) -> None:
        if self.metrics is not None:
            self.metrics.dataplane_request(kind, time.perf_counter() - start)

    def _writer(self, rel: str) -> int:
        """A write-only descriptor of its own for a client: not a dup of the store's, so
        nothing a client does to its file status flags (O_APPEND...) reaches the store.

        Raises
        ------
        FileNotFoundError
            The file was removed (garbage collection).
        BusyError
            No descriptor is left (``EMFILE``).
        """
        try:
            return os.open(self.store.root / rel, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            busy = out_of_descriptors(exc)
            if busy is not None:
                raise busy from exc
            raise

    def _lease(self, c: _Conn, key: tuple[str, int, str], nbytes: int) -> tuple[LeasedRange, int]:
        """A lease of ``key`` in a file of this connection's, and the client's descriptor.

        Garbage collection may remove a leased file at any time, also before its descriptor
        is opened here: then the range is given up and a new one leased (in a new file).
        """
        for _ in range(8):
            lease = self.store.lease(*key, nbytes, self.lease_bytes, owner=c.owner)
            try:
                return lease, self._writer(lease.file)
            except FileNotFoundError:
                lease.release()
            except BaseException:
                lease.release()
                raise
        raise ServerError(f"every file leased for run {key[0]!r} step {key[1]} was removed at once")

    @staticmethod
    def _note(body: bytearray) -> NoteRequest | None:
        """The note in ``body``, or ``None`` for another request.

        Raises
        ------
        ConnectionAbortedError
            For a malformed note: answering it would hand the reply to the next request
            of a client that waits for none, so the connection is dropped instead.
        """
        try:
            return _note_decoder.decode(body)
        except msgspec.DecodeError:
            try:
                tag = msgspec.msgpack.decode(body)[0]
            except (msgspec.DecodeError, TypeError, KeyError, IndexError):
                return None
            if tag == "note":
                raise ConnectionAbortedError("malformed note") from None
            return None

    def _handle(self, body: bytearray, c: _Conn) -> tuple[str, DataReply, list[int], int]:
        """Serve one request: ``(kind, reply, descriptors to pass, per-request descriptors
        taken for them)``; the caller closes the descriptors and gives those back."""
        fds: list[int] = []
        taken = 0
        kind = "invalid"
        m = self.metrics
        try:
            req = _decoder.decode(body)
            if isinstance(req, LeaseRequest):
                kind = "lease"
                key = (req.run, req.step, req.field)
                self.fds.take(1, "a lease")
                taken = 1
                lease, fd = self._lease(c, key, req.nbytes)
                fds.append(fd)
                old = c.leases.pop(key, None)  # this client moves on to the new range
                if old is not None:
                    old.release()
                c.leases[key] = lease
                while len(c.leases) > LEASES:  # as many as a client keeps: the oldest is done
                    done = next(iter(c.leases))
                    c.leases.pop(done).release()
                    self.store.seal_lease(c.owner, done)  # its unused tail stops counting
                self.store.counts.handed_out("write", [lease.file])
                fsync = self.store.fsync == "always"
                return kind, LeaseReply(lease.file, lease.offset, lease.nbytes, fsync), fds, taken
            if isinstance(req, FieldsRequest):
                return "fields", FieldsReply(self.store.fields), fds, taken
            if isinstance(req, OpenRequest):
                kind = "open"
                if len(req.files) > MAX_FDS:
                    raise PayloadTooLargeError(
                        f"open of {len(req.files)} files is above the limit of {MAX_FDS} a "
                        "request (what one message can pass)"
                    )
                self.fds.take(len(req.files), f"an open of {len(req.files)} files")
                taken = len(req.files)
                for rel, end in req.files:
                    fds.append(self.store.open_for_read(rel, end))
                keeps = self.store.reads.keeps
                once = [i for i, (rel, _) in enumerate(req.files) if not keeps(rel)]
                self.store.counts.handed_out("read", [rel for rel, _ in req.files])
                return kind, OpenReply(len(fds), once), fds, taken
            if isinstance(req, ReserveRequest):
                kind = "reserve"
                need = self.store.files_needed(req.items)
                what = f"a reservation of {len(req.items)} items"
                self.fds.take(2 * need, what)  # the store's while it lasts, and the client's
                taken = 2 * need
                p = self.store.begin_append(req.items, private=True, transport=DATA_PLANE)
                try:
                    files = p.files
                    if len(files) > MAX_FDS:
                        raise PayloadTooLargeError(
                            f"reservation spans {len(files)} files, above the {MAX_FDS} one "
                            "reply can pass; split it"
                        )
                    for rel in files:  # one by one: the except closes what was opened
                        fds.append(self._writer(rel))
                except BaseException:
                    p.close()
                    raise
                txn = next(self._txns)
                deadline = time.monotonic() + self.reservation_timeout
                c.pending[txn] = (p, deadline, need)  # the store's are given back with it
                taken = need  # the client's: given back once sent
                index = {rel: i for i, rel in enumerate(files)}
                extents = [ReservedExtent(index[rel], off, n) for rel, off, n in p.extents]
                self.store.counts.handed_out("write", files)
                return kind, ReserveReply(txn, files, extents), fds, taken
            if isinstance(req, CommitRequest | AbortRequest):
                kind = "abort" if isinstance(req, AbortRequest) else "commit"
                try:
                    p = self._end_reservation(c, req.txn)
                except KeyError:
                    raise InvalidRequestError(
                        f"no open reservation {req.txn} on this connection: never made, "
                        "committed already, made on a connection that ended, or given back "
                        f"after {self.reservation_timeout:.0f} s uncommitted"
                    ) from None
                if isinstance(req, AbortRequest):
                    p.close()
                    return kind, CommitReply([]), [], taken
                p.written_elsewhere()
                try:
                    reply = CommitReply(p.commit())
                finally:
                    p.close()
                return kind, reply, [], taken
            raise InvalidRequestError(f"unexpected request {type(req).__name__}")
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            self.fds.give(taken)
            if isinstance(exc, PayloadError):
                if isinstance(exc, BusyError) and m is not None:
                    m.refused_one(DATA_PLANE, "descriptors")
                if status_of(exc) >= 500:  # a full disk or an I/O error: the operator must see it
                    log.error("data plane: %s: %s", type(exc).__name__, exc)
                error = ErrorReply(type(exc).__name__, str(exc))
            elif isinstance(exc, msgspec.DecodeError):
                error = ErrorReply("InvalidRequestError", f"bad data plane request: {exc}")
            else:
                log.exception("data plane request failed")
                error = ErrorReply("ServerError", f"internal error: {type(exc).__name__}")
            if m is not None:
                m.error(error.error, DATA_PLANE)
            return kind, error, [], 0


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
