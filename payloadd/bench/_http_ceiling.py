"""The ceiling of HTTP reads on this machine: a bare uvicorn app (part of ``payloadd bench``).

A plain ASGI app, no payloadd and no framework, run by uvicorn in a child process as the
daemon is (same loop ``uvloop``, same HTTP parser ``httptools``), on a Unix socket of the same
kind. It answers ``GET /bytes?n=N`` with ``N`` bytes from a bytes object it holds, and
``GET /pread?file=F&offset=O&n=N`` with ``N`` bytes it ``os.pread``-s at ``O`` of ``F`` (a
path under its root, opened once), each as one body with a ``Content-Length``. The bench
reads them with httpx, the client payloadd's HTTP transport uses, on the same Unix-socket
transport (``httpx.HTTPTransport(uds=...)``), streaming the body into a preallocated array,
and reads the same stored bytes with payloadd's ``read_field(..., dtype=np.uint8, out=...)``
over HTTP, interleaved, for 1 MiB and 16 MiB items: payloadd ÷ the ``pread`` ceiling.

Run as ``python -m payloadd.bench._http_ceiling SOCKET ROOT``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
import numpy as np

from payload_client import PayloadClient
from payloadd.bench._daemon_process import run_child
from payloadd.bench._measure import Add, Op, measure_gbps, page_aligned
from payloadd.bench._rl_batch import LAYERS, ROUTED, TOP_K

__all__ = ["BareApp", "bench_http_ceiling", "main", "start_bare"]

SIZES = {"1MiB": 2_730, "16MiB": 43_690}
"""Rows of router ids of each item size (as in the throughput rows)."""
RUN = "bench-http-ceiling"
CEILING = "HTTP ceiling: bare uvicorn, pread"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class BareApp:
    """The bare ASGI app: ``/healthz``, ``/bytes`` and ``/pread``.

    Parameters
    ----------
    root : Path
        Folder the ``file`` of ``/pread`` is relative to.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.held: dict[int, bytes] = {}
        self.fds: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request (``lifespan`` is off)."""
        if scope["type"] != "http":
            return
        q = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        status, body = 200, b"ok"
        if scope["path"] == "/bytes":
            n = int(q["n"])
            if n not in self.held:
                self.held[n] = os.urandom(n)
            body = self.held[n]
        elif scope["path"] == "/pread":
            f = q["file"]
            if f not in self.fds:
                self.fds[f] = os.open(self.root / f, os.O_RDONLY | os.O_CLOEXEC)
            body = os.pread(self.fds[f], int(q["n"]), int(q["offset"]))
        elif scope["path"] != "/healthz":
            status, body = 404, b"not found"
        headers = [(b"content-type", b"application/octet-stream"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    """Serve `BareApp` on a Unix socket: ``SOCKET ROOT``."""
    import uvicorn

    sock, root = (argv if argv is not None else sys.argv[1:])[:2]
    uvicorn.run(BareApp(Path(root)), uds=sock, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off")  # fmt: skip


@contextlib.contextmanager
def start_bare(sock: Path, root: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run the bare app in a child process until the block ends; wait until it answers.

    Parameters
    ----------
    sock : Path
        Unix socket it listens on (made by uvicorn).
    root : Path
        Folder of the files it preads.
    """
    cmd = [sys.executable, "-m", "payloadd.bench._http_ceiling", str(sock), str(root)]
    with run_child(cmd, sock, "the bare app") as proc:
        yield proc


def _into(hc: httpx.Client, url: str, out: np.ndarray) -> None:
    """GET ``url`` and stream its body into ``out`` (``uint8``, exactly the body's size)."""
    dest = memoryview(out.reshape(-1).data)
    pos = 0
    with hc.stream("GET", url) as r:
        if r.status_code != 200:
            raise RuntimeError(f"bare app answered {r.status_code}")
        for chunk in r.iter_raw():
            dest[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    if pos != len(dest):
        raise RuntimeError(f"bare app sent {pos} bytes, not {len(dest)}")


def bench_http_ceiling(
    add: Add, socket: Path, root: Path, tmp: Path, repeat: int, quick: bool
) -> None:
    """Measure payloadd's HTTP reads against the bare app, interleaved, in GB/s.

    Parameters
    ----------
    add, socket, root, repeat
        As every ``bench_*`` function's (`payloadd.bench._measure`); the bare app preads the
        stored files under ``root``.
    tmp : Path
        Folder for the bare app's socket.
    quick : bool
        Reads rotate over 16 MiB of stored copies instead of 64 MiB, and a sample moves
        16 MiB instead of 64 MiB (at least 2 calls).
    """
    budget = (16 << 20) if quick else (64 << 20)
    bare = tmp / "bare.sock"
    with (
        PayloadClient(socket) as fast,
        PayloadClient(socket, data_plane=False) as http,
        start_bare(bare, root),
        httpx.Client(transport=httpx.HTTPTransport(uds=str(bare)), base_url="http://bare",
                     timeout=60) as hc,
    ):  # fmt: skip
        for label, n in SIZES.items():
            _one_size(add, label, n, fast, http, hc, budget, repeat)


def _one_size(
    add: Add,
    label: str,
    n: int,
    fast: PayloadClient,
    http: PayloadClient,
    hc: httpx.Client,
    budget: int,
    repeat: int,
) -> None:
    rows = np.random.default_rng(4).integers(0, 128, (n, LAYERS, TOP_K), dtype=np.uint8)
    segs = [s for _ in range(max(1, budget // rows.nbytes))
            for s in fast.append(ROUTED, rows, 0, run=RUN, step=0)]  # fmt: skip
    out = page_aligned(rows.nbytes).reshape(rows.shape)
    turn = itertools.cycle(segs)
    urls = itertools.cycle(
        [f"/pread?file={quote(s.file)}&offset={s.offset}&n={rows.nbytes}" for s in segs]
    )

    def payloadd() -> None:
        s = next(turn)
        http.read_field([s], ROUTED, s.pos, s.pos + s.rows, 0, dtype=np.uint8, out=out)

    ops: list[Op] = [
        ("HTTP ceiling: bare uvicorn, bytes object",
         lambda: _into(hc, f"/bytes?n={rows.nbytes}", out), rows.nbytes, None),
        (CEILING, lambda: _into(hc, next(urls), out), rows.nbytes, None),
        ("read uint8 out= (http), vs the ceiling", payloadd, rows.nbytes, CEILING),
    ]  # fmt: skip
    measure_gbps(add, ops, label, max(2, budget // rows.nbytes), repeat)


if __name__ == "__main__":
    main()
