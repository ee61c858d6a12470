"""Cluster reads across separate network stacks: four hosts, each a network namespace with
its own address, payload root and daemon (TCP and the peer port on that address, the admin
token), trainer ranks reading inside the hosts' namespaces. Run by ``make check-hosts`` (as
root), never by ``make test`` (skipped unless ``PAYLOADD_HOSTS=1``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, encode_segments
from tests.integration.netns import Host, Hosts
from tests.payloadd.test_cluster import Node, write_batch
from tests.reference import dense_read

TOKEN = "hosts-token-0123456789abcdef0123"
HTTP_PORT, PEER_PORT = 8765, 8766
CONNECT_S, READ_S = 2.0, 5.0
"""The ranks' client limits: a host that drops packets fails a read within about these."""
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class HostNode:
    host: Host
    node: Node
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{HTTP_PORT}"


@dataclass
class Cluster:
    hosts: Hosts
    nodes: list[HostNode]
    segs: list[PayloadSegment]
    length: int
    folder: Path

    def node_map(self, local: int) -> dict[str, str]:
        """The node map of a rank on host ``local``: its own daemon by socket."""
        return {n.node.name: f"unix://{n.node.socket}" if i == local else n.url
                for i, n in enumerate(self.nodes)}  # fmt: skip

    def files(self) -> dict[str, bytes]:
        out = {}
        for n in self.nodes:
            for p in (n.node.root / n.node.name).rglob("*"):
                if p.is_file() and not p.name.startswith("@"):
                    out[str(p.relative_to(n.node.root))] = p.read_bytes()
        return out


def _start(host: Host, node: Node, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "payloadd", "serve", "--root", str(node.root),
            "--socket", str(node.socket), "--node", node.name, "--tcp-host", host.address,
            "--tcp-port", str(HTTP_PORT), "--peer-port", str(PEER_PORT)]  # fmt: skip
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN, PYTHONPATH=f"{ROOT}/client:{ROOT}")
    node.root.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(host.command(argv), stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT)  # fmt: skip
    with PayloadClient(str(node.socket)) as c:  # a Unix socket: reachable from here
        c.wait_ready(30)
    return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("hosts")
    with Hosts(4) as hosts:
        nodes: list[HostNode] = []
        try:
            for i, host in enumerate(hosts.hosts):
                node = Node(f"h{i}", folder / f"h{i}" / "root", folder / f"h{i}.sock",
                            HTTP_PORT, PEER_PORT)  # fmt: skip
                nodes.append(HostNode(host, node, _start(host, node, folder / f"h{i}.log")))
            by_name = {n.node.name: n.node for n in nodes}
            segs, length = write_batch(by_name, np.random.default_rng(33))
            yield Cluster(hosts, nodes, segs, length, folder)
        finally:
            for n in nodes:
                n.proc.terminate()
            for n in nodes:
                n.proc.wait(30)


def _cp_windows(length: int, cp: int) -> list[tuple[str, int, int, int]]:
    out = []
    chunk = length // cp
    for r in range(cp):
        lo, hi = r * chunk, length if r == cp - 1 else (r + 1) * chunk
        out += [("routed_experts", lo, hi, 0), ("sampling_mask", lo + 1, hi + 1, -1)]
    return out


