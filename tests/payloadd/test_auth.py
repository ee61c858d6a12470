"""Access control with real daemons: the admin token over the Unix socket, the TCP listener."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import AsyncPayloadClient, PayloadClient, UnauthorizedError
from payloadd.settings._settings import Settings
from tests.conftest import Daemons, free_port

PAYLOADD = [sys.executable, "-m", "payloadd"]
TOKEN = "t0ken-" + "a1b2c3d4" * 4
ADMIN_CALLS = [
    ("POST", "/v1/admin/gc"),
    ("DELETE", "/v1/admin/runs/r1"),
    ("GET", "/v1/admin/usage"),
    ("DELETE", "/v1/admin/nodes/n2/runs/r1"),
    ("GET", "/v1/admin"),
]


@dataclass(frozen=True)
class Guarded:
    """A daemon with an admin token (from a file) and a TCP listener on loopback."""

    root: Path
    socket: Path
    url: str
    log: Path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "token").write_text(f"  {TOKEN}\n")
    (tmp / "token").chmod(0o600)
    port = free_port()
    g = Guarded(tmp / "root", tmp / "payloadd.sock", f"http://127.0.0.1:{port}", tmp / "log")
    flags = ("--admin-token-file", str(tmp / "token"), "--tcp-port", str(port))
    with Daemons(tmp) as d:
        d.start(*flags, socket=g.socket, log=g.log, log_level="debug")
        yield g


def _unix(g: Guarded) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(g.socket)), base_url="http://d")


def _assert_401(r: httpx.Response, sent: str | None) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert ('error="invalid_token"' in r.headers["www-authenticate"]) == (sent is not None)
    body = r.json()
    assert body["error"] == "UnauthorizedError" and "admin token" in body["message"]
    assert TOKEN not in r.text


@pytest.mark.parametrize(("method", "path"), ADMIN_CALLS)
def test_admin_calls_over_the_socket_need_the_token(
    guarded: Guarded, method: str, path: str
) -> None:
    with _unix(guarded) as http:
        _assert_401(http.request(method, path), None)
        for wrong in ("Bearer " + TOKEN[:-1] + "X", "Bearer " + TOKEN + "X", "Bearer", "x"):
            r = http.request(method, path, headers={"Authorization": wrong})
            _assert_401(r, None if wrong == "x" else wrong)
        r = http.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code != 401  # the route's own answer (404 until it exists)
        r = http.request(method, path, headers={"Authorization": f"bearer   {TOKEN}"})
        assert r.status_code != 401


def test_other_calls_over_the_socket_need_no_token(guarded: Guarded) -> None:
    for data_plane in (True, False):
        with PayloadClient(guarded.socket, data_plane=data_plane) as c:
            assert c.health().status == "ok"
            (seg,) = c.append("f", np.full((2, 3), 7, np.uint8), 0, run="u", step=0)
            np.testing.assert_array_equal(c.read_field([seg], "f", 0, 2, 0), np.full((2, 3), 7))
            assert c.stats().appends >= 1


def test_gc_and_run_deletion_need_the_token(guarded: Guarded) -> None:
    rows = np.ones((2, 48, 8), np.uint8)
    with PayloadClient(guarded.socket) as c:
        segs = c.append("f", rows, 0, run="guarded", step=0)  # appends need no token
        with pytest.raises(UnauthorizedError, match="401"):
            c.gc("guarded", 0)
        with pytest.raises(UnauthorizedError):
            c.delete_run("guarded")
        wrong = PayloadClient(guarded.socket, token="wrong-token-0123456789")
        with wrong, pytest.raises(UnauthorizedError, match="not it"):
            wrong.gc("guarded", 0)
        assert c.read_field(segs, "f", 0, 2, 0) is not None  # nothing was removed
    cmd = [*PAYLOADD, "gc", "--socket", str(guarded.socket), "--run", "guarded"]
    env = {k: v for k, v in os.environ.items() if k != "PAYLOADD_ADMIN_TOKEN"}
    refused = subprocess.run([*cmd, "--through-step", "0"], capture_output=True, text=True,
                             env=env, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "UnauthorizedError" not in refused.stdout
    assert "401" in refused.stderr
    env["PAYLOADD_ADMIN_TOKEN"] = TOKEN
    done = subprocess.run([*cmd, "--through-step", "0"], capture_output=True, text=True,
                          env=env, timeout=60)  # fmt: skip
    assert done.returncode == 0 and '"files": 1' in done.stdout, done.stderr
    with PayloadClient(guarded.socket, token=TOKEN) as admin:
        admin.append("f", rows, 0, run="guarded", step=3)
        assert admin.delete_run("guarded").files == 1


def test_tcp_listener_serves_the_api_with_the_token(guarded: Guarded) -> None:
    rows = np.arange(48 * 8 * 5, dtype=np.uint8).reshape(5, 48, 8)
    with PayloadClient(base_url=guarded.url, token=TOKEN) as c:
        assert c.data_socket is None  # TCP never uses the data plane
        assert c.health().status == "ok"
        segs = c.append("routed_experts", rows, 10, run="tcp", step=1)
        np.testing.assert_array_equal(c.read_field(segs, "routed_experts", 10, 15, 0), rows)
        appends = c.stats().appends
    with PayloadClient(guarded.socket) as local:  # the same daemon, the same files
        np.testing.assert_array_equal(local.read_field(segs, "routed_experts", 10, 15, 0), rows)
    assert (guarded.root / segs[0].file).is_file()
    with PayloadClient(base_url=guarded.url, token=TOKEN) as c:
        assert c.stats().appends == appends
    auth = {"Authorization": f"Bearer {TOKEN}"}
    doc = httpx.get(f"{guarded.url}/openapi.json", headers=auth).json()
    assert doc["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_tcp_listener_refuses_every_call_without_the_token(
    guarded: Guarded, token: str | None
) -> None:
    with PayloadClient(guarded.socket) as local:
        before = local.stats().appends
    with PayloadClient(base_url=guarded.url, token=token) as c:
        with pytest.raises(UnauthorizedError, match="calls over TCP need the admin token"):
            c.health()
        with pytest.raises(UnauthorizedError):
            c.append("f", np.ones((4, 2), np.uint8), 0, run="nope", step=0)
        with pytest.raises(UnauthorizedError):
            c.stats()
    with PayloadClient(guarded.socket) as local:
        assert local.stats().appends == before
    assert not (guarded.root / "test" / "nope").exists()
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=guarded.url, headers=headers) as http:
        for method, path in [("GET", "/healthz"), ("GET", "/openapi.json"), ("GET", "/v1/stats"),
                             ("POST", "/v1/read"), ("POST", "/v1/append"), ("GET", "/nope"),
                             *ADMIN_CALLS]:  # fmt: skip
            _assert_401(http.request(method, path), token)


def test_the_token_never_reaches_the_log(guarded: Guarded) -> None:
    with PayloadClient(base_url=guarded.url, token=TOKEN) as c:
        c.health()
    with (
        PayloadClient(base_url=guarded.url, token=TOKEN[::-1]) as c,
        pytest.raises(UnauthorizedError),
    ):
        c.health()
    log = guarded.log.read_text()
    assert "TCP 127.0.0.1" in log  # the log is the daemon's, at debug level
    assert TOKEN not in log and TOKEN[::-1] not in log


def test_token_from_the_environment(tmp_path: Path, daemons: Daemons) -> None:
    env = {**os.environ, "PAYLOADD_ADMIN_TOKEN": TOKEN}
    sock = tmp_path / "s.sock"
    with daemons.run(socket=sock, env=env) as d, _unix_path(sock) as http:
        _assert_401(http.post("/v1/admin/gc"), None)
        r = http.post("/v1/admin/gc", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code != 401
        assert http.get("/healthz").status_code == 200
        assert TOKEN.encode() not in Path(f"/proc/{d.pid}/cmdline").read_bytes()


def _unix_path(path: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://d")


def _serve(
    tmp_path: Path, *flags: str, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYLOADD_")}
    if token is not None:
        env["PAYLOADD_ADMIN_TOKEN"] = token
    cmd = [
        *PAYLOADD,
        "serve",
        "--root",
        str(tmp_path / "r"),
        "--socket",
        str(tmp_path / "s"),
        *flags,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def _peer_on(host: str) -> list[str]:
    """Flags of HTTP over TCP on ``host`` and a peer port."""
    return ["--tcp-host", host, "--tcp-port", "1", "--peer-port", "2"]


@pytest.mark.parametrize(
    ("flags", "token", "status", "match"),
    [
        (["--tcp-port", "1"], None, 1, "TCP listener (tcp_port) needs an admin token"),
        (["--admin-token-file", "FILE"], TOKEN, 1, "not both"),
        ([], "short-secret", 1, "shorter than 16 characters"),
        ([], TOKEN[:10] + " " + TOKEN[10:], 1, "visible ASCII"),
        (["--admin-token-file", "/nonexistent/token"], None, 1, "cannot read admin_token_file"),
        (["--max-file-bytes", "0"], TOKEN, 2, "max_file_bytes"),
        (["--tcp-port", "70000"], TOKEN, 2, "tcp_port"),
        ([*_peer_on("10.1.2.3"), "--peer-host", "127.0.0.1"], TOKEN, 1, "(tcp_host 10.1.2.3)"),
        ([*_peer_on("127.0.0.2"), "--peer-host", "::1"], TOKEN, 1, "leave peer_host unset"),
        ([*_peer_on("0.0.0.0"), "--peer-host", "localhost"], TOKEN, 1, "peer_host localhost"),
        ([*_peer_on("fd00::2"), "--peer-host", "0.0.0.0"], TOKEN, 1, "bind it to ::"),
        (["--admin-token", TOKEN], None, 2, "--admin-token is not a flag"),
        ([f"--admin_token={TOKEN}"], None, 2, "is not a flag"),
    ],
)
def test_bad_token_and_tcp_settings_are_clean_start_errors(
    tmp_path: Path, flags: list[str], token: str | None, status: int, match: str
) -> None:
    (tmp_path / "file").write_text(TOKEN)
    flags = [str(tmp_path / "file") if f == "FILE" else f for f in flags]
    out = _serve(tmp_path, *flags, token=token)
    assert out.returncode == status, out.stderr
    assert match in out.stderr and "Traceback" not in out.stderr
    for secret in {TOKEN, token or TOKEN}:
        assert secret not in out.stderr and secret not in out.stdout
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.lock").exists()


def test_the_token_is_in_no_help_and_no_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAYLOADD_ADMIN_TOKEN", TOKEN)
    settings = Settings()
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in str(settings)
    assert TOKEN not in settings.model_dump_json()
    out = subprocess.run([*PAYLOADD, "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env={**os.environ})  # fmt: skip
    assert out.returncode == 0 and "--admin-token-file" in out.stdout
    assert "--admin-token " not in out.stdout and TOKEN not in out.stdout
    assert "PAYLOADD_ADMIN_TOKEN" in out.stdout


@pytest.mark.asyncio
async def test_the_async_client_over_tcp(guarded: Guarded) -> None:
    rows = np.arange(6, dtype=np.uint8).reshape(3, 2)
    async with AsyncPayloadClient(base_url=guarded.url, token=TOKEN) as c:
        segs = await c.append("f", rows, 0, run="atcp", step=0)
        np.testing.assert_array_equal(await c.read_field(segs, "f", 0, 3, 0), rows)
    async with AsyncPayloadClient(base_url=guarded.url) as c:
        with pytest.raises(UnauthorizedError, match="calls over TCP"):
            await c.read_field(segs, "f", 0, 3, 0)


def test_a_token_file_of_two_lines_accepts_both_while_a_token_is_rotated(
    tmp_path: Path, daemons: Daemons
) -> None:
    """Rotation without a refused call: the file holds the new token and the old one; both
    are taken over TCP and on the peer port, any other is not; the CLI sends the first."""
    new, old = "new-" + "n" * 28, "old-" + "o" * 28
    (tmp_path / "token").write_text(f"{new}\n\n{old}\n")
    (tmp_path / "token").chmod(0o600)
    http, peer = free_port(), free_port()
    flags = ("--admin-token-file", str(tmp_path / "token"), "--tcp-port", str(http),
             "--peer-port", str(peer))  # fmt: skip
    with daemons.run(*flags, socket=tmp_path / "s.sock"):
        with PayloadClient(tmp_path / "s.sock", token=new) as local:
            segs = local.append("f", np.arange(8, dtype=np.uint8).reshape(4, 2), 0, run="r", step=0)
        for token in (new, old):
            with PayloadClient(base_url=f"http://127.0.0.1:{http}", token=token) as c:
                assert c.stats().node  # HTTP over TCP
                got = c.read_field(segs, "f", 0, 4, 0)  # the peer port
                assert got is not None and got.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
                assert c._peer is not None  # it went over the peer port, not HTTP
        with (
            PayloadClient(base_url=f"http://127.0.0.1:{http}", token="x" * 32) as c,
            pytest.raises(UnauthorizedError),
        ):
            c.stats()
        out = subprocess.run(
            [sys.executable, "-m", "payloadd", "gc", "--socket", str(tmp_path / "s.sock"),
             "--token-file", str(tmp_path / "token"), "--run", "r", "--through-step", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr


def test_a_token_file_of_too_many_tokens_or_a_short_one_is_refused_at_start(
    tmp_path: Path,
) -> None:
    for text, message in [
        ("\n".join(f"token-{i:02d}-" + "x" * 20 for i in range(9)), "holds 9 tokens; at most 8"),
        ("good-" + "g" * 20 + "\nshort\n", "shorter than 16"),
        ("\n\n", "shorter than 16"),
    ]:
        (tmp_path / "token").write_text(text)
        out = subprocess.run(
            [sys.executable, "-m", "payloadd", "serve", "--root", str(tmp_path / "root"),
             "--socket", str(tmp_path / "s.sock"), "--admin-token-file", str(tmp_path / "token")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode != 0 and message in out.stderr, out.stderr
        assert "g" * 20 not in out.stderr and "x" * 20 not in out.stderr  # never the tokens
