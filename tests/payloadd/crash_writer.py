"""A writer process of the kill -9 test: appends until the daemon goes away, records each ack.

Run as ``python -m tests.payloadd.crash_writer SOCKET RECORD WRITER``; it starts appending when
a line arrives on stdin (so it can start while the daemon does). Two threads share one
data-plane client and one HTTP client; each thread alternates between them. As soon as an
append returns, its thread writes an `Ack` line (JSON) to RECORD and flushes it, then writes
one byte to stdout (``d`` data plane, ``h`` HTTP) so the test can count acknowledged appends
without polling. The rows are not recorded: `plan` regenerates them from
``(writer, thread, seq)``. At its first `PayloadError` a thread writes a `Stop` line and ends.
The process exits 0 only when every thread ended that way.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import IO

import msgspec
import numpy as np

from payload_client import PayloadClient, PayloadError, PayloadSegment

__all__ = ["FIELDS", "MAX_FILE_BYTES", "Ack", "Plan", "Stop", "plan", "record_decoder"]

MAX_FILE_BYTES = 64 << 10
"""Rotation size the test's daemon runs with; a few items are larger (split across files)."""
THREADS = 2
DEADLINE_S = 120.0
"""A writer whose daemon never goes away stops by itself after this long."""
SPECS: list[tuple[str, str, tuple[int, ...] | None]] = [
    ("routed_experts", "uint8", (48, 8)),
    ("routed_experts", "uint16", (48, 8)),  # more than 256 experts, in the same field's files
    ("sampling_mask", "int32", None),  # ragged: a width of its own per item
    ("logprobs", "float32", (1,)),
    ("weights", "float16", (4,)),
    ("flags", "int8", (3,)),
    ("ids", "int16", (2, 5)),
]
FIELDS = {
    "routed_experts": {"dtypes": ["uint8", "uint16"], "fill": 0, "ragged": False},
    "sampling_mask": {"dtypes": ["int32"], "fill": -1, "max_width": 1 << 16, "ragged": True},
    "logprobs": {"dtypes": ["float32"], "fill": 0.0, "ragged": False},
    "weights": {"dtypes": ["float16"], "fill": 0.0, "ragged": False},
    "flags": {"dtypes": ["int8"], "fill": 0, "ragged": False},
    "ids": {"dtypes": ["int16"], "fill": 0, "ragged": False},
}
"""The test's daemon's fields table (``--fields``), one entry per field of `SPECS`: unknown
fields are refused. Each field's row shape is the same in every run (fixed by its first
append there), but for the ragged sampling mask's width."""
RUNS = ("crash-a", "crash-b")
STEPS = 3


@dataclass(frozen=True)
class Plan:
    """One append: where it goes, how it travels, and its items ``(field, rows, pos)``."""

    run: str
    step: int
    via: str  # "dp" (data plane) or "http"
    items: list[tuple[str, np.ndarray, int]]


def plan(writer: int, thread: int, seq: int) -> Plan:
    """The append number ``seq`` of a thread: the same arrays every time it is asked for.

    Rows are random bits (float NaN payloads included), 1..48 rows an item, one item in
    25 larger than a data file; one append in four carries 2..4 items (``append_many``).
    """
    rng = np.random.default_rng([writer, thread, seq])
    run = RUNS[int(rng.integers(len(RUNS)))]
    step = int(rng.integers(STEPS))
    n_items = 1 if rng.random() < 0.75 else int(rng.integers(2, 5))
    items = []
    for _ in range(n_items):
        field, dtype, shape = SPECS[int(rng.integers(len(SPECS)))]
        if shape is None:
            shape = (int(rng.integers(1, 41)),)
        dt = np.dtype(dtype).newbyteorder("<")
        row_nb = dt.itemsize * int(np.prod(shape))
        if rng.random() < 0.04:
            rows = MAX_FILE_BYTES // row_nb + int(rng.integers(1, 64))
        else:
            rows = int(rng.integers(1, 49))
        data = np.frombuffer(rng.bytes(rows * row_nb), dtype=dt).reshape(rows, *shape)
        items.append((field, data, int(rng.integers(0, 1 << 40))))
    return Plan(run, step, "dp" if (seq + thread) % 2 == 0 else "http", items)


class Ack(msgspec.Struct, tag="ack"):
    """An acknowledged append: the segments of each item of ``plan(writer, thread, seq)``."""

    writer: int
    thread: int
    seq: int
    via: str
    segments: list[list[PayloadSegment]]


class Stop(msgspec.Struct, tag="stop"):
    """A thread's last append failed with ``error`` (a `PayloadError` class name)."""

    writer: int
    thread: int
    seq: int
    via: str
    error: str
    message: str


record_decoder = msgspec.json.Decoder(Ack | Stop)
_encoder = msgspec.json.Encoder()


def _write_thread(
    writer: int,
    thread: int,
    clients: dict[str, PayloadClient],
    out: IO[bytes],
    lock: threading.Lock,
) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    seq = 0
    while time.monotonic() < deadline:
        p = plan(writer, thread, seq)
        c = clients[p.via]
        try:
            if len(p.items) == 1:
                field, rows, pos = p.items[0]
                segments = [c.append(field, rows, pos, run=p.run, step=p.step)]
            else:
                segments = c.append_many(p.items, run=p.run, step=p.step)
        except PayloadError as exc:
            stop = Stop(writer, thread, seq, p.via, type(exc).__name__, str(exc))
            with lock:
                out.write(_encoder.encode(stop) + b"\n")
                out.flush()
            return True
        with lock:
            out.write(_encoder.encode(Ack(writer, thread, seq, p.via, segments)) + b"\n")
            out.flush()
            os.write(1, b"d" if p.via == "dp" else b"h")
        seq += 1
    return False


def main(argv: list[str]) -> int:
    """Append from `THREADS` threads until each sees a `PayloadError`; 0 if all did."""
    socket_path, record, writer = argv[0], argv[1], int(argv[2])
    ok = [False] * THREADS
    lock = threading.Lock()
    sys.stdin.readline()  # go

    def run(thread: int) -> None:
        try:
            ok[thread] = _write_thread(writer, thread, clients, out, lock)
        except BaseException:
            traceback.print_exc()

    with (
        PayloadClient(socket_path, timeout=30) as dp,
        PayloadClient(socket_path, data_plane=False, timeout=30) as http,
        open(record, "ab") as out,
    ):
        clients = {"dp": dp, "http": http}
        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
