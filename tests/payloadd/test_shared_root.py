"""A payload root shared by two daemons: node ``a`` and node ``b``, two sockets, one root.

Two real ``payloadd serve`` processes stand for the daemons of two nodes that mount the same
shared file system. Both run on this machine's local file system, whose page cache is
coherent between them: these tests check placement, ownership, GC and which descriptors are
kept, not the cache consistency of NFS or Lustre (none here; see docs/deployment.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from payload_client import (
    AsyncPayloadClient,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    PayloadClient,
    PayloadSegment,
    StepCollectedError,
)
from payloadd.settings._settings import Settings
from payloadd.store._watermarks import REFRESH_S
from tests.conftest import Daemons, wait_until
from tests.payloadd.test_metrics import scrape, value

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

PAYLOADD = [sys.executable, "-m", "payloadd"]

TRANSPORTS = ["data-plane", "http"]
REOPEN = ("--foreign-reads", "reopen")
DIRECTIONS = [("a", "b"), ("b", "a")]
"""(writer, reader): ``b`` reads ``a``'s files under ``reopen``, ``a`` reads ``b``'s cached."""


@dataclass(frozen=True)
class Pair:
    """Two running daemons on one root: their sockets and process ids."""

    root: Path
    a: Path
    b: Path
    pid_a: int
    pid_b: int

    def client(self, node: str, transport: str = "data-plane") -> PayloadClient:
        sock = self.a if node == "a" else self.b
        return PayloadClient(sock, data_plane=transport == "data-plane")


def start_pair(
    daemons: Daemons, a_flags: tuple[str, ...] = (), b_flags: tuple[str, ...] = ()
) -> Pair:
    """Start daemons ``a`` and ``b`` (until ``daemons`` closes) on one root, ``root`` of
    its folder, sockets ``a.sock`` and ``b.sock``.

    Returns once both have run their first GC sweep (it removes an orphan left for it), so
    that files a test lays out afterwards meet only the sweeps it asks for.
    """
    root = daemons.folder / "root"
    firsts = [root / node / "first-sweep" for node in ("a", "b")]
    for first in firsts:  # an earlier daemon's empty file: the first sweep removes it
        (first / "0").mkdir(parents=True)
        (first / "0" / "f-00000000-000001.bin").touch()
    a = daemons.start(*a_flags, node="a")
    b = daemons.start(*b_flags, node="b")
    wait_until(lambda: not any(first.exists() for first in firsts), what="a first GC sweep")
    return Pair(root, a.socket, b.socket, a.pid, b.pid)


def sweeps(pair: Pair, node: str) -> float:
    """How many background GC sweeps the daemon of ``node`` has finished."""
    sock = pair.a if node == "a" else pair.b
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x") as h:
        return value(scrape(h), "payloadd_gc_runs_total", trigger="sweep")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """One pair for the module (each test uses runs of its own): ``a`` keeps descriptors of
    ``b``'s files (``--foreign-reads cached``, the default), ``b`` opens ``a``'s anew for
    every read (``--foreign-reads reopen``)."""
    with Daemons(tmp_path_factory.mktemp("shared")) as d:
        yield start_pair(d, b_flags=REOPEN)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return ((np.arange(n * 384) * 7 + seed) % 251).astype(np.uint8).reshape(n, 48, 8)


def read(c: PayloadClient, segs: list[PayloadSegment]) -> np.ndarray:
    lo = min(s.pos for s in segs)
    hi = max(s.pos + s.rows for s in segs)
    out = c.read_field(segs, "f", lo, hi, 0, dtype=np.uint8)
    assert out is not None
    return out


def new_run() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


def digest(top: Path) -> dict[str, str]:
    """Every regular file below ``top`` (relative path -> sha256), and every directory."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), top) + "/"] = "dir"
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, top)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def open_paths(pid: int | str = "self") -> list[str]:
    """Targets of a process's open descriptors."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def age(path: Path, seconds: float = 3600) -> None:
    """Set the modification time of every file below ``path`` ``seconds`` back."""
    then = time.time() - seconds
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            os.utime(os.path.join(dirpath, f), (then, then))


# -- hand-off: write via one daemon, read via the other ------------------------------------


@pytest.mark.parametrize("reader", TRANSPORTS)
@pytest.mark.parametrize("writer", TRANSPORTS)
def test_write_via_a_read_via_b(pair: Pair, writer: str, reader: str) -> None:
    run = new_run()
    with pair.client("a", writer) as a, pair.client("b", reader) as b:
        segs = a.append("f", rows(300, 1), 10, run=run, step=0)
        assert all(s.file.startswith(f"a/{run}/0/") for s in segs)
        np.testing.assert_array_equal(read(b, segs), rows(300, 1))
        window = b.read_field(segs, "f", 50, 120, 0, dtype=np.uint8)
        np.testing.assert_array_equal(window, rows(300, 1)[40:110])
        # and back: written via b, read via a
        back = b.append("f", rows(5, 2), 0, run=run, step=0)
        assert back[0].file.startswith(f"b/{run}/0/")
        np.testing.assert_array_equal(read(a, back), rows(5, 2))


@pytest.mark.asyncio
@pytest.mark.parametrize("reader", TRANSPORTS)
async def test_async_clients_hand_off_between_daemons(pair: Pair, reader: str) -> None:
    run = new_run()
    async with (
        AsyncPayloadClient(pair.a) as a,
        AsyncPayloadClient(pair.b, data_plane=reader == "data-plane") as b,
    ):
        segs = await a.append("f", rows(64, 3), 0, run=run, step=1)
        got = await b.read_field(segs, "f", 0, 64, 0, dtype=np.uint8)
        np.testing.assert_array_equal(got, rows(64, 3))
        assert (await b.delete_run(run, node="a", dry_run=True)).steps == [(run, 1)]
        assert (await b.gc(run, 1, node="a")).steps == [(run, 1)]  # b collects a's step
        with pytest.raises(FileGoneError, match=f"step 1 of run '{run}'"):
            await a.read_field(segs, "f", 0, 64, 0)


# -- GC on one node, reads on the other -------------------------------------------------------


@pytest.mark.parametrize(("owner", "other"), DIRECTIONS)
@pytest.mark.parametrize("reader", TRANSPORTS)
def test_reads_via_b_of_what_a_collected_answer_gone(
    pair: Pair, reader: str, owner: str, other: str
) -> None:
    run = new_run()
    with pair.client(owner) as a, pair.client(other, reader) as b:
        old = a.append("f", rows(4, 0), 0, run=run, step=0)
        keep = a.append("f", rows(4, 1), 0, run=run, step=1)
        np.testing.assert_array_equal(read(b, old), rows(4, 0))  # b may now cache a descriptor
        assert a.gc(run, 0).steps == [(run, 0)]
        with pytest.raises(FileGoneError, match=f"step 0 of run '{run}' was garbage-collected"):
            read(b, old)
        np.testing.assert_array_equal(read(b, keep), rows(4, 1))
        a.delete_run(run)
        with pytest.raises(FileGoneError, match=r"step 1 .*\(run,"):
            read(b, keep)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prefix_that_does_not_exist_is_404(pair: Pair, transport: str) -> None:
    (pair.root / "plainfile").write_bytes(b"x" * 4096)  # a regular file where a node would be
    with pair.client("b", transport) as b:
        for node in ("nosuchnode", "plainfile"):
            seg = PayloadSegment("f", f"{node}/r/0/f-00000000-000001.bin", 0, 0, 1, "uint8", [8])
            with pytest.raises(FileMissingError, match="does not exist"):
                b.read_field([seg], "f", 0, 1, 0)
        assert b.health().status == "ok"


def test_gc_on_a_leaves_b_files_bit_for_bit(daemons: Daemons) -> None:
    pair = start_pair(daemons)
    with pair.client("a") as a, pair.client("b") as b:
        root = pair.root
        for run in ("shared", "only-b"):  # b's runs, one of the same name as a's
            for step in range(3):
                b.append("f", rows(8, step), 0, run=run, step=step)
        for step in range(3):
            a.append("f", rows(8, step), 0, run="shared", step=step)
        a.append("f", rows(8), 0, run="old", step=0)
        for node in ("a", "b"):  # an earlier daemon's empty file, an empty directory
            orphan = root / node / "crashed" / "0" / "f-deadbeef-000001.bin"
            orphan.parent.mkdir(parents=True)
            orphan.touch()
            (root / node / "empty" / "7").mkdir(parents=True)
        age(root)  # every file an hour old: both nodes' files match the age rule
        before = digest(root / "b")
        time.sleep(1.1)  # the runs idle for a second: the age rule at ttl_s=1 takes a's
        watermark = a.gc("shared", 1)  # every call also takes orphans and empty directories
        assert watermark.steps == [("shared", 0), ("shared", 1)]
        assert watermark.by_reason["orphan"].files == 1
        assert a.delete_run("shared").steps == [("shared", 2)]
        assert a.gc(ttl_s=1).steps == [("old", 0)]
        assert sorted(os.listdir(root / "a")) == [
            "@gc-ledger.jsonl", "@gc-reserve", "@run-shapes.jsonl"
        ]  # fmt: skip
        assert digest(root / "b") == before
        assert not (root / "b" / "@gc-ledger.jsonl").exists()


def test_b_sweep_leaves_a_prefix(daemons: Daemons) -> None:
    sweep = ("--ttl-s", "1", "--gc-interval-s", "0.2")
    pair = start_pair(daemons, b_flags=sweep)
    with pair.client("a") as a:
        with pair.client("b") as b:
            mine = b.append("f", rows(2), 0, run="b-run", step=0)
        theirs = a.append("f", rows(2), 0, run="a-run", step=0)
        orphan = pair.root / "a" / "crashed" / "0" / "f-deadbeef-000001.bin"
        orphan.parent.mkdir(parents=True)
        orphan.touch()
        age(pair.root)
        before = digest(pair.root / "a")
        own_step = pair.root / mine[0].file  # b's own aged step goes: its sweep ran
        wait_until(lambda: not own_step.exists(), what="b's sweep collecting its own step")
        more = sweeps(pair, "b") + 2
        wait_until(lambda: sweeps(pair, "b") >= more, what="two more sweeps of b")
        assert digest(pair.root / "a") == before
        np.testing.assert_array_equal(read(a, theirs), rows(2))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_cap_counts_only_the_own_prefix(daemons: Daemons, transport: str) -> None:
    cap = ("--max-root-bytes", str(1 << 20), "--lease-bytes", "65536", "--gc-interval-s", "0.2")
    pair = start_pair(daemons, a_flags=cap)
    with (
        pair.client("a", transport) as a,
        pair.client("b", transport) as b,
    ):
        for k in range(8):  # 8 x 384 KiB = 3 MiB via b, three times a's cap
            b.append("f", rows(1024, k), 0, run="big", step=k)
        more = sweeps(pair, "a") + 2
        wait_until(lambda: sweeps(pair, "a") >= more, what="a's sweeps recounting its prefix")
        assert a.stats().root_bytes == 0
        segs = a.append("f", rows(1024), 0, run="small", step=0)  # 384 KiB fits under 1 MiB
        np.testing.assert_array_equal(read(b, segs), rows(1024))
        assert a.stats().root_bytes <= 1 << 20


# -- collecting another node's prefix, when told ----------------------------------------------


@pytest.mark.parametrize("reader", TRANSPORTS)
def test_a_collects_b_prefix_when_told(pair: Pair, reader: str) -> None:
    run = new_run()
    root = pair.root
    with pair.client("a") as a, pair.client("b", reader) as b:
        segs = {step: b.append("f", rows(4, step), 0, run=run, step=step) for step in range(3)}
        mine = a.append("f", rows(4, 9), 0, run=run, step=0)  # a's own step of that run
        np.testing.assert_array_equal(read(b, segs[0]), rows(4, 0))  # b may keep a descriptor
        dry = a.gc(run, 0, node="b", dry_run=True)
        assert dry.steps == [(run, 0)] and dry.files == 1
        assert (root / segs[0][0].file).exists()
        report = a.gc(run, 0, node="b")
        assert report.steps == [(run, 0)] and report.by_reason["watermark"].files == 1
        assert not (root / segs[0][0].file).exists()
        for c in (a, b):  # the line went to b's ledger: 410 through either daemon
            with pytest.raises(FileGoneError, match=f"step 0 of run '{run}'.*watermark"):
                read(c, segs[0])
        assert segs[0][0].file in (root / "b" / "@gc-ledger.jsonl").read_text()
        assert run not in (root / "a" / "@gc-ledger.jsonl").read_text()
        np.testing.assert_array_equal(read(b, mine), rows(4, 9))  # a's own step stays
        np.testing.assert_array_equal(read(a, segs[1]), rows(4, 1))
        time.sleep(1.5 * REFRESH_S)  # b's daemon reads what another wrote in its ledger
        with pytest.raises(StepCollectedError, match="through step 0"):
            b.append("f", rows(2, 5), 0, run=run, step=0)  # the step is gone on b too
        again = b.append("f", rows(2, 5), 0, run=run, step=3)  # b goes on in later steps
        np.testing.assert_array_equal(read(a, again), rows(2, 5))
        gone = a.delete_run(run, node="b")
        assert gone.steps == [(run, s) for s in (1, 2, 3)] and gone.by_reason["run"].files == 3
        assert not (root / "b" / run).exists() and (root / "a" / run).is_dir()
        with pytest.raises(FileGoneError, match=r"step 2 .*\(run,"):
            read(b, segs[2])
        np.testing.assert_array_equal(read(a, mine), rows(4, 9))


def test_collecting_another_node_needs_a_rule_and_a_good_name(pair: Pair) -> None:
    with pair.client("a") as a:
        with pytest.raises(InvalidRequestError, match="needs run and through_step, or ttl_s"):
            a.gc(node="b")
        with pytest.raises(InvalidRequestError, match="node"):
            a.gc("r", 0, node="../b")
        with pytest.raises(InvalidRequestError, match="node"):
            a.delete_run("r", node="b/c")
        assert a.gc(node="a", dry_run=True).dry_run  # its own node: the plain call
        assert a.gc("r", 0, node="nobody").steps == []  # a prefix that does not exist
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(pair.a)), base_url="http://d") as h:
        for body in ({"node": "b"}, {"node": "..", "run": "r", "through_step": 0}, {"node": 3}):
            answer = h.post("/v1/admin/gc", json=body)
            assert answer.status_code == 400, body
            assert answer.json()["error"] == "InvalidRequestError"
        assert h.delete("/v1/admin/nodes/b/runs/none?dry_run=true").json()["dry_run"] is True
        assert h.delete("/v1/admin/nodes/..%2Fb/runs/r").status_code in (400, 404)
        assert h.delete("/v1/admin/nodes/b%2Fc/runs/r").status_code in (400, 404)
        assert h.delete("/v1/admin/nodes/.../runs/r").status_code == 200  # a valid name


def test_the_gc_command_collects_another_node(pair: Pair) -> None:
    run = new_run()
    with pair.client("b") as b:
        segs = [b.append("f", rows(2, step), 0, run=run, step=step) for step in range(2)]
    gc = [*PAYLOADD, "gc", "--socket", str(pair.a)]
    done = subprocess.run(
        [*gc, "--node", "b", "--run", run, "--through-step", "0"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == [[run, 0]]
    assert not (pair.root / segs[0][0].file).exists() and (pair.root / segs[1][0].file).exists()
    alone = subprocess.run([*gc, "--node", "b"], capture_output=True, text=True)
    assert alone.returncode == 2 and "--node needs" in alone.stderr
    done = subprocess.run([*gc, "--node", "b", "--delete-run", run], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["steps"] == [[run, 1]]
    assert not (pair.root / "b" / run).exists()


def test_the_age_rule_on_another_node_goes_by_file_age(pair: Pair) -> None:
    run = new_run()
    with pair.client("a") as a, pair.client("b") as b:
        theirs = b.append("f", rows(2), 0, run=run, step=0)
        fresh = b.append("f", rows(2), 0, run=run, step=1)
        mine = a.append("f", rows(2), 0, run=run, step=0)
        age(pair.root / "b" / run / "0")  # just used by b, but its files are an hour old
        age(pair.root / "a" / run)
        report = a.gc(ttl_s=600, node="b")  # other tests' files are younger than 10 minutes
        assert report.steps == [(run, 0)] and report.by_reason["ttl"].files == 1
        with pytest.raises(FileGoneError, match="ttl"):
            read(b, theirs)
        np.testing.assert_array_equal(read(b, fresh), rows(2))
        np.testing.assert_array_equal(read(b, mine), rows(2))  # a's own: not in this call
        assert a.gc(node="b", ttl_s=0).steps == []  # no rule: nothing


# -- foreign_reads: descriptors of other nodes' files ----------------------------------------


@pytest.mark.parametrize(("writer", "reader"), DIRECTIONS)
@pytest.mark.parametrize("read_via", TRANSPORTS)
@pytest.mark.parametrize("write_via", TRANSPORTS)
def test_a_file_that_grows_after_the_first_read_is_read_whole(
    pair: Pair, writer: str, reader: str, write_via: str, read_via: str
) -> None:
    run = new_run()
    with pair.client(writer, write_via) as w, pair.client(reader, read_via) as r:
        first = w.append("f", rows(3, 0), 0, run=run, step=0)
        np.testing.assert_array_equal(read(r, first), rows(3, 0))
        second = w.append("f", rows(5, 1), 3, run=run, step=0)
        assert second[0].file == first[0].file and second[0].offset > first[0].offset
        np.testing.assert_array_equal(read(r, second), rows(5, 1))
        both = np.concatenate([rows(3, 0), rows(5, 1)])
        np.testing.assert_array_equal(read(r, first + second), both)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_reopen_keeps_no_descriptor_and_cached_keeps_one(pair: Pair, transport: str) -> None:
    run = new_run()
    with pair.client("a", "http") as wa, pair.client("b", "http") as wb:  # no lease here
        in_a = wa.append("f", rows(4), 0, run=run, step=0)
        in_b = wb.append("f", rows(4), 0, run=run, step=0)
    path_a = os.path.realpath(pair.root / in_a[0].file)
    path_b = os.path.realpath(pair.root / in_b[0].file)
    with pair.client("b", transport) as b:  # b: reopen
        for _ in range(2):
            np.testing.assert_array_equal(read(b, in_a), rows(4))
            assert path_a not in open_paths()  # the client closed it after the read
            # the daemon closes what it passed once sent (its thread may not be there yet)
            wait_until(lambda: path_a not in open_paths(pair.pid_b), 10, "b letting a's file go")
    with pair.client("a", transport) as a:  # a: cached
        np.testing.assert_array_equal(read(a, in_b), rows(4))
        assert path_b in open_paths(pair.pid_a)
        assert (path_b in open_paths()) == (transport == "data-plane")


def test_foreign_reads_is_a_setting(tmp_path: Path) -> None:
    bad = subprocess.run(
        [*PAYLOADD, "serve", "--root", str(tmp_path), "--foreign-reads", "sometimes"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--foreign-reads" in bad.stderr
    assert Settings(foreign_reads="reopen").foreign_reads == "reopen"


def test_a_node_prefix_that_is_a_symlink_out_of_the_root_is_not_collected(
    pair: Pair, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"  # not under the root: no daemon's files
    step = outside / "r" / "0"
    step.mkdir(parents=True)
    (step / "f-00000000-000001.bin").write_bytes(b"not the daemon's")
    age(outside)
    before = digest(outside)
    link = pair.root / "elsewhere"
    link.symlink_to(outside)
    try:
        with pair.client("a") as a:
            for collect in (
                lambda: a.delete_run("r", node="elsewhere"),
                lambda: a.gc("r", 5, node="elsewhere"),
                lambda: a.gc(node="elsewhere", ttl_s=1),
            ):
                with pytest.raises(InvalidRequestError, match="symlink"):
                    collect()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(pair.a)), base_url="http://d") as h:
            assert h.delete("/v1/admin/nodes/elsewhere/runs/r").status_code == 400
    finally:
        link.unlink()
    assert digest(outside) == before
