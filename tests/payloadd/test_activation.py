"""Socket activation with real processes: listening sockets passed as systemd passes them.

The test binds the listening sockets itself, as systemd's socket unit does, and keeps them
open; `listen_exec.py` puts them at descriptors 3, 4 and sets ``LISTEN_*`` for the pid of
the real ``payloadd serve`` it execs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient, PayloadError, PayloadSegment
from payload_client.wire._dataplane import DataReply, FieldsReply, FieldsRequest
from payload_client.wire._frames import FRAME_PREFIX
from payloadd.server._activation import passed_sockets
from payloadd.server._sockets import StartError
from tests.conftest import Daemons, wait_until

LISTEN_EXEC = Path(__file__).with_name("listen_exec.py")
PAYLOADD = [sys.executable, "-m", "payloadd"]
R, M = "routed_experts", "sampling_mask"
"""The fields of the default table: the daemons here start with no ``PAYLOADD_*`` setting."""


@contextlib.contextmanager
def _listening(path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(64)
    try:
        yield sock
    finally:
        sock.close()


def _command(
    tmp: Path, passed: list[tuple[socket.socket, str]], *flags: str
) -> tuple[list[str], dict[str, str]]:
    specs = [f"{s.fileno()}={name}" if name else str(s.fileno()) for s, name in passed]
    serve = [*PAYLOADD, "serve", "--root", str(tmp / "root"), "--socket", str(tmp / "s.sock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAYLOADD_", "LISTEN_"))}
    env["PAYLOADD_CONFIG"] = ""
    cmd = [sys.executable, str(LISTEN_EXEC), *specs, "--", *serve, "--log-level", "warning"]
    return [*cmd, *flags], env


def _start(
    tmp: Path, passed: list[tuple[socket.socket, str]], *flags: str
) -> subprocess.Popen[bytes]:
    cmd, env = _command(tmp, passed, *flags)
    proc = subprocess.Popen(cmd, env=env, pass_fds=[s.fileno() for s, _ in passed])
    deadline = time.monotonic() + 60
    with PayloadClient(tmp / "s.sock", timeout=2, data_plane=False) as probe:
        while True:  # a connect succeeds at once (the kernel queues it): wait for an answer
            try:
                probe.health()
                return proc
            except PayloadError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"payloadd did not start (exit {proc.poll()})") from None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def _inode(path: Path) -> int:
    return os.lstat(path).st_ino


def _queued_data_request(path: Path) -> socket.socket:
    """Connect to the data socket and send a request, as a client does (no daemon needed)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(path))
    body = msgspec.msgpack.encode(FieldsRequest())
    conn.sendall(FRAME_PREFIX.pack(len(body)) + body)
    return conn


def _data_reply(conn: socket.socket) -> DataReply:
    conn.settimeout(60)
    with conn.makefile("rb") as stream:
        (n,) = FRAME_PREFIX.unpack(stream.read(FRAME_PREFIX.size))
        reply: DataReply = msgspec.msgpack.decode(stream.read(n), type=DataReply)
    return reply


