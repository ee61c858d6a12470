"""``payloadd soak``: a short run with a kill, a short run with hostile neighbours, and checks
that can fail (a real daemon)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from payload_client import PayloadClient, PayloadSegment, Window
from payloadd.cli._soak import add_soak_flags
from payloadd.soak import _verdict
from payloadd.soak._check import (
    MASK,
    ROUTED,
    MicroBatch,
    SoakShape,
    Written,
    compare,
    expected_region,
    expected_window,
    pack,
    tail_batch,
)
from payloadd.soak._probes import CHECK_AFTER, RefusalProber, _Refusal
from payloadd.soak._report import dump_document, growth_checks, held_deleted
from payloadd.soak._run import Soak
from payloadd.soak._state import Kill, Probes, RunState
from payloadd.soak._workers import Tally, check_windows, write_sample
from tests.conftest import Daemons

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

PAYLOADD = [sys.executable, "-m", "payloadd"]
SHAPE = SoakShape(seed=3, max_tokens=300, max_turns=4, seq_len=256, cp=3)


@pytest.fixture(scope="module")
def soak_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A daemon of its own (the soak's writes go to run ``soak``)."""
    with Daemons(tmp_path_factory.mktemp("soak")) as d:
        yield d.start("--node", "soak").socket


def test_a_short_soak_with_a_restart_passes(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "soak.json", tmp_path / "soak.png"
    args = [
        "soak", "--duration", "10", "--kill-every", "5", "--writers", "2", "--ranks", "3",
        "--samples-per-step", "4", "--max-tokens", "256", "--seq-len", "200",
        "--sample-every", "0.5", "--warmup", "1", "--settle", "2",
        "--json", str(out_json), "--plot", str(out_png),
    ]  # fmt: skip
    began = time.monotonic()
    run = subprocess.run([*PAYLOADD, *args], capture_output=True, text=True, timeout=180)
    took = time.monotonic() - began
    report = run.stdout + run.stderr
    assert out_json.exists(), report
    doc = json.loads(out_json.read_text())
    v = doc["verdict"]
    assert doc["samples"] and {"t", "epoch", "phase", "rss_mib", "fds", "deleted_fds",
                               "threads", "stats"} <= set(doc["samples"][0])  # fmt: skip
    assert {"passed", "failed", "counts", "errors", "checks"} <= set(v)
    c = v["counts"]
    assert c["restarts"] == 1 and len(doc["kills"]) == 1 and len(doc["starts"]) == 2
    assert c["steps_across_kills"] >= 1  # acknowledged before the kill, read after it
    assert c["appends"] > 0 and c["windows"] > 0 and c["gone_checked"] > 0, report
    assert c["tail_windows"] > 0  # samples longer than --seq-len: their tails are read apart
    assert {s["epoch"] for s in doc["samples"]} == {0, 1}
    assert {s["phase"] for s in doc["samples"]} >= {"load", "settle"}
    checks = {ch["name"]: ch for ch in v["checks"]}
    data = ["mismatches", "unexpected errors", "windows compared", "410 reads checked",
            "run completed"]  # fmt: skip
    assert all(checks[name]["ok"] for name in data), report
    # the resources: no growth, and nothing of the removed files held after the final GC
    for name in ("RSS growth", "descriptors growth", "threads growth", "files_open_for_append",
                 "root_bytes", "descriptors of removed files"):  # fmt: skip
        assert checks[name]["ok"], f"{name}: {checks[name]}\n{report}"
    assert run.returncode == 0 and "soak: OK" in run.stdout, report
    assert out_png.stat().st_size > 10_000
    assert took < 60, f"the smoke run took {took:.0f} s"


def test_bad_flags_are_exit_status_2(tmp_path: Path) -> None:
    cases = [
        ["--ranks", "2", "--reader-processes", "3"],
        ["--duration", "0"],
        ["--daemon-arg=--fsync=sometimes"],  # payloadd serve refuses it
    ]
    for flags in cases:
        run = subprocess.run(
            [*PAYLOADD, "soak", *flags, "--json", str(tmp_path / "x.json")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 2, (flags, run.stdout + run.stderr)
        assert not (tmp_path / "x.json").exists()


def _one_batch(client: PayloadClient, step: int) -> tuple[list[Written], list[MicroBatch]]:
    tally = Tally()
    written = [
        write_sample(client, SHAPE, 0, step, k, tally, "test", time.monotonic() + 30)
        for k in range(3)
    ]
    assert not tally.errors
    return written, pack(SHAPE, step, written)


def _read_rank(
    client: PayloadClient, mb: MicroBatch, segs: list[PayloadSegment], rank: int, how: int = 0
) -> list[str]:
    lo, hi = mb.windows(SHAPE.cp)[rank]
    region = expected_region(SHAPE, mb, lo, hi + 1)
    got = client.read_many(
        [
            Window(segs, ROUTED, lo, hi, 0, coverage=how == 2),
            Window(segs, MASK, lo + 1, hi + 1, -1),
        ],
        coverage=None,  # the routing window as it asks
    )
    return check_windows(got[0], got[1], region, lo, hi, f"rank {rank}")


def test_the_checker_passes_what_was_written_and_fails_a_wrong_pos(soak_socket: Path) -> None:
    with PayloadClient(soak_socket) as client:
        _, batches = _one_batch(client, step=0)
        assert sum(len(mb.members) for mb in batches) == 3
        for mb in batches:
            for rank in range(SHAPE.cp):
                for how in (0, 2):
                    assert _read_rank(client, mb, mb.segments, rank, how) == []
        # a routing segment one position off: its rows land one row late
        mb = batches[0]
        k = next(i for i, s in enumerate(mb.segments) if s.field == ROUTED)
        wrong = list(mb.segments)
        wrong[k] = msgspec.structs.replace(wrong[k], pos=wrong[k].pos + 1)
        found = [m for r in range(SHAPE.cp) for m in _read_rank(client, mb, wrong, r, 2)]
        assert found and any("rows differ" in m for m in found), found
        # a mask segment one row further in its file: other rows
        k = next(i for i, s in enumerate(mb.segments) if s.field == MASK)
        wrong = list(mb.segments)
        wrong[k] = msgspec.structs.replace(wrong[k], offset=wrong[k].offset + 4 * wrong[k].shape[0])
        assert any(_read_rank(client, mb, wrong, r) for r in range(SHAPE.cp))
        # a segment missing (as for an append in doubt): fill where rows were expected
        assert any(
            _read_rank(client, mb, [s for i, s in enumerate(mb.segments) if i != 0], r)
            for r in range(SHAPE.cp)
        )


def test_compare_reports_a_corrupted_expected_array(soak_socket: Path) -> None:
    with PayloadClient(soak_socket) as client:
        _, batches = _one_batch(client, step=1)
        mb = batches[0]
        lo, hi = mb.windows(SHAPE.cp)[0]
        region = expected_region(SHAPE, mb, lo, hi + 1)
        got = client.read_field(mb.segments, ROUTED, lo, hi, 0)
        want = expected_window(region, ROUTED, lo, hi)
        assert got is not None and want is not None and compare(got, want, "w") is None
        want[3, 2, 1] ^= 1
        assert (
            compare(got, want, "w") == f"w: 1 of {hi - lo} rows differ, the first at window row 3"
        )
        assert "expected int32" in (compare(got.astype(np.int64), want, "w") or "")
        assert "expected None" in (compare(got, None, "w") or "")
        assert "got NoneType" in (compare(None, want, "w") or "")


def test_a_truncated_tail_is_read_at_its_own_positions(soak_socket: Path) -> None:
    with PayloadClient(soak_socket) as client:
        tally = Tally()
        until = time.monotonic() + 30
        for k in range(20):  # some sample is longer than seq_len
            w = write_sample(client, SHAPE, 1, 2, k, tally, "test", until)
            tb = tail_batch(SHAPE, w)
            if tb is not None:
                break
        assert tb is not None
        lo, hi = tb.members[0].lo, tb.members[0].hi
        assert lo == SHAPE.seq_len and all(s.pos >= lo for s in tb.segments)
        region = expected_region(SHAPE, tb, lo, hi)
        for field, fill in ((ROUTED, 0), (MASK, -1)):
            got = client.read_field(tb.segments, field, lo, hi, fill)
            assert compare(got, expected_window(region, field, lo, hi), field) is None


def _samples(values: list[float], epoch: int = 0, t0: float = 0.0) -> list[dict[str, Any]]:
    return [
        {"t": t0 + i, "epoch": epoch, "phase": "load", "rss_mib": v, "fds": v, "threads": 8}
        for i, v in enumerate(values)
    ]


def test_growth_checks_fail_on_growth_and_say_by_how_much() -> None:
    slack = {"rss_mib": 16.0, "fds": 16.0, "threads": 4.0}
    flat = _samples([100.0] * 12)
    assert all(ch.ok for ch in growth_checks(flat, [0.0], 1.0, slack, 10.0))
    growing = _samples([100.0 + 5 * i for i in range(12)])
    rss, fds, threads = growth_checks(growing, [0.0], 1.0, slack, 10.0)
    # 11 samples after the warm-up: medians 127.5 (second third) and 147.5 (last third)
    assert not fds.ok and fds.value == 20.0 and fds.detail.endswith("grew 4 more than allowed")
    assert not rss.ok and rss.limit == 16.0 and "grew 4 MiB more" in rss.detail
    assert threads.ok and threads.value == 0
    rss = growth_checks(growing, [0.0], 1.0, slack, 20.0)[0]
    assert rss.ok and rss.limit == 25.5  # 20 % of the second third's median
    # a restart frees everything: each epoch is judged apart
    restarted = _samples([100.0] * 8) + _samples([50.0] * 8, epoch=1, t0=8.0)
    assert all(ch.ok for ch in growth_checks(restarted, [0.0, 8.0], 1.0, slack, 10.0))
    few = growth_checks(_samples([1.0, 99.0]), [0.0], 0.0, slack, 10.0)
    assert all(ch.ok and ch.value is None and "not measured" in ch.detail for ch in few)


def test_only_transport_errors_around_a_kill_are_expected(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_soak_flags(parser)
    with open(tmp_path / "log", "ab") as log:
        soak = Soak(parser.parse_args([]), tmp_path, log)
    soak.state.kills.append(Kill(at=100.0, ready=102.0))
    assert soak._expected([99.8, 100.1, "append", "ConnectError", "", ""])
    assert soak._expected([104.0, 106.0, "read", "ConnectionLostError", "", ""])  # in the grace
    assert soak._expected([101.0, 101.5, "append", "AppendInDoubtError", "", ""])
    assert not soak._expected([101.0, 101.5, "append", "ServerError", "", ""])
    assert not soak._expected([90.0, 90.5, "read", "ConnectError", "", ""])
    assert not soak._expected([120.0, 120.5, "read", "TimeoutError", "", ""])


def test_a_removed_file_held_across_samples_counts_as_leaked() -> None:
    gone = "/r/soak/soak/3/routed_experts-1-000001.bin (deleted)"
    brief = "/r/soak/soak/4/routed_experts-1-000002.bin (deleted)"
    samples = [
        {
            "t": float(t),
            "pid": 7,
            "deleted": ([gone] if t >= 2 else []) + ([brief] if t == 5 else []),
        }
        for t in range(20)
    ]
    assert held_deleted(samples, 10.0) == {gone: 17.0}
    assert held_deleted(samples, 18.0) == {}
    # the same path in another daemon process (after a restart) starts a new stretch
    for s in samples[10:]:
        s["pid"] = 8
    assert held_deleted(samples, 10.0) == {}
    text = dump_document({"verdict": {"passed": True}, "samples": samples[:2]})
    assert json.loads(text)["samples"] == samples[:2] and len(text.splitlines()) == 9


def test_operations_lists_every_soak_flag_with_its_default() -> None:
    text = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    section = text.split("\n## Soak and race harness\n", 1)[1].split("\n## ", 1)[0]
    parser = argparse.ArgumentParser()
    add_soak_flags(parser)
    flags = {a.option_strings[0]: a for a in parser._actions if a.option_strings[0] != "-h"}
    listed: dict[str, str] = {}
    for row in section.splitlines():
        if row.startswith("| `--"):
            cells = [c.strip() for c in row.strip("|").split("|")]
            names = re.findall(r"`(--[a-z-]+)", cells[0])
            defaults = [d.strip().strip("`") for d in cells[1].split(",")]
            if len(defaults) != len(names):
                defaults = defaults * len(names)
            listed.update(zip(names, defaults, strict=True))
    assert sorted(listed) == sorted(flags)
    for name, default in listed.items():
        want = flags[name].default
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            assert float(default) == want, name


def test_a_short_hostile_soak_passes_with_its_figures(tmp_path: Path) -> None:
    """Strangers press on TCP and the peer port while the Unix socket is probed: 200 idle TCP
    connections, more than the Unix socket's 64 (``--max-connections``), and none of them may
    refuse a local health probe; every refused call of the prober is checked."""
    out_json = tmp_path / "soak.json"
    args = [
        "soak", "--hostile", "--duration", "8", "--writers", "2", "--ranks", "3",
        "--samples-per-step", "4", "--max-tokens", "256", "--seq-len", "200",
        "--sample-every", "0.5", "--warmup", "1", "--settle", "2",
        "--json", str(out_json), "--plot", "", "--daemon-arg=--max-connections=64",
    ]  # fmt: skip
    run = subprocess.run([*PAYLOADD, *args], capture_output=True, text=True, timeout=180)
    report = run.stdout + run.stderr[-3000:]
    assert out_json.exists(), report
    v = json.loads(out_json.read_text())["verdict"]
    checks = {ch["name"]: ch for ch in v["checks"]}
    p = v["probes"]
    assert p["health"] >= 4 and p["health_failed"] == 0, report
    assert {k.split()[1] for k in p["calls"]} == {"unix", "tcp"}  # both ways in
    refused = sum(n for k, n in p["calls"].items() if k.endswith(" refused"))
    assert sum(p["refusals_checked"].values()) == refused >= 1, p  # each one checked
    assert p["refusals_executed"] == []
    kinds = v["neighbours"]["kinds"]
    assert set(kinds) == {"idle_tcp", "trickle_tcp", "stalled_http", "idle_peer",
                          "trickle_peer", "stalled_peer"}  # fmt: skip
    for kind, n in kinds.items():
        assert n["opened"] >= n["planned"] >= 1 and n["closed"] + n["refused"] <= n["opened"], kind
    assert kinds["idle_tcp"]["planned"] == 200 and kinds["idle_peer"]["planned"] == 25
    # more strangers than the daemon lets wait for a head: some were refused or closed
    assert kinds["idle_tcp"]["refused"] + kinds["idle_tcp"]["closed"] > 0
    stragglers = v["neighbours"]["stragglers"]  # a client's threads on old steps, counted
    assert stragglers["moves"] >= 1 and stragglers["straggler appends"] > stragglers["moves"]
    b = v["bytes"]
    assert b["samples"] >= 1 and b["at_rest"]["real"] > 0 and b["at_rest"]["files"] > 0
    for name in ("health probes failed", "refused calls executed", "counted vs real bytes",
                 "counted vs real bytes at rest", "unexpected errors", "mismatches"):  # fmt: skip
        assert checks[name]["ok"], f"{name}: {checks[name]}\n{report}"
    assert "neighbour  idle_tcp" in run.stdout and "probes     health" in run.stdout
    assert run.returncode == 0 and "soak: OK" in run.stdout, report


def _bytes(drift: int, n_open: int, lease: int = 1000) -> dict[str, Any]:
    real = 5000
    return {"counted": [real + drift] * 2, "real": real, "files": 3, "open": n_open,
            "drift": drift, "tolerance": lease * n_open}  # fmt: skip


def _state(sample_drift: int = 1500, rest_drift: int = 0) -> RunState:
    """A run whose new checks pass: a sample above the files within its two leases, the
    count equal to the files at rest, 10 health probes, a refusal checked."""
    st = RunState(probes=Probes(health=10), at_rest=_bytes(rest_drift, 2))
    st.samples = [
        {"t": 1.0, "epoch": 0, "phase": "load", "pid": 7, "rss_mib": 50.0, "fds": 20,
         "threads": 8, "deleted_fds": 0, "deleted": [], "stats": None,
         "bytes": _bytes(sample_drift, 2)}
    ]  # fmt: skip
    assert st.probes is not None
    st.probes.calls["append unix refused"] += 1
    st.probes.checked["append unix"] += 1
    return st


def _new_checks(state: RunState) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    add_soak_flags(parser)
    v = _verdict.verdict(parser.parse_args([]), state, Tally(), [0.0], 0.0)
    names = ("health probes failed", "refused calls executed", "counted vs real bytes",
             "counted vs real bytes at rest")  # fmt: skip
    checks = {ch["name"]: ch for ch in v["checks"] if ch["name"] in names}
    assert set(checks) == set(names)
    for name, ch in checks.items():
        assert (name in v["failed"]) == (not ch["ok"])
    return checks


def test_the_verdict_fails_on_a_failed_probe_a_refusal_carried_out_or_a_drift() -> None:
    assert all(ch["ok"] for ch in _new_checks(_state()).values())
    assert all(ch["ok"] for ch in _new_checks(_state(-2000, 0)).values())  # at the bounds
    # a health probe of the Unix socket that failed, away from any kill
    st = _state()
    assert st.probes is not None
    st.probes.health_failed.append([5.0, 5.1, "health", "BusyError", "daemon busy", "probe"])
    ch = _new_checks(st)["health probes failed"]
    assert not ch["ok"] and ch["value"] == 1 and "BusyError: daemon busy" in ch["detail"]
    st.kills.append(Kill(at=5.05, ready=5.5))  # a transport error around a kill is expected
    st.probes.health_failed[0][3] = "ConnectError"
    assert _new_checks(st)["health probes failed"]["ok"]
    st.probes.health = 0  # and no probe at all is no pass
    assert not _new_checks(st)["health probes failed"]["ok"]
    # a refused call that was carried out
    st = _state()
    assert st.probes is not None
    st.probes.executed.append("append over unix answered BusyError ... and was carried out")
    ch = _new_checks(st)["refused calls executed"]
    assert not ch["ok"] and ch["value"] == 1 and "carried out" in ch["detail"]
    # the count below the files at rest, or above them, by one byte
    ch = _new_checks(_state(rest_drift=-1))["counted vs real bytes at rest"]
    assert not ch["ok"] and ch["value"] == -1 and "1 bytes below the files" in ch["detail"]
    ch = _new_checks(_state(rest_drift=1))["counted vs real bytes at rest"]
    assert not ch["ok"] and ch["value"] == 1 and "1 bytes above the files" in ch["detail"]
    # a sample beyond a lease of each file open, either way
    for drift in (-2001, 2001):
        ch = _new_checks(_state(sample_drift=drift))["counted vs real bytes"]
        assert not ch["ok"] and ch["value"] == 1 and "1 beyond" in ch["detail"]


def test_the_prober_finds_a_refused_call_that_was_carried_out(soak_socket: Path) -> None:
    root = soak_socket.parent / "root"
    probes = Probes()
    prober = RefusalProber(str(soak_socket), None, None, root, root / "soak", probes, Tally())
    run, row = "soak-probe-unix", np.zeros((2, 48, 8), np.uint8)
    past = time.monotonic() - CHECK_AFTER
    with PayloadClient(soak_socket, data_plane=False) as c:
        # appends answered 503: the one to step 7 stored all the same, the one to step 8 not
        c.append(ROUTED, row, 0, run=run, step=7)
        prober.pending += [_Refusal("append", "unix", past, run, 7),
                           _Refusal("append", "unix", past, run, 8)]  # fmt: skip
        prober._check_due(time.monotonic())
        assert len(probes.executed) == 1 and f"{run} step 7 holds 1 file" in probes.executed[0]
        # a GC answered 503 that ran all the same, and one that did not
        kept = c.append(ROUTED, row, 0, run=run, step=9)
        files = [s.file for s in kept]
        prober.pending.append(_Refusal("gc", "unix", past, run, 9, files))
        prober._check_due(time.monotonic())  # its files are there: nothing done
        c.gc(run=run, through_step=9)
        prober.pending.append(_Refusal("gc", "unix", past, run, 9, files))
        prober._check_due(time.monotonic())
    assert probes.checked == {"append unix": 2, "gc unix": 2}
    assert len(probes.executed) == 2 and "files it would remove are gone" in probes.executed[1]
