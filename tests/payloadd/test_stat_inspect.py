"""``GET /v1/admin/usage``, ``payloadd stat`` and ``payloadd inspect`` against real daemons."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    StepCollectedError,
    UnauthorizedError,
)
from payload_client.protocol import format_size
from payloadd.cli._main import main
from payloadd.cli._stat import rates
from tests.conftest import Daemon, Daemons, wait_until

PAYLOADD = [sys.executable, "-m", "payloadd"]
TOKEN = "stat-token-" + "0123456789abcdef"


def run_cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAYLOADD_")}
    return subprocess.run([*PAYLOADD, *args], capture_output=True, text=True, timeout=120,
                          env=base | (env or {}), input=stdin)  # fmt: skip


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command in this process (its error paths: no process start per case)."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def routed(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n * 48 * 8) * 7 + seed) % 251).astype(np.uint8).reshape(n, 48, 8)


def mask(n: int, width: int, seed: int) -> np.ndarray:
    return (np.arange(n * width, dtype=np.int32) * 3 - seed).reshape(n, width)


def files_on_disk(root: Path, run_dir: Path) -> dict[int, tuple[int, int, int]]:
    """Step -> (files, apparent bytes, bytes on disk), by os.stat."""
    out = {}
    for step_dir in run_dir.iterdir():
        st = [os.stat(p) for p in step_dir.iterdir()]
        out[int(step_dir.name)] = (len(st), sum(s.st_size for s in st),
                                   sum(s.st_blocks * 512 for s in st))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon of this module's own (GC and ledger assertions need a quiet node)."""
    with Daemons(tmp_path_factory.mktemp("stat")) as d:
        own = d.start("--node", "st", socket=d.folder / "payloadd.sock")
        yield Daemon(own.root, own.socket)


# -- the route and the clients -------------------------------------------------------------


@pytest.mark.parametrize("data_plane", [True, False])
def test_usage_matches_the_files_written_and_changes_after_gc(own: Daemon, data_plane: bool) -> None:  # fmt: skip
    run = f"u-{uuid.uuid4().hex[:8]}"
    with PayloadClient(own.socket, data_plane=data_plane) as c:
        for step in range(3):
            c.append("routed_experts", routed(5 + step, step), 0, run=run, step=step)
            c.append("sampling_mask", mask(5 + step, 16, step), 0, run=run, step=step)
        c.stats()  # the data-plane client's counters reach the daemon
        u = c.usage()
        (r,) = [x for x in u.runs if x.run == run]
        assert [s.step for s in r.steps] == [0, 1, 2]
        disk = files_on_disk(own.root, own.root / "st" / run)
        for s in r.steps:
            assert (s.files, s.bytes, s.disk_bytes) == disk[s.step]
            if not data_plane:  # over HTTP a file is exactly its rows
                assert s.bytes == (5 + s.step) * (384 + 64)
            assert s.files == 2 and 0 < u.now - s.mtime < 600
        assert (r.files, r.bytes) == (6, sum(d[1] for d in disk.values()))
        report = c.gc(run=run, through_step=1)
        assert report.steps == [(run, 0), (run, 1)]
        after = c.usage(ledger=1)
        (r2,) = [x for x in after.runs if x.run == run]
        assert [s.step for s in r2.steps] == [2]
        assert after.bytes == u.bytes - disk[0][1] - disk[1][1]
        assert after.files == u.files - 4 and after.steps == u.steps - 2
        (entry,) = after.ledger
        assert (entry.run, entry.reason, entry.steps, entry.files) == (run, "watermark", [0, 1], 4)
        assert entry.bytes == report.bytes == disk[0][1] + disk[1][1]
        assert after.ledger_entries == u.ledger_entries + 1
        with pytest.raises(InvalidRequestError, match="max_steps"):
            c.usage(max_steps=-1)
        with pytest.raises(InvalidRequestError, match="400"):  # the daemon's bound
            c.usage(ledger=10**6)
        assert c.usage(max_steps=0).runs == []


@pytest.mark.asyncio
async def test_async_client_usage(aclient: AsyncPayloadClient) -> None:
    run = f"au-{uuid.uuid4().hex[:8]}"
    await aclient.append("f", np.ones((3, 4), np.uint8), 0, run=run, step=9)
    u = await aclient.usage()
    (r,) = [x for x in u.runs if x.run == run]
    assert [(s.step, s.files) for s in r.steps] == [(9, 1)]


