"""The ``payloadd`` command: demo, serve's settings and its socket handling (real processes)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from payload_client import PayloadClient
from payloadd.settings._settings import Settings
from tests.conftest import Daemons

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

PAYLOADD = [sys.executable, "-m", "payloadd"]


@pytest.mark.parametrize("nodes", [1, 3])
def test_demo_small_run_checks_parity_for_every_cp_degree(nodes: int) -> None:
    args = ["demo", "--samples", "6", "--max-tokens", "700", "--seq-len", "512", "--writers", "3",
            "--nodes", str(nodes)]  # fmt: skip
    out = subprocess.run([*PAYLOADD, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for cp in (1, 2, 4):
        line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith(f"CP {cp}:"))
        assert "0 mismatches" in line and "parity OK" in line
    assert "demo: OK" in out.stdout
    if nodes == 3:  # each node wrote its share, and the other nodes' reads reached theirs
        lines = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("node-")]
        assert [ln.split()[0] for ln in lines] == ["node-a", "node-b", "node-c"]
        answered = [int(ln.split(" data-plane requests, ")[1].split()[0]) for ln in lines]
        assert answered[0] == 0 and answered[1] > 0 and answered[2] > 0
        assert "through ClusterClient from node node-a" in out.stdout


def test_demo_parity_check_can_fail() -> None:
    from payloadd.bench._demo import _same
    from payloadd.bench._rl_batch import MASK_FILL, ROUTED_FILL

    a = np.zeros((4, 2, 3), np.int32)
    b = a.copy()
    assert _same(a, b, ROUTED_FILL)
    b[2, 1, 0] = 1
    assert not _same(a, b, ROUTED_FILL)
    narrow = np.full((3, 2), MASK_FILL, np.int32)
    wide = np.full((3, 5), MASK_FILL, np.int32)
    assert _same(narrow, wide, MASK_FILL)  # only fill beyond the narrow width
    wide[0, 4] = 9
    assert not _same(narrow, wide, MASK_FILL)
    assert not _same(None, wide, MASK_FILL)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--max-file-bytes", "0"], "max_file_bytes"),
        (["--node", "../x"], "node"),
        (["--socket-mode", "9z"], "socket_mode"),
        (["--fsync", "sometimes"], "fsync"),
        (["--socket-group", "a b"], "socket_group"),
        (["--tcp-port", "0"], "tcp_port"),
        (["--fsync-interval-s", "0"], "fsync_interval_s"),
        (["--max-root-bytes", "-1"], "max_root_bytes"),
        (["--min-free-bytes", "-1"], "min_free_bytes"),
    ],
)
def test_serve_refuses_invalid_settings(tmp_path: Path, flags: list[str], match: str) -> None:
    cmd = [
        *PAYLOADD,
        "serve",
        "--root",
        str(tmp_path / "r"),
        "--socket",
        str(tmp_path / "s"),
        *flags,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and match in out.stderr


def test_settings_come_from_flags_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAYLOADD_MAX_FILE_BYTES", "12345")
    monkeypatch.setenv("PAYLOADD_SOCKET_MODE", "0600")
    assert Settings().max_file_bytes == 12345
    assert Settings().socket_mode == 0o600
    assert Settings(max_file_bytes=99).max_file_bytes == 99


def test_socket_mode_stale_socket_live_socket_and_clean_exit(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock_path = tmp_path / "payloadd.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))  # a socket file nobody listens on: a killed daemon's leftover
    stale.close()
    with daemons.run(socket=sock_path) as d:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(tmp_path / "root").st_mode) == 0o750
        with PayloadClient(sock_path) as c:
            segs = c.append("f", np.ones((2, 2), np.uint8), 0, run="r", step=0)
        second = subprocess.run(
            [*PAYLOADD, "serve", "--root", str(tmp_path / "other"), "--socket", str(sock_path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1 and "already listens" in second.stderr
        with PayloadClient(sock_path) as c:  # the live daemon is untouched
            np.testing.assert_array_equal(c.read_field(segs, "f", 0, 2, 0), np.ones((2, 2)))
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
    assert not sock_path.exists()


def test_bench_quick_run_writes_parsable_figures(tmp_path: Path) -> None:
    """Without --out it writes into a new temporary folder, never into the folder it runs
    in (a checkout's published figures); it says what it measures as it goes, on stderr."""
    out = subprocess.run(
        [*PAYLOADD, "bench", "--quick", "--repeat", "1", "--skip-ray", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (tmp_path / "docs").exists()
    wrote = Path(out.stdout.split("wrote ")[1].split()[0])
    assert wrote.name == "bench.json" and wrote.parent.name.startswith("payloadd-bench-")
    progress = [ln for ln in out.stderr.splitlines() if ln.startswith("[")]
    assert "1/14 append and read throughput" in progress[0] and "14/14" in progress[-1]
    assert re.search(r"payloadd bench: 1 repetitions, \d+ min \d\d s in all", out.stdout)
    assert re.search(r"(?m)^  python +3\.", out.stdout)  # the environment, a line each
    assert re.search(r"(?m)^caveat: --quick: .* indicative", out.stdout)  # with the table
    assert re.search(r"(?m)^caveat: --repeat 1: ", out.stdout)
    doc = json.loads(wrote.read_text())
    png = (wrote.parent / "bench.png").stat().st_size
    shutil.rmtree(wrote.parent)
    assert doc["seconds"] > 0
    assert doc["caveats"][0].startswith("caveat: --quick") and doc["load_1min"]["cores"] >= 1
    rows = {(r["name"], r["size"]): r for r in doc["results"]}
    for size in ("64KiB", "1MiB"):
        for name in ("raw pwrite", "append (data plane)", "read int32 out= (http)"):
            r = rows[name, size]
            assert r["median"] > 0 and r["min"] <= r["median"] <= r["max"]
        ratio = rows["append (data plane)", size]["ratio"]
        assert ratio == pytest.approx(
            rows["append (data plane)", size]["median"] / rows["raw pwrite", size]["median"]
        )
    assert rows["one-row append p50, sync (data plane)", "384B"]["unit"] == "ms"
    for policy in ("never", "interval", "always"):  # measured alike; never is the baseline
        big = rows[f"append, fsync {policy} (data plane)", "1MiB"]
        one = rows[f"one-row append p50, fsync {policy} (data plane)", "384B"]
        assert big["unit"] == "GB/s" and big["median"] > 0 and one["unit"] == "ms"
        if policy != "never":
            assert big["baseline"] == "append, fsync never (data plane)"
            assert one["baseline"] == "one-row append p50, fsync never (data plane)"
            assert one["ratio"] == pytest.approx(
                one["median"]
                / rows["one-row append p50, fsync never (data plane)", "384B"]["median"]
            )
    for name, unit in (("RL orchestrator resident", "MiB"), ("RL bytes sent", "MiB"),
                       ("RL pack + encode", "s"), ("RL decode + materialise, a rank", "s")):  # fmt: skip
        inline, handle = rows[f"{name} (inline)", "4x4k"], rows[f"{name} (by handle)", "4x4k"]
        assert inline["unit"] == handle["unit"] == unit and inline["median"] > 0
        assert handle["ratio"] == pytest.approx(handle["median"] / inline["median"])
    # by handle the message carries segments, not rows: far fewer bytes
    assert rows["RL bytes sent (by handle)", "4x4k"]["ratio"] < 0.1
    assert doc["rl_batch"]["samples"] == 4
    assert doc["notes"] == [  # Ray listens on every interface; TransferQueue runs on Ray
        "Ray: skipped (--skip-ray)",
        "TransferQueue: skipped (--skip-ray: it runs on Ray)",
    ]
    assert not any(name.startswith("RL job") for name, _ in rows)
    # each new row against its physical baseline of the same run
    for name, size, unit in (
        ("packed read uint8 out=, CP 1 (data plane)", "8x2k", "GB/s"),
        ("packed read int32 out=, CP 4 (http)", "8x2k", "GB/s"),
        ("packed mask read out=, CP 4 (data plane)", "8x2k", "GB/s"),
        ("read uint8 out= (http), vs the ceiling", "16MiB", "GB/s"),
        ("writes: append (data plane)", "16MiB", "GB/s"),
        ("writes: append (data plane), warm", "16MiB", "GB/s"),
        ("new-key append, mean (data plane)", "small", "ms"),
        ("segments: merge_pd_segments", "100k", "µs"),
        ("cross-node read uint8 out= (peer port)", "1MiB", "GB/s"),
        ("cross-node read uint8 out= (http)", "16MiB", "GB/s"),
        ("cluster packed read uint8 out=, CP 4 (3 nodes, peer port)", "8x2k", "GB/s"),
        ("cluster packed read uint8 out=, CP 1 (3 nodes, http)", "8x2k", "GB/s"),
        *(("one-row segments, read out= (data plane)", f"N={n}", "µs")
          for n in ("10", "100", "1k", "10k")),
    ):  # fmt: skip
        r = rows[name, size]
        base = rows[r["baseline"], size]
        assert r["unit"] == base["unit"] == unit and r["median"] > 0 and base["median"] > 0
        assert r["ratio"] == pytest.approx(r["median"] / base["median"])
    assert rows["packed read uint8 out=, CP 1 (data plane)", "8x2k"]["baseline"] == (
        "packed direct reader uint8, CP 1"
    )
    assert rows["one-row segments, one pread of the range", "N=1k"]["median"] > 0
    assert rows["one-row read p50, sync (data plane)", "384B"]["unit"] == "ms"
    share = rows["RL resident payload share (by handle)", "4x4k"]
    assert share["unit"] == "x" and -1 < share["median"] < 1
    assert rows["RL orchestrator resident (no payload)", "4x4k"]["median"] > 0
    assert png > 10_000
    assert "ideal int32 reader" in out.stdout
    assert not list(tmp_path.glob("payloadd-bench-*"))  # its temporary root is gone


def test_a_busy_data_socket_path_is_a_clean_start_error(tmp_path: Path) -> None:
    (tmp_path / "s.sock.data").write_text("not a socket")
    cmd = [*PAYLOADD, "serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s.sock")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "s.sock.data exists and is not a socket" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "s.sock").exists()  # the control socket is not left behind


def test_serve_help_prints_defaults_as_flags_take_them() -> None:
    env = {**os.environ, "COLUMNS": "2000"}  # one line per flag
    cmd = [*PAYLOADD, "serve", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "[env PAYLOADD_DATA_PLANE; default true]" in text
    assert "[env PAYLOADD_ACCESS_LOG; default false]" in text
    start = text.index("[env PAYLOADD_FIELDS; default ") + len("[env PAYLOADD_FIELDS; default ")
    fields, _ = json.JSONDecoder().raw_decode(text[start:])  # JSON, as --fields takes it
    default = Settings.model_fields["fields"].get_default(call_default_factory=True)
    assert fields == {name: rule.model_dump() for name, rule in default.items()}


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_node_prefix_that_is_no_directory_of_the_root_is_a_clean_start_error(
    tmp_path: Path, kind: str
) -> None:
    root, outside = tmp_path / "r", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    if kind == "symlink":
        (root / "n1").symlink_to(outside)
    else:
        (root / "n1").write_text("")
    cmd = [*PAYLOADD, "serve", "--root", str(root), "--socket", str(tmp_path / "s.sock")]
    out = subprocess.run([*cmd, "--node", "n1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "node prefix" in out.stderr and str(root / "n1") in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "s.sock").exists() and list(outside.iterdir()) == []


def test_the_command_line_needs_no_temporary_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    # a container with a read-only root file system (Kubernetes' readOnlyRootFilesystem) has
    # no writable /tmp: `payloadd serve` and the `payloadd health` probes must still start
    import tempfile

    from payloadd.cli._main import _command_line

    def none() -> str:
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.setattr(tempfile, "gettempdir", none)
    parser, _ = _command_line()
    args = parser.parse_args(["health", "--socket", "/run/payloadd/payloadd.sock"])
    assert args.socket is not None
