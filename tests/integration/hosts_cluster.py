"""A cluster of daemons on hosts of their own network stacks (`tests.integration.netns`): one
daemon a host, its own payload root, HTTP and the peer port on the host's address, admin
tokens from a file (so that a rolling rotation can restart it with others); trainer ranks
run inside the hosts' namespaces (`tests.integration.hosts_reader`), many at once."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from payload_client import PayloadClient, PayloadSegment, encode_segments
from tests.integration.netns import Host, Hosts
from tests.payloadd.test_metrics import scrape

__all__ = ["HTTP_PORT", "PEER_PORT", "TOKENS", "HostCluster", "HostDaemon", "host_cluster"]

HTTP_PORT, PEER_PORT = 8765, 8766
TOKENS = ("hosts-token-0123456789abcdef0123", "hosts-token-rotated-456789abcdef")
"""The admin token the cluster starts with, and the one a rotation moves it to."""
ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=f"{ROOT}/client:{ROOT}")
"""Every process in a host runs this checkout."""


@dataclass
class HostDaemon:
    """A host's daemon (node ``name``), started and stopped by the check, by its pid."""

    host: Host
    name: str
    folder: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    tokens: Sequence[str] = ()

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def socket(self) -> Path:
        return self.folder / "d.sock"

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{HTTP_PORT}"

    def start(self, tokens: Sequence[str]) -> None:
        """Start it with ``tokens`` (its token file, the first sent by its tools); return once
        it answers on its Unix socket."""
        self.tokens = tokens
        token_file = self.folder / "token"
        token_file.write_text("".join(f"{t}\n" for t in tokens))
        token_file.chmod(0o600)
        argv = [sys.executable, "-m", "payloadd", "serve", "--root", str(self.root),
                "--socket", str(self.socket), "--node", self.name, "--tcp-host",
                self.host.address, "--tcp-port", str(HTTP_PORT), "--peer-port", str(PEER_PORT),
                "--admin-token-file", str(token_file)]  # fmt: skip
        self.root.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with (self.folder / f"log-{self.starts}").open("wb") as out:
            self.proc = subprocess.Popen(self.host.command(argv), stdout=out,
                                         stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)  # fmt: skip
        with PayloadClient(str(self.socket)) as c:  # a Unix socket: reachable from here
            c.wait_ready(60)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(60)
            self.proc = None

    def restart(self, tokens: Sequence[str]) -> tuple[float, float]:
        """Stop it and start it with ``tokens``: the times (``time.time()``) it went and came
        back."""
        went = time.time()
        self.stop()
        self.start(tokens)
        return went, time.time()

    def client(self) -> PayloadClient:
        """A client of its Unix socket, with the first of its tokens (admin calls need it)."""
        return PayloadClient(str(self.socket), token=self.tokens[0])

    def read_bytes(self) -> dict[str, float]:
        """Bytes this daemon served to reads, by transport (``payloadd_read_bytes_total``)."""
        transport = httpx.HTTPTransport(uds=str(self.socket))
        with httpx.Client(transport=transport, base_url="http://d") as h:
            samples = scrape(h)
        out: dict[str, float] = {}
        for (name, labels), v in samples.items():
            if name == "payloadd_read_bytes_total":
                t = dict(labels)["transport"]
                out[t] = out.get(t, 0.0) + v
        return out

    def usage(self) -> dict[str, Any]:
        """Its resident memory (KiB), open descriptors, the removed files it holds open, and
        threads (`/proc`: the hosts share this machine's process ids)."""
        assert self.proc is not None
        pid = self.proc.pid  # `ip netns exec` execs the daemon: its pid
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        values = dict(line.split(":", 1) for line in status)
        links = []
        for p in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(FileNotFoundError):  # closed since it was listed
                links.append(os.readlink(p))
        return {"rss_kib": int(values["VmRSS"].split()[0]), "fds": len(links),
                "deleted": [x for x in links if x.endswith(" (deleted)")
                            and not x.startswith("/memfd:")],  # a memfd has no file
                "threads": int(values["Threads"])}  # fmt: skip


