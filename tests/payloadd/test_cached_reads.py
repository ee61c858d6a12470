"""Data-plane reads at once from cached descriptors (``read_now``): no exchange, one ``fstat``
a file; a collected file is still 410, also when another node's daemon collected it.

Real daemons on real sockets; the client's periodic look at every descriptor and its notes of
runs in use are pushed out of the way, so that only the read's own look tells a reader that a
file went.
"""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from payload_client import FileGoneError, PayloadClient, PayloadSegment, Window
from payload_client.clients._plans import plan_reads
from payload_client.transports.dataplane import _descriptors
from tests.conftest import Daemon

R = "routed_experts"


@pytest.fixture(autouse=True)
def _no_periodic_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_descriptors, "DROP_REMOVED_S", 1e9)
    monkeypatch.setattr(_descriptors, "TELL_USE_S", 1e9)


def rows(value: int, n: int = 3) -> np.ndarray:
    return (np.arange(n * 384).reshape(n, 48, 8) + value).astype(np.uint8)


def at_once(c: PayloadClient, segs: list[PayloadSegment], out: np.ndarray) -> bool:
    """Whether a read of ``segs`` into ``out`` is served at once (and then do it)."""
    dp = c._data_plane
    assert dp is not None
    planned = plan_reads([Window(segs, R, segs[0].pos, segs[0].pos + len(out), 0, out)])
    return dp.read_now(planned.plans, planned.outs)


def test_a_second_read_is_served_at_once_and_a_collection_ends_that(daemon: Daemon) -> None:
    run = f"cached-{uuid.uuid4().hex[:8]}"
    with PayloadClient(daemon.socket) as c, PayloadClient(daemon.socket) as admin:
        old = c.append(R, rows(1), 0, run=run, step=0)
        new = c.append(R, rows(2), 0, run=run, step=1)
        out = np.empty((3, 48, 8), np.uint8)
        assert not at_once(c, old, out)  # never opened: it needs the daemon
        c.read_field(old, R, 0, 3, 0, out=out)
        c.read_field(new, R, 0, 3, 0, out=out)
        out[...] = 0
        assert at_once(c, old, out)  # cached, still linked
        np.testing.assert_array_equal(out, rows(1))
        assert admin.gc(run, 0).files == 1  # another client collects step 0
        assert not at_once(c, old, out)  # removed: the daemon answers
        with pytest.raises(FileGoneError):
            c.read_field(old, R, 0, 3, 0, out=out)  # never the removed file's bytes
        np.testing.assert_array_equal(c.read_field(new, R, 0, 3, 0, out=out), rows(2))
        assert at_once(c, new, out)  # still there: at once


def test_reads_racing_collections_give_their_rows_or_410(daemon: Daemon) -> None:
    """Readers released by a barrier onto steps that a collector removes one by one."""
    run, steps, threads = f"cached-{uuid.uuid4().hex[:8]}", 24, 4
    with PayloadClient(daemon.socket) as c, PayloadClient(daemon.socket) as admin:
        segs = [c.append(R, rows(s), 0, run=run, step=s) for s in range(steps)]
        start = threading.Barrier(threads + 1)
        collected = [-1]  # steps <= this one are gone (set after the gc call returns)
        errors: list[BaseException] = []
        counts = {"rows": 0, "gone": 0}
        lock = threading.Lock()

        def reader(t: int) -> None:
            try:
                out = np.empty((3, 48, 8), np.uint8)
                start.wait()
                deadline = time.monotonic() + 20
                k = t
                while collected[0] < steps - 1 and time.monotonic() < deadline:
                    s = k % steps
                    k += 1
                    before = collected[0]
                    try:
                        c.read_field(segs[s], R, 0, 3, 0, out=out)
                    except FileGoneError:
                        # 410 only from the collection of its step on (it may still run)
                        assert s <= collected[0] + 1, f"step {s} answered 410 before its gc"
                        with lock:
                            counts["gone"] += 1
                        continue
                    assert s > before, f"step {s} read after its collection returned"
                    np.testing.assert_array_equal(out, rows(s))
                    with lock:
                        counts["rows"] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        def collector() -> None:
            try:
                start.wait()
                for s in range(steps):
                    time.sleep(0.02)
                    admin.gc(run, s)
                    collected[0] = s
            except BaseException as exc:  # reported below
                errors.append(exc)

        workers = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
        workers.append(threading.Thread(target=collector))
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert not errors, errors
        assert counts["rows"] > steps and counts["gone"] > 0, counts