def test_usage_is_an_admin_call(
    tmp_path: Path, daemons: Daemons, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o600)
    sock = tmp_path / "s.sock"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ("--admin-token-file", str(tmp_path / "token"), "--tcp-port", str(port))
    with daemons.run(*flags, socket=sock):
        with PayloadClient(sock) as c:
            segs = c.append("f", np.arange(8, dtype=np.uint8).reshape(2, 4), 0, run="t", step=0)
            with pytest.raises(UnauthorizedError, match="401"):
                c.usage()
        # over TCP (rows over HTTP), both commands with the token
        url, token = f"http://127.0.0.1:{port}", str(tmp_path / "token")
        code, out, err = run_main(capsys, "stat", "--base-url", url, "--token-file", token,
                                  "--interval", "0", "--json")  # fmt: skip
        assert code == 0 and json.loads(out)["usage"]["runs"][0]["run"] == "t", err
        path = _segments_file(tmp_path, segs)
        code, out, err = run_main(capsys, "inspect", str(path), "--base-url", url,
                                  "--token-file", token, "--json")  # fmt: skip
        assert code == 0 and json.loads(out)["segments"][0]["read"]["rows"] == [[0, 1, 2, 3], [4, 5, 6, 7]], err  # fmt: skip
        code, out, err = run_main(capsys, "inspect", str(path), "--base-url", url)
        assert code == 1 and "  error: UnauthorizedError: calls over TCP need" in out, out
        with PayloadClient(sock, token=TOKEN) as c:
            assert [r.run for r in c.usage().runs] == ["t"]
        refused = run_cli("stat", "--socket", str(sock), "--interval", "0")
        assert refused.returncode == 1 and "UnauthorizedError" in refused.stderr
        assert "admin token" in refused.stderr and refused.stdout == ""
        done = run_cli("stat", "--socket", str(sock), "--interval", "0",
                       "--token-file", str(tmp_path / "token"))  # fmt: skip
        assert done.returncode == 0, done.stderr
        done = run_cli("stat", "--interval", "0", env={"PAYLOADD_SOCKET": str(sock),
                                                      "PAYLOADD_ADMIN_TOKEN": TOKEN})  # fmt: skip
        assert done.returncode == 0, done.stderr


# -- payloadd stat ----------------------------------------------------------------------------


class Writer(threading.Thread):
    """Appends and reads over HTTP (counted by the daemon at once) until stopped."""

    def __init__(self, socket: Path, run: str, step: int) -> None:
        super().__init__(daemon=True)
        self.socket, self.run_name, self.step = socket, run, step
        self.stop = threading.Event()
        self.started_writing = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with PayloadClient(self.socket, data_plane=False) as c:
                while not self.stop.is_set():
                    segs = c.append(
                        "routed_experts", routed(4, 1), 0, run=self.run_name, step=self.step
                    )
                    c.read_field(segs, "routed_experts", 0, 4, 0)
                    self.started_writing.set()
        except BaseException as exc:
            self.error = exc
            self.started_writing.set()


