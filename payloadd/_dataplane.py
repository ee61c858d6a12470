"""The data plane server: hands out file descriptors over ``<socket>.data`` (SCM_RIGHTS).

One thread per connection, blocking sockets: a request, its reply, the next request. The
`Store` does all placement and checking, exactly as for HTTP; this module only moves
descriptors and frames. A reservation a client never commits (it died, or aborted) leaves
unreferenced bytes in its file, as an unfinished HTTP append does.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from pathlib import Path

import msgspec

from payload_client import InvalidRequestError, PayloadError, ServerError
from payload_client._descriptors import LEASES
from payload_client._errors import status_of
from payload_client._wire import (
    FRAME_PREFIX,
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
)

from ._appends import Lease, PendingAppend
from ._metrics import DATA_PLANE, Metrics
from ._sockets import bind_unix_socket
from ._store import Store

__all__ = ["DataPlaneServer"]

log = logging.getLogger("payloadd.dataplane")

MAX_FRAME = 64 << 20
"""Largest request frame (a reservation's header or an open request)."""

_decoder = msgspec.msgpack.Decoder(DataRequest)
_note_decoder = msgspec.msgpack.Decoder(NoteRequest)
_encoder = msgspec.msgpack.Encoder()


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


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
    """

    def __init__(
        self,
        store: Store,
        path: str | os.PathLike[str],
        mode: int = 0o660,
        lease_bytes: int = 16 << 20,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.lease_bytes = lease_bytes
        self.path = Path(path)
        self.mode = mode
        self._txns = itertools.count(1)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._owned = True
        self._thread: threading.Thread | None = None
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

    def _accept(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._woken, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in selector.select()]
                if self._woken in ready:
                    return
                try:
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError:
                    log.exception("data plane: accepting connections failed; it stops")
                    return
                conn.setblocking(True)
                with self._lock:
                    self._conns.add(conn)
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pending: dict[int, PendingAppend] = {}
        leases: dict[tuple[str, int, str], Lease] = {}
        try:
            while True:
                head = _recv_exact(conn, FRAME_PREFIX.size)
                if head is None:
                    return
                (n,) = FRAME_PREFIX.unpack(head)
                body = _recv_exact(conn, n) if n <= MAX_FRAME else None
                if body is None:
                    return  # gone, or a frame no client sends: drop the connection
                start = time.perf_counter()
                self.store.count("data_plane_requests")
                note = self._note(body)
                if note is not None:  # counters only; a reply only when asked for
                    self.store.count("appends", note.appends)
                    self.store.count("rows_appended", note.rows)
                    self.store.count("bytes_appended", note.nbytes)
                    if self.metrics is not None:
                        self.metrics.noted(note)
                    for node, run in note.runs:  # runs in use: the GC age rule spares them
                        if node == self.store.node:
                            self.store.touch(run)
                    if note.ack:
                        frame = _encoder.encode(CommitReply([]))
                        conn.sendall(FRAME_PREFIX.pack(len(frame)) + frame)
                    self._observe("note", start)
                    continue
                kind, reply, fds = self._handle(body, pending, leases)
                self.store.count("data_plane_fds", len(fds))
                try:
                    frame = _encoder.encode(reply)
                    data = FRAME_PREFIX.pack(len(frame)) + frame
                    sent = socket.send_fds(conn, [data], fds) if fds else 0
                    conn.sendall(data[sent:])
                finally:
                    for fd in fds:
                        os.close(fd)
                self._observe(kind, start)
        except OSError:
            return
        finally:
            for p in pending.values():
                p.close()
            for lease in leases.values():
                lease.release()
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _observe(self, kind: str, start: float) -> None:
        if self.metrics is not None:
            self.metrics.dataplane_request(kind, time.perf_counter() - start)

    def _writer(self, rel: str) -> int:
        """A write-only descriptor of its own for a client: not a dup of the store's, so
        nothing a client does to its file status flags (O_APPEND...) reaches the store."""
        return os.open(self.store.root / rel, os.O_WRONLY | os.O_CLOEXEC)

    def _lease(self, key: tuple[str, int, str], nbytes: int) -> tuple[Lease, int]:
        """A lease of ``key`` and the client's descriptor of its file.

        Garbage collection may remove a leased file at any time, also before its descriptor
        is opened here: then the range is given up and a new one leased (in a new file).
        """
        for _ in range(8):
            lease = self.store.lease(*key, nbytes, self.lease_bytes)
            try:
                return lease, self._writer(lease.file)
            except FileNotFoundError:
                lease.release()
            except BaseException:
                lease.release()
                raise
        raise ServerError(f"every file leased for run {key[0]!r} step {key[1]} was removed at once")

    @staticmethod
    def _note(body: bytes) -> NoteRequest | None:
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

    def _handle(
        self,
        body: bytes,
        pending: dict[int, PendingAppend],
        leases: dict[tuple[str, int, str], Lease],
    ) -> tuple[str, DataReply, list[int]]:
        """Serve one request: ``(kind, reply, descriptors to pass)``."""
        fds: list[int] = []
        kind = "invalid"
        m = self.metrics
        try:
            req = _decoder.decode(body)
            if isinstance(req, LeaseRequest):
                kind = "lease"
                key = (req.run, req.step, req.field)
                lease, fd = self._lease(key, req.nbytes)
                fds.append(fd)
                old = leases.pop(key, None)  # this client moves on to the new range
                if old is not None:
                    old.release()
                leases[key] = lease
                while len(leases) > LEASES:  # as many as a client keeps: the oldest is done
                    leases.pop(next(iter(leases))).release()
                if m is not None:
                    m.leased(req.field, lease.nbytes)
                    m.handed_out("write", [lease.file])
                fsync = self.store.fsync == "always"
                return kind, LeaseReply(lease.file, lease.offset, lease.nbytes, fsync), fds
            if isinstance(req, FieldsRequest):
                return "fields", FieldsReply(self.store.fields), fds
            if isinstance(req, OpenRequest):
                kind = "open"
                for rel, end in req.files:
                    fds.append(self.store.open_for_read(rel, end))
                keeps = self.store.reads.keeps
                once = [i for i, (rel, _) in enumerate(req.files) if not keeps(rel)]
                if m is not None:
                    m.handed_out("read", [rel for rel, _ in req.files])
                return kind, OpenReply(len(fds), once), fds
            if isinstance(req, ReserveRequest):
                kind = "reserve"
                p = self.store.begin_append(req.items)
                txn = next(self._txns)
                pending[txn] = p  # closed with the connection, whatever happens next
                files = [rel for rel, _ in p.files]
                fds = [self._writer(rel) for rel, _ in p.files]
                index = {rel: i for i, rel in enumerate(files)}
                extents = [ReservedExtent(index[rel], off, n) for rel, off, n in p.extents]
                if m is not None:
                    m.handed_out("write", files)
                return kind, ReserveReply(txn, files, extents), fds
            if isinstance(req, CommitRequest | AbortRequest):
                kind = "abort" if isinstance(req, AbortRequest) else "commit"
                p = pending.pop(req.txn)
                if isinstance(req, AbortRequest):
                    p.close()
                    return kind, CommitReply([]), []
                p.written_elsewhere()
                reply = CommitReply(p.commit())
                if m is not None:
                    m.appended(p.items, DATA_PLANE)
                return kind, reply, []
            raise InvalidRequestError(f"unexpected request {type(req).__name__}")
        except Exception as exc:
            for fd in fds:
                os.close(fd)
            if isinstance(exc, PayloadError):
                if status_of(exc) >= 500:  # a full disk or an I/O error: the operator must see it
                    log.error("data plane: %s: %s", type(exc).__name__, exc)
                error = ErrorReply(type(exc).__name__, str(exc))
            elif isinstance(exc, msgspec.DecodeError):
                error = ErrorReply("InvalidRequestError", f"bad data plane request: {exc}")
            elif isinstance(exc, KeyError):
                error = ErrorReply("InvalidRequestError", f"no open reservation {exc}")
            else:
                log.exception("data plane request failed")
                error = ErrorReply("ServerError", f"internal error: {type(exc).__name__}")
            if m is not None:
                m.error(error.error, DATA_PLANE)
            return kind, error, []
