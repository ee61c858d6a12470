"""The systemd files in deploy/systemd: they agree with each other and with the settings,
and systemd's own tools accept them (when installed; systemd itself need not run)."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from payloadd.settings._settings import Settings

UNITS = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
INSTALLED = "/usr/local/bin/payloadd"


def _unit(name: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (a key may repeat), sections ignored."""
    keys: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


def _flag(argv: list[str], flag: str, default: object) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else str(default)


def test_the_units_agree_with_each_other_and_the_settings() -> None:
    service, sock = _unit("payloadd.service"), _unit("payloadd.socket")
    argv = shlex.split(service["ExecStart"][0])
    assert argv[:2] == [INSTALLED, "serve"]
    socket_path = _flag(argv, "--socket", Settings.model_fields["socket"].default)
    root = _flag(argv, "--root", Settings.model_fields["root"].default)
    assert sock["ListenStream"] == [socket_path, f"{socket_path}.data"]
    assert sock["Service"] == ["payloadd.service"]
    assert sock["SocketUser"] == service["User"] and sock["SocketGroup"] == service["Group"]
    assert sock["SocketMode"] == ["0660"] and sock["DirectoryMode"] == ["0750"]
    assert sock["FileDescriptorName"]
    assert "payloadd.socket" in service["Wants"] and "payloadd.socket" in service["After"]
    assert service["RestartPreventExitStatus"] == ["2"]  # serve: bad settings or config file
    # the socket directory outlives the service: stopping it must not remove the sockets
    run_dir = os.path.dirname(socket_path)
    assert service["RuntimeDirectory"] == [os.path.basename(run_dir)]
    assert run_dir == f"/run/{service['RuntimeDirectory'][0]}"
    assert service["RuntimeDirectoryPreserve"] == ["yes"]
    assert root in service["ReadWritePaths"][0].split()
    tmpfiles = [ln.split() for ln in (UNITS / "payloadd.tmpfiles").read_text().splitlines()]
    entries = [e for e in tmpfiles if e and not e[0].startswith("#")]
    assert entries == [["d", run_dir, "0750", *service["User"], *service["Group"], "-"]]


def _copies(tmp: Path, *names: str) -> list[Path]:
    """The units in ``tmp``, ExecStart= pointing at this checkout's payloadd (which exists)."""
    payloadd = Path(sys.executable).with_name("payloadd")
    assert payloadd.exists()
    out = []
    for name in names:
        text = (UNITS / name).read_text().replace(f"ExecStart={INSTALLED}", f"ExecStart={payloadd}")
        (tmp / name).write_text(text)
        out.append(tmp / name)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
@pytest.mark.parametrize(
    "names", [("payloadd.socket", "payloadd.service"), ("payloadd.service",)], ids=["both", "alone"]
)
def test_systemd_analyze_verify_reports_nothing(tmp_path: Path, names: tuple[str, ...]) -> None:
    units = _copies(tmp_path, *names)
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *map(str, units)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # a misspelt key or a bad value is only a warning: the output must be empty
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verify_can_fail(tmp_path: Path) -> None:
    (unit,) = _copies(tmp_path, "payloadd.socket")
    unit.write_text(unit.read_text().replace("SocketMode=", "SocketMod="))
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Unknown key 'SocketMod'" in out.stderr


@pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="no systemd-sysusers or systemd-tmpfiles here",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles needs root to chown")
def test_sysusers_and_tmpfiles_make_the_user_and_the_socket_directory(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()  # an image root: nothing of this host is touched
    for cmd in (
        ["systemd-sysusers", f"--root={tmp_path}", str(UNITS / "payloadd.sysusers")],
        ["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(UNITS / "payloadd.tmpfiles")],
    ):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    users = {e.split(":")[0]: e.split(":") for e in (tmp_path / "etc/passwd").read_text().split()}
    uid, gid = int(users["payloadd"][2]), int(users["payloadd"][3])
    st = os.stat(tmp_path / "run" / "payloadd")
    assert stat.S_IMODE(st.st_mode) == 0o750 and (st.st_uid, st.st_gid) == (uid, gid)
    assert uid != pwd.getpwuid(0).pw_uid