def test_stat_shows_runs_steps_ledger_and_rates_under_traffic(own: Daemon) -> None:
    run = f"s-{uuid.uuid4().hex[:8]}"
    with PayloadClient(own.socket) as c:
        for step in (3, 4):
            c.append("routed_experts", routed(2, step), 0, run=run, step=step)
        c.append("routed_experts", routed(2, 0), 0, run=run, step=1)
        c.gc(run=run, through_step=1)
        with pytest.raises(StepCollectedError, match=f"step 0 of run '{run}' is refused"):
            c.append("routed_experts", routed(4, 1), 0, run=run, step=0)  # below the watermark
    writer = Writer(own.socket, run, 2)  # the next step: above the watermark
    writer.start()
    try:
        assert writer.started_writing.wait(60) and writer.error is None
        out = run_cli("stat", "--socket", str(own.socket), "--interval", "1", "--json")
        text = run_cli("stat", "--socket", str(own.socket), "--interval", "0.5")
    finally:
        writer.stop.set()
        writer.join(60)
    assert writer.error is None
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    r = doc["rates"]
    assert r["interval_s"] > 0
    for name in ("appends_per_s", "rows_appended_per_s", "bytes_appended_per_s",
                 "reads_per_s", "bytes_read_per_s"):  # fmt: skip
        assert r[name] > 0, name
    assert doc["stats"]["node"] == "st" and doc["usage"]["node"] == "st"
    (mine,) = [x for x in doc["usage"]["runs"] if x["run"] == run]
    assert [s["step"] for s in mine["steps"]] == [2, 3, 4]  # no step 0: nothing stored
    assert doc["usage"]["ledger"][-1]["run"] == run
    assert doc["usage"]["ledger"][-1]["steps"] == [1]
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("daemon  node st on ") and "fsync never" in lines[0]
    rates = next(ln for ln in lines if ln.startswith("rates"))
    assert "appends/s" in rates and not rates.split(": ")[1].startswith("0.0 appends/s")
    unit = r"(B|KiB|MiB|GiB)/s"  # as every size: binary units, no MB/s
    assert re.search(rf"rows/s, [\d.]+ {unit} appended$", rates), rates
    assert re.search(rf"HTTP reads [\d.]+/s, [\d.]+ {unit};", text.stdout), text.stdout
    assert re.search(rf"on disk [+-][\d.]+ {unit}$", text.stdout, re.M), text.stdout
    assert "cap none;" in text.stdout and "floor 1 GiB (1073741824 bytes);" in text.stdout
    header = next(i for i, ln in enumerate(lines) if ln.startswith("RUN "))
    assert lines[header].split() == ["RUN", "STEP", "FILES", "BYTES", "ON", "DISK", "AGE"]
    at = next(i for i, ln in enumerate(lines) if ln.split()[:2] == [run, "all"])
    step_rows = [ln.split() for ln in lines[at + 1 : at + 4]]
    assert [row[0] for row in step_rows] == ["2", "3", "4"]
    assert step_rows[1][1:4] == ["1", "768", "B"]  # one file of 2 rows of 384 bytes
    gc_line = next(ln for ln in lines if ln.startswith("GC ledger: "))
    assert "collection" in gc_line
    last = lines[-1].split()
    assert last[2:6] == ["watermark", run, "1", "1"]


@pytest.mark.parametrize(
    ("n", "text", "exact"),
    [
        (0, "0 B", "0 B"), (512, "512 B", "512 B"), (1023, "1023 B", "1023 B"),
        (1024, "1 KiB", "1 KiB (1024 bytes)"), (1536, "1.5 KiB", "1.5 KiB (1536 bytes)"),
        (64 << 10, "64 KiB", "64 KiB (65536 bytes)"),
        (512 << 20, "512 MiB", "512 MiB (536870912 bytes)"),
        (1 << 30, "1 GiB", "1 GiB (1073741824 bytes)"),
        (3 << 29, "1.5 GiB", "1.5 GiB (1610612736 bytes)"),
        ((1 << 20) - 1, "1 MiB", "1 MiB (1048575 bytes)"),  # rounded up to the next unit
        (4 << 60, "4 EiB", "4 EiB (4611686018427387904 bytes)"),
        (-5e6, "-4.8 MiB", "-4.8 MiB"), (-0.2, "0 B", "0 B"), (20.21e6, "19.3 MiB", "19.3 MiB"),
    ],
)  # fmt: skip
def test_every_size_is_written_by_format_size(n: float, text: str, exact: str) -> None:
    assert format_size(n) == text
    assert format_size(n, exact=True) == exact


def test_stat_writes_the_limits_with_units_and_exact_bytes(
    tmp_path: Path, daemons: Daemons
) -> None:
    root, sock = tmp_path / "root", tmp_path / "s.sock"
    limits = ("--max-root-bytes", "1.5GiB", "--min-free-bytes", "64KiB")
    with daemons.run("--node", "n", *limits, root=root, socket=sock), PayloadClient(sock) as c:
        c.append("routed_experts", routed(4, 0), 0, run="r", step=0)  # 1536 bytes
        out = run_cli("stat", "--socket", str(sock), "--interval", "0")
    assert out.returncode == 0, out.stderr
    disk = out.stdout.split("disk    ", 1)[1].split("rates", 1)[0]
    assert "cap 1.5 GiB (1610612736 bytes); " in disk and "floor 64 KiB (65536 bytes);" in disk
    assert re.search(r"free [\d.]+ (KiB|MiB|GiB|TiB), ", disk), disk
    (row,) = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] == ["0"]]
    assert row[:4] == ["0", "1", "1.5", "KiB"], row  # the step's one file


