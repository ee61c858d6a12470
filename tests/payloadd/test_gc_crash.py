"""A collection cut by a crash is finished by the restart, before the daemon serves.

Its ledger line says its files go: after a ``kill -9`` between the line and the last
removal, the restarted daemon removes what is left of them (and says the collection done),
so that no read answers a file the ledger calls collected.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

from payload_client import FileGoneError, PayloadClient, PayloadError, PayloadSegment
from payloadd.store._ledger import LEDGER_NAME, Ledger

from ..conftest import TRANSPORTS, Daemons, default_env, wait_until

RE = "routed_experts"
SMALL = ("--node", "n", "--max-file-bytes", "4096")  # a file every 10 rows of 384 bytes


def _write(sock: Path, steps: int, per_step: int) -> dict[int, list[PayloadSegment]]:
    """``per_step`` files in each of ``steps`` steps of run ``r``; their segments by step."""
    rows = np.full((10, 48, 8), 7, np.uint8)
    segs: dict[int, list[PayloadSegment]] = {}
    with PayloadClient(sock, data_plane=False) as c:
        for step in range(steps):
            segs[step] = [s for k in range(per_step) for s in
                          c.append(RE, rows, 10 * k, run="r", step=step)]  # fmt: skip
    return segs


@pytest.mark.parametrize("reader", TRANSPORTS)
def test_a_collection_cut_after_its_line_is_finished_by_the_restart(
    tmp_path: Path, daemons: Daemons, reader: str
) -> None:
    root, sock, env = tmp_path / "root", tmp_path / "s.sock", default_env()
    with daemons.run(*SMALL, root=root, socket=sock, env=env):
        segs = _write(sock, 2, 8)
    files = sorted({s.file for s in segs[0]})
    assert len(files) == 8
    ledger = Ledger(root / "n" / LEDGER_NAME)  # the state a kill -9 mid-collection leaves:
    ledger.begin("r", "watermark", files, 0)  # its line written, fsync'd ...
    for rel in files[:3]:
        os.unlink(root / rel)  # ... and only some of its files removed
    with daemons.run(*SMALL, root=root, socket=sock, env=env):
        assert not [rel for rel in files if (root / rel).exists()]
        with PayloadClient(sock, data_plane=reader == "data-plane") as c:
            for s in segs[0]:
                with pytest.raises(FileGoneError, match="step 0 of run 'r'"):
                    c.read_field([s], RE, s.pos, s.pos + s.rows, 0)
            got = c.read_field(segs[1][:1], RE, 0, 10, 0)  # the step not collected
            assert got is not None and (got == 7).all()
    assert not Ledger(root / "n" / LEDGER_NAME).unfinished()  # said done, once


def test_kill_9_during_a_large_collection_leaves_no_listed_file_after_the_restart(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    root, sock, env = tmp_path / "root", tmp_path / "s.sock", default_env()
    ledger_path = root / "n" / LEDGER_NAME
    with daemons.run(*SMALL, root=root, socket=sock, env=env) as d:
        segs = _write(sock, 4, 80)  # 320 files

        def collect() -> None:
            with PayloadClient(sock, data_plane=False) as c, contextlib.suppress(PayloadError):
                c.gc(run="r", through_step=3)  # (the daemon dies under it)

        t = threading.Thread(target=collect)
        t.start()
        wait_until(  # its line is written: the removals begin
            lambda: b'"files":["n/r/' in (ledger_path.read_bytes() if ledger_path.exists() else b""),
            30, "the collection's line", every=0.001,
        )  # fmt: skip
        os.kill(d.pid, signal.SIGKILL)
        d.proc.wait(10)
        t.join(60)
    lines = [json.loads(line) for line in ledger_path.read_bytes().splitlines()]
    listed = {f for line in lines for f in line.get("files", [])}  # each: a file that goes
    assert listed
    with daemons.run(*SMALL, root=root, socket=sock, env=env):
        gone = [s for step in segs for s in segs[step] if s.file in listed]
        assert not [s.file for s in gone if (root / s.file).exists()]
        with PayloadClient(sock) as c:
            for s in gone[:: max(1, len(gone) // 20)]:
                with pytest.raises(FileGoneError):
                    c.read_field([s], RE, s.pos, s.pos + s.rows, 0)
    assert not Ledger(ledger_path).unfinished()
