"""Garbage collection through the real daemon: admin routes, clients, 410 Gone, the sweep."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    StepCollectedError,
)
from payload_client.transports.dataplane import _descriptors
from tests.conftest import Daemon, Daemons, wait_until

PAYLOADD = [sys.executable, "-m", "payloadd"]


def rows(n: int, seed: int = 0) -> np.ndarray:
    return ((np.arange(n * 384) + seed) % 251).astype(np.uint8).reshape(n, 48, 8)


def read(c: PayloadClient, segs: list[PayloadSegment]) -> np.ndarray:
    out = c.read_field(segs, "f", segs[0].pos, segs[0].pos + segs[0].rows, 0, dtype=np.uint8)
    assert out is not None
    return out


def test_watermark_then_reads_answer_gone_naming_run_and_step(client: PayloadClient) -> None:
    run = f"wm-{uuid.uuid4().hex[:8]}"
    segs = {step: client.append("f", rows(4, step), 0, run=run, step=step) for step in range(4)}
    dry = client.gc(run, 1, dry_run=True)
    assert dry.dry_run and dry.steps == [(run, 0), (run, 1)] and dry.files == 2
    assert np.array_equal(read(client, segs[0]), rows(4, 0))  # a dry run removed nothing
    report = client.gc(run, 1)
    assert report.steps == [(run, 0), (run, 1)] and report.bytes == 2 * 4 * 384
    for step in (0, 1):
        with pytest.raises(FileGoneError, match=f"step {step} of run '{run}'"):
            read(client, segs[step])
    for step in (2, 3):
        assert np.array_equal(read(client, segs[step]), rows(4, step))
    never = PayloadSegment("f", f"test/{run}/9/f-00000000-000001.bin", 0, 0, 1, "uint8", [48, 8])
    with pytest.raises(FileMissingError):
        read(client, [never])
    report = client.delete_run(run)
    assert report.by_reason["run"].files == 2
    with pytest.raises(FileGoneError, match=r"step 3 .*\(run,"):
        read(client, segs[3])


def test_gone_is_http_410_and_bad_requests_are_400(daemon: Daemon) -> None:
    run = f"h-{uuid.uuid4().hex[:8]}"
    with PayloadClient(daemon.socket, data_plane=False) as c:
        (seg,) = c.append("f", rows(2), 0, run=run, step=0)
    transport = httpx.HTTPTransport(uds=str(daemon.socket))
    with httpx.Client(transport=transport, base_url="http://payloadd") as http:
        answer = http.post("/v1/admin/gc", json={"run": run, "through_step": 0})
        assert answer.status_code == 200 and answer.json()["files"] == 1
        body = {"extents": [[seg.file, 0, 768, 768]]}
        gone = http.post("/v1/read", json=body)
        assert gone.status_code == 410 and gone.json()["error"] == "FileGoneError"
        assert f"run '{run}'" in gone.json()["message"]
        for bad in ({"run": run}, {"through_step": -1}, {"ttl_s": -1}, {"nope": 1}):
            answer = http.post("/v1/admin/gc", json=bad)
            assert answer.status_code == 400, bad
        assert http.delete("/v1/admin/runs/..%2Fx").status_code in (400, 404)
        assert http.delete("/v1/admin/runs/a.b?dry_run=true").json()["dry_run"] is True
        maybe = http.delete("/v1/admin/runs/a.b?dry_run=maybe")
        assert maybe.status_code == 400 and maybe.json()["error"] == "InvalidRequestError"
        assert "dry_run" in maybe.json()["message"]
    with socket.socket(socket.AF_UNIX) as raw:  # no body, no Content-Length (curl -X POST)
        raw.connect(str(daemon.socket))
        raw.sendall(b"POST /v1/admin/gc HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n")
        raw_answer = b"".join(iter(lambda: raw.recv(65536), b""))
    assert raw_answer.startswith(b"HTTP/1.1 200 ") and b'"dry_run":false' in raw_answer


@pytest.mark.asyncio
async def test_async_client_collects(aclient: AsyncPayloadClient) -> None:
    run = f"a-{uuid.uuid4().hex[:8]}"
    segs = await aclient.append("f", rows(3), 0, run=run, step=5)
    assert (await aclient.gc(run, 5)).steps == [(run, 5)]
    with pytest.raises(FileGoneError):
        await aclient.read_field(segs, "f", 0, 3, 0)
    with pytest.raises(InvalidRequestError, match="go together"):
        await aclient.gc(run)
    assert (await aclient.delete_run(run, dry_run=True)).files == 0


def test_cached_descriptors_never_read_collected_files(daemon: Daemon) -> None:
    run, other = (f"dp-{uuid.uuid4().hex[:8]}" for _ in range(2))
    with PayloadClient(daemon.socket) as c, PayloadClient(daemon.socket) as admin:
        segs = c.append("f", rows(8), 0, run=run, step=0)
        assert np.array_equal(read(c, segs), rows(8))  # the client now caches the descriptor
        admin.gc(run, 0)
        with pytest.raises(FileGoneError):  # neither the old bytes nor fill
            read(c, segs)
        # the step is closed: the writer's next append into it is refused, nothing stored
        with pytest.raises(StepCollectedError, match=f"step 0 of run '{run}'"):
            c.append("f", rows(8, 1), 0, run=run, step=0)
        assert not (daemon.root / "test" / run / "0").exists()
        # a run deleted leaves its steps open: the writer's lease pointed into the removed
        # file, and the next append lands in a new one
        segs = c.append("f", rows(8), 0, run=other, step=0)
        assert np.array_equal(read(c, segs), rows(8))
        admin.delete_run(other)
        with pytest.raises(FileGoneError):
            read(c, segs)
        again = c.append("f", rows(8, 1), 0, run=other, step=0)
        assert again[0].file != segs[0].file
        assert (daemon.root / again[0].file).exists()
        assert np.array_equal(read(c, again), rows(8, 1))


def test_a_read_in_progress_completes_intact(daemon: Daemon) -> None:
    run = f"ip-{uuid.uuid4().hex[:8]}"
    data = rows(16384, 3)  # 6 MiB: streamed in 1 MiB chunks
    with PayloadClient(daemon.socket) as c:
        (seg,) = c.append("f", data, 0, run=run, step=0)
        transport = httpx.HTTPTransport(uds=str(daemon.socket))
        with httpx.Client(transport=transport, base_url="http://payloadd") as http:
            n = data.nbytes
            body = {"extents": [[seg.file, seg.offset, n, seg.offset + n]]}
            with http.stream("POST", "/v1/read", json=body) as answer:
                chunks = answer.iter_bytes()
                got = bytearray(next(chunks))
                assert c.gc(run, 0).files == 1  # collected while the answer is streaming
                for chunk in chunks:
                    got += chunk
        assert bytes(got) == data.tobytes()
        with pytest.raises(FileGoneError):
            read(c, [seg])


def test_ledger_survives_a_restart_and_the_cli_collects(tmp_path: Path, daemons: Daemons) -> None:
    root, sock = tmp_path / "root", tmp_path / "d.sock"
    with daemons.run("--node", "n", root=root, socket=sock), PayloadClient(sock) as c:
        segs = c.append("f", rows(2), 0, run="r", step=1)
        keep = c.append("f", rows(2), 0, run="r", step=2)
        done = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), "--run", "r",
                               "--through-step", "1", "--dry-run"], capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["steps"] == [["r", 1]]
        bad = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), "--run", "r"],
                             capture_output=True, text=True)  # fmt: skip
        assert bad.returncode == 2 and "--run and --through-step go together" in bad.stderr
        both = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), "--delete-run", "r",
                               "--run", "r", "--through-step", "1"], capture_output=True, text=True)  # fmt: skip
        assert both.returncode == 2 and "--delete-run goes alone" in both.stderr
        no_token = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), "--token-file",
                                   str(tmp_path / "missing"), "--run", "r", "--through-step", "1"],
                                  capture_output=True, text=True)  # fmt: skip
        assert no_token.returncode == 2 and "cannot read --token-file" in no_token.stderr
        for bad_value in (["--run", "../r", "--through-step", "1"], ["--ttl-s", "nan"]):
            out = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), *bad_value],
                                 capture_output=True, text=True)  # fmt: skip
            assert out.returncode == 2 and "InvalidRequest" not in out.stderr, out.stderr
            assert ("run" if "--run" in bad_value else "ttl_s") in out.stderr
        assert (root / segs[0].file).exists()  # nothing collected
        done = subprocess.run([*PAYLOADD, "gc", "--socket", str(sock), "--run", "r",
                               "--through-step", "1"], capture_output=True, text=True)  # fmt: skip
        assert json.loads(done.stdout)["files"] == 1
    with daemons.run("--node", "n", root=root, socket=sock), PayloadClient(sock) as c:
        with pytest.raises(FileGoneError, match="step 1 of run 'r'"):
            read(c, segs)
        assert np.array_equal(read(c, keep), rows(2))


def test_background_sweep_removes_old_steps_and_orphans(tmp_path: Path, daemons: Daemons) -> None:
    root, sock = tmp_path / "root", tmp_path / "d.sock"
    orphan = root / "n" / "crashed" / "0" / "f-deadbeef-000001.bin"
    orphan.parent.mkdir(parents=True)
    orphan.touch()  # an earlier daemon created it and died before writing
    sweep = ("--node", "n", "--ttl-s", "1", "--gc-interval-s", "0.2")
    with daemons.run(*sweep, root=root, socket=sock), PayloadClient(sock) as c:
        segs = c.append("f", rows(2), 0, run="old", step=0)
        hour_ago = time.time() - 3600
        os.utime(root / segs[0].file, (hour_ago, hour_ago))
        gone = (root / "n" / "old", root / "n" / "crashed")
        wait_until(lambda: not any(p.exists() for p in gone), 30, "the sweep collecting")
        with pytest.raises(FileGoneError, match="ttl"):
            read(c, segs)


def test_a_client_lets_go_of_collected_files(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = f"held-{uuid.uuid4().hex[:8]}"
    with PayloadClient(daemon.socket) as trainer, PayloadClient(daemon.socket) as admin:
        old = trainer.append("f", rows(4), 0, run=run, step=0)  # a lease on step 0's file
        read(trainer, old)  # and a cached read descriptor of it
        admin.gc(run, 0)
        monkeypatch.setattr(_descriptors, "DROP_REMOVED_S", 0.0)  # check at the next call
        new = trainer.append("f", rows(4), 0, run=run, step=1)
        assert np.array_equal(read(trainer, new), rows(4))
        assert old[0].file not in " ".join(open_files())  # its space is free


def open_files() -> list[str]:
    """Targets of this process's descriptors (a removed file shows as '... (deleted)')."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


@pytest.mark.parametrize("use", ["read", "append"])
def test_ttl_spares_a_run_in_use_over_the_data_plane(
    tmp_path: Path, daemons: Daemons, use: str
) -> None:
    root, sock = tmp_path / "root", tmp_path / "d.sock"
    sweep = ("--node", "n", "--ttl-s", "1", "--gc-interval-s", "0.2")
    with daemons.run(*sweep, root=root, socket=sock), PayloadClient(sock) as c:
        segs = c.append("f", rows(2), 0, run="busy", step=0)
        assert np.array_equal(read(c, segs), rows(2))
        t0 = time.monotonic()
        for k in itertools.count():  # in use every 0.1 s, for three TTLs
            if time.monotonic() - t0 > 3:
                break
            if use == "append":  # later steps of the run: step 0 is still the run's data
                c.append("f", rows(1, k), k, run="busy", step=1)
            else:
                assert np.array_equal(read(c, segs), rows(2))
            time.sleep(0.1)
        assert np.array_equal(read(c, segs), rows(2))