def test_stat_with_one_sample_has_no_rates_and_refuses_bad_flags(
    own: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_cli("stat", "--socket", str(own.socket), "--interval", "0", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["rates"] is None and doc["stats"]["uptime_s"] > 0
    text = run_cli("stat", "--socket", str(own.socket), "--interval", "0")
    assert "rates   none" in text.stdout
    for flags, message in [
        (["--interval", "-1"], "--interval must be >= 0"),
        (["--interval", "nan"], "--interval must be >= 0"),
        (["--interval", "1e300"], "and <= 86400 seconds"),  # time.sleep would overflow
        (["--max-steps", "-2"], "--max-steps must be in [0, 100000]"),
        (["--ledger", "100001"], "--ledger must be in [0, 100000]"),
        (["--interval", "x"], "invalid float value"),
        (["--token-file", "/nonexistent/token"], "cannot read --token-file /nonexistent/token"),
    ]:
        code, out_text, err = run_main(capsys, "stat", "--socket", str(own.socket), *flags)
        assert code == 2 and message in err and out_text == "", (flags, err)
    code, _, err = run_main(capsys, "stat", "--socket", str(own.root / "nobody.sock"),
                            "--interval", "0")  # fmt: skip
    assert code == 1 and "ConnectError" in err


def test_stat_has_no_rates_across_a_restart_between_its_samples(
    tmp_path: Path, daemons: Daemons
) -> None:
    root, sock = tmp_path / "root", tmp_path / "s.sock"
    with daemons.run(root=root, socket=sock), PayloadClient(sock, data_plane=False) as c:
        for step in range(3):
            c.append("routed_experts", routed(2, step), 0, run="r", step=step)
        s1, u1 = c.stats(), c.usage()
    sampled = time.monotonic()
    with daemons.run(root=root, socket=sock), PayloadClient(sock, data_plane=False) as c:
        for step in range(3, 8):  # more than the first daemon: no counter goes down
            c.append("routed_experts", routed(2, step), 0, run="r", step=step)
        # the new daemon's uptime passes the old one's
        wait_until(lambda: c.stats().uptime_s > s1.uptime_s, 30, "the uptime", every=0.05)
        elapsed = time.monotonic() - sampled
        s2, u2 = c.stats(), c.usage()
    assert s2.appends > s1.appends and s2.uptime_s > s1.uptime_s
    assert rates(s1, s2, u1, u2, elapsed) is None  # its uptime grew less than the time passed
    fewer = msgspec.structs.replace(s2, appends=s1.appends - 1)
    assert rates(s1, fewer, u1, u2) is None  # a counter went down
    assert rates(s1, s2, u1, u2) is not None  # what the times alone cannot tell


# -- payloadd inspect -----------------------------------------------------------------------


def _segments_file(tmp_path: Path, segs: list[PayloadSegment], name: str = "segs.json") -> Path:
    path = tmp_path / name
    path.write_bytes(msgspec.json.encode(segs))
    return path


def test_inspect_prints_the_rows_appended(
    own: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = f"i-{uuid.uuid4().hex[:8]}"
    r_rows, m_rows = routed(6, 5), mask(3, 7, 2)
    f16 = np.array([[0.5, -1.25], [3.0, 1e-3]], np.float16)
    with PayloadClient(own.socket) as c:
        segs = c.append("routed_experts", r_rows, 100, run=run, step=0)
        segs += c.append("sampling_mask", m_rows, 200, run=run, step=0)
        segs += c.append("weights", f16, 300, run=run, step=0)
    path = _segments_file(tmp_path, segs)
    out = run_cli("inspect", str(path), "--socket", str(own.socket), "--json", "--max-rows", "4")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    r, m, w = doc["segments"]
    assert (r["field"], r["file"], r["offset"], r["dtype"], r["shape"]) == (
        "routed_experts", segs[0].file, segs[0].offset, "uint8", [48, 8])  # fmt: skip
    assert r["positions"] == [100, 106] and r["row_nbytes"] == 384
    assert r["read"]["positions"] == [100, 101, 102, 103]
    assert np.array_equal(np.array(r["read"]["rows"]), r_rows[:4])
    assert m["read"]["positions"] == [200, 201, 202]
    assert np.array_equal(np.array(m["read"]["rows"]), m_rows)
    assert np.array_equal(np.array(w["read"]["rows"], np.float16), f16)
    text = run_cli("inspect", str(path), "--socket", str(own.socket), "--max-rows", "2")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"segment [0]: routed_experts  {segs[0].file}"
    assert lines[1] == f"  offset {segs[0].offset}, dtype uint8, shape [48, 8], positions [100, 106) (6 rows of 384 bytes)"  # fmt: skip
    assert lines[2].startswith("  pos 100: [[") and "  ... 4 more rows (--max-rows)" in lines
    at = lines.index(f"segment [1]: sampling_mask  {segs[1].file}")
    assert lines[at + 2] == "  pos 200: " + np.array2string(m_rows[0])
    assert lines[at + 3] == "  pos 201: " + np.array2string(m_rows[1])
    assert "  pos 300: [ 0.5  -1.25]" in lines
    code, out_text, err = run_main(capsys, "inspect", str(path), "--socket", str(own.socket),
                                   "--field", "sampling_mask", "--json")  # fmt: skip
    assert code == 0, err
    (only,) = json.loads(out_text)["segments"]
    assert only["segment"] == "[1]" and only["read"]["rows"] == m_rows.tolist()
    # the same through standard input, with the append answer's form (a list per item)
    nested = msgspec.json.encode({"segments": [[segs[1]]]}).decode()
    piped = run_cli("inspect", "-", "--socket", str(own.socket), "--json", stdin=nested)
    assert piped.returncode == 0, piped.stderr
    (only,) = json.loads(piped.stdout)["segments"]
    assert only["segment"] == "[0][0]" and np.array_equal(only["read"]["rows"], m_rows)


def test_inspect_window_marks_fill_positions(own: Daemon, tmp_path: Path) -> None:
    run = f"w-{uuid.uuid4().hex[:8]}"
    with PayloadClient(own.socket) as c:
        segs = c.append("sampling_mask", mask(2, 4, 0), 10, run=run, step=0)
        segs += c.append("sampling_mask", mask(1, 2, 9), 13, run=run, step=0)
    # a generate response carrying the segments (the guide's router form)
    doc = {"choices": [{"index": 0, "payload": [list(msgspec.to_builtins(s)) for s in segs]}]}
    path = tmp_path / "response.json"
    path.write_text(json.dumps(doc))
    out = run_cli("inspect", str(path), "--socket", str(own.socket), "--lo", "9", "--hi", "15",
                  "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    (w,) = json.loads(out.stdout)["windows"]
    assert (w["field"], w["fill"], w["dtype"], w["shape"], w["real"]) == (
        "sampling_mask", -1, "int32", [6, 4], 3)  # fmt: skip
    assert w["positions"] == list(range(9, 15))
    assert w["covered"] == [False, True, True, False, True, False]
    expect = np.full((6, 4), -1, np.int32)
    expect[1:3] = mask(2, 4, 0)
    expect[4, :2] = mask(1, 2, 9)[0]
    assert np.array_equal(np.array(w["rows"]), expect)
    text = run_cli("inspect", str(path), "--socket", str(own.socket), "--lo", "9", "--hi", "15")
    lines = text.stdout.splitlines()
    assert text.returncode == 0, text.stderr
    assert "segment choices[0].payload[1]: sampling_mask  " + segs[1].file in lines
    assert "window [9, 15) of sampling_mask: 3 positions hold rows, 3 fill (-1); int32 [6, 4]" in lines  # fmt: skip
    assert "  pos 9: fill" in lines and "  pos 12: fill" in lines and "  pos 14: fill" in lines
    assert "  pos 13: " + np.array2string(expect[4]) in lines
    fill = run_cli("inspect", str(path), "--socket", str(own.socket), "--lo", "9", "--hi", "11",
                   "--fill", "7", "--dtype", "int64", "--json")  # fmt: skip
    (w,) = json.loads(fill.stdout)["windows"]
    assert w["fill"] == 7 and w["dtype"] == "int64" and w["rows"][0] == [7, 7, 7, 7]


def test_inspect_of_a_collected_segment_says_gone(own: Daemon, tmp_path: Path) -> None:
    run = f"g-{uuid.uuid4().hex[:8]}"
    with PayloadClient(own.socket) as c:
        gone = c.append("routed_experts", routed(2, 3), 0, run=run, step=0)
        kept = c.append("routed_experts", routed(2, 4), 0, run=run, step=1)
        c.gc(run=run, through_step=0)
    path = _segments_file(tmp_path, gone + kept)
    for data_plane in ("socket", "none"):  # the client's data plane, or HTTP only
        sock = str(own.socket) if data_plane == "socket" else str(tmp_path / "http.sock")
        if data_plane == "none":  # a symlink: the data socket is not found beside it
            os.symlink(own.socket, sock)
        out = run_cli("inspect", str(path), "--socket", sock)
        assert out.returncode == 1
        lines = out.stdout.splitlines()
        assert lines[2].startswith("  error: FileGoneError: payload file")
        assert f"step 0 of run '{run}' was garbage-collected (watermark" in lines[2]
        assert lines[5].startswith("  pos 0: [[")  # the other segment is still shown
        assert "reads failed: [0]" in out.stderr
    out = run_cli("inspect", str(path), "--socket", str(own.socket), "--json")
    doc = json.loads(out.stdout)
    assert doc["segments"][0]["read"]["error"] == "FileGoneError"
    assert np.array_equal(np.array(doc["segments"][1]["read"]["rows"]), routed(2, 4))
    missing = msgspec.structs.replace(gone[0], file=f"st/{run}/0/nope-00000000-000001.bin")
    path = _segments_file(tmp_path, [missing], "missing.json")
    out = run_cli("inspect", str(path), "--socket", str(own.socket))
    assert out.returncode == 1 and "FileMissingError" in out.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2", "not JSON"),
        ("{}", "expected a list of segments"),
        ('"x"', "expected a list of segments, got str"),
        ('[{"field": "f"}]', "segment [0] must be an array"),
        (
            '[["f", "a.bin", 0, 0, 1, "uint8"]]',
            "segment [0]: Expected `array` of at least length 7",
        ),
        ('[["f", "a.bin", -1, 0, 1, "uint8", [1]]]', "segment [0]: offset"),
        ('[["f", "../a.bin", 0, 0, 1, "uint8", [1]]]', "segment [0]: file must be"),
        ('[["f", "a.bin", 0, 0, 1, "uint64", [1]]]', "segment [0]: dtype"),
        ('[["f", "a.bin", 0, 0, 1, "uint8", []]]', "segment [0]: shape"),
        ('{"choices": [{"payload": 3}]}', "choices[0].payload must be a list"),
    ],
)
def test_inspect_refuses_bad_json_naming_what_is_wrong(
    own: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, out, err = run_main(capsys, "inspect", str(path), "--socket", str(own.socket))
    assert code == 2 and out == ""
    assert err.startswith(f"payloadd inspect: {path}: ") and message in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lo", "3"], "--lo and --hi go together"),
        (["--lo", "5", "--hi", "3"], "0 <= lo <= hi"),
        (["--max-rows", "-1"], "--max-rows must be >= 0"),
        (["--dtype", "nonsense"], "is not a numpy dtype"),
        (["--dtype", "int8"], "segment [0]: dtype int8 cannot hold"),
        (["--lo", "0", "--hi", "2", "--fill", "0.5"], "fill"),
        (["--lo", "x"], "invalid int value"),
        (["--field", "nope"], "has no segment of field 'nope' (it has ['f'])"),
    ],
)
def test_inspect_refuses_bad_flags(
    own: Daemon, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with PayloadClient(own.socket) as c:
        segs = c.append("f", np.full((2, 3), 200, np.uint8), 0, run="flags", step=0)
    path = _segments_file(tmp_path, segs)
    code, out, err = run_main(capsys, "inspect", str(path), "--socket", str(own.socket), *flags)
    assert code == 2 and message in err and out == "", err
    code, _, err = run_main(capsys, "inspect", str(tmp_path / "absent.json"))
    assert code == 2 and "cannot read" in err
