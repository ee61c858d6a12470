"""kill -9 during heavy concurrent appends, restart: nothing acknowledged is lost or changed.

Writer processes (`tests.payloadd.crash_writer`) append over both transports and record each
acknowledged append as soon as it returns. The daemon is SIGKILLed while they append; a new
daemon starts on the same root and socket (the killed one's socket files are still there).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import selectors
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from payload_client import (
    PayloadClient,
    PayloadSegment,
    SegmentFileError,
    TransportError,
    Window,
    row_nbytes,
)
from tests.conftest import Daemons
from tests.payloadd.crash_writer import (
    FIELDS,
    MAX_FILE_BYTES,
    Ack,
    Stop,
    plan,
    record_decoder,
)

WRITERS = 4
"""Writer processes (two threads each)."""
KILL_AFTER = 400
"""Acknowledged appends (at least) before the kill; at least `PER_TRANSPORT` on each
transport and `PER_WRITER` from every writer, so all of them are busy when it lands."""
PER_TRANSPORT = 150
PER_WRITER = 25
WAIT_S = 120.0
"""Generous bound on every wait (a loaded 2-core machine); none is reached normally."""
FLAGS = (
    "--node", "crash", "--max-file-bytes", str(MAX_FILE_BYTES), "--lease-bytes", "16384",
    "--fields", json.dumps(FIELDS),  # the writers' fields, declared
)  # fmt: skip
R = "routed_experts"


@dataclass
class Appended:
    """An acknowledged append: its items ``(field, rows, pos)`` and each item's segments."""

    name: str
    items: list[tuple[str, np.ndarray, int]]
    segments: list[list[PayloadSegment]]
    via: str = ""


@dataclass
class Writer:
    """A writer process, its record file and the acks it has announced on stdout."""

    index: int
    proc: subprocess.Popen[bytes]
    record: Path
    stderr: Path
    acks: Counter[str] = field(default_factory=Counter)
    open: bool = True

    def log(self) -> str:
        return f"writer {self.index} (exit {self.proc.poll()}): {self.stderr.read_text()[-3000:]}"


def _start_writers(tmp: Path, sock: Path) -> list[Writer]:
    repo = Path(__file__).resolve().parents[2]
    writers = []
    for i in range(WRITERS):
        record, err = tmp / f"writer-{i}.jsonl", tmp / f"writer-{i}.err"
        with open(err, "wb") as stderr:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.payloadd.crash_writer",
                    str(sock),
                    str(record),
                    str(i),
                ],
                cwd=repo,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        writers.append(Writer(i, proc, record, err))
    return writers


def _go(writers: list[Writer]) -> None:
    for w in writers:
        assert w.proc.stdin is not None
        w.proc.stdin.write(b"go\n")
        w.proc.stdin.close()


def _pump(sel: selectors.BaseSelector, timeout: float) -> None:
    """Count the ack bytes the writers announce; notice the ones that ended."""
    for key, _ in sel.select(timeout):
        w: Writer = key.data
        data = os.read(key.fd, 1 << 16)
        if not data:
            sel.unregister(key.fileobj)
            w.open = False
        w.acks["dp"] += data.count(b"d")
        w.acks["http"] += data.count(b"h")


def _wait_until_busy(sel: selectors.BaseSelector, writers: list[Writer]) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        total = sum((w.acks for w in writers), Counter[str]())
        if (
            total.total() >= KILL_AFTER
            and min(total["dp"], total["http"]) >= PER_TRANSPORT
            and all(w.acks.total() >= PER_WRITER for w in writers)
        ):
            return
        for w in writers:
            assert w.open, f"a writer ended before the kill: {w.log()}"
        if time.monotonic() > deadline:
            pytest.fail(f"too few acks in {WAIT_S} s: {[dict(w.acks) for w in writers]}")
        _pump(sel, 1.0)


def _drain(sel: selectors.BaseSelector, writers: list[Writer]) -> None:
    """Read until every writer closed its stdout (it stopped), then reap them."""
    deadline = time.monotonic() + WAIT_S
    while any(w.open for w in writers):
        assert time.monotonic() < deadline, "writers did not stop after the kill"
        _pump(sel, 1.0)
    for w in writers:
        assert w.proc.wait(WAIT_S) == 0, w.log()


@contextlib.contextmanager
def _reaped(writers: list[Writer]) -> Iterator[None]:
    """On the way out, end the writer processes still running (a failed test) and reap them."""
    try:
        yield
    finally:
        for w in writers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()
            for pipe in (w.proc.stdin, w.proc.stdout):
                assert pipe is not None
                pipe.close()