def _read(cluster: Cluster, rank_host: int, windows: list[tuple[str, int, int, int]],
          segs: list[PayloadSegment], mode: str, name: str,
          repeat: int = 0) -> dict[str, Any]:  # fmt: skip
    """Read ``windows`` of ``segs`` in a rank on host ``rank_host``; its JSON answer."""
    folder = cluster.folder / name
    folder.mkdir()
    (folder / "segs.bin").write_bytes(encode_segments(segs, "columns"))
    files = cluster.files()
    expected = []
    for i, (f, lo, hi, fill) in enumerate(windows):
        want = dense_read(files, segs, f, lo, hi, fill)
        assert want is not None
        np.save(folder / f"{i}.npy", want)
        expected.append(str(folder / f"{i}.npy"))
    job = {"nodes": cluster.node_map(rank_host), "token": TOKEN, "segments": str(folder / "segs.bin"),
           "windows": windows, "expected": expected, "mode": mode, "connect_s": CONNECT_S,
           "read_s": READ_S, "repeat": repeat}  # fmt: skip
    (folder / "job.json").write_text(json.dumps(job))
    host = cluster.nodes[rank_host].host
    argv = [sys.executable, "-m", "tests.integration.hosts_reader", str(folder / "job.json")]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}/client:{ROOT}")
    done = subprocess.run(host.command(argv), capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_windows_across_hosts_equal_the_dense_reference(
    cluster: Cluster, cp: int, mode: str
) -> None:
    for rank_host in range(len(cluster.nodes)):
        got = _read(cluster, rank_host, _cp_windows(cluster.length, cp), cluster.segs, mode,
                    f"cp{cp}-{mode}-{rank_host}")  # fmt: skip
        assert got["ok"], got


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_host_whose_link_drops_packets_fails_its_reads_in_time_and_recovers(
    cluster: Cluster, mode: str
) -> None:
    cut = cluster.nodes[3]
    theirs = [s for s in cluster.segs if s.file.startswith(f"{cut.node.name}/")]
    others = [s for s in cluster.segs if not s.file.startswith(f"{cut.node.name}/")]
    whole = [("routed_experts", 0, cluster.length, 0)]
    with cluster.hosts.link_down(cut.host):
        t0 = time.monotonic()
        failed = _read(cluster, 0, whole, theirs, mode, f"down-theirs-{mode}")
        took = time.monotonic() - t0
        assert not failed["ok"] and cut.node.name in failed["error"], failed
        assert took < 60, took
        mixed = _read(cluster, 0, whole, cluster.segs, mode, f"down-all-{mode}")
        assert not mixed["ok"] and cut.node.name in mixed["error"], mixed
        unaffected = _read(cluster, 0, whole, others, mode, f"down-others-{mode}")
        assert unaffected["ok"], unaffected
    again = _read(cluster, 0, whole, theirs, mode, f"up-theirs-{mode}")
    assert again["ok"], again
    print(
        f"{mode}: link down: first error after {failed['s']:.2f} s; other hosts read in "
        f"{unaffected['s']:.2f} s; after the link came back: read in {again['s']:.2f} s"
    )


REPEAT = 5
"""Timed reads of each way under a shaped link (after one that makes the connections)."""


@pytest.mark.parametrize("rate", ["10gbit", "1gbit"])
def test_a_16_mib_window_of_another_host_under_a_shaped_link_against_raw_tcp(
    cluster: Cluster, rate: str
) -> None:
    """Figures, not asserted: a rank on host 0 reads a 16 MiB window written on host 1 over
    the peer port, against the same bytes sent with ``sendfile`` and received with
    ``recv_into`` between the same two namespaces; every link at ``rate``."""
    owner, rank = cluster.nodes[1], cluster.nodes[0]
    rows = (16 << 20) // 384
    ids = np.random.default_rng(7).integers(0, 128, (rows, 48, 8), dtype=np.uint8)
    with PayloadClient(str(owner.node.socket)) as c:
        segs = c.append("routed_experts", ids, 0, run=f"shaped-{rate}", step=0)
    assert len(segs) == 1
    path = owner.node.root / segs[0].file
    env = dict(os.environ, PYTHONPATH=f"{ROOT}/client:{ROOT}")
    raw = [sys.executable, "-m", "tests.integration.raw_tcp"]
    with cluster.hosts.shaped(rate):
        server = subprocess.Popen(owner.host.command([*raw, "serve", owner.host.address,
                                  "9100", str(path), str(REPEAT + 1)]), env=env, cwd=ROOT)  # fmt: skip
        try:
            time.sleep(0.5)  # the server's listen (no condition to wait for across namespaces)
            fetched = subprocess.run(rank.host.command([*raw, "fetch", owner.host.address,
                                     "9100", str(path.stat().st_size), str(REPEAT + 1)]),
                                     capture_output=True, text=True, env=env, cwd=ROOT,
                                     timeout=120, check=True)  # fmt: skip
        finally:
            server.wait(30)
        got = _read(cluster, 0, [("routed_experts", 0, rows, 0)], segs, "sync",
                    f"shaped-{rate}", repeat=REPEAT)  # fmt: skip
    assert got["ok"], got
    raw_s = float(np.median(json.loads(fetched.stdout)[1:]))
    ours_s = float(np.median(got["times"]))
    mb = (16 << 20) / 1e6
    print(
        f"{rate}: 16 MiB window over the peer port {mb / ours_s:.0f} MB/s, raw TCP "
        f"{mb / raw_s:.0f} MB/s: {raw_s / ours_s:.2f}x raw (medians of {REPEAT})"
    )
