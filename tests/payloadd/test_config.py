"""The TOML config file of ``payloadd serve``: precedence, bad files, the example, the docs."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from payload_client import PayloadClient
from payloadd.settings import _config_file as _config
from payloadd.settings._config_file import NOT_IN_FILE, ConfigFileError
from payloadd.settings._settings import Settings
from tests.conftest import Daemons

PAYLOADD = [sys.executable, "-m", "payloadd"]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "payloadd.toml"
FILE_KEYS = [name for name in Settings.model_fields if name not in NOT_IN_FILE]
NO_TOML_DEFAULT = {
    "socket_group", "admin_token_file", "tcp_port", "peer_host", "peer_port", "node",
    "foreign_wait_s", "gc_grace_s",
}  # fmt: skip
"""Settings whose default (none, the host name, or one by the root's file system) a TOML
value cannot state."""


def _env(**values: str) -> dict[str, str]:
    """This environment without PAYLOADD_* variables, plus ``values``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAYLOADD_")}
    return {**env, **values}


def test_flag_over_env_over_file_over_default_through_serve(
    tmp_path: Path, daemons: Daemons
) -> None:
    config = tmp_path / "payloadd.toml"
    config.write_text(
        'node = "from-file"\n'
        "max_root_bytes = 111111111\n"
        "min_free_bytes = 222222\n"
        'fsync = "interval"\n'
        "[fields.file_only]\n"
        'dtypes = ["uint8"]\n'
    )
    env = _env(
        PAYLOADD_CONFIG=str(config),  # the file named by the environment
        PAYLOADD_NODE="from-env",
        PAYLOADD_MAX_ROOT_BYTES="444444444",
        PAYLOADD_FIELDS='{"env_only": {"dtypes": ["int32"], "fill": -1}}',
        PAYLOADD_UNKNOWN_FIELDS="refuse",
    )
    flags = ("--node", "from-flag", "--min-free-bytes", "555")
    sock = tmp_path / "s.sock"
    with daemons.run(*flags, socket=sock, env=env), PayloadClient(sock) as c:
        health, stats, table = c.health(), c.stats(), c.fields()
    assert health.node == "from-flag"  # flag > env > file
    assert stats.min_free_bytes == 555  # flag > file
    assert stats.max_root_bytes == 444444444  # env > file
    assert stats.fsync == "interval"  # file > default
    assert table.unknown_fields == "refuse"  # env > default
    assert sorted(table.fields) == ["env_only"]  # the env's table replaces the file's whole


@pytest.mark.parametrize(
    "given", [c for n in range(4) for c in itertools.combinations(("flag", "env", "file"), n)]
)
def test_every_pair_of_sources_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: tuple[str, ...]
) -> None:
    value = {"flag": 3, "env": 2, "file": 1}
    config = tmp_path / "c.toml"
    config.write_text(f"lease_bytes = {value['file']}\n" if "file" in given else "")
    if "env" in given:
        monkeypatch.setenv("PAYLOADD_LEASE_BYTES", str(value["env"]))
    kwargs: dict[str, Any] = {"lease_bytes": str(value["flag"])} if "flag" in given else {}
    settings = Settings(config=str(config), **kwargs)  # flags come in as init arguments
    want = value[given[0]] if given else Settings.model_fields["lease_bytes"].default
    assert settings.lease_bytes == want
    assert settings.config == config


def test_the_config_flag_wins_over_the_variable(tmp_path: Path, monkeypatch) -> None:
    good = tmp_path / "good.toml"
    good.write_text("ttl_s = 7.0\n")
    monkeypatch.setenv("PAYLOADD_CONFIG", str(tmp_path / "missing.toml"))
    assert Settings(config=str(good)).ttl_s == 7.0
    with pytest.raises(ConfigFileError, match=r"missing\.toml"):
        Settings()