def test_passed_sockets_serve_both_planes_and_a_restart_refuses_no_client(tmp_path: Path) -> None:
    sock, data_path = tmp_path / "s.sock", tmp_path / "s.sock.data"
    with _listening(sock) as http, _listening(data_path) as data:
        inodes = _inode(sock), _inode(data_path)
        passed = [(http, "http"), (data, "data")]
        first = _start(tmp_path, passed)
        rows = np.arange(24, dtype=np.uint8).reshape(6, 4)
        segs: list[PayloadSegment] = []
        for dp in (True, False):
            with PayloadClient(sock, data_plane=dp) as c:
                segs += c.append(R, rows, 6 * len(segs), run="r", step=0)
        with PayloadClient(sock) as c:
            assert c.stats().data_plane_requests > 0  # the passed data socket served
        for dp in (True, False):
            with PayloadClient(sock, data_plane=dp) as c:
                np.testing.assert_array_equal(
                    c.read_field(segs, R, 0, 12, 0), np.concatenate([rows, rows])
                )
        # the lock still keeps a second daemon off the socket
        other = subprocess.run(
            [*PAYLOADD, "serve", "--root", str(tmp_path / "other"), "--socket", str(sock)],
            capture_output=True, text=True, timeout=60, env=_command(tmp_path, [])[1],
        )  # fmt: skip
        assert other.returncode == 1 and "s.sock.lock" in other.stderr
        _stop(first)
        # systemd's files stay, the daemon's lock goes
        assert (_inode(sock), _inode(data_path)) == inodes
        assert not Path(f"{sock}.lock").exists()

        # no daemon runs: the kernel queues a new client on the sockets systemd still holds
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        waiting.connect(str(sock))
        waiting.sendall(b"GET /healthz HTTP/1.1\r\nHost: payloadd\r\nConnection: close\r\n\r\n")
        waiting_data = _queued_data_request(data_path)
        second = _start(tmp_path, passed)
        try:
            waiting.settimeout(60)
            answer = b""
            while chunk := waiting.recv(1 << 16):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer
            reply = _data_reply(waiting_data)
            assert isinstance(reply, FieldsReply) and "routed_experts" in reply.table.fields
            for dp in (True, False):  # and the first daemon's segments read back
                with PayloadClient(sock, data_plane=dp) as c:
                    np.testing.assert_array_equal(c.read_field(segs, R, 0, 6, 0), rows)
        finally:
            waiting.close()
            waiting_data.close()
            _stop(second)
        assert (_inode(sock), _inode(data_path)) == inodes


def test_sockets_without_their_names_are_told_apart_by_path(tmp_path: Path) -> None:
    sock, data_path = tmp_path / "s.sock", tmp_path / "s.sock.data"
    with _listening(sock) as http, _listening(data_path) as data:
        # one socket unit names all its sockets alike; here the data socket even comes first
        proc = _start(tmp_path, [(data, "payloadd"), (http, "payloadd")])
        try:
            with PayloadClient(sock) as c:
                seg = c.append(M, np.ones((2, 3), np.int32), 0, run="r", step=0)
                np.testing.assert_array_equal(c.read_field(seg, M, 0, 2, 0), np.ones((2, 3)))
                assert c.stats().data_plane_requests > 0
        finally:
            _stop(proc)


def test_a_data_socket_not_passed_is_bound_by_the_daemon(tmp_path: Path) -> None:
    sock, data_path = tmp_path / "s.sock", tmp_path / "s.sock.data"
    with _listening(sock) as http:
        proc = _start(tmp_path, [(http, "")])
        try:
            assert data_path.is_socket()
            with PayloadClient(sock) as c:
                c.append(M, np.ones((2, 3), np.int32), 0, run="r", step=0)
                assert c.stats().data_plane_requests > 0
        finally:
            _stop(proc)
        assert sock.is_socket()  # systemd's: kept
        assert not data_path.exists()  # the daemon's own: removed


