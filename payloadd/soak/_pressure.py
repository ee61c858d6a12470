"""``payloadd soak --hostile``: the daemon's TCP port, peer port and admin token
(`HostileSetup`), and what presses on it beside the load (`Pressure`): the hostile
neighbours (`payloadd.soak._hostile`) and the probes of the node's own socket
(`payloadd.soak._probes`), and the threads of a client that straggle on old steps
(`payloadd.soak._stragglers`)."""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from payloadd.soak._hostile import NeighbourPlan, Neighbours
from payloadd.soak._probes import HealthProber, RefusalProber
from payloadd.soak._state import Probes
from payloadd.soak._stragglers import Stragglers
from payloadd.soak._workers import Tally

__all__ = ["FD_ROOM", "HostileSetup", "Pressure", "make_room"]

FD_ROOM = 512
"""Descriptors the soak keeps for itself beside the neighbours' connections."""


@dataclass
class HostileSetup:
    """The daemon's TCP port and peer port (free ports of 127.0.0.1) and its admin token, in
    a file of mode 0600 that the soak made."""

    token: str
    token_file: Path
    tcp_port: int
    peer_port: int

    @classmethod
    def make(cls, tmp: Path) -> HostileSetup:
        """A new token in ``tmp/admin-token`` and two free ports."""
        token = secrets.token_hex(32)
        path = tmp / "admin-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        with contextlib.ExitStack() as stack:  # both bound at once: two different ports
            socks = [stack.enter_context(socket.socket()) for _ in range(2)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
            tcp, peer = (int(s.getsockname()[1]) for s in socks)
        return cls(token, path, tcp, peer)

    def daemon_flags(self) -> list[str]:
        """The flags of ``payloadd serve`` that open them."""
        return [
            f"--admin-token-file={self.token_file}",
            f"--tcp-port={self.tcp_port}",
            f"--peer-port={self.peer_port}",
        ]

    @property
    def tcp_url(self) -> str:
        """The TCP listener's URL."""
        return f"http://127.0.0.1:{self.tcp_port}"


def make_room(connections: int) -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` (up to its hard one) so that the
    neighbours' ``connections`` and `FD_ROOM` more fit.

    Raises
    ------
    ValueError
        The hard limit is too low.
    """
    need = connections + FD_ROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(
                f"{connections} neighbour connections need {need} descriptors; "
                f"RLIMIT_NOFILE allows {hard}"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class Pressure:
    """The neighbours and the probers of one soak, each in a thread of its own, from
    `start` to `stop`.

    Parameters
    ----------
    setup : HostileSetup
        The daemon's ports and token.
    socket : str
        The daemon's Unix socket.
    root, node_dir : Path
        The payload root and ``<root>/<node>``.
    plan : NeighbourPlan
        How many neighbours of each kind.
    tally : Tally
        Where the probers' unexpected errors go.
    """

    def __init__(
        self,
        setup: HostileSetup,
        socket: str,
        root: Path,
        node_dir: Path,
        plan: NeighbourPlan,
        tally: Tally,
    ) -> None:
        self.probes = Probes()
        self.tally = tally
        tcp, peer = ("127.0.0.1", setup.tcp_port), ("127.0.0.1", setup.peer_port)
        self.neighbours = Neighbours(tcp, peer, setup.token, plan)
        self.health = HealthProber(socket, self.probes)
        self.refusals = RefusalProber(
            socket, setup.tcp_url, setup.token, root, node_dir, self.probes, tally
        )
        self.stragglers = Stragglers(socket, setup.token, tally)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=fn, args=(self._stop,), daemon=True, name=name)
            for fn, name in (
                (self.neighbours.run, "soak neighbours"),
                (self.health.run, "soak health probe"),
                (self.refusals.run, "soak refusal prober"),
                (self.stragglers.run, "soak stragglers"),
            )
        ]
        self._stopped = False

    def start(self) -> None:
        """Start the neighbours and the probes."""
        for t in self._threads:
            t.start()

    def stop(self, until: float) -> dict[str, Any]:
        """Stop them (the refusal prober checks the refusals it still holds), delete the
        prober's runs; return the neighbours' summary. Only the first call does it. The
        stragglers' run stays, for the comparison of counted and real bytes at rest:
        `clean_up` deletes it."""
        if self._stopped:
            return self.neighbours.summary()
        self._stopped = True
        self._stop.set()
        for t in self._threads:
            t.join(max(1.0, until - time.monotonic()))
            if t.is_alive():
                self.tally.error("pressure", RuntimeError(f"{t.name} did not end"),
                                 time.monotonic(), t.name)  # fmt: skip
        if self.neighbours.failed is not None:
            why = RuntimeError(f"the neighbours stopped early: {self.neighbours.failed}")
            self.tally.error("neighbours", why, time.monotonic(), "neighbours")
        if not self.refusals.cleanup(time.monotonic() + 10):
            why = RuntimeError("the refusal prober's runs could not be deleted")
            self.tally.error("probe cleanup", why, time.monotonic(), "refusal prober")
        return {**self.neighbours.summary(), "stragglers": dict(self.stragglers.counts)}

    def clean_up(self) -> None:
        """Delete the stragglers' run (after the comparison at rest)."""
        if not self.stragglers.cleanup():
            why = RuntimeError("the stragglers' run could not be deleted")
            self.tally.error("straggler cleanup", why, time.monotonic(), "stragglers")
