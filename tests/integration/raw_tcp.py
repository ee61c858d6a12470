"""The physical baseline between two hosts: a file's bytes sent with ``os.sendfile`` and
received with ``recv_into``, timed by the receiver.

``python -m tests.integration.raw_tcp serve ADDRESS PORT FILE COUNT`` sends the file to each of
COUNT connections; ``python -m tests.integration.raw_tcp fetch ADDRESS PORT NBYTES COUNT``
receives them and prints the seconds of each as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def serve(address: str, port: int, path: str, count: int) -> None:
    with socket.create_server((address, port)) as server, open(path, "rb") as f:
        server.settimeout(60)
        size = os.fstat(f.fileno()).st_size
        for _ in range(count):
            conn, _ = server.accept()
            with conn:
                sent = 0
                while sent < size:
                    sent += os.sendfile(conn.fileno(), f.fileno(), sent, size - sent)


def fetch(address: str, port: int, nbytes: int, count: int) -> list[float]:
    buf = bytearray(nbytes)
    times = []
    for _ in range(count):
        t = time.perf_counter()
        with socket.create_connection((address, port), timeout=30) as conn:
            view, got = memoryview(buf), 0
            while got < nbytes:
                k = conn.recv_into(view[got:])
                if not k:
                    raise ConnectionError("short")
                got += k
        times.append(time.perf_counter() - t)
    return times


if __name__ == "__main__":
    what, address, port, arg, count = sys.argv[1:6]
    if what == "serve":
        serve(address, int(port), arg, int(count))
    else:
        print(json.dumps(fetch(address, int(port), int(arg), int(count))))
