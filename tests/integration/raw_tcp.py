"""The physical baseline between hosts: bytes of a file sent with ``os.sendfile`` and received
with ``recv_into``, on connections kept from one transfer to the next (as the peer port's).

``python -m tests.integration.raw_tcp serve ADDRESS PORT FILE`` serves until killed: on each
connection, each 8-byte request (a little-endian byte count) is answered with that many bytes
of FILE from its start. ``python -m tests.integration.raw_tcp JOB.json`` connects to
every source of the job (``[address, port, nbytes]``), makes a first transfer, waits for
the other ranks (`start_together`), then ``repeat`` times asks every source at once and
receives from all in one poll loop, timed until all bytes are in; it prints
``{"times": [...]}``.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

ASK = struct.Struct("<Q")


def _send(conn: socket.socket, fd: int) -> None:
    with conn:
        while True:
            got = conn.recv(ASK.size, socket.MSG_WAITALL)
            if len(got) < ASK.size:
                return
            (n,) = ASK.unpack(got)
            sent = 0
            while sent < n:
                sent += os.sendfile(conn.fileno(), fd, sent, n - sent)


def serve(address: str, port: int, path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    with socket.create_server((address, port), backlog=256) as server:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=_send, args=(conn, fd), daemon=True).start()


def _receive(conns: list[socket.socket], bufs: list[bytearray]) -> None:
    """Ask every connection for its buffer's bytes at once, and receive them all in this
    thread (a poll loop: no thread a source, no lock between them)."""
    for conn, buf in zip(conns, bufs, strict=True):
        conn.sendall(ASK.pack(len(buf)))
    views = {c.fileno(): (c, memoryview(b)) for c, b in zip(conns, bufs, strict=True) if b}
    poll = select.poll()
    for fd in views:
        poll.register(fd, select.POLLIN)
    while views:
        for fd, _ in poll.poll(60_000):
            conn, view = views[fd]
            k = conn.recv_into(view)
            if not k:
                raise ConnectionError("the server closed the connection")
            if k == len(view):
                poll.unregister(fd)
                del views[fd]
            else:
                views[fd] = (conn, view[k:])


def start_together(job: dict[str, Any]) -> None:
    """Say this process is ready (a file ``<ready_dir>/<rank>``) and wait for the others:
    until ``<ready_dir>/go`` exists, then until the time it holds (``time.time()``)."""
    ready, go = Path(job["ready_dir"]), Path(job["ready_dir"]) / "go"
    (ready / str(job["rank"])).touch()
    deadline = time.monotonic() + 300
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go within 300 s")
        time.sleep(0.01)
    time.sleep(max(0.0, float(go.read_text() or 0) - time.time()))


def fetch(job: dict[str, Any]) -> dict[str, Any]:
    sources = [(a, int(p), int(n)) for a, p, n in job["sources"]]
    conns = [socket.create_connection((a, p), timeout=60) for a, p, _ in sources]
    bufs = [bytearray(n) for _, _, n in sources]
    _receive(conns, bufs)  # a first transfer: the connections warm
    start_together(job)
    times = []
    for _ in range(job["repeat"]):
        t = time.perf_counter()
        _receive(conns, bufs)
        times.append(time.perf_counter() - t)
    for conn in conns:
        conn.close()
    return {"times": times}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        print(json.dumps(fetch(json.loads(Path(sys.argv[1]).read_text()))))
