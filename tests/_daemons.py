"""Real daemons for the tests, and waiting for a condition instead of sleeping.

`Daemons` starts ``payloadd serve`` processes under one folder and stops every one it
started when it closes (the ``daemons`` fixture of ``tests/conftest.py`` is one on the
test's ``tmp_path``; a module- or session-scoped fixture opens its own on a folder of
``tmp_path_factory``). `wait_until` polls a condition until it holds or a deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from payloadd.bench._daemon_process import start_daemon

__all__ = ["Daemon", "Daemons", "Started", "await_until", "wait_until"]

T = TypeVar("T")

POLL_S = 0.02
"""How often `wait_until` and `await_until` look at their condition."""


@dataclass(frozen=True)
class Daemon:
    """A running daemon: its payload root and socket."""

    root: Path
    socket: Path


@dataclass(frozen=True)
class Started(Daemon):
    """A daemon a `Daemons` started: its process and its log (``None`` when it logs to
    the test's stderr) too."""

    proc: subprocess.Popen[bytes]
    log: Path | None = None

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        return self.proc.pid


class Daemons:
    """Starts real daemons under ``folder``; `close` (or the end of a ``with``) stops those
    `start` and `start_all` started.

    Each daemon has the root ``folder/root`` unless given another, and the socket
    ``folder/s.sock``, or ``folder/<node>.sock`` for a daemon given a ``node``, unless
    given another.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop every daemon `start` and `start_all` started, the last one first."""
        self._stack.close()

    def start(self, *flags: str, **options: Any) -> Started:
        """Start a daemon with ``flags`` that runs until `close`; see `run` for ``options``."""
        return self._stack.enter_context(self.run(*flags, **options))

    def start_all(
        self, nodes: Sequence[str], *flags: str, shared_root: bool = True, **options: Any
    ) -> dict[str, Started]:
        """Start one daemon a node of ``nodes``, each with ``flags``, until `close`.

        They share the root ``folder/root``, or with ``shared_root=False`` each has
        ``folder/<node>/root``; each has the socket ``folder/<node>.sock``.
        """
        started = {}
        for node in nodes:
            root = self.folder / "root" if shared_root else self.folder / node / "root"
            started[node] = self.start(*flags, node=node, root=root, **options)
        return started

    @contextlib.contextmanager
    def run(
        self,
        *flags: str,
        node: str | None = None,
        root: Path | None = None,
        socket: Path | None = None,
        log: Path | None = None,
        log_level: str = "warning",
        **popen: Any,
    ) -> Iterator[Started]:
        """A daemon with ``flags`` for the ``with`` block only (a test that stops it, or
        restarts one on the same root and socket).

        Parameters
        ----------
        node
            Passed as ``--node``; it also names the default socket.
        root, socket
            The payload root and the socket, instead of the defaults.
        log
            A file the daemon's stderr is appended to.
        log_level
            The daemon's ``--log-level``.
        **popen
            Passed to `subprocess.Popen` (``env``, ``preexec_fn``, ``umask``, ``stderr``).
        """
        root = root if root is not None else self.folder / "root"
        if socket is None:
            socket = self.folder / ("s.sock" if node is None else f"{node}.sock")
        extra = (*flags, "--node", node) if node is not None else flags
        with contextlib.ExitStack() as stack:
            if log is not None:
                popen["stderr"] = stack.enter_context(log.open("ab"))
            proc = stack.enter_context(
                start_daemon(root, socket, *extra, log_level=log_level, **popen)
            )
            yield Started(root, socket, proc, log)


def wait_until(
    condition: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "the condition",
    every: float = POLL_S,
) -> T:
    """Call ``condition`` (every ``every`` seconds) until it returns something true, and
    return that.

    Raises
    ------
    AssertionError
        Naming ``what``, when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(every)
    return got


async def await_until(
    condition: Callable[[], Awaitable[T | None] | T | None],
    timeout: float = 30.0,
    what: str = "the condition",
) -> T:
    """`wait_until` for a test on an event loop: the loop runs on between two looks;
    ``condition`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(POLL_S)