def _read_records(writers: list[Writer]) -> tuple[list[Appended], list[Stop]]:
    acked, stops = [], []
    for w in writers:
        for line in w.record.read_bytes().splitlines():
            rec = record_decoder.decode(line)
            if isinstance(rec, Stop):
                stops.append(rec)
                continue
            assert isinstance(rec, Ack)
            p = plan(rec.writer, rec.thread, rec.seq)
            assert rec.via == p.via
            name = f"writer {rec.writer} thread {rec.thread} append {rec.seq} ({rec.via})"
            acked.append(Appended(name, p.items, rec.segments, rec.via))
    return acked, stops


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every data file under ``root``: its size and SHA-256."""
    return {
        p.relative_to(root).as_posix(): (
            p.stat().st_size,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in root.rglob("*.bin")
    }


def _check_tiling(a: Appended) -> None:
    """Each item's segments cover its rows in order, with its field, dtype and shape."""
    assert len(a.segments) == len(a.items), a.name
    for (fld, rows, pos), segs in zip(a.items, a.segments, strict=True):
        at = pos
        for s in segs:
            assert (s.field, s.dtype, s.shape) == (fld, rows.dtype.name, list(rows.shape[1:]))
            assert s.pos == at, a.name
            at += s.rows
        assert at == pos + len(rows), a.name


Spans = dict[str, list[tuple[int, int, str]]]
"""Acknowledged byte ranges ``(start, end, name)`` of each file, sorted."""


def _check_files(root: Path, appended: Sequence[Appended]) -> Spans:
    """Every segment's bytes in its file are the rows sent, bit for bit; no two overlap."""
    files: dict[str, bytes] = {}
    spans: Spans = {}
    for a in appended:
        _check_tiling(a)
        for (_, rows, pos), segs in zip(a.items, a.segments, strict=True):
            sent = rows.tobytes()  # little-endian already
            for s in segs:
                nb = row_nbytes(s)
                if s.file not in files:
                    files[s.file] = (root / s.file).read_bytes()
                k = s.pos - pos
                stored = files[s.file][s.offset : s.offset + s.rows * nb]
                assert stored == sent[k * nb : (k + s.rows) * nb], f"{a.name}: {s}"
                if s.rows:
                    spans.setdefault(s.file, []).append((s.offset, s.offset + s.rows * nb, a.name))
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end1, n1), (start2, _, n2) in itertools.pairwise(ranges):
            assert end1 <= start2, f"{n1} and {n2} overlap in {file}"
    return spans


def _check_unacknowledged(root: Path, stops: Sequence[Stop], spans: Spans) -> int:
    """The rows of the appends the kill cut short, wherever some of them reached a file, lie
    outside every acknowledged range; returns how many items were found so."""
    found = 0
    needles = []
    for stop in stops:
        for _, rows, _ in plan(stop.writer, stop.thread, stop.seq).items:
            if rows.nbytes >= 32:  # 32 random bytes or more: no match by chance
                needles.append((rows.tobytes()[:64], f"unacknowledged {stop}"))
    for path in root.rglob("*.bin"):
        file, data = path.relative_to(root).as_posix(), path.read_bytes()
        for needle, name in needles:
            at = data.find(needle)
            if at >= 0:
                found += 1
            while at >= 0:
                for start, end, acked in spans.get(file, []):
                    assert not (start < at + len(needle) and at < end), f"{name} is in {acked}"
                at = data.find(needle, at + 1)
    return found


def _check_reads(c: PayloadClient, appended: Sequence[Appended]) -> None:
    """Every item read back through ``c`` in its own dtype equals the rows sent, bit for bit."""
    windows, sent, names = [], [], []
    for a in appended:
        for (fld, rows, pos), segs in zip(a.items, a.segments, strict=True):
            windows.append(Window(segs, fld, pos, pos + len(rows), 0, dtype=rows.dtype))
            sent.append(rows)
            names.append(a.name)
    for start in range(0, len(windows), 256):
        end = start + 256
        got = c.read_many(windows[start:end])
        for out, rows, name in zip(got, sent[start:end], names[start:end], strict=True):
            assert out is not None and (out.dtype, out.shape) == (rows.dtype, rows.shape), name
            assert out.tobytes() == rows.tobytes(), name


def _is_socket(path: Path) -> bool:
    return path.exists() and stat.S_ISSOCK(path.lstat().st_mode)


def _append(c: PayloadClient, name: str, writer: int, seq: int) -> Appended:
    p = plan(writer, 0, seq)
    return Appended(name, p.items, c.append_many(p.items, run=p.run, step=p.step))


