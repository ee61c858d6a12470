"""Run ``payloadd serve`` as a child process (the demo and the tests use the real daemon)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from payload_client import PayloadClient, PayloadError

__all__ = ["run_child", "start_daemon"]


@contextlib.contextmanager
def start_daemon(
    root: Path, socket_path: Path, *extra: str, log_level: str = "warning", **popen: Any
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``payloadd serve`` in a child process until the block ends; wait until it answers.

    ``popen`` goes to `subprocess.Popen` (e.g. ``env``, ``umask``, ``stderr``). The child
    reads no config file unless ``extra`` or ``env`` names one (``PAYLOADD_CONFIG`` is set
    empty otherwise): a daemon on a temporary root must not take a node's
    /etc/payloadd/payloadd.toml.
    """
    env = dict(popen.pop("env") if "env" in popen else os.environ)
    env.setdefault("PAYLOADD_CONFIG", "")
    cmd = [
        sys.executable,
        "-m",
        "payloadd",
        "serve",
        "--root",
        str(root),
        "--socket",
        str(socket_path),
    ]

    def answers() -> None:
        with PayloadClient(socket_path, timeout=5) as probe:
            probe.health()

    cmd += ["--log-level", log_level, *extra]
    with run_child(cmd, socket_path, "payloadd", answers, env=env, **popen) as proc:
        yield proc


@contextlib.contextmanager
def run_child(
    cmd: list[str],
    socket_path: Path,
    what: str,
    probe: Callable[[], object] = lambda: None,
    **popen: Any,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` in a child process until the block ends; first wait (at most 30 s) until
    ``socket_path`` takes a connection and ``probe()`` returns.

    Raises
    ------
    RuntimeError
        Naming ``what``, when the child exits or does not answer in time.
    """
    proc = subprocess.Popen(cmd, **popen)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                # a plain connect first: httpcore leaks the socket of a refused connect
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                    raw.connect(str(socket_path))
                probe()
                break
            except (PayloadError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not start (exit {proc.poll()})") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
