"""Socket safety with real daemon processes: the lock, stale files, modes, group, exit, drain."""

from __future__ import annotations

import grp
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import (
    APPEND_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
)
from payloadd.server._sockets import SocketLock, resolve_group
from tests.conftest import Daemons, wait_until

PAYLOADD = [sys.executable, "-m", "payloadd"]


def _files(sock: Path) -> dict[str, Path]:
    return {"socket": sock, "data": Path(f"{sock}.data"), "lock": Path(f"{sock}.lock")}


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino, st.st_mode, st.st_mtime_ns


def _serve(root: Path, sock: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [*PAYLOADD, "serve", "--root", str(root), "--socket", str(sock), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _refused(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except (ConnectionRefusedError, FileNotFoundError):
            return True
    return False


def test_second_daemon_refuses_and_leaves_the_live_one_untouched(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    with daemons.run(socket=sock) as d:
        files = _files(sock)
        before = {name: _identity(p) for name, p in files.items()}
        assert files["lock"].read_text() == f"{d.pid}\n"
        assert stat.S_IMODE(before["lock"][2]) == 0o600
        with PayloadClient(sock) as c:
            segs = c.append("f", np.arange(8, dtype=np.uint8).reshape(4, 2), 0, run="r", step=0)
        second = _serve(tmp_path / "other", sock)
        assert second.returncode == 1, second.stderr
        assert f"a live daemon already listens on {sock}" in second.stderr
        assert f"pid {d.pid}" in second.stderr and "Traceback" not in second.stderr
        assert {name: _identity(p) for name, p in files.items()} == before
        assert files["lock"].read_text() == f"{d.pid}\n"
        for data_plane in (True, False):  # both planes of the live daemon still serve
            with PayloadClient(sock, data_plane=data_plane) as c:
                got = c.read_field(segs, "f", 0, 4, 0)
                np.testing.assert_array_equal(got, np.arange(8).reshape(4, 2))
                assert (c._data_plane is not None and c._data_plane.sock is not None) == data_plane
        assert d.proc.poll() is None


def test_the_lock_decides_even_before_the_winner_listens(tmp_path: Path, daemons: Daemons) -> None:
    """A daemon that holds the lock but has only bound its socket (not listening yet, so a
    probe sees it as stale) must not lose its socket to a second daemon starting then."""
    sock = tmp_path / "payloadd.sock"
    winner = SocketLock(sock)
    winner.acquire()
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(sock))  # bound, not listening: connecting is refused
    try:
        before = _identity(sock)
        out = _serve(tmp_path / "root", sock)
        assert out.returncode == 1 and "already listens" in out.stderr, out.stderr
        assert f"pid {os.getpid()}" in out.stderr
        assert _identity(sock) == before  # not removed as stale
        assert not Path(f"{sock}.data").exists()
    finally:
        bound.close()
        winner.release()
    assert not Path(f"{sock}.lock").exists()
    with daemons.run(socket=sock):  # the lock is free: the stale file is replaced
        assert _identity(sock) != before
        with PayloadClient(sock) as c:
            assert c.health().status == "ok"


def test_daemons_racing_for_one_socket_leave_exactly_one(tmp_path: Path) -> None:
    sock = tmp_path / "payloadd.sock"
    procs = [
        subprocess.Popen(
            [
                *PAYLOADD,
                "serve",
                "--root",
                str(tmp_path / f"root{i}"),
                "--socket",
                str(sock),
                "--node",
                f"n{i}",
                "--log-level",
                "warning",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    try:
        wait_until(lambda: sum(p.poll() is not None for p in procs) >= 2, 60, "two losers")
        losers = [p for p in procs if p.poll() is not None]
        (survivor,) = [p for p in procs if p.poll() is None]
        for p in losers:
            assert p.returncode == 1
            assert p.stderr is not None and "already listens" in p.stderr.read()
        wait_until(lambda: not _refused(sock), 30, "the survivor listening")
        with PayloadClient(sock) as c:
            assert c.health().node == f"n{procs.index(survivor)}"
            (seg,) = c.append("f", np.ones((3, 1), np.uint8), 0, run="r", step=0)
            assert seg.file.startswith(f"n{procs.index(survivor)}/")
        assert Path(f"{sock}.lock").read_text() == f"{survivor.pid}\n"
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(30) == 0
        assert not any(p.exists() for p in _files(sock).values())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stderr is not None:
                p.stderr.close()


def test_a_killed_daemon_leaves_files_that_do_not_block_a_restart(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "payloadd.sock"
    rows = np.arange(12, dtype=np.uint8).reshape(6, 2)
    with daemons.run(socket=sock) as d:
        with PayloadClient(sock) as c:
            segs = c.append("f", rows, 0, run="r", step=0)
        d.proc.kill()
        d.proc.wait()
        assert all(p.exists() for p in _files(sock).values())  # what a crash leaves
        assert _refused(sock)
    with daemons.run(socket=sock) as d:
        assert Path(f"{sock}.lock").read_text() == f"{d.pid}\n"
        with PayloadClient(sock) as c:
            np.testing.assert_array_equal(c.read_field(segs, "f", 0, 6, 0), rows)


@pytest.mark.parametrize(
    ("umask", "flags", "mode"),
    [(0o077, (), 0o660), (0o000, ("--socket-mode", "0640"), 0o640)],
)
def test_root_and_socket_modes_whatever_the_umask(
    tmp_path: Path, daemons: Daemons, umask: int, flags: tuple[str, ...], mode: int
) -> None:
    sock = tmp_path / "run" / "payloadd.sock"
    with daemons.run(*flags, socket=sock, umask=umask):
        assert stat.S_IMODE(os.stat(tmp_path / "root").st_mode) == 0o750
        for name, p in _files(sock).items():
            want = 0o600 if name == "lock" else mode
            assert stat.S_IMODE(os.lstat(p).st_mode) == want, name
            assert stat.S_ISSOCK(os.lstat(p).st_mode) == (name != "lock")


def _other_group() -> grp.struct_group:
    """A group this process may give its files, other than its own."""
    for g in grp.getgrall():
        if g.gr_gid != os.getegid() and (os.geteuid() == 0 or g.gr_gid in os.getgroups()):
            return g
    pytest.skip("this user is in no group but its own")


def test_socket_group(tmp_path: Path, daemons: Daemons) -> None:
    group = _other_group()
    sock = tmp_path / "payloadd.sock"
    with daemons.run("--socket-group", group.gr_name, socket=sock):
        for p in (sock, Path(f"{sock}.data")):
            st = os.stat(p)
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (group.gr_gid, 0o660)
        with PayloadClient(sock) as c:
            assert c.health().status == "ok"
    assert resolve_group(group.gr_name) == group.gr_gid
    assert resolve_group("4242") == 4242  # a number is a gid, named or not


def test_unknown_socket_group_is_a_clean_start_error(tmp_path: Path) -> None:
    sock = tmp_path / "payloadd.sock"
    out = _serve(tmp_path / "root", sock, "--socket-group", "no-such-group-xyz")
    assert out.returncode == 1, out.stderr
    assert "no group named 'no-such-group-xyz'" in out.stderr and "Traceback" not in out.stderr
    assert not any(p.exists() for p in _files(sock).values())


def test_sigint_exits_cleanly_and_removes_both_sockets_and_the_lock(
    tmp_path: Path, daemons: Daemons
) -> None:
    # SIGTERM: test_sigterm_drains_an_in_flight_append
    sock = tmp_path / "payloadd.sock"
    with daemons.run(socket=sock) as d:
        assert all(p.exists() for p in _files(sock).values())
        d.proc.send_signal(signal.SIGINT)
        assert d.proc.wait(30) == 0
        assert not any(p.exists() for p in _files(sock).values())
        assert (tmp_path / "root").is_dir()


def test_sigterm_drains_an_in_flight_append(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "payloadd.sock"
    rows = np.random.default_rng(7).integers(0, 256, (512, 48, 8), dtype=np.uint8)
    header = msgspec.msgpack.encode(
        AppendRequest([AppendItem("f", "uint8", [48, 8], 512, 0, "d", 0)])
    )
    body = FRAME_PREFIX.pack(len(header)) + header + rows.tobytes()
    with daemons.run(socket=sock) as d:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(30)
            raw.connect(str(sock))
            raw.sendall(
                f"POST /v1/append HTTP/1.1\r\nHost: payloadd\r\nContent-Type: "
                f"{APPEND_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n"
                "Expect: 100-continue\r\n\r\n".encode()
            )
            # the route asks for the body: the request is in flight
            assert raw.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
            raw.sendall(body[:1000])
            d.proc.send_signal(signal.SIGTERM)
            # no new connections while it drains
            wait_until(lambda: _refused(sock), 30, "new connections refused")
            assert d.proc.poll() is None
            for i in range(1000, len(body), 64 << 10):  # the rest of the body, slowly
                raw.sendall(body[i : i + (64 << 10)])
                time.sleep(0.02)  # slowly: the drain waits for it
            answer = b""
            while chunk := raw.recv(1 << 16):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), answer[:300]
        (segs,) = msgspec.json.decode(payload, type=AppendResponse).segments
        assert d.proc.wait(30) == 0
        assert not any(p.exists() for p in _files(sock).values())
    with daemons.run(socket=sock), PayloadClient(sock) as c:
        np.testing.assert_array_equal(c.read_field(segs, "f", 0, 512, 0), rows)
