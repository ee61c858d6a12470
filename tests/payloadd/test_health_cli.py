"""``payloadd health``: the probe command, against a real daemon and sockets that are not one."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from payload_client import DEFAULT_SOCKET
from payload_client._errors import NO_DAEMON as CLIENT_NO_DAEMON
from payloadd.cli._health import DEFAULT_SOCKET as HEALTH_DEFAULT_SOCKET
from payloadd.cli._health import NO_DAEMON as HEALTH_NO_DAEMON
from payloadd.cli._main import main
from payloadd.settings._settings import Settings
from tests.conftest import Daemon, Daemons

PAYLOADD = [sys.executable, "-m", "payloadd"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``payloadd ARGS`` in a child process, as a probe runs it."""
    return subprocess.run(
        [*PAYLOADD, *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_healthy_daemon_exits_0_with_one_line(daemon: Daemon) -> None:
    out = run("health", "--socket", str(daemon.socket))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"payloadd health: ok: node test, payloadd 0.1.0, on {daemon.socket}"
    ]
    assert out.stderr == ""


def test_listed_in_payloadd_help() -> None:
    out = run("--help")
    assert out.returncode == 0 and "health" in out.stdout and "probes" in out.stdout


def test_socket_defaults_to_payloadd_socket_env(daemon: Daemon) -> None:
    env = {**os.environ, "PAYLOADD_SOCKET": str(daemon.socket)}
    assert run("health", env=env).returncode == 0
    env["PAYLOADD_SOCKET"] = str(daemon.socket) + ".nope"
    out = run("health", env=env)
    assert out.returncode == 1 and f"no payloadd listening on {daemon.socket}.nope" in out.stderr


def test_default_socket_is_the_daemons_and_the_clients() -> None:
    assert HEALTH_DEFAULT_SOCKET == DEFAULT_SOCKET
    assert Path(HEALTH_DEFAULT_SOCKET) == Settings.model_fields["socket"].default


def test_no_daemon_is_said_as_the_client_says_it() -> None:
    assert HEALTH_NO_DAEMON == CLIENT_NO_DAEMON


def test_daemon_with_admin_token_needs_none_for_health(tmp_path: Path, daemons: Daemons) -> None:
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o600)
    sock = tmp_path / "s.sock"
    with daemons.run("--admin-token-file", str(token), socket=sock):
        assert main(["health", "--socket", str(sock)]) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def unhealthy(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``payloadd health ARGS`` in this process; check exit status 1 and one line on
    stderr, nothing on stdout; return that line."""
    assert main(["health", *args]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("payloadd health: "), out.err
    return lines[0]


def test_no_daemon(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / "absent.sock"
    assert unhealthy(capsys, "--socket", str(sock)) == (
        f"payloadd health: no payloadd listening on {sock}: is `payloadd serve` running?"
    )


def test_stale_socket_nobody_listens_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))  # bound, never listening: what a killed daemon leaves
        line = unhealthy(capsys, "--socket", str(sock))
    assert line == f"payloadd health: no payloadd listening on {sock}: is `payloadd serve` running?"


def test_path_that_is_not_a_socket(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    assert unhealthy(capsys, "--socket", str(path)).endswith(f"{path} is not a socket")


def test_socket_path_too_long(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / ("x" * 120)
    assert "path too long" in unhealthy(capsys, "--socket", str(sock))


@contextlib.contextmanager
def fake_server(path: Path, answer: Callable[[socket.socket], None]) -> Iterator[None]:
    """A Unix socket at ``path`` that is not a payloadd: ``answer`` serves each connection."""
    stop = threading.Event()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    listener.settimeout(0.05)

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def http_answer(status_line: bytes, body: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.recv(65536)
        head = b"%s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        conn.sendall(head % (status_line, len(body)) + body)

    return answer


def not_http(conn: socket.socket) -> None:
    conn.recv(65536)
    conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")


def hang_up(conn: socket.socket) -> None:
    conn.recv(65536)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (not_http, "did not answer as HTTP (BadStatusLine)"),
        (hang_up, "did not answer as HTTP (RemoteDisconnected)"),
        (http_answer(b"HTTP/1.1 404 Not Found", b"{}"), "answered HTTP 404 to GET /healthz"),
        (http_answer(b"HTTP/1.1 200 OK", b"<html>"), "with something not JSON"),
        (http_answer(b"HTTP/1.1 200 OK", b"[1, 2]"), "with status None, not 'ok'"),
        (
            http_answer(b"HTTP/1.1 200 OK", b'{"status": "starting"}'),
            "with status 'starting', not 'ok'",
        ),
        (
            http_answer(
                b"HTTP/1.1 200 OK",
                b'{"status": "degraded", "data_plane": "refusing connections: out of file '
                b'descriptors (EMFILE) now"}',
            ),
            "status 'degraded', not 'ok' (data plane: refusing connections: out of file",
        ),
    ],
    ids=["not-http", "hangs-up", "http-404", "not-json", "not-an-object", "not-ok", "degraded"],
)
def test_socket_that_is_not_a_healthy_daemon(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    answer: Callable[[socket.socket], None],
    reason: str,
) -> None:
    sock = tmp_path / "other.sock"
    with fake_server(sock, answer):
        line = unhealthy(capsys, "--socket", str(sock))
    assert line.startswith(f"payloadd health: {sock} ") and reason in line


def test_an_answer_that_matches_is_healthy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the counterpart of the cases above: the same fake server, answering as payloadd does
    sock = tmp_path / "like.sock"
    body = b'{"status":"ok","node":"n1","version":"9"}'
    with fake_server(sock, http_answer(b"HTTP/1.1 200 OK", body)):
        assert main(["health", "--socket", str(sock)]) == 0
    assert capsys.readouterr().out == f"payloadd health: ok: node n1, payloadd 9, on {sock}\n"


@pytest.mark.parametrize("trickle", [False, True], ids=["silent", "trickling"])
def test_no_answer_in_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trickle: bool
) -> None:
    gone = threading.Event()

    def answer(conn: socket.socket) -> None:
        conn.recv(65536)
        if trickle:  # a status line that never ends, a byte at a time: one deadline for all
            conn.sendall(b"HTTP/1.1 200 OK\r\nX: ")
            while not gone.wait(0.05):
                with contextlib.suppress(OSError):
                    conn.sendall(b"x")
        gone.wait(10)

    sock = tmp_path / "slow.sock"
    with fake_server(sock, answer):
        try:
            line = unhealthy(capsys, "--socket", str(sock), "--timeout", "0.5")
        finally:
            gone.set()
    assert line == f"payloadd health: no answer from {sock} within 0.5 s"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "0"], "must be a number of seconds > 0"),
        (["--timeout", "-1"], "must be a number of seconds > 0"),
        (["--timeout", "nan"], "must be a number of seconds > 0"),
        (["--timeout", "inf"], "must be a number of seconds > 0"),
        (["--timeout", "1e300"], "and <= 86400, got 1e300"),  # a socket timeout overflows
        (["--timeout", "soon"], "not a number of seconds: 'soon'"),
        (["--wait", "-1"], "must be a number of seconds >= 0 and <= 86400, got -1"),
        (["--wait", "nan"], "must be a number of seconds >= 0"),
        (["--wait", "1e300"], "and <= 86400, got 1e300"),
        (["--sock", "/x"], "unrecognized arguments"),
        (["extra"], "unrecognized arguments"),
    ],
)
def test_bad_flags_exit_2(args: list[str], message: str) -> None:
    out = run("health", *args)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


def test_health_imports_none_of_the_heavy_modules(tmp_path: Path) -> None:
    # probes run it every few seconds with a timeout of seconds: keep its start small
    code = (
        "import sys\n"
        "from payloadd.cli._main import main\n"
        f"assert main(['health', '--socket', {str(tmp_path / 'no.sock')!r}]) == 1\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded = set(json.loads(out.stdout))
    heavy = {"numpy", "httpx", "msgspec", "pydantic", "pydantic_settings", "fastapi", "uvicorn"}
    assert loaded & (heavy | {"payload_client", "asyncio"}) == set()
    assert "payloadd" in loaded and "http" in loaded  # it did import what it runs on


# -- --wait: a script that has just started a daemon ----------------------------------------


def test_wait_for_a_daemon_that_starts_later(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "late.sock"
    started = time.monotonic()
    waiting = subprocess.Popen(
        [*PAYLOADD, "health", "--socket", str(sock), "--wait", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.0)  # it finds no socket, then a socket nobody listens on yet
        assert waiting.poll() is None
        with daemons.run("--node", "late", socket=sock):
            out, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, err
    assert out == f"payloadd health: ok: node late, payloadd 0.1.0, on {sock}\n" and err == ""
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("stale", [False, True], ids=["absent", "stale"])
def test_wait_ends_with_the_no_daemon_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stale: bool
) -> None:
    sock = tmp_path / "never.sock"
    with contextlib.ExitStack() as stack:
        if stale:
            s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            s.bind(str(sock))
        t0 = time.monotonic()
        line = unhealthy(capsys, "--socket", str(sock), "--wait", "1.5")
        took = time.monotonic() - t0
    assert line == (
        f"payloadd health: no payloadd listening on {sock}: is `payloadd serve` running? "
        "(waited 1.5 s)"
    )
    assert 1.5 <= took < 10


def test_wait_asks_until_the_answer_is_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = [
        http_answer(b"HTTP/1.1 503 Service Unavailable", b"{}"),
        http_answer(b"HTTP/1.1 200 OK", b'{"status": "degraded", "data_plane": "stopped"}'),
        http_answer(b"HTTP/1.1 200 OK", b'{"status":"ok","node":"n2","version":"9"}'),
    ]

    def answer(conn: socket.socket) -> None:
        (answers.pop(0) if len(answers) > 1 else answers[0])(conn)

    sock = tmp_path / "warming.sock"
    with fake_server(sock, answer):
        assert main(["health", "--socket", str(sock), "--wait", "30"]) == 0
    assert capsys.readouterr().out == f"payloadd health: ok: node n2, payloadd 9, on {sock}\n"


def test_wait_gives_up_at_once_on_what_waiting_would_not_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    t0 = time.monotonic()
    assert unhealthy(capsys, "--socket", str(path), "--wait", "60").endswith("is not a socket")
    sock = tmp_path / "other.sock"
    with fake_server(sock, not_http):
        line = unhealthy(capsys, "--socket", str(sock), "--wait", "60")
    assert "did not answer as HTTP" in line and "waited" not in line
    assert time.monotonic() - t0 < 20


def test_wait_keeps_each_check_within_the_time_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = threading.Event()
    sock = tmp_path / "mute.sock"

    def mute(conn: socket.socket) -> None:
        gone.wait(10)

    with fake_server(sock, mute):
        t0 = time.monotonic()
        try:
            line = unhealthy(capsys, "--socket", str(sock), "--timeout", "60", "--wait", "1")
        finally:
            gone.set()
        took = time.monotonic() - t0
    assert line == f"payloadd health: no answer from {sock} within 1 s (waited 1 s)"
    assert took < 5


@pytest.mark.parametrize("command", ["stat", "gc", "inspect"])
def test_the_other_commands_say_the_same_when_no_daemon_listens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    sock = tmp_path / "absent.sock"
    url = f"http://127.0.0.1:{free_port()}"
    segments = tmp_path / "segments.json"
    segments.write_text('[["routed_experts", "n/r/0/f.bin", 0, 0, 1, "uint8", [8]]]')
    args = {
        "stat": (["stat", "--socket", str(sock), "--interval", "0"], sock),
        "gc": (["gc", "--base-url", url, "--dry-run"], url),
        "inspect": (["inspect", "--socket", str(sock), str(segments)], sock),
    }
    argv, where = args[command]
    assert main(argv) == 1
    out = capsys.readouterr()  # inspect shows each segment's error on stdout, then fails
    said = out.err if command != "inspect" else out.out
    assert f"no payloadd listening on {where}: is `payloadd serve` running?" in said, out