@pytest.mark.parametrize(
    "case", ["other path", "wrong name", "no http", "data plane off", "not listening", "tcp"]
)
def test_passed_sockets_that_do_not_fit_the_settings_stop_the_start(
    tmp_path: Path, case: str
) -> None:
    sock, data_path = tmp_path / "s.sock", tmp_path / "s.sock.data"
    flags: list[str] = []
    with contextlib.ExitStack() as stack:
        if case == "other path":
            passed = [(stack.enter_context(_listening(tmp_path / "x.sock")), "http")]
            want = f"is bound to {tmp_path / 'x.sock'}, not {sock}"
        elif case == "wrong name":
            passed = [(stack.enter_context(_listening(data_path)), "http")]
            want = f"the http socket but is bound to {data_path}"
        elif case == "no http":
            passed = [(stack.enter_context(_listening(data_path)), "")]
            want = f"none bound to the socket setting {sock}"
        elif case == "data plane off":
            passed = [
                (stack.enter_context(_listening(sock)), "http"),
                (stack.enter_context(_listening(data_path)), "data"),
            ]
            flags, want = ["--data-plane", "false"], "data_plane is false"
        else:
            if case == "tcp":
                raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                raw.bind(("127.0.0.1", 0))
                raw.listen(1)
            else:
                raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                raw.bind(str(sock))  # bound, never listening
            passed = [(stack.enter_context(raw), "http")]
            want = "is not a listening Unix stream socket"
        cmd, env = _command(tmp_path, passed, *flags)
        out = subprocess.run(
            cmd, env=env, pass_fds=[s.fileno() for s, _ in passed], capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 1, out.stderr
        assert want in out.stderr and "Traceback" not in out.stderr
        for s, _ in passed:  # nothing of systemd's was touched
            name = s.getsockname()
            if isinstance(name, str):
                assert Path(name).is_socket()
        assert not Path(f"{sock}.lock").exists()


def test_listen_variables_are_always_unset_and_only_this_pid_takes_them() -> None:
    other = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    assert passed_sockets(other) == [] and other == {}  # meant for another process
    bad = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "two"}
    with pytest.raises(StartError, match="LISTEN_FDS='two'"):
        passed_sockets(bad)
    assert bad == {}
    odd = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "\u00b3"}  # a digit int() refuses
    with pytest.raises(StartError, match="is not a number"):
        passed_sockets(odd)
    assert passed_sockets({"LISTEN_PID": "\u00b3", "LISTEN_FDS": "2"}) == []  # not this pid
    none = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "0", "PATH": "/bin"}
    assert passed_sockets(none) == [] and none == {"PATH": "/bin"}


def test_listen_variables_of_another_process_leave_the_daemon_binding_its_own(
    tmp_path: Path, daemons: Daemons
) -> None:
    env = {**os.environ, "LISTEN_PID": "1", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "http:data"}
    sock = tmp_path / "s.sock"
    with daemons.run(socket=sock, env=env) as d, PayloadClient(sock) as c:
        c.append("f", np.ones((2, 3), np.int32), 0, run="r", step=0)
        assert c.stats().data_plane_requests > 0
        _stop(d.proc)
    assert not sock.exists() and not Path(f"{sock}.data").exists()  # its own: removed


@pytest.mark.skipif(
    shutil.which("systemd-socket-activate") is None, reason="no systemd-socket-activate here"
)
@pytest.mark.parametrize("names", ["http:data", "payloadd:payloadd"])
def test_systemd_socket_activate_starts_the_daemon_on_the_first_connection(
    tmp_path: Path, names: str
) -> None:
    sock, data_path = tmp_path / "s.sock", tmp_path / "s.sock.data"
    serve = [*PAYLOADD, "serve", "--root", str(tmp_path / "root"), "--socket", str(sock)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAYLOADD_", "LISTEN_"))}
    env["PAYLOADD_CONFIG"] = ""
    # systemd's own implementation of the protocol: it listens, and execs the daemon in its
    # place (same pid) once a client connects
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(sock), "-l", str(data_path), f"--fdname={names}",
         *serve, "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    try:

        def connected() -> bool:
            assert proc.poll() is None
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
                try:
                    first.connect(str(data_path))
                except (FileNotFoundError, ConnectionRefusedError):
                    return False
            return True

        # the data socket listens last; the first connect starts the daemon
        wait_until(connected, 30, "a connect to the data socket", every=0.05)
        with PayloadClient(sock, timeout=60) as c:
            seg = c.append(M, np.ones((2, 3), np.int32), 0, run="r", step=0)
            np.testing.assert_array_equal(c.read_field(seg, M, 0, 2, 0), np.ones((2, 3)))
            assert c.stats().data_plane_requests > 0
    finally:
        _stop(proc)
    assert sock.is_socket() and data_path.is_socket()  # not the daemon's to remove
