"""Cluster reads across separate network stacks: hosts (4, or ``PAYLOADD_HOSTS_N``), each a
network namespace with its own address, payload root and daemon (HTTP and the peer port on
that address, admin tokens from a file), trainer ranks reading inside the hosts'
namespaces. Run by ``make check-hosts`` (as root), never by ``make test`` (skipped unless
``PAYLOADD_HOSTS=1``). Figures are printed, and written as JSON to
``PAYLOADD_HOSTS_REPORT`` when it is set."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from payload_client import PayloadSegment
from payloadd.bench._packed import PackedBatch, stored_bytes, write_packed
from payloadd.soak._report import held_deleted
from tests.integration.hosts_cluster import ENV, ROOT, TOKENS, HostCluster, host_cluster
from tests.payloadd.test_cluster import Node, write_batch
from tests.reference import dense_read

N_HOSTS = int(os.environ.get("PAYLOADD_HOSTS_N", "4"))
CUT = min(N_HOSTS, 6) - 1
"""The host whose link the failure checks cut: the last that holds a sample of the small
micro batch (six samples, on the hosts in turn)."""
CONNECT_S, READ_S = 2.0, 5.0
"""The ranks' client limits: a host that drops packets fails a read within about these."""
FIGURES: dict[str, Any] = {"hosts": N_HOSTS}
"""What the checks measured (printed at the end, and written to ``PAYLOADD_HOSTS_REPORT``)."""

Win = tuple[str, int, int, int]  # field, lo, hi, fill
Rank = tuple[int, Sequence[PayloadSegment], list[Win], str | None]
"""A rank of a figure: its host, segments, windows, and the dtype of its routing ids."""


@dataclass
class Cluster:
    hosts: HostCluster
    segs: list[PayloadSegment]  # a small micro batch of six multi-turn samples
    length: int
    packed: list[PayloadSegment]  # a packed micro batch (PackedBatch), samples on every host
    spec: PackedBatch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("hosts")
    with host_cluster(N_HOSTS, folder) as hc:
        nodes = {d.name: Node(d.name, d.root, d.socket, 0, None) for d in hc.daemons}
        segs, length = write_batch(nodes, np.random.default_rng(33))
        spec = PackedBatch(samples=2 * N_HOSTS)
        clients = [d.client() for d in hc.daemons]
        try:
            packed = write_packed(spec, clients, run="packed", first_step=100)
        finally:
            for c in clients:
                c.close()
        yield Cluster(hc, segs, length, packed, spec)
    report = os.environ.get("PAYLOADD_HOSTS_REPORT")
    print("\n" + json.dumps(FIGURES, indent=1))
    if report:
        Path(report).write_text(json.dumps(FIGURES, indent=1) + "\n")


def cp_windows(length: int, cp: int) -> list[Win]:
    """Every CP rank's routing window and its mask window (label positions, one later)."""
    out = []
    chunk = length // cp
    for r in range(cp):
        lo, hi = r * chunk, length if r == cp - 1 else (r + 1) * chunk
        out += [("routed_experts", lo, hi, 0), ("sampling_mask", lo + 1, hi + 1, -1)]
    return out


def on_node(segs: Sequence[PayloadSegment], node: str, mine: bool = True) -> list[PayloadSegment]:
    """The segments of ``segs`` written on ``node`` (or, ``mine=False``, on the others)."""
    return [s for s in segs if s.file.startswith(f"{node}/") == mine]