def test_the_default_file_is_read_when_it_exists(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PAYLOADD_CONFIG", raising=False)
    default = tmp_path / "etc" / "payloadd.toml"
    monkeypatch.setattr(_config, "DEFAULT_CONFIG", default)
    assert Settings().config is None  # absent: no file, no error
    default.parent.mkdir()
    default.write_text("keep_alive_s = 9.0\n")
    settings = Settings()
    assert settings.keep_alive_s == 9.0 and settings.config == default
    assert Settings(config="").keep_alive_s == 5.0 and Settings(config="").config is None
    monkeypatch.setenv("PAYLOADD_CONFIG", "")
    assert Settings().config is None
    default.unlink()
    default.mkdir()  # there, but not a file: an error, not silently skipped
    monkeypatch.delenv("PAYLOADD_CONFIG")
    with pytest.raises(ConfigFileError, match="not a regular file"):
        Settings()


SECRET = "s3cret-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("text", "keys"),
    [
        ("max_file_byte = 10\n", ["max_file_byte", "did you mean max_file_bytes"]),
        ('max_file_bytes = "lots"\n', ["max_file_bytes: 'lots' is not a size", "1GiB"]),
        ('lease_bytes = "1.5B"\n', ["lease_bytes: '1.5B' is not a whole number of bytes"]),
        ("lease_bytes = 1.5\n", ["lease_bytes: 1.5 is not a whole number of bytes"]),
        ("max_file_bytes = 0\n", ["max_file_bytes", "greater than 0"]),
        ("ttl_s = true\n", ["ttl_s", "boolean"]),
        ("socket_mode = 660\n", ["socket_mode", "0777"]),
        ('fsync = "sometimes"\n', ["fsync"]),
        ("data_plane = 3\n", ["data_plane", "boolean"]),
        ('ROOT = "/x"\n', ["ROOT", "did you mean root"]),
        ('[fields.m]\ndtypes = ["uint9"]\n', ["fields.m", "uint9"]),
        ('[fields.m]\ndtypes = ["uint8"]\nwidth = 3\n', ["fields.m.width"]),
        ('fields = "not a table"\n', ["fields"]),
        (f'admin_token = "{SECRET}"\n', ["admin_token", "admin_token_file"]),
        ('config = "other.toml"\n', ["config", "another"]),
        ("max_file_bytes =\n", ["not valid TOML", "line 1"]),
    ],
)
def test_a_bad_config_file_stops_the_start(tmp_path: Path, text: str, keys: list[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    cmd = [*PAYLOADD, "serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s")]
    # a flag that overrides the key does not make a bad file good
    out = subprocess.run(
        [*cmd, "--config", str(config), "--max-file-bytes", "4096"],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert str(config) in out.stderr and "Traceback" not in out.stderr
    for key in keys:
        assert key in out.stderr
    assert SECRET not in out.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


SIZES = sorted(name for name in Settings.model_fields if name.endswith("_bytes"))
"""Every size setting: each takes a unit."""


def test_every_size_setting_takes_units_from_every_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SIZES == [
        "lease_bytes", "max_control_bytes", "max_file_bytes", "max_inflight_bytes",
        "max_request_bytes", "max_root_bytes", "min_free_bytes",
    ]  # fmt: skip
    config = tmp_path / "c.toml"
    config.write_text("".join(f'{name} = "2 KiB"\n' for name in SIZES))
    from_file = Settings(config=str(config))
    for name in SIZES:
        monkeypatch.setenv(f"PAYLOADD_{name.upper()}", "1.5kib")
    from_env = Settings(config=str(config))
    flags: dict[str, Any] = {name: "3MiB" for name in SIZES}  # as argparse hands them on
    from_flags = Settings(config=str(config), **flags)
    for name in SIZES:
        assert getattr(from_file, name) == 2048, name
        assert getattr(from_env, name) == 1536, name
        assert getattr(from_flags, name) == 3 << 20, name


@pytest.mark.parametrize(
    ("given", "size"),
    [
        ("4096", 4096), (4096, 4096), ("64KiB", 64 << 10), ("512MiB", 512 << 20),
        ("1GiB", 1 << 30), ("1gib", 1 << 30), ("1 GiB", 1 << 30), (" 2KiB ", 2048),
        ("1.5GB", 1_500_000_000), ("1.5GiB", 3 << 29), ("1K", 1000), ("1.005KB", 1005),
        (".5MiB", 1 << 19), (2e9, 2_000_000_000), ("7EiB", 7 << 60),
    ],
)  # fmt: skip
def test_size_forms(given: object, size: int) -> None:
    assert Settings(config="", max_root_bytes=given).max_root_bytes == size


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("1GXB", "'1GXB' is not a size: unknown unit 'GXB': give bytes (1073741824) or a "
                 "number with a unit (512MiB, 1GiB, 1.5GB)"),
        ("-1", "'-1' is not a size: give bytes"),
        ("1GiB/s", "'1GiB/s' is not a size"),  # pydantic's ByteSize would take 1 GiB
        ("1e9", "'1e9' is not a size"),
        ("8Gbit", "unknown unit 'Gbit'"),  # a size setting counts bytes
        ("1.5B", "'1.5B' is not a whole number of bytes (1.5 bytes)"),  # not truncated to 1
        ("1.5", "'1.5' is not a whole number of bytes"),
        ("0.3KiB", "'0.3KiB' is not a whole number of bytes (307.2 bytes)"),
        (1.5, "1.5 is not a whole number of bytes"),
        (True, "True is not a size"),
        ("16EiB", "less than or equal to 9223372036854775807"),
    ],
)  # fmt: skip
def test_a_bad_size_is_refused_naming_the_value(given: object, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(config="", max_root_bytes=given)
    (e,) = err.value.errors()
    assert e["loc"] == ("max_root_bytes",) and message in e["msg"], e["msg"]


def test_units_through_serve_flag_env_and_file(tmp_path: Path, daemons: Daemons) -> None:
    config = tmp_path / "payloadd.toml"
    config.write_text('max_root_bytes = "1.5GB"\nlease_bytes = "1MiB"\nmax_file_bytes = 65536\n')
    env = _env(PAYLOADD_CONFIG=str(config), PAYLOADD_MIN_FREE_BYTES="64 KiB")
    flags = ("--max-file-bytes", "4MiB")
    sock = tmp_path / "s.sock"
    with daemons.run(*flags, socket=sock, env=env), PayloadClient(sock) as c:
        stats = c.stats()
        rows = np.ones((8192, 48, 8), np.uint8)  # 3 MiB: one file under a 4 MiB rotation
        segs = c.append("routed_experts", rows, 0, run="u", step=0)
    assert stats.max_root_bytes == 1_500_000_000  # file
    assert stats.min_free_bytes == 64 << 10  # environment
    assert len({s.file for s in segs}) == 1  # the flag's 4 MiB, not the file's 65536


@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_bad_size_stops_the_start_naming_the_setting(tmp_path: Path, how: str) -> None:
    cmd = [*PAYLOADD, "serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s")]
    env = _env()
    if how == "flag":
        cmd += ["--max-root-bytes", "1GXB"]
    elif how == "env":
        env["PAYLOADD_MAX_ROOT_BYTES"] = "1GXB"
    else:
        config = tmp_path / "c.toml"
        config.write_text('max_root_bytes = "1GXB"\n')
        cmd += ["--config", str(config)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr
    line = "max_root_bytes: '1GXB' is not a size: unknown unit 'GXB': give bytes (1073741824) "
    assert line + "or a number with a unit (512MiB, 1GiB, 1.5GB)" in out.stderr, out.stderr
    assert "(got '1GXB')" not in out.stderr  # quoted once
    assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()


def test_serve_help_gives_sizes_defaults_with_units() -> None:
    env = {**_env(), "COLUMNS": "2000"}  # one line per flag
    out = subprocess.run([*PAYLOADD, "serve", "--help"], capture_output=True, text=True,
                         timeout=60, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[env PAYLOADD_MAX_FILE_BYTES; default 1 GiB]" in out.stdout
    assert "[env PAYLOADD_MAX_ROOT_BYTES; default 0]" in out.stdout
    assert out.stdout.count("Bytes, or a number with a unit: 512MiB, 1GiB, 1.5GB.") == len(SIZES)


@pytest.mark.parametrize("how", ["flag", "env", "file"])
@pytest.mark.parametrize("key", ["root", "socket"])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(
    tmp_path: Path, how: str, key: str
) -> None:
    paths = {"root": str(tmp_path / "r"), "socket": str(tmp_path / "s")}
    env = _env()
    if how == "flag":
        paths[key] = ""
    elif how == "env":
        del paths[key]
        env[f"PAYLOADD_{key.upper()}"] = ""  # e.g. a template variable left unset
    else:
        del paths[key]
        config = tmp_path / "c.toml"
        config.write_text(f'{key} = ""\n')
        env["PAYLOADD_CONFIG"] = str(config)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    flags = [a for k, v in paths.items() for a in (f"--{k}", v)]
    out = subprocess.run(
        [*PAYLOADD, "serve", "--node", "n", *flags], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert key in out.stderr and "must not be empty" in out.stderr
    assert "Traceback" not in out.stderr
    assert list(cwd.iterdir()) == []  # nothing made in the working directory


@pytest.mark.parametrize("how", ["flag", "file"])
def test_an_fsync_interval_the_flusher_cannot_wait_is_refused(tmp_path: Path, how: str) -> None:
    flags = ["--fsync", "interval", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s")]
    env = _env()
    if how == "flag":
        flags += ["--fsync-interval-s", "1e300"]
    else:
        config = tmp_path / "c.toml"
        config.write_text("fsync_interval_s = 1e300\n")
        env["PAYLOADD_CONFIG"] = str(config)
    out = subprocess.run(
        [*PAYLOADD, "serve", *flags], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 2, out.stderr  # not a daemon whose flusher died: it never fsyncs
    assert "fsync_interval_s" in out.stderr and "86400" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_config_file_not_utf8_stops_the_start_with_a_message(tmp_path: Path) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes('node = "n\xe9ud"\n'.encode("latin-1"))  # TOML is UTF-8 only
    out = subprocess.run(
        [*PAYLOADD, "serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s"),
         "--config", str(config)],
        capture_output=True, text=True, timeout=60, env=_env(),
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"config file {config} is not valid TOML: not UTF-8" in out.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_named_config_file_that_is_missing_stops_the_start(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "nowhere" / "payloadd.toml"
    cmd = [*PAYLOADD, "serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s")]
    if how == "flag":
        out = subprocess.run(
            [*cmd, "--config", str(missing)], capture_output=True, text=True, timeout=60,
            env=_env(),
        )  # fmt: skip
    else:
        env = _env(PAYLOADD_CONFIG=str(missing))
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert f"config file {missing} (the config setting) does not exist" in out.stderr


def _uncommented(text: str) -> str:
    """The example with every commented-out setting (``#key = ...``, ``#[table]``) active."""
    return re.sub(r"(?m)^#(?=[A-Za-z\[])", "", text)


def test_the_example_config_covers_every_setting_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith("PAYLOADD_"):
            monkeypatch.delenv(name)
    text = EXAMPLE.read_text()
    assert tomllib.loads(text) == {}  # as shipped: every setting commented out
    assert Settings(config=str(EXAMPLE)).model_dump(exclude={"config"}) == Settings(
        config=""
    ).model_dump(exclude={"config"})
    active = tmp_path / "active.toml"
    active.write_text(_uncommented(text))
    data = tomllib.loads(active.read_text())
    assert sorted(data) == sorted(FILE_KEYS)  # every setting, nothing else
    settings = Settings(config=str(active))  # and every value valid
    defaults = Settings(config="")
    for name in FILE_KEYS:
        if name not in NO_TOML_DEFAULT:  # the others are examples, said so in the file
            assert getattr(settings, name) == getattr(defaults, name), name
            assert f"{name} = " in text
    for name in NO_TOML_DEFAULT:
        block = text.split(f"#{name} = ")[0].rsplit("\n\n", 1)[-1]
        assert "Example" in block, name
    for name in NOT_IN_FILE:
        assert name in text  # said why it is not there


def test_the_example_config_starts_a_daemon(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    config = ("--config", str(EXAMPLE))
    with daemons.run(*config, socket=sock, env=_env()), PayloadClient(sock) as c:
        assert c.health().status == "ok"  # no PAYLOADD_* variable: the file's settings
        table = c.fields()
        assert sorted(table.fields) == ["routed_experts", "sampling_mask"]
        assert table.unknown_fields == "refuse"
        assert [table.fields[f].ragged for f in sorted(table.fields)] == [False, True]


def test_operations_table_lists_every_setting() -> None:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if re.match(r"^\| `\w+` \|", ln)]
    names = [re.match(r"^\| `(\w+)` \|", ln).group(1) for ln in rows]  # type: ignore[union-attr]
    assert sorted(names) == sorted(Settings.model_fields)  # every setting, once
    for name, row in zip(names, rows, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        flag = "none" if name == "admin_token" else f"`--{name.replace('_', '-')}`"
        assert cells[1] == flag and cells[2] == f"`PAYLOADD_{name.upper()}`", row
    for name in NOT_IN_FILE:
        assert f"`{name}`" in section.split("### Config file", 1)[1]