@dataclass
class HostCluster:
    hosts: Hosts
    daemons: list[HostDaemon]
    folder: Path
    token: str = TOKENS[0]
    _jobs: int = field(default=0)

    def node_map(self, local: int) -> dict[str, str]:
        """The node map of a rank on host ``local``: its own daemon by socket."""
        return {d.name: f"unix://{d.socket}" if i == local else d.url
                for i, d in enumerate(self.daemons)}  # fmt: skip

    def files(self) -> dict[str, bytes]:
        """Every data file of every node, by its path under the root."""
        out = {}
        for d in self.daemons:
            for p in (d.root / d.name).rglob("*"):
                if p.is_file() and not p.name.startswith("@"):
                    out[str(p.relative_to(d.root))] = p.read_bytes()
        return out

    def segments_file(self, segs: Sequence[PayloadSegment]) -> str:
        """``segs`` in a file a rank reads (`encode_segments`, columns)."""
        self._jobs += 1
        path = self.folder / f"segs-{self._jobs}.bin"
        path.write_bytes(encode_segments(list(segs), "columns"))
        return str(path)

    def read_bytes(self) -> dict[str, float]:
        """Bytes all daemons served, by transport."""
        out: dict[str, float] = {}
        for d in self.daemons:
            for t, v in d.read_bytes().items():
                out[t] = out.get(t, 0.0) + v
        return out

    def ranks(
        self,
        jobs: Sequence[tuple[int, dict[str, Any]]],
        timeout: float = 300,
        *,
        together: bool = False,
        module: str = "tests.integration.hosts_reader",
    ) -> list[dict[str, Any]]:
        """Run a rank for each ``(host, job)`` at once (``module``: the reader, or
        `tests.integration.raw_tcp`'s fetch), each with its host's node map and the token
        unless the job names them; their answers in order. ``together``: their timed part
        starts at once, when all are ready (`tests.integration.raw_tcp.start_together`)."""
        self._jobs += 1
        ready = self.folder / f"ready-{self._jobs}"
        ready.mkdir()
        procs = []
        for rank, (host, job) in enumerate(jobs):
            path = ready / f"job-{rank}.json"
            job = {"nodes": self.node_map(host), "token": self.token, **job}
            if together:
                job |= {"ready_dir": str(ready), "rank": rank}
            path.write_text(json.dumps(job))
            argv = [sys.executable, "-m", module, str(path)]
            procs.append(subprocess.Popen(self.daemons[host].host.command(argv),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=ENV, cwd=ROOT))  # fmt: skip
        try:
            if together:
                _all_ready(ready, procs)
            answers = []
            deadline = time.monotonic() + timeout
            for p in procs:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                assert p.returncode == 0, err
                answers.append(json.loads(out.strip().splitlines()[-1]))
            return answers
        finally:  # interrupted, or one failed: none outlives the check
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()


def _all_ready(ready: Path, procs: Sequence[subprocess.Popen[str]]) -> None:
    """Wait until every rank said it is ready, then let them go half a second later."""
    deadline = time.monotonic() + 300
    while sum(1 for p in ready.iterdir() if p.name.isdigit()) < len(procs):
        for p in procs:
            if p.poll() is not None:
                out, err = p.communicate()
                raise AssertionError(f"a rank ended before it was ready: {out} {err}")
        assert time.monotonic() < deadline, "the ranks were not ready within 300 s"
        time.sleep(0.05)
    go = ready / "go.tmp"
    go.write_text(str(time.time() + 0.5))
    go.rename(ready / "go")


@contextlib.contextmanager
def host_cluster(n: int, folder: Path) -> Iterator[HostCluster]:
    """``n`` hosts, a daemon on each (nodes ``h0`` ...), all stopped and removed at the end."""
    with Hosts(n) as hosts:
        daemons = [HostDaemon(h, f"h{i}", folder / f"h{i}") for i, h in enumerate(hosts.hosts)]
        try:
            for d in daemons:
                d.folder.mkdir(parents=True)
                d.start([TOKENS[0]])
            yield HostCluster(hosts, daemons, folder)
        finally:
            for d in daemons:
                with contextlib.suppress(Exception):
                    d.stop()