def window_job(
    c: Cluster, segs: Sequence[PayloadSegment], windows: Sequence[Win], *,
    expected: bool = True, dtype: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A rank's job: ``windows`` of ``segs``, with their dense reference when ``expected``."""
    path = c.hosts.segments_file(segs)
    job: dict[str, Any] = {"windows": [[path, f, lo, hi, fill, dtype] for f, lo, hi, fill in windows],
                           "connect_s": CONNECT_S, "read_s": READ_S}  # fmt: skip
    if expected:
        files = c.hosts.files()
        names = []
        for f, lo, hi, fill in windows:
            want = dense_read(files, list(segs), f, lo, hi, fill)
            assert want is not None
            name = f"{path}.{f}.{lo}.npy"
            np.save(name, want)
            names.append(name)
        job["expected"] = names
    return job


# -- bit for bit --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_windows_across_hosts_equal_the_dense_reference(
    cluster: Cluster, cp: int, mode: str
) -> None:
    """A rank on every host at once reads every CP window of the small micro batch and of the
    packed one, twice (sync ranks): the first read of a node goes over HTTP (its answer names
    the peer port), the second over the peer port."""
    windows = cp_windows(cluster.length, cp)
    packed = [(f, lo, hi, fill) for f, lo, hi, fill in cp_windows(cluster.spec.length, cp)]
    jobs = [window_job(cluster, cluster.segs, windows), window_job(cluster, cluster.packed, packed)]
    before = cluster.hosts.read_bytes()
    answers = cluster.hosts.ranks(
        [(h, {**job, "mode": mode, "again": True}) for h in range(N_HOSTS) for job in jobs]
    )
    after = cluster.hosts.read_bytes()
    assert all(a["ok"] for a in answers), answers
    if mode == "sync":
        http, peer = (after.get(t, 0) - before.get(t, 0) for t in ("http", "peer"))
        assert http > 0 and peer == http, (before, after)


# -- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_host_whose_link_drops_packets_fails_its_reads_in_time_and_recovers(
    cluster: Cluster, mode: str
) -> None:
    cut = cluster.hosts.daemons[CUT]
    whole = [("routed_experts", 0, cluster.length, 0)]
    theirs = window_job(cluster, on_node(cluster.segs, cut.name), whole)
    everything = window_job(cluster, cluster.segs, whole)
    others = window_job(cluster, on_node(cluster.segs, cut.name, mine=False), whole)
    with cluster.hosts.hosts.link_down(cut.host):
        failed, mixed, unaffected = cluster.hosts.ranks(
            [(0, {**j, "mode": mode}) for j in (theirs, everything, others)]
        )
    (again,) = cluster.hosts.ranks([(0, {**theirs, "mode": mode})])
    for a in (failed, mixed):
        assert not a["ok"] and cut.name in a["error"], a
        assert a["s"] < 3 * (CONNECT_S + READ_S), a  # nothing hangs
    assert unaffected["ok"] and again["ok"], (unaffected, again)
    FIGURES[f"link_down_{mode}"] = {
        "first_error_s": round(failed["s"], 2), "others_read_s": round(unaffected["s"], 2),
        "after_link_up_read_s": round(again["s"], 2),
    }  # fmt: skip


@dataclass
class Timeline:
    """What the check did to the cluster while the ranks read, as ``time.time()``."""

    cut: float = 0.0
    up: float = 0.0
    switched: float = 0.0  # the ranks moved to the new token
    collected: tuple[float, float] = (0.0, 0.0)
    restarts: list[tuple[str, float, float]] | None = None  # node, went, back

    def explains(self, cut: str, start: float, end: float, error: str) -> bool:
        """Whether a read that failed with ``error`` did so while a node it names was cut off
        or restarting (its connections refused, or dropped, for up to 2 s after)."""
        if cut in error and end >= self.cut and start <= self.up + 1.0:
            return True
        return any(node in error and end >= went and start <= back + 2.0
                   for node, went, back in self.restarts or [])  # fmt: skip


def _rates(events: list[list[Any]], lo: float, hi: float) -> tuple[float, int]:
    """Successful reads a second that started in ``[lo, hi)``, and the failures there."""
    inside = [e for e in events if lo <= e[0] < hi]
    return len([e for e in inside if e[2] is None]) / max(hi - lo, 1e-9), len(
        [e for e in inside if e[2] is not None]
    )


