"""Descriptors under real load: trainer ranks racing onto new files, a low ``RLIMIT_NOFILE``,
running out at ``accept()``, appends of many new files, and what reads may open.

Every test runs a real daemon and looks at its descriptors in /proc.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from payload_client import (
    BusyError,
    FileMissingError,
    PayloadClient,
    PayloadSegment,
    Window,
)
from payload_client.wire._dataplane import OpenRequest
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import APPEND_CONTENT_TYPE, AppendItem, AppendRequest
from tests.conftest import Daemons, wait_until
from tests.payloadd import procfs

pytestmark = pytest.mark.slow  # one of the longest modules (`-m "not slow"` skips it)

R = "routed_experts"


def _nofile(limit: int) -> Callable[[], None]:
    """A ``preexec_fn`` that starts the daemon under ``RLIMIT_NOFILE`` ``limit``."""

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return set_limit


@pytest.mark.parametrize("transport", ["data-plane", "http"])
def test_ranks_released_onto_new_files_at_once_leak_no_descriptor(
    tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--node", "n", socket=sock) as d:
        rows = np.arange(4 * 384, dtype=np.uint8).reshape(4, 48, 8)
        with PayloadClient(sock, data_plane=False) as w:  # 200 steps: 200 new files
            segs = [w.append(R, rows, 0, run="r", step=k) for k in range(200)]
        ranks = 8
        barrier = threading.Barrier(ranks)
        failures: list[BaseException] = []

        def rank() -> None:
            try:
                with PayloadClient(sock, data_plane=transport == "data-plane") as c:
                    for s in segs:
                        barrier.wait(timeout=30)  # every rank opens the same new file at once
                        np.testing.assert_array_equal(c.read_field(s, R, 0, 4, 0), rows)
            except BaseException as exc:
                failures.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=rank) for _ in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        with PayloadClient(sock) as c:
            assert c.gc(run="r", through_step=199).files == 200
        assert (
            procfs.deleted_fds(d.pid, tmp_path / "root") == []
        )  # every removed file's space is freed
        assert len(procfs.fds(d.pid)) < 40  # the cache keeps one descriptor a file


def test_a_low_limit_gives_a_small_daemon_that_serves_and_sheds_idle_connections(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    sock = tmp_path / "s.sock"
    extra = ("--node", "n", "--request-timeout-s", "2")
    with daemons.run(*extra, socket=sock, preexec_fn=_nofile(64)) as d:
        rows = np.full((3, 48, 8), 7, np.uint8)
        with PayloadClient(sock) as c:
            (seg,) = c.append(R, rows, 0, run="r", step=0)
        idle = []  # 70 idle connections to each socket: beyond any share of 64 descriptors
        for path in (sock, f"{sock}.data"):
            for _ in range(70):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(path))
                idle.append(s)
        time.sleep(0.5)  # time for a breach of the limit to show (nothing to wait for)
        assert len(procfs.fds(d.pid)) <= 64
        try:  # meanwhile: served, or refused in words; never a hang until the timeout
            with PayloadClient(sock, timeout=10) as c:
                start = time.monotonic()
                try:
                    np.testing.assert_array_equal(c.read_field([seg], R, 0, 3, 0), rows)
                except BusyError as exc:
                    assert "try again" in str(exc)
                assert time.monotonic() - start < 5
        finally:
            for s in idle:
                s.close()
        for path in (sock, f"{sock}.data"):  # the idle connections gone
            _wait_for_connections(path, 0)
        with PayloadClient(sock) as c:  # served again, on the data plane
            before = c.stats()
            (more,) = c.append(R, rows + 1, 3, run="r", step=0)
            np.testing.assert_array_equal(
                c.read_field([seg, more], R, 0, 6, 0), np.r_[rows, rows + 1]
            )
            after = c.stats()
            assert after.leases == before.leases + 1
            assert c.health().data_plane == "serving"


def test_the_http_side_closes_idle_connections_and_refuses_beyond_its_share(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    sock = tmp_path / "s.sock"
    extra = ("--max-connections", "3", "--request-timeout-s", "1")
    with daemons.run(*extra, socket=sock):
        idle = []
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            idle.append(s)
        _wait_for_connections(sock, 3)
        with (
            pytest.raises(BusyError, match="3 HTTP connections"),
            PayloadClient(sock, data_plane=False) as c,
        ):
            c.health()
        for s in idle:  # no request head within request_timeout_s: closed
            s.settimeout(5)
            assert s.recv(1) == b""
            s.close()
        half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a head that never ends
        half.connect(str(sock))
        half.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        half.settimeout(5)
        assert half.recv(1) == b""
        half.close()
        with PayloadClient(sock, data_plane=False) as c:
            assert c.health().status == "ok"


def test_a_call_refused_beyond_the_share_is_not_carried_out(
    tmp_path: Path, daemons: Daemons
) -> None:
    """The 503 says nothing was done, and nothing is: each call that changes state (an
    append, a prefetch, a collection, a run deletion, another node's run deletion) refused
    beyond ``max_connections`` is not routed (its request, sent whole, is never parsed); the
    files and the counters are checked after each one, and no server error is logged or
    counted."""
    sock, root, log = tmp_path / "s.sock", tmp_path / "root", tmp_path / "daemon.log"
    flags = ("--max-connections", "2", "--request-timeout-s", "5", "--node", "n")
    with log.open("wb") as out, daemons.run(*flags, root=root, socket=sock, stderr=out):
        with PayloadClient(sock, data_plane=False) as c:
            (seg,) = c.append(R, np.ones((4, 48, 8), np.uint8), 0, run="kept", step=0)
        (root / "other" / "kept" / "0").mkdir(parents=True)  # another node's run
        (root / "other" / "kept" / "0" / "f").write_bytes(b"x" * 64)

        def state() -> tuple[object, ...]:
            with PayloadClient(sock, data_plane=False) as c:
                st = c.stats()
            files = sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))
            return files, st.appends, st.bytes_appended, st.reads, st.bytes_read

        before = state()
        idle = []
        for _ in range(2):  # the whole share, idle
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            idle.append(s)
        _wait_for_connections(sock, 2)
        with contextlib.ExitStack() as held, PayloadClient(sock, data_plane=False) as c:

            def close_idle() -> None:
                for s in idle:
                    s.close()

            held.callback(close_idle)
            calls = {
                "append": lambda: c.append(R, np.ones((4, 48, 8), np.uint8), 0, run="new", step=0),
                "prefetch": lambda: c.prefetch([Window([seg], R, 0, 4, 0)]),
                "gc": lambda: c.gc(run="kept", through_step=0),
                "delete_run": lambda: c.delete_run("kept"),
                "delete_node_run": lambda: c.delete_run("kept", node="other"),
            }
            for name, call in calls.items():
                with pytest.raises(BusyError, match="2 HTTP connections"):
                    call()
                for s in idle:  # room for a look at the state, then the share full again
                    s.close()
                _wait_for_connections(sock, 0)
                assert state() == before, name  # nothing of it was done
                idle = []
                for _ in range(2):
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.connect(str(sock))
                    idle.append(s)
                _wait_for_connections(sock, 2)
        for s in idle:
            s.close()
        _wait_for_connections(sock, 0)
        with PayloadClient(sock, data_plane=False) as c:
            assert c.usage().runs[0].run == "kept"  # neither deleted nor collected
            metrics = c._http.client.get("/metrics").text
        assert 'error="ServerError"' not in metrics
        assert 'payloadd_refused_total{reason="connections",transport="http"} 5.0' in metrics
    assert "Exception in ASGI" not in log.read_text(errors="replace")


def test_beyond_the_data_plane_share_clients_fall_back_to_http(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--max-data-connections", "2", socket=sock):
        held = []
        for _ in range(2):  # the whole share, idle
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(f"{sock}.data")
            held.append(s)
        _wait_for_connections(f"{sock}.data", 2)
        rows = np.full((4, 48, 8), 2, np.uint8)
        with PayloadClient(sock) as c:
            before = c.stats()
            (seg,) = c.append(R, rows, 0, run="r", step=0)  # over HTTP: a daemon-written file
            np.testing.assert_array_equal(c.read_field([seg], R, 0, 4, 0), rows)
            after = c.stats()
            assert after.leases == before.leases and after.appends == before.appends + 1
            metrics = c._http.client.get("/metrics").text
            assert 'payloadd_refused_total{reason="connections",transport="data_plane"} 0' not in (
                metrics
            )
        for s in held:
            s.close()
        _wait_for_connections(f"{sock}.data", 0)
        with PayloadClient(sock) as c:  # room again: on the data plane
            leases = c.stats().leases
            c.append(R, rows, 4, run="r", step=0)
            assert c.stats().leases == leases + 1


@pytest.fixture
def lowered(tmp_path: Path, daemons: Daemons) -> Iterator[tuple[Path, int]]:
    """A daemon (socket, pid) whose soft RLIMIT_NOFILE the test may lower while it runs."""
    sock = tmp_path / "s.sock"
    with daemons.run("--node", "n", socket=sock, log_level="error") as d:
        yield sock, d.pid


def test_the_data_plane_serves_again_after_running_out_of_descriptors(
    lowered: tuple[Path, int],
) -> None:
    sock, pid = lowered
    rows = np.full((2, 48, 8), 3, np.uint8)
    with PayloadClient(sock) as c:
        c.append(R, rows, 0, run="r", step=0)
    old = procfs.set_nofile(pid, len(procfs.fds(pid)) + 3)
    hogs = []
    try:
        for _ in range(8):  # the daemon runs out of descriptors at accept()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(f"{sock}.data")
            hogs.append(s)
        time.sleep(0.3)  # time to meet EMFILE at accept (nothing shows it but this call)
        start = time.monotonic()
        with (
            pytest.raises(BusyError, match="out of file descriptors"),  # in words, at once
            PayloadClient(sock, timeout=10) as c,
        ):
            c.append(R, rows, 2, run="r", step=0)
        assert time.monotonic() - start < 5
    finally:
        procfs.set_nofile(pid, old)
        for s in hogs:
            s.close()
    with PayloadClient(sock) as c:  # the accept loop lives on, and serves at once
        wait_until(lambda: c.health().data_plane == "serving", 10, "the data plane serving")
        before = c.stats().leases
        (seg,) = c.append(R, rows, 2, run="r", step=0)
        np.testing.assert_array_equal(c.read_field([seg], R, 2, 4, 0), rows)
        assert c.stats().leases == before + 1  # on the data plane
        assert c.health().status == "ok"


def test_health_says_the_data_plane_is_refusing_while_out_of_descriptors(
    lowered: tuple[Path, int],
) -> None:
    sock, pid = lowered
    with _http(sock) as http:
        assert http.get("/healthz").json()["data_plane"] == "serving"
        old = procfs.set_nofile(pid, len(procfs.fds(pid)) + 1)
        hogs = []
        try:
            for _ in range(3):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(f"{sock}.data")
                hogs.append(s)
            answer = wait_until(  # on the connection it already has
                lambda: _degraded(http), 10, "health saying the data plane is refusing"
            )
            assert answer["status"] == "degraded"
            assert answer["data_plane"].startswith("refusing connections: out of file")
        finally:
            procfs.set_nofile(pid, old)
            for s in hogs:
                s.close()


def _degraded(http: httpx.Client) -> dict[str, str] | None:
    """The health answer once it is not ``ok``."""
    answer = http.get("/healthz").json()
    return None if answer["status"] == "ok" else answer


def test_an_append_out_of_descriptors_is_refused_and_leaves_no_debris(
    lowered: tuple[Path, int], tmp_path: Path
) -> None:
    sock, pid = lowered
    rows = np.ones((1, 2), np.uint8)
    with PayloadClient(sock, data_plane=False) as c:
        c.health()  # the connection is open before the limit drops
        old = procfs.set_nofile(pid, len(procfs.fds(pid)) + 4)
        try:
            items = [(R, rows, 0)] * 1
            with pytest.raises(BusyError, match="descriptors"):
                for step in range(40):  # each append to a new step: a new file, until none
                    c.append_many(items, run="many", step=step)
        finally:
            procfs.set_nofile(pid, old)
        node = tmp_path / "root" / "n" / "many"
        kept = {p.name for p in node.iterdir()} if node.exists() else set()
        for name in kept:  # only steps whose append was acknowledged remain, never empty
            assert list((node / name).iterdir())
        (seg,) = c.append(R, rows, 0, run="many", step=99)
        np.testing.assert_array_equal(c.read_field([seg], R, 0, 1, 0), rows)


def test_an_append_of_more_new_files_than_a_request_may_hold_is_refused_first(
    tmp_path: Path,
    daemons: Daemons,
) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--node", "n", socket=sock, preexec_fn=_nofile(256)):
        rows = np.ones((1, 2), np.uint8)
        with PayloadClient(sock, data_plane=False) as c:
            items = [(R, rows, k) for k in range(3000)]
            segs = c.append_many(items, run="one", step=0)  # 3000 items, one file
            assert len({s.file for group in segs for s in group}) == 1
        with _http(sock) as http:
            body = _many_steps_body(30000)
            r = http.post(  # 30,000 items, each to a step of its own
                "/v1/append", content=body, headers={"content-type": APPEND_CONTENT_TYPE}
            )
            assert r.status_code == 413, r.text
            assert "file descriptors" in r.json()["message"]
        runs = [p.name for p in (tmp_path / "root" / "n").iterdir() if p.name[0] != "@"]
        assert runs == ["one"]  # nothing of the refused append


def test_an_open_naming_a_file_30000_times_is_refused_in_words(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--node", "n", socket=sock) as d:
        with PayloadClient(sock) as c:
            (seg,) = c.append(R, np.ones((1, 2), np.uint8), 0, run="r", step=0)
        before = len(procfs.fds(d.pid))
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(f"{sock}.data")
        body = msgspec.msgpack.encode(OpenRequest([(seg.file, 2)] * 30_000))
        raw.sendall(FRAME_PREFIX.pack(len(body)) + body)
        msg, anc, _, _ = raw.recvmsg(1 << 16, socket.CMSG_SPACE(4))
        assert not anc
        error = msgspec.msgpack.decode(msg[FRAME_PREFIX.size :])
        assert error[:2] == ["error", "PayloadTooLargeError"] and "250" in error[2]
        raw.close()
        assert len(procfs.fds(d.pid)) <= before + 1


def _http(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://payloadd")


def _many_steps_body(n: int) -> bytes:
    items = [AppendItem(R, "uint8", [2], 1, 0, "many", step) for step in range(n)]
    header = msgspec.msgpack.encode(AppendRequest(items))
    return FRAME_PREFIX.pack(len(header)) + header + bytes(2 * n)


@pytest.mark.parametrize("transport", ["data-plane", "http"])
def test_nothing_but_data_files_is_readable(
    tmp_path: Path, daemons: Daemons, transport: str
) -> None:
    sock = tmp_path / "s.sock"
    with (
        daemons.run("--node", "n", socket=sock),
        PayloadClient(sock, data_plane=transport == "data-plane") as c,
    ):
        c.append(R, np.ones((1, 2), np.uint8), 0, run="r", step=0)
        c.gc(run="r", through_step=0)  # writes the GC ledger: run names, files, sizes
        size = (tmp_path / "root" / "n" / "@gc-ledger.jsonl").stat().st_size
        assert size > 0
        leak = PayloadSegment(R, "n/@gc-ledger.jsonl", 0, 0, 1, "uint8", [size])
        with pytest.raises(FileMissingError, match="no data file") as info:
            c.read_field([leak], R, 0, 1, 0)
        assert "watermark" not in str(info.value)  # nothing of its content
        place = tmp_path / "root" / "n" / "r2" / "0"  # where a data file would lie
        place.mkdir(parents=True)
        os.symlink("../../@gc-ledger.jsonl", place / "x.bin")
        leak = PayloadSegment(R, "n/r2/0/x.bin", 0, 0, 1, "uint8", [size])
        with pytest.raises(FileMissingError, match="no data file"):
            c.read_field([leak], R, 0, 1, 0)
        with _http(sock) as http:  # the raw route, without a token
            r = http.post("/v1/read", json={"extents": [["n/@gc-ledger.jsonl", 0, size, size]]})
            assert r.status_code == 404 and "watermark" not in r.text


def test_the_limits_are_logged_and_raised_at_start(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    log = tmp_path / "log"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))

    with (
        log.open("wb") as err,
        daemons.run(socket=sock, log_level="info", stderr=err, preexec_fn=lower) as d,
    ):
        limit = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)[0]
    text = log.read_text()
    if hard != 128:
        assert limit == hard and f"raised from 128 to {hard}" in text
    assert "file descriptors: limit" in text and "per request" in text
    del soft


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_descriptors_the_accept_loop_waits_instead_of_spinning(
    lowered: tuple[Path, int],
) -> None:
    sock, pid = lowered
    old = procfs.set_nofile(pid, 3)  # nothing can be opened, not even the spare
    queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        queued.connect(f"{sock}.data")  # waits in the queue
        time.sleep(0.3)  # the accept loop meets EMFILE and starts waiting
        before = _cpu_seconds(pid)
        time.sleep(2)  # the thing measured: CPU time spent over 2 s of waiting
        assert _cpu_seconds(pid) - before < 0.5  # retries every 0.1 s, no busy loop
    finally:
        procfs.set_nofile(pid, old)
        queued.close()
    with PayloadClient(sock) as c:
        wait_until(lambda: c.health().data_plane == "serving", 10, "the data plane serving")


def test_a_read_that_gets_no_descriptor_for_the_cache_leaks_none(
    lowered: tuple[Path, int], tmp_path: Path
) -> None:
    sock, pid = lowered
    rows = np.full((2, 3), 7, np.uint8)
    with PayloadClient(sock, data_plane=False) as c:
        (a,) = c.append("f", rows, 0, run="r", step=0)
        (b,) = c.append("g", rows, 0, run="r", step=1)
        c.read_field([b], "g", 0, 2, 0)  # the connection is open
        taken = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
        free = min(set(range(max(taken) + 2)) - taken)
        old = procfs.set_nofile(pid, free + 1)  # room to open the file, not to cache it
        try:
            got: np.ndarray | str | None = c.read_field([a], "f", 0, 2, 0)
        except BusyError as exc:  # refused in words is fine too
            got = str(exc)
        finally:
            procfs.set_nofile(pid, old)
        if isinstance(got, str):
            assert "descriptors" in got and "try again" in got, got
        else:
            np.testing.assert_array_equal(got, rows)
        assert c.health().status == "ok"
        assert c.gc(run="r", through_step=1).files == 2
    root = tmp_path / "root"
    wait_until(lambda: procfs.deleted_fds(pid, root) == [], 10, "no removed file held open")


def _wait_for_connections(path: Path | str, n: int) -> None:
    """Wait until the daemon listening on ``path`` holds ``n`` connections of it, and none
    waits to be accepted."""
    wait_until(lambda: procfs.unix_connections(path) == (n, 0), 10, f"{n} connections held")


def test_connections_refused_over_http_linger_in_bounds(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    with daemons.run("--max-connections", "2", socket=sock) as d:
        base = len(procfs.fds(d.pid))
        served = []
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            served.append(s)
        refused = []
        for _ in range(100):  # a storm of clients beyond the share
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            refused.append(s)
        time.sleep(0.3)  # time for a breach of the bound to show (nothing to wait for)
        assert len(procfs.fds(d.pid)) <= base + 2 + 2 + 1  # served, lingering, slack
        refused[0].settimeout(5)
        assert refused[0].recv(64).startswith(b"HTTP/1.1 503")
        for s in refused + served:
            s.close()
