"""Cluster reads (docs/contract.md, "Reads across nodes"): three real daemons on distinct roots (no sharing), each with TCP
and the peer port on 127.0.0.1 behind a token; a trainer reads packed micro batches whose
samples were written on all three through `ClusterClient` and `AsyncClusterClient`, and
every window equals the dense reference bit for bit."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import (
    AsyncClusterClient,
    ClusterClient,
    ConnectError,
    CoveredRead,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadClient,
    PayloadSegment,
    ReadResult,
    UnauthorizedError,
    Window,
    load_nodes,
    shift_segments,
)
from tests.conftest import Daemons, free_port
from tests.payloadd.test_metrics import Samples, delta, scrape
from tests.reference import dense_coverage, dense_read

TOKEN = "cluster-token-" + "x" * 24
NODES = ("na", "nb", "nc")
FIELDS = ("routed_experts", "sampling_mask")


@dataclass(frozen=True)
class Node:
    name: str
    root: Path
    socket: Path
    http: int
    peer: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def metrics(self) -> Samples:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            return scrape(h)


@dataclass
class Cluster:
    nodes: dict[str, Node]
    segs: list[PayloadSegment]  # a packed micro batch of samples written on every node
    length: int

    def map(self, local: str = "na") -> dict[str, str]:
        """The node map of a trainer on node ``local``: its own daemon by socket."""
        return {
            n.name: f"unix://{n.socket}" if n.name == local else n.url for n in self.nodes.values()
        }

    def files(self) -> dict[str, bytes]:
        """A mirror of every data file of the three roots (for the dense reference)."""
        out = {}
        for n in self.nodes.values():
            for p in (n.root / n.name).rglob("*"):
                if p.is_file() and not p.name.startswith("@"):
                    out[str(p.relative_to(n.root))] = p.read_bytes()
        return out


def start_nodes(daemons: Daemons, *extra: str, peer: bool = True) -> dict[str, Node]:
    """Start the daemons of `NODES` with ``daemons``, each on a root of its own with TCP
    and (with ``peer``) the peer port behind `TOKEN`; they run until ``daemons`` closes."""
    env = dict(os.environ, PAYLOADD_ADMIN_TOKEN=TOKEN)
    nodes = {}
    for name in NODES:
        n = Node(name, daemons.folder / name / "root", daemons.folder / name / "s.sock",
                 free_port(), free_port() if peer else None)  # fmt: skip
        flags = ["--tcp-port", str(n.http), *extra]
        if n.peer is not None:
            flags += ["--peer-port", str(n.peer)]
        daemons.start(*flags, node=name, root=n.root, socket=n.socket, env=env)
        nodes[name] = n
    return nodes


BATCH_STEPS = 6
"""Steps one `write_batch` writes into (a sample each)."""


def write_batch(
    nodes: dict[str, Node], rng: np.random.Generator, first_step: int = 0
) -> tuple[list[PayloadSegment], int]:
    """Six multi-turn samples, written on the nodes in turn, turn by turn (routing ids and masks
    at each turn's own width), packed back to back into one micro batch; sample ``i`` in
    step ``first_step + i``."""
    segs: list[PayloadSegment] = []
    at = 0
    names = list(nodes)
    for i in range(6):
        node = nodes[names[i % len(names)]]
        with PayloadClient(node.socket) as c:
            sample: list[PayloadSegment] = []
            pos = 0
            for _ in range(int(rng.integers(4, 9))):
                t = int(rng.integers(1, 40))
                routed = rng.integers(0, 128, (t, 48, 8), dtype=np.uint8)
                width = int(rng.integers(1, 9))
                mask = rng.integers(-1, 1000, (t, width), dtype=np.int32)
                step = first_step + i
                sample += c.append("routed_experts", routed, pos, run="mb", step=step)
                sample += c.append("sampling_mask", mask, pos, run="mb", step=step)
                pos += t
        segs += shift_segments(sample, at)
        at += pos
    return segs, at


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Daemons(tmp_path_factory.mktemp("cluster")) as d:
        nodes = start_nodes(d)
        segs, length = write_batch(nodes, np.random.default_rng(16))
        yield Cluster(nodes, segs, length)


def cp_windows(segs: list[PayloadSegment], length: int, cp: int) -> list[Window]:
    """Every CP rank's routing window and its mask window (label positions, one later)."""
    out = []
    chunk = length // cp
    for r in range(cp):
        lo = r * chunk
        hi = length if r == cp - 1 else lo + chunk
        out.append(Window(segs, "routed_experts", lo, hi, 0))
        out.append(Window(segs, "sampling_mask", lo + 1, hi + 1, -1))
    return out


def check(results: Sequence[ReadResult], windows: list[Window], files: dict[str, bytes]) -> None:
    for w, got in zip(windows, results, strict=True):
        want = dense_read(files, list(w.segments), w.field, w.lo, w.hi, w.fill)
        if w.coverage:
            assert isinstance(got, CoveredRead)
            assert np.array_equal(
                got.covered, dense_coverage(list(w.segments), w.field, w.lo, w.hi)
            )
            got = got.array
        assert isinstance(got, np.ndarray) and want is not None
        if w.dtype is not None:
            want = want.astype(w.dtype)
        if w.out is not None:
            assert got is w.out
            pad = np.full(got.shape, w.fill, got.dtype)
            pad[(slice(None), *(slice(0, d) for d in want.shape[1:]))] = want
            want = pad
        assert got.dtype == want.dtype and got.shape == want.shape, (w.field, w.lo, w.hi)
        assert np.array_equal(got, want), (w.field, w.lo, w.hi)


def test_the_batch_spans_every_node(cluster: Cluster) -> None:
    assert {s.file.partition("/")[0] for s in cluster.segs} == set(NODES)
    assert len(cluster.segs) >= 48


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_windows_equal_the_dense_reference(cluster: Cluster, cp: int) -> None:
    windows = cp_windows(cluster.segs, cluster.length, cp)
    with ClusterClient(cluster.map(), token=TOKEN) as cc:
        check(cc.read_many(windows), windows, cluster.files())
        for w in windows[:2]:  # one window a call, too
            check([cc.read_field(w.segments, w.field, w.lo, w.hi, w.fill)], [w], cluster.files())


@pytest.mark.parametrize("cp", [1, 4])
def test_async_cp_windows_equal_the_dense_reference(cluster: Cluster, cp: int) -> None:
    windows = cp_windows(cluster.segs, cluster.length, cp)

    async def main() -> list[ReadResult]:
        async with AsyncClusterClient(cluster.map("nb"), token=TOKEN) as ac:
            first = await ac.read_field(*windows[0][:5])
            return [first, *await ac.read_many(windows)]

    results = asyncio.run(main())
    check(results, [windows[0], *windows], cluster.files())


def test_coverage_out_and_dtype(cluster: Cluster) -> None:
    n = cluster.length
    wide = np.empty((n - 10, 12), np.int32)
    windows = [
        Window(cluster.segs, "routed_experts", 5, n - 5, 0, None, np.uint8, True),
        Window(cluster.segs, "sampling_mask", 10, n, -1, wide, None, True),
        Window(cluster.segs, "routed_experts", 0, n + 50, 0, None, np.int64),  # past the end
        Window(cluster.segs, "routed_experts", 7, 7, 0),
    ]
    with ClusterClient(cluster.map(), token=TOKEN) as cc:
        results = cc.read_many(windows, coverage=None)  # each window as it asks
    check(results[:3], windows[:3], cluster.files())
    empty = results[3]
    assert isinstance(empty, np.ndarray) and empty.shape == (0, 48, 8)


def test_later_segments_win_across_nodes(cluster: Cluster) -> None:
    """Rows of one node overwritten by rows of another later in the list, narrower rows of
    a third on top: a window read across nodes as within one."""
    rng = np.random.default_rng(3)
    segs = []
    for i, name in enumerate(NODES):
        with PayloadClient(cluster.nodes[name].socket) as c:
            segs += c.append("sampling_mask", rng.integers(0, 99, (50, 6 - 2 * i), np.int32),
                             10 * i, run="lw", step=0)  # fmt: skip
    segs = [segs[1], segs[0], segs[2], segs[1]]  # nb, then na over it, nc, nb again on top
    windows = [
        Window(segs, "sampling_mask", lo, hi, -1) for lo, hi in ((0, 70), (15, 35), (45, 46))
    ]
    with ClusterClient(cluster.map("nc"), token=TOKEN) as cc:
        check(cc.read_many(windows), windows, cluster.files())


def test_reads_go_over_the_peer_port_and_this_node_over_the_data_plane(cluster: Cluster) -> None:
    """A node's first read goes over HTTP, whose answer names the peer port; the next ones
    over the peer port (one request a node either way)."""
    windows = cp_windows(cluster.segs, cluster.length, 2)
    with ClusterClient(cluster.map("na"), token=TOKEN) as cc:
        before = {n: node.metrics() for n, node in cluster.nodes.items()}
        check(cc.read_many(windows), windows, cluster.files())  # over HTTP: ports named
        after = {n: node.metrics() for n, node in cluster.nodes.items()}
        for name in ("nb", "nc"):
            assert delta(before[name], after[name], "payloadd_http_request_duration_seconds_count",
                         route="/v1/read", status_class="2xx") == 1  # fmt: skip
        before = after
        check(cc.read_many(windows), windows, cluster.files())
    for name, node in cluster.nodes.items():
        now = node.metrics()
        peer = sum(delta(before[name], now, "payloadd_read_bytes_total", field=f, transport="peer")
                   for f in FIELDS)  # fmt: skip
        http = sum(delta(before[name], now, "payloadd_read_bytes_total", field=f, transport="http")
                   for f in FIELDS)  # fmt: skip
        assert http == 0, name
        if name == "na":  # its own daemon: descriptors, the daemon reads nothing
            assert peer == 0
        else:
            assert peer > 0, name


def test_without_a_peer_port_the_reads_go_over_http(daemons: Daemons) -> None:
    nodes = start_nodes(daemons, peer=False)
    segs, length = write_batch(nodes, np.random.default_rng(5))
    cl = Cluster(nodes, segs, length)
    before = nodes["nb"].metrics()
    windows = cp_windows(segs, length, 2)
    with ClusterClient(cl.map("na"), token=TOKEN) as cc:
        check(cc.read_many(windows), windows, cl.files())
    after = nodes["nb"].metrics()
    got = sum(delta(before, after, "payloadd_read_bytes_total", field=f, transport="http")
              for f in FIELDS)  # fmt: skip
    assert got > 0


def test_a_segment_of_a_node_not_in_the_map_is_refused_before_any_io(cluster: Cluster) -> None:
    nodes = cluster.map()
    del nodes["nc"]
    before = cluster.nodes["nb"].metrics()
    with (
        ClusterClient(nodes, token=TOKEN) as cc,
        pytest.raises(InvalidRequestError, match=r"on node 'nc', which is not in the node map"),
    ):
        cc.read_many(cp_windows(cluster.segs, cluster.length, 1))
    after = cluster.nodes["nb"].metrics()
    assert delta(before, after, "payloadd_http_request_duration_seconds_count",
                 route="/healthz", status_class="2xx") == 0  # fmt: skip
    assert delta(before, after, "payloadd_peer_request_duration_seconds_count", kind="read") == 0


def test_invalid_segments_come_before_the_node_check(cluster: Cluster) -> None:
    bad = [*cluster.segs, PayloadSegment("routed_experts", "zz/r/0/f", -1, 0, 1, "uint8", [1])]
    with ClusterClient(cluster.map(), token=TOKEN) as cc:
        with pytest.raises(InvalidSegmentError, match="offset"):
            cc.read_field(bad, "routed_experts", 0, 10, 0)
        with pytest.raises(InvalidRequestError, match="lo"):
            cc.read_field(bad, "routed_experts", 5, 2, 0)


def test_a_node_that_cannot_be_reached_is_named_with_its_address(cluster: Cluster) -> None:
    nodes = cluster.map()
    dead = f"http://127.0.0.1:{free_port()}"
    nodes["nc"] = dead
    with ClusterClient(nodes, token=TOKEN, timeout=5) as cc:
        with pytest.raises(ConnectError, match=rf"node 'nc' at {dead}"):
            cc.read_many(cp_windows(cluster.segs, cluster.length, 1))
        # a read of the other nodes' segments alone does not need it
        mine = [s for s in cluster.segs if not s.file.startswith("nc/")]
        assert cc.read_field(mine, "routed_experts", 0, cluster.length, 0) is not None


def test_a_map_of_a_thousand_nodes_makes_clients_only_for_the_nodes_read(
    cluster: Cluster,
) -> None:
    """A rank's map names every node of the cluster; its client makes this node's client at
    once and another node's on the first read that needs it (a thousand eager clients held
    0.8 GiB and took 19 s to make)."""
    nodes = cluster.map("na") | {f"x{i}": f"http://127.0.0.1:{1 + i}" for i in range(1021)}
    mine = [s for s in cluster.segs if not s.file.startswith("nc/")]
    with ClusterClient(nodes, token=TOKEN) as cc:
        assert set(cc.clients) == {"na"}
        got = cc.read_field(mine, "routed_experts", 0, cluster.length, 0)
        assert set(cc.clients) == {"na", "nb"}
        check([got], [Window(mine, "routed_experts", 0, cluster.length, 0)], cluster.files())
    with pytest.raises(InvalidRequestError, match="closed"):
        cc.read_many(cp_windows(cluster.segs, cluster.length, 1))


def _race_close(cc: ClusterClient, windows: list[Window]) -> list[BaseException]:
    """Four threads reading through ``cc`` while this one closes it, released together;
    what they raised other than `InvalidRequestError` saying closed."""
    barrier = threading.Barrier(5)
    errors: list[BaseException] = []

    def rank() -> None:
        barrier.wait(timeout=30)
        for _ in range(20):
            try:
                cc.read_many(windows)
            except InvalidRequestError as exc:
                if "closed" not in str(exc):
                    errors.append(exc)
                return
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    barrier.wait(timeout=30)
    cc.close()
    for t in threads:
        t.join(60)
    return errors


def test_reads_racing_close_end_or_say_the_client_is_closed(cluster: Cluster) -> None:
    """Each read returns its window or raises `InvalidRequestError` saying closed (not the
    pool's `RuntimeError`), and no pool of threads is made again after the close."""
    windows = cp_windows(cluster.segs, cluster.length, 1)
    for _ in range(10):
        cc = ClusterClient(cluster.map("na"), token=TOKEN)
        cc.read_many(windows)  # the pool and the nodes' clients made
        assert _race_close(cc, windows) == []
        assert cc._pool is None  # none made again after the close


def test_a_wrong_token_is_unauthorized(cluster: Cluster) -> None:
    for token in ("not-the-token-" + "y" * 20, None):  # a wrong one, none at all
        with ClusterClient(cluster.map(), token=token) as cc, pytest.raises(UnauthorizedError):
            cc.read_many(cp_windows(cluster.segs, cluster.length, 1))


def test_ranks_released_at_once_read_a_new_step_of_every_node(cluster: Cluster) -> None:
    """Eight trainer ranks (threads, one cluster client each) released by a barrier onto a
    micro batch just written on all three nodes: every window right, no thread stuck."""
    segs, length = write_batch(cluster.nodes, np.random.default_rng(99), BATCH_STEPS)
    files = cluster.files()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            windows = cp_windows(segs, length, 4)[2 * (r % 4) : 2 * (r % 4) + 2]
            with ClusterClient(cluster.map(NODES[r % 3]), token=TOKEN) as cc:
                barrier.wait(timeout=30)
                for _ in range(5):
                    check(cc.read_many(windows), windows, files)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_the_node_map_from_a_file_and_the_environment(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(cluster.map()))
    assert load_nodes(path) == cluster.map()
    monkeypatch.setenv("PAYLOADD_NODES", str(path))
    assert load_nodes() == cluster.map()
    monkeypatch.setenv("PAYLOADD_NODES", path.read_text())
    with ClusterClient(token=TOKEN) as cc:
        assert cc.read_field(cluster.segs, "routed_experts", 0, 5, 0) is not None
    for bad, message in [
        ({"na": "tcp://x:1"}, "node 'na': address must be"),
        ({"n/a": "http://h:1"}, "node name"),
        ({}, "non-empty"),
        ({"na": "http://h"}, "address must be"),
        ({"na": "http://h:port"}, "address must be"),
        ({"na": "http://10.0.0.2\t:8765"}, "address must be"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            load_nodes(bad)
    with ClusterClient({"na": "http://h:80"}) as cc:  # the default port, said (no I/O yet)
        assert cc.nodes == {"na": "http://h:80"}
    with pytest.raises(InvalidRequestError, match="printable ASCII"):
        ClusterClient({"na": "http://h:80"}, token="tok\u00e9n-" + "x" * 24)
    monkeypatch.delenv("PAYLOADD_NODES")
    with pytest.raises(InvalidRequestError, match="PAYLOADD_NODES is not set"):
        load_nodes()
    with pytest.raises(InvalidRequestError, match="cannot read the node map"):
        load_nodes(tmp_path / "missing.json")