def _disturb(c: Cluster, t: Timeline, token_file: Path, t0: float) -> None:
    """Cut host `CUT` at ``t0 + 3``; collect a run on host 1 meanwhile; restart every
    daemon in turn with the new and the old token; the link back up; the ranks moved to
    the new token; every daemon restarted again with the new one alone."""
    hc, cut = c.hosts, c.hosts.daemons[CUT]
    t.restarts = []
    time.sleep(max(0.0, t0 + 3 - time.time()))
    hc.hosts.link(cut.host, up=False)
    t.cut = time.time()
    time.sleep(1.0)
    with hc.daemons[1].client() as local:
        went = time.time()
        local.gc("old", through_step=3)
        t.collected = (went, time.time())
    for d in hc.daemons:
        t.restarts.append((d.name, *d.restart([TOKENS[1], TOKENS[0]])))
    hc.hosts.link(cut.host, up=True)
    t.up = time.time()
    time.sleep(3.0)
    token_file.write_text(TOKENS[1] + "\n")
    hc.token = TOKENS[1]  # the next checks' ranks too
    t.switched = time.time()
    time.sleep(2.0)
    for d in hc.daemons:
        t.restarts.append((d.name, *d.restart([TOKENS[1]])))


def test_reads_through_a_cut_a_collection_and_a_rolling_token_rotation(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Ranks on every host but `CUT` read the small micro batch again and again (one rank
    all of it, one the part not written on `CUT`) while that host's link
    goes down, host 1 collects a run, every daemon restarts in turn with the new token and
    the old one, the link comes back, the ranks move to the new token, and every daemon
    restarts with the new one alone. Every failed read names a node that was cut off or
    restarting at that moment; nothing hangs; every rank reads again after."""
    hc, cut = cluster.hosts, cluster.hosts.daemons[CUT]
    with hc.daemons[1].client() as local:
        for step in range(4):
            rows = np.full((64, 48, 8), step, np.uint8)
            local.append("routed_experts", rows, 0, run="old", step=step)
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS[0] + "\n")
    whole = [("routed_experts", 0, cluster.length, 0), ("sampling_mask", 1, cluster.length, -1)]
    both = {
        "all": window_job(cluster, cluster.segs, whole),
        "others": window_job(cluster, on_node(cluster.segs, cut.name, mine=False), whole),
    }
    t0 = time.time() + 4 + N_HOSTS  # the ranks' start-up
    span = 30 + 10 * N_HOSTS
    jobs = [(h, {**job, "token_file": str(token_file), "loop_until": t0 + span, "pause": 0.05})
            for h in range(N_HOSTS) if h != CUT for job in both.values()]  # fmt: skip
    t = Timeline()
    failed: list[BaseException] = []

    def disturb() -> None:
        try:
            _disturb(cluster, t, token_file, t0)
        except BaseException as exc:  # the test fails on it, below
            failed.append(exc)

    actions = threading.Thread(target=disturb)
    actions.start()
    try:
        answers = hc.ranks(jobs, timeout=span + 120)
    finally:
        actions.join(300)
        hc.hosts.link(cut.host, up=True)
    assert not failed, failed
    assert t.switched and t.switched + 2 * N_HOSTS < t0 + span, "the actions outlasted the reads"
    kinds = [kind for h in range(N_HOSTS) if h != CUT for kind in both]
    figures: dict[str, Any] = {"collect_s": round(t.collected[1] - t.collected[0], 3),
                               "restart_s": [round(b - w, 2) for _, w, b in t.restarts or []]}  # fmt: skip
    for kind, a in zip(kinds, answers, strict=True):
        assert a["ok"], a  # the last read of each rank is bit for bit
        events = a["events"]
        hung = [e for e in events if e[1] - e[0] > CONNECT_S + READ_S + 3]
        assert not hung, hung
        unexplained = [e for e in events if e[2] and not t.explains(cut.name, *e)]
        assert not unexplained, unexplained
        errors = [e for e in events if e[2] and cut.name in e[2] and e[1] >= t.cut]
        fig = figures.setdefault(kind, {"reads_s": [], "failed_cut": 0, "failed_restarting": 0,
                                        "first_error_s": [], "recover_s": []})  # fmt: skip
        fig["failed_cut"] += sum(1 for e in events if e[2] and cut.name in e[2])
        fig["failed_restarting"] += sum(1 for e in events if e[2] and cut.name not in e[2])
        fig["reads_s"].append([round(_rates(events, lo, hi)[0], 1) for lo, hi in
                               ((t0, t.cut), (t.cut, t.up), (t.up, t0 + span))])  # fmt: skip
        if kind == "all":
            assert errors, "no read failed while the host was cut off"
            fig["first_error_s"].append(round(errors[0][1] - t.cut, 2))
            back = [e for e in events if e[2] is None and e[0] >= t.up]
            assert back, "no read succeeded after the link came back"
            fig["recover_s"].append(round(back[0][1] - t.up, 2))
    FIGURES["cut_collect_rotate"] = figures
    print(figures)


# -- figures under shaped links ----------------------------------------------------------

RANKS = 8
"""Ranks a host in the figures of many ranks (a node's GPUs), all reading at once."""
RAW_PORT = 9100
MIB16 = (16 << 20) // 384
MIB1 = (1 << 20) // 384
"""Rows of routing ids (384 bytes a row) in a 16 MiB and a 1 MiB window."""


@pytest.fixture(scope="module")
def big(cluster: Cluster) -> Iterator[dict[str, list[list[PayloadSegment]]]]:
    """On every host, a 16 MiB and a 1 MiB segment of routing ids; the raw servers (every
    host's own file of 32 MiB, `tests.integration.raw_tcp`) running, stopped at the end."""
    out: dict[str, list[list[PayloadSegment]]] = {"16": [], "1": []}
    rng = np.random.default_rng(7)
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for d in cluster.hosts.daemons:
            with d.client() as c:
                for key, rows in (("16", MIB16), ("1", MIB1)):
                    ids = rng.integers(0, 128, (rows, 48, 8), dtype=np.uint8)
                    out[key].append(c.append("routed_experts", ids, 0, run="big", step=0))
            blob = d.folder / "raw.bin"
            blob.write_bytes(rng.integers(0, 256, 32 << 20, dtype=np.uint8).tobytes())
            argv = [sys.executable, "-m", "tests.integration.raw_tcp", "serve", d.host.address,
                    str(RAW_PORT), str(blob)]  # fmt: skip
            servers.append(subprocess.Popen(d.host.command(argv), env=ENV, cwd=ROOT))
        yield out
    finally:
        for p in servers:
            p.kill()
            p.wait(30)


def _remote_bytes(c: Cluster, segs: Sequence[PayloadSegment], windows: Sequence[Win],
                  host: int) -> list[list[Any]]:  # fmt: skip
    """The raw baseline's sources for a rank on ``host``: from each other host, the stored
    bytes of the windows' rows written there."""
    sources = []
    for g, d in enumerate(c.hosts.daemons):
        mine = on_node(segs, d.name)
        n = sum(stored_bytes(mine, f, lo, hi) for f, lo, hi, _ in windows)
        if g != host and n:
            sources.append([d.host.address, RAW_PORT, n])
    return sources


@contextlib.contextmanager
def _sampled(c: Cluster) -> Iterator[list[int]]:
    """The most threads any daemon ran, sampled every 20 ms during the block (a thread a
    peer-port connection: the connections they held, above the idle count)."""
    seen: list[int] = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            with contextlib.suppress(OSError, AssertionError):
                seen.append(max(d.usage()["threads"] for d in c.hosts.daemons))

    t = threading.Thread(target=sample)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()


def _figure(c: Cluster, name: str, plan: Sequence[Rank], repeat: int) -> dict[str, Any]:
    """Ranks ``(host, segments, windows, dtype of the routing ids)`` all reading at once,
    ``repeat`` times, against raw TCP moving each rank's remote bytes between the same
    hosts; throughput = the remote bytes of all reads / the slowest rank's time. With it, the
    daemons' threads idle and at most during the reads (one a peer-port connection)."""
    ours_jobs, raw_jobs, moved = [], [], 0
    for host, segs, windows, dtype in plan:
        job = window_job(c, segs, windows, expected=False)
        for w in job["windows"]:
            w[5] = dtype if w[1] == "routed_experts" else None
        ours_jobs.append((host, {**job, "repeat": repeat, "reuse_out": True}))
        sources = _remote_bytes(c, segs, windows, host)
        moved += sum(n for _, _, n in sources) * repeat
        raw_jobs.append((host, {"sources": sources, "repeat": repeat}))
    idle = max(d.usage()["threads"] for d in c.hosts.daemons)
    before = c.hosts.read_bytes()
    with _sampled(c) as threads:
        ours = c.hosts.ranks(ours_jobs, together=True)
    after = c.hosts.read_bytes()
    # every timed read over the peer port, each rank's first (untimed) one over HTTP
    http, peer = (after.get(t, 0) - before.get(t, 0) for t in ("http", "peer"))
    assert (http, peer) == (moved // repeat, moved), (http, peer, moved)
    raw = c.hosts.ranks(raw_jobs, together=True, module="tests.integration.raw_tcp")
    assert all(a["ok"] for a in ours), ours
    ours_s = max(sum(a["times"]) for a in ours)
    raw_s = max(sum(a["times"]) for a in raw)
    ours_mid = float(np.median([sum(a["times"]) for a in ours]))
    raw_mid = float(np.median([sum(a["times"]) for a in raw]))
    fig = {"ranks": len(plan), "remote_mb": round(moved / 1e6, 1),
           "peer_port_mb_s": round(moved / ours_s / 1e6), "raw_tcp_mb_s": round(moved / raw_s / 1e6),
           "ratio": round(raw_s / ours_s, 2), "ratio_median_rank": round(raw_mid / ours_mid, 2),
           "daemon_threads": [idle, max(threads)]}  # fmt: skip
    print(f"{name}: {fig}")
    return fig


@pytest.mark.parametrize("rate", ["10gbit", "1gbit"])
def test_figures_under_shaped_links_against_raw_tcp(
    cluster: Cluster, big: dict[str, list[list[PayloadSegment]]], rate: str
) -> None:
    """Figures, not asserted: every link shaped at ``rate`` (a token bucket on each host's
    end); a rank on host 0 reading a window written on host 1 (1 and 16 MiB, the routing ids
    as stored and, for 16 MiB, as ``int32``, the default); `RANKS` ranks on every host at
    once, each reading a window written on the next host; and the packed micro batch
    (samples on every host) at CP 1 and 4, by one rank on host 0 alone (CP window 0, or 1 at
    CP 4: none of its rows there) and by `RANKS` ranks a host (rank r: CP window r mod CP).
    Each against raw TCP moving the same remote bytes between the same hosts."""
    n, spec = N_HOSTS, cluster.spec
    figs: dict[str, Any] = {}
    with cluster.hosts.hosts.shaped(rate):
        for key, rows in (("1", MIB1), ("16", MIB16)):
            win = [("routed_experts", 0, rows, 0)]
            figs[f"one rank, {key} MiB"] = _figure(cluster, f"{rate} one rank {key} MiB",
                                                   [(0, big[key][1], win, "uint8")], 5)  # fmt: skip
        figs["one rank, 16 MiB as int32"] = _figure(
            cluster, f"{rate} one rank 16 MiB int32",
            [(0, big["16"][1], [("routed_experts", 0, MIB16, 0)], None)], 5,
        )  # fmt: skip
        for cp in (1, 4):  # CP 4: window 1, none of its rows on host 0
            windows = cp_windows(spec.length, cp)[2:4] if cp > 1 else cp_windows(spec.length, 1)
            figs[f"one rank, packed CP {cp}"] = _figure(
                cluster,
                f"{rate} one rank packed CP {cp}",
                [(0, cluster.packed, windows, "uint8")],
                5,
            )
        for key, rows in (("1", MIB1), ("16", MIB16)):
            win = [("routed_experts", 0, rows, 0)]
            plan = [
                (h, big[key][(h + 1) % n], win, "uint8") for h in range(n) for _ in range(RANKS)
            ]
            figs[f"{RANKS} ranks a host, {key} MiB"] = _figure(
                cluster, f"{rate} {RANKS} ranks a host {key} MiB", plan, 3
            )
        for cp in (1, 4):
            windows = cp_windows(spec.length, cp)
            plan = [(h, cluster.packed, windows[2 * (r % cp) : 2 * (r % cp) + 2], "uint8")
                    for h in range(n) for r in range(RANKS)]  # fmt: skip
            figs[f"{RANKS} ranks a host, packed CP {cp}"] = _figure(
                cluster, f"{rate} {RANKS} ranks a host packed CP {cp}", plan, 3
            )
    FIGURES[f"shaped_{rate}"] = figs


# -- soak -----------------------------------------------------------------------------------

SOAK_S = float(os.environ.get("PAYLOADD_HOSTS_SOAK_S", "180"))
"""Seconds of the soak across hosts (``make check-hosts SOAK_S=...``)."""


def _write_and_collect(c: Cluster, until: float, usage: list[list[dict[str, Any]]]) -> int:
    """Every host's inference appends a step a second (run ``soak``) and the orchestrator
    collects all but the last four; every 5 s each daemon's usage is sampled. Returns the
    steps written."""
    step, sampled = 0, 0.0
    rng = np.random.default_rng(5)
    clients = [d.client() for d in c.hosts.daemons]
    try:
        while time.time() < until:
            for cl in clients:
                rows = rng.integers(0, 128, (int(rng.integers(200, 2000)), 48, 8), dtype=np.uint8)
                cl.append("routed_experts", rows, 0, run="soak", step=step)
                if step >= 4:
                    cl.gc("soak", through_step=step - 4)
            if time.time() - sampled >= 5:
                usage.append([{**d.usage(), "t": time.time()} for d in c.hosts.daemons])
                sampled = time.time()
            step += 1
            time.sleep(1.0)
    finally:
        for cl in clients:
            cl.close()
    usage.append([{**d.usage(), "t": time.time()} for d in c.hosts.daemons])
    return step


def test_a_soak_across_hosts_keeps_memory_descriptors_and_threads_flat(cluster: Cluster) -> None:
    """Two ranks on every host read CP 4 windows of the packed micro batch again and again for
    `SOAK_S` seconds, while every host appends a step a second and collects old ones: no read
    fails, the last is bit for bit, and each daemon's memory, descriptors and threads end
    where they were after the first minute."""
    spec = cluster.spec
    windows = cp_windows(spec.length, 4)
    t0 = time.time() + 4 + 2 * N_HOSTS
    until = t0 + SOAK_S
    jobs = [(h, {**window_job(cluster, cluster.packed, windows[2 * r : 2 * r + 2]),
                 "loop_until": until, "pause": 0.02})
            for h in range(N_HOSTS) for r in ((h % 4), (h + 2) % 4)]  # fmt: skip
    usage: list[list[dict[str, Any]]] = []
    written: list[int | BaseException] = []

    def write() -> None:
        try:
            written.append(_write_and_collect(cluster, until, usage))
        except BaseException as exc:  # the test fails on it, below
            written.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        answers = cluster.hosts.ranks(jobs, timeout=SOAK_S + 180)
    finally:
        writer.join(SOAK_S + 60)
    assert written and isinstance(written[0], int), written
    reads = sum(len(a["events"]) for a in answers)
    failed = [e for a in answers for e in a["events"] if e[2]]
    assert all(a["ok"] for a in answers) and not failed, failed[:5]
    settled = usage[min(12, len(usage) - 1)]  # after about a minute
    end = usage[-1]
    for i, (d, first, last) in enumerate(zip(cluster.hosts.daemons, settled, end, strict=True)):
        assert last["rss_kib"] - first["rss_kib"] < 32 << 10, (d.name, first, last)
        assert last["fds"] <= first["fds"] + 8, (d.name, first, last)
        assert last["threads"] <= first["threads"] + 4, (d.name, first, last)
        # a removed file may be held while a call on it ends, not longer (GC closes them)
        samples = [{**u[i], "pid": d.name} for u in usage]
        assert held_deleted(samples, 12.0) == {}, (d.name, [u[i]["deleted"] for u in usage])
    brief = {k: v for k, v in end[0].items() if k != "deleted"}
    FIGURES["soak"] = {"seconds": SOAK_S, "reads": reads, "reads_s": round(reads / SOAK_S, 1),
                       "failures": len(failed), "steps_written": written[0] if written else 0,
                       "host_0_after_1_min": {k: v for k, v in settled[0].items() if k != "deleted"},
                       "host_0_at_end": brief}  # fmt: skip
    print(FIGURES["soak"])
