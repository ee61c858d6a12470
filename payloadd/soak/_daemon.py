"""The soak's daemon: a real ``payloadd serve`` on the soak's root and socket, started,
SIGKILLed and started again."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from payloadd.bench._daemon_process import start_daemon

__all__ = ["NODE", "SoakDaemon"]

NODE = "soak"
"""The daemon's node: its files are under ``<root>/soak``."""


class SoakDaemon:
    """The soak's daemon: started, SIGKILLed and started again on the same root and socket."""

    def __init__(self, root: Path, socket: Path, extra: list[str], log: IO[bytes]) -> None:
        self.root, self.socket, self.extra, self.log = root, socket, extra, log
        self._cm: contextlib.AbstractContextManager[subprocess.Popen[bytes]] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts: list[float] = []  # when each start answered (time.monotonic)
        self.restarting = False  # down on purpose: killed, not started again yet

    def start(self) -> None:
        """Start the daemon and wait until it answers.

        Raises
        ------
        RuntimeError
            It exited or did not answer in time (its flags, from ``--daemon-arg``).
        """
        cm = start_daemon(self.root, self.socket, "--node", NODE, *self.extra, stderr=self.log)
        self.proc = cm.__enter__()
        self._cm = cm
        self.starts.append(time.monotonic())

    def kill(self) -> int:
        """SIGKILL the daemon; return its pid."""
        assert self.proc is not None and self._cm is not None
        pid = self.proc.pid
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.stop()  # nothing left to terminate: just the context
        return pid

    @property
    def pid(self) -> int | None:
        """The running daemon's pid; ``None`` when none runs."""
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def stop(self) -> None:
        """SIGTERM (as `start_daemon` ends) and wait."""
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)