def test_kill_9_during_concurrent_appends_loses_nothing(tmp_path: Path, daemons: Daemons) -> None:
    """Four writer processes (two threads each, both transports, append and append_many, seven
    dtypes and shapes, two runs, three steps, items larger than a file) append until the
    daemon is SIGKILLed after 400 or more acknowledged appends. The writers stop on clear
    errors; a daemon restarted on the same root and socket then serves every acknowledged
    segment bit for bit (files, data plane, HTTP, clients that lived through the kill); no
    two segments overlap; what the kill cut short is in no segment; new appends go to new
    files and leave the files of before the kill as they were."""
    root, sock = tmp_path / "root", tmp_path / "payloadd.sock"
    data_sock = Path(f"{sock}.data")
    mine: list[Appended] = []  # the test's own appends, before and after the kill
    early = np.arange(2 * 384, dtype=np.uint8).reshape(2, 48, 8)
    with contextlib.ExitStack() as stack:
        writers = _start_writers(tmp_path, sock)  # they import while the daemon starts
        stack.enter_context(_reaped(writers))
        first = stack.enter_context(daemons.run(*FLAGS, socket=sock))
        # clients that live through the kill, unused while the daemon is down: one holds a
        # lease and a read descriptor of the first daemon, the other a pooled connection
        survivor = stack.enter_context(PayloadClient(sock))
        survivor_http = stack.enter_context(PayloadClient(sock, data_plane=False))
        segs = survivor.append(R, early, 0, run="crash-a", step=0)
        mine.append(Appended("survivor before", [(R, early, 0)], [segs]))
        _check_reads(survivor, mine)
        _check_reads(survivor_http, mine)
        with selectors.DefaultSelector() as sel:
            for w in writers:
                assert w.proc.stdout is not None
                sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            _go(writers)
            _wait_until_busy(sel, writers)
            with PayloadClient(sock, data_plane=False) as http:
                assert http.stats().leases >= 10  # data-plane appends really placed in leases
            os.kill(first.pid, signal.SIGKILL)
            assert first.proc.wait(WAIT_S) == -signal.SIGKILL
            _drain(sel, writers)
        acked, stops = _read_records(writers)

        # every writer thread stopped on a PayloadError (a clear transport error, no crash)
        assert len(stops) == 2 * WRITERS
        assert {s.error for s in stops} <= {
            "ConnectError",
            "TransportError",
            "ProtocolError",
            "AppendInDoubtError",
            "ConnectionLostError",
        }, stops
        via = Counter(a.via for a in acked)
        assert len(acked) >= 300 and min(via["dp"], via["http"]) >= PER_TRANSPORT, via

        # the killed daemon left its socket files; nothing answers on them
        assert _is_socket(sock) and _is_socket(data_sock)
        with PayloadClient(sock) as down:
            with pytest.raises(TransportError):
                down.append(R, early, 0, run="crash-a", step=0)
            fld, _, pos = acked[0].items[0]
            with pytest.raises(TransportError):
                down.read_field(acked[0].segments[0], fld, pos, pos + 1, 0)
        before = _snapshot(root)

        # restart on the same root and socket
        stack.enter_context(daemons.run(*FLAGS, socket=sock))
        fresh = stack.enter_context(PayloadClient(sock))
        fresh_http = stack.enter_context(PayloadClient(sock, data_plane=False))
        late = np.full((2, 48, 8), 7, np.uint8)
        segs = survivor.append(R, late, 2, run="crash-a", step=0)
        assert segs[0].file not in before  # not in the lease the first daemon gave it
        assert fresh_http.stats().leases == 1  # by the data plane, in a lease of the new daemon
        mine.append(Appended("survivor after", [(R, late, 2)], [segs]))
        mine += [_append(survivor_http, "survivor HTTP", 102, k) for k in range(5)]
        mine += [_append(fresh, "fresh data plane", 100, k) for k in range(20)]
        mine += [_append(fresh_http, "fresh HTTP", 101, k) for k in range(20)]

        # every acknowledged segment reads back bit for bit: in the files and on both
        # transports (the survivor's descriptors of the first daemon were dropped)
        everything = acked + mine
        spans = _check_files(root, everything)
        # the appends in flight at the kill: what of them reached a file is in no segment
        cut_short = _check_unacknowledged(root, stops, spans)
        for c in (fresh, fresh_http, survivor, survivor_http):
            _check_reads(c, everything)

        # new appends went to new files; the files of before the kill are untouched
        after = _snapshot(root)
        for a in mine[1:]:
            for s in itertools.chain.from_iterable(a.segments):
                assert s.file not in before, f"{a.name} appended to {s.file}, a file of before"
        # ... except empty ones: no append was acknowledged from them, and the restarted
        # daemon's first GC sweep removes them as orphans
        assert {f: after[f] for f in before if f in after} == {
            f: v for f, v in before.items() if f in after
        }
        assert all(before[f][0] == 0 for f in before if f not in after)

        # a segment reaching past what a file holds (a torn tail) is an error naming the
        # file on both transports, never fill
        last = max(
            (s for a in acked for s in itertools.chain.from_iterable(a.segments)),
            key=lambda s: before[s.file][0],
        )
        size = before[last.file][0]
        past = PayloadSegment(last.field, last.file, size - 1, 0, 1, "uint8", [2])
        for c in (fresh, fresh_http):
            with pytest.raises(SegmentFileError, match=re.escape(last.file)):
                c.read_field([past], last.field, 0, 1, 0)
        print(  # shown with pytest -s
            f"acknowledged before the kill: {dict(via)}; files: {len(before)}; "
            f"cut short, found in files: {cut_short}; stops: {Counter(s.error for s in stops)}"
        )
