"""``fsync = never | interval | always``: what each policy flushes, and when."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from payload_client import PayloadClient
from payload_client.wire._http import AppendItem, Stats
from payloadd import Store
from payloadd.store._durability import Flusher
from tests.conftest import Daemons, wait_until

R = "routed_experts"


def item(rows: int, *, run: str = "r", step: int = 0) -> AppendItem:
    return AppendItem(R, "uint8", [48, 8], rows, 0, run, step)


def _open_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def test_interval_flush_covers_appends_leases_and_sealed_files(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", fsync="interval", max_file_bytes=1000)
    ((a,),) = store.append([item(2)], bytes(768))
    ((b,),) = store.append([item(2)], bytes(768))  # rotates: a's file is sealed and closed
    assert a.file != b.file and str(tmp_path / a.file) not in _open_files()
    assert store.stats().files_dirty == 2
    assert store.flush() == sorted([a.file, b.file])  # the closed file too, by path
    assert store.flush() == []  # nothing written since
    lease = store.lease("r", 1, R, 384, 384, owner=1)
    assert store.flush() == [lease.file]  # the client writes it unseen: every flush
    assert store.flush() == [lease.file]
    lease.release()
    assert store.flush() == [lease.file]  # the flush after the lease ended
    assert store.flush() == []
    s = store.stats()
    assert (s.fsync, s.flushes, s.files_flushed, s.files_dirty, s.flush_errors) == (
        "interval", 4, 5, 0, 0,
    )  # fmt: skip
    store.close()


def test_interval_flush_skips_a_file_removed_since(tmp_path: Path) -> None:
    store = Store(tmp_path, "n", fsync="interval")
    ((a,),) = store.append([item(1, step=0)], bytes(384))
    ((b,),) = store.append([item(1, step=1)], bytes(384))
    (tmp_path / a.file).unlink()  # removed before the flush: nothing left to keep
    assert store.flush() == [b.file]
    assert store.stats().flush_errors == 0
    store.close()


@pytest.mark.parametrize("policy", ["never", "always"])
def test_other_policies_have_nothing_to_flush(tmp_path: Path, policy: str) -> None:
    store = Store(tmp_path, "n", fsync=policy)  # type: ignore[arg-type]
    store.append([item(1)], bytes(384))
    store.lease("r", 0, R, 384, 384, owner=1).release()
    assert store.flush() == []
    assert (store.stats().fsync, store.stats().files_dirty) == (policy, 0)
    store.close()


def test_flusher_runs_every_interval_and_flushes_once_more_at_stop() -> None:
    calls: list[float] = []

    def flush() -> list[str]:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise OSError("a failing flush is logged, the flusher goes on")
        return []

    flusher = Flusher(flush, 0.02)
    flusher.start()
    wait_until(lambda: len(calls) >= 4, 10, "four ticks of the flusher")
    flusher.stop()
    n = len(calls)
    assert n >= 5  # at least 4 ticks (one failed) and the last flush
    time.sleep(0.1)  # five of its intervals: time for a call after the stop to show
    assert len(calls) == n  # stopped
    with pytest.raises(ValueError, match="> 0"):
        Flusher(flush, 0)


def _wait_for(c: PayloadClient, ok: Callable[[Stats], bool]) -> Stats:
    """The daemon's counters once ``ok`` holds for them."""

    def counters() -> Stats | None:
        s = c.stats()
        return s if ok(s) else None

    return wait_until(counters, 20, "the counters")


def test_a_daemon_under_interval_flushes_both_transports(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "payloadd.sock"
    flags = ("--fsync", "interval", "--fsync-interval-s", "0.1")
    rows = np.arange(4 * 384, dtype=np.uint8).reshape(4, 48, 8)
    with daemons.run(*flags, socket=sock), PayloadClient(sock) as probe:
        assert probe.stats().fsync == "interval"
        with PayloadClient(sock, data_plane=False) as http:
            http.append(R, rows, 0, run="http", step=0)
        s = _wait_for(probe, lambda s: s.files_flushed >= 1 and s.files_dirty == 0)
        flushed = s.files_flushed
        with PayloadClient(sock) as fast:
            segs = fast.append(R, rows, 0, run="dp", step=0)  # a lease: dirty while it lasts
            assert fast._data_plane is not None and fast._data_plane.leases.items
            assert not next(
                iter(fast._data_plane.leases.items.values())
            ).fsync  # the flusher does it
            # the leased file is fsync'd at every flush, for as long as the lease lasts
            s = _wait_for(probe, lambda s: s.files_flushed >= flushed + 3)
            assert s.files_dirty == 1
            np.testing.assert_array_equal(fast.read_field(segs, R, 0, 4, 0), rows)
        # the client closed: its lease ended; the flush after that leaves nothing dirty
        s = _wait_for(probe, lambda s: s.files_dirty == 0)
        assert s.flush_errors == 0


def test_shutdown_flushes_what_the_interval_has_not_yet(
    tmp_path: Path, daemons: Daemons, capfd: pytest.CaptureFixture[str]
) -> None:
    sock = tmp_path / "payloadd.sock"
    flags = ("--fsync", "interval", "--fsync-interval-s", "3600")
    with daemons.run(*flags, socket=sock, log_level="info") as d:
        with PayloadClient(sock, data_plane=False) as c:
            c.append(R, np.ones((1, 48, 8), np.uint8), 0, run="r", step=0)
            c.append(R, np.ones((1, 48, 8), np.uint8), 0, run="r", step=1)
            s = c.stats()
            assert (s.files_dirty, s.flushes) == (2, 0)  # the first flush is an hour away
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
    assert "last flush at shutdown: 2 data files fsync'd" in capfd.readouterr().err
