"""``GET /metrics`` and the logs, against real daemons: counters move by exactly what was
appended, read and collected, over HTTP and the data plane; request ids reach the answers and
the log lines."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from payload_client import FileMissingError, PayloadClient, PayloadSegment
from payload_client.wire._dataplane import DATA_SOCKET_SUFFIX, NoteRequest
from payload_client.wire._frames import FRAME_PREFIX
from tests.conftest import Daemons, free_port

TOKEN = "m3trics-" + "0123abcd" * 4
R, M = "routed_experts", "sampling_mask"
HEX16 = re.compile(r"[0-9a-f]{16}")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@dataclass(frozen=True)
class Observed:
    """A daemon with JSON logs, the access log, a token, a TCP listener on loopback, and
    unknown fields allowed."""

    root: Path
    socket: Path
    url: str
    log: Path

    def http(self) -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://d"
        )

    def client(self, data_plane: bool) -> PayloadClient:
        return PayloadClient(self.socket, token=TOKEN, data_plane=data_plane)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    tmp = tmp_path_factory.mktemp("observed")
    port = free_port()
    o = Observed(tmp / "root", tmp / "s.sock", f"http://127.0.0.1:{port}", tmp / "log")
    flags = (
        "--node", "obs", "--tcp-port", str(port), "--log-format", "json",
        "--access-log", "true", "--max-file-bytes", str(1 << 20), "--gc-interval-s", "3600",
        "--unknown-fields", "allow",  # a field outside the table: counted, under one label
    )  # fmt: skip
    env = {**os.environ, "PAYLOADD_ADMIN_TOKEN": TOKEN}
    with Daemons(tmp) as d:
        d.start(*flags, log=o.log, log_level="info", env=env)
        yield o


def scrape(http: httpx.Client, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of ``GET /metrics``, parsed by prometheus_client's own parser."""
    r = http.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def requests_of(samples: Samples, route: str, status_class: str = "2xx") -> float:
    return value(
        samples, "payloadd_http_request_duration_seconds_count", route=route,
        status_class=status_class,
    )  # fmt: skip


def test_http_appends_and_reads_count_their_exact_rows_and_bytes(observed: Observed) -> None:
    with observed.http() as http, observed.client(data_plane=False) as c:
        before = scrape(http)
        routed = np.arange(5 * 48 * 8, dtype=np.uint8).reshape(5, 48, 8)
        (seg,) = c.append(R, routed, 0, run="m-http", step=0)
        c.append_many(
            [(M, np.ones((3, 7), np.int32), 0), ("my_weights", np.ones((2, 4), np.int16), 0)],
            run="m-http",
            step=0,
        )
        window = c.read_field([seg], R, 1, 4, 0)  # rows 1..3: one byte range of 3 * 384
        assert window is not None
        after = scrape(http)
    assert delta(before, after, "payloadd_appends_total", transport="http") == 2  # 2 calls
    rows, nbytes = "payloadd_appended_rows_total", "payloadd_appended_bytes_total"
    assert delta(before, after, rows, field=R, transport="http") == 5
    assert delta(before, after, nbytes, field=R, transport="http") == 5 * 384
    assert delta(before, after, rows, field=M, transport="http") == 3
    assert delta(before, after, nbytes, field=M, transport="http") == 3 * 7 * 4
    # a field outside the fields table never becomes a label of its own
    assert delta(before, after, rows, field="@other", transport="http") == 2
    assert delta(before, after, nbytes, field="@other", transport="http") == 2 * 4 * 2
    assert not any(dict(labels).get("field") == "my_weights" for _, labels in after)
    assert delta(before, after, "payloadd_read_bytes_total", field=R, transport="http") == 3 * 384
    assert delta(before, after, "payloadd_read_extents_total", field=R, transport="http") == 1
    assert requests_of(after, "/v1/append") - requests_of(before, "/v1/append") == 2
    assert requests_of(after, "/v1/read") - requests_of(before, "/v1/read") == 1
    assert requests_of(after, "/metrics") - requests_of(before, "/metrics") == 1  # the first scrape
    buckets = [
        v
        for (name, labels), v in after.items()
        if name == "payloadd_http_request_duration_seconds_bucket"
        and ("route", "/v1/append") in labels
        and ("status_class", "2xx") in labels
    ]
    assert max(buckets) == requests_of(after, "/v1/append")  # le="+Inf" holds every request


def test_a_large_http_read_counts_once_streamed(observed: Observed) -> None:
    rows = np.full((3000, 48, 8), 7, np.uint8)  # 1,152,000 bytes: streamed in chunks
    with observed.http() as http, observed.client(data_plane=False) as c:
        segs = c.append(R, rows, 0, run="m-big", step=0)
        before = scrape(http)
        got = c.read_field(segs, R, 0, 3000, 0, dtype=np.uint8)
        after = scrape(http)
    np.testing.assert_array_equal(got, rows)
    assert (
        delta(before, after, "payloadd_read_bytes_total", field=R, transport="http") == 3000 * 384
    )


def test_the_served_daemon_exposes_no_created_series(observed: Observed) -> None:
    """``payloadd serve`` turns *_created off: counters read from the store at scrape time
    follow it too (one gauge series more per counter series otherwise)."""
    rows = np.full((10, 48, 8), 1, np.uint8)
    with observed.http() as http, observed.client(data_plane=False) as c:
        segs = c.append(R, rows, 0, run="m-created", step=0)
        c.read_field(segs, R, 0, 10, 0, dtype=np.uint8)
        samples = scrape(http)
    assert value(samples, "payloadd_appends_total", transport="http") >= 1
    assert value(samples, "payloadd_read_bytes_total", field=R, transport="http") >= 3840
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_data_plane_appends_count_from_notes_and_reservations(observed: Observed) -> None:
    with observed.http() as http:
        before = scrape(http)
        with observed.client(data_plane=True) as c:
            for i in range(3):  # lease appends: the client reports them in notes
                c.append(R, np.zeros((2, 48, 8), np.uint8), 2 * i, run="m-dp", step=0)
            c.append("my_weights", np.zeros((4, 3), np.float32), 0, run="m-dp", step=0)
            big = np.zeros((3000, 48, 8), np.uint8)  # above max_file_bytes: a reservation
            segs = c.append(R, big, 100, run="m-dp", step=1)
            assert len(segs) == 2  # split over two files
            c.stats()  # sends the note of the lease appends, and waits for it to count
            got = c.read_field(segs, R, 100, 3100, 0, dtype=np.uint8)  # by descriptor
            np.testing.assert_array_equal(got, big)
            mid = scrape(http)
        after = scrape(http)
    rows, nbytes = "payloadd_appended_rows_total", "payloadd_appended_bytes_total"
    dp = "data_plane"
    assert delta(before, mid, "payloadd_appends_total", transport=dp) == 5
    assert delta(before, mid, rows, field=R, transport=dp) == 6 + 3000
    assert delta(before, mid, nbytes, field=R, transport=dp) == (6 + 3000) * 384
    assert delta(before, mid, rows, field="@other", transport=dp) == 4
    assert delta(before, mid, nbytes, field="@other", transport=dp) == 4 * 3 * 4
    assert delta(before, mid, "payloadd_appends_total", transport="http") == 0
    # what the daemon sees of the data plane: requests, leases and descriptors, not read bytes
    assert delta(before, mid, "payloadd_dataplane_leases_total", field=R) == 1
    assert delta(before, mid, "payloadd_dataplane_leases_total", field="@other") == 1
    assert delta(before, mid, "payloadd_dataplane_leased_bytes_total", field=R) >= 6 * 384
    kinds = {
        k: delta(before, mid, "payloadd_dataplane_request_duration_seconds_count", kind=k)
        for k in ("lease", "reserve", "commit", "open", "note")
    }
    # the big append asks for a lease first, is told it is too large, then reserves
    assert kinds["lease"] == 3 and kinds["reserve"] == 1 and kinds["commit"] == 1
    too_large = {"error": "PayloadTooLargeError", "transport": dp}
    assert delta(before, mid, "payloadd_errors_total", **too_large) == 1
    assert kinds["open"] == 1 and kinds["note"] >= 1
    fds = "payloadd_dataplane_fds_total"
    assert delta(before, mid, fds, mode="write", field=R) == 1 + 2  # a lease, a reservation's 2
    assert delta(before, mid, fds, mode="read", field=R) == 2  # the two files of the big append
    assert delta(before, mid, "payloadd_read_bytes_total", field=R, transport="http") == 0
    assert value(mid, "payloadd_dataplane_connections") >= 1
    assert value(mid, "payloadd_dataplane_leases_active") >= 2
    assert value(after, "payloadd_dataplane_leases_active") == 0  # closed with its connection


def _note(path: str, note: NoteRequest) -> None:
    """Send one note on the data socket, as a client of any version would, and wait for it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        frame = msgspec.msgpack.encode(note)
        s.sendall(FRAME_PREFIX.pack(len(frame)) + frame)
        (n,) = FRAME_PREFIX.unpack(s.recv(FRAME_PREFIX.size, socket.MSG_WAITALL))
        assert isinstance(msgspec.msgpack.decode(s.recv(n, socket.MSG_WAITALL)), list)


def test_note_rows_not_split_by_field_count_as_other(observed: Observed) -> None:
    path = f"{observed.socket}{DATA_SOCKET_SUFFIX}"
    rows, nbytes = "payloadd_appended_rows_total", "payloadd_appended_bytes_total"
    with observed.http() as http:
        before = scrape(http)
        _note(path, NoteRequest(2, 5, 100, ack=True))  # an older client: totals only
        _note(path, NoteRequest(1, 4, 80, ack=True, fields=[(M, 3, 60)]))
        after = scrape(http)
    assert delta(before, after, "payloadd_appends_total", transport="data_plane") == 3
    assert delta(before, after, rows, field="@other", transport="data_plane") == 5 + 1
    assert delta(before, after, nbytes, field="@other", transport="data_plane") == 100 + 20
    assert delta(before, after, rows, field=M, transport="data_plane") == 3
    assert delta(before, after, nbytes, field=M, transport="data_plane") == 60


def test_errors_are_counted_by_class_and_route_template(observed: Observed) -> None:
    missing = PayloadSegment(
        R, "obs/none/0/routed_experts-00000000-000001.bin", 0, 0, 1, "uint8", [8]
    )
    errors = "payloadd_errors_total"
    with observed.http() as http:
        before = scrape(http)
        r = http.post("/v1/read", json={"extents": [[missing.file, 0, 8, 8]]})
        assert r.status_code == 404
        assert http.post("/v1/read", content=b"{", headers={"content-type": "application/json",
                         "content-length": "1"}).status_code == 400  # fmt: skip
        assert http.get("/no/such/path").status_code == 404
        assert http.post("/v1/stats").status_code == 405
        assert http.delete("/v1/admin/runs/x").status_code == 401  # no token
        with observed.client(data_plane=True) as c, pytest.raises(FileMissingError):
            c.read_field([missing], R, 0, 1, 0)
        with observed.client(data_plane=False) as c:
            report = c.delete_run("m-nothing-here")
            assert report.files == 0
        after = scrape(http)
    assert delta(before, after, errors, error="FileMissingError", transport="http") == 1
    assert delta(before, after, errors, error="InvalidRequestError", transport="http") == 1
    assert delta(before, after, errors, error="HTTPError", transport="http") == 2  # 404, 405
    assert delta(before, after, errors, error="UnauthorizedError", transport="http") == 1
    assert delta(before, after, errors, error="FileMissingError", transport="data_plane") == 1
    assert requests_of(after, "/v1/read", "4xx") - requests_of(before, "/v1/read", "4xx") == 2
    assert requests_of(after, "unmatched", "4xx") - requests_of(before, "unmatched", "4xx") == 1
    assert requests_of(after, "/v1/stats", "4xx") - requests_of(before, "/v1/stats", "4xx") == 1
    run_route = "/v1/admin/runs/{run}"  # the template, never the raw path
    assert requests_of(after, run_route, "4xx") - requests_of(before, run_route, "4xx") == 1
    assert requests_of(after, run_route) - requests_of(before, run_route) == 1
    assert not any("m-nothing-here" in str(labels) for _, labels in after)


def test_gc_counts_runs_files_and_bytes_by_rule(observed: Observed) -> None:
    with observed.http() as http, observed.client(data_plane=False) as c:
        for step in range(3):
            c.append(R, np.zeros((step + 1, 48, 8), np.uint8), 0, run="m-gc", step=step)
        before = scrape(http)
        assert c.gc(run="m-gc", through_step=1, dry_run=True).files == 2
        dry = scrape(http)
        watermark = c.gc(run="m-gc", through_step=1)
        gone = c.delete_run("m-gc")
        after = scrape(http)
    assert delta(before, dry, "payloadd_gc_runs_total", trigger="call") == 0  # a dry run
    assert delta(before, dry, "payloadd_gc_removed_files_total", rule="watermark") == 0
    assert watermark.files == 2 and watermark.bytes == (1 + 2) * 384
    assert gone.files == 1 and gone.bytes == 3 * 384
    assert delta(before, after, "payloadd_gc_runs_total", trigger="call") == 2
    files, nbytes = "payloadd_gc_removed_files_total", "payloadd_gc_removed_bytes_total"
    assert delta(before, after, files, rule="watermark") == 2
    assert delta(before, after, nbytes, rule="watermark") == 3 * 384
    assert delta(before, after, files, rule="run") == 1
    assert delta(before, after, nbytes, rule="run") == 3 * 384
    assert delta(before, after, "payloadd_gc_removed_dirs_total") == watermark.dirs + gone.dirs
    assert value(after, "payloadd_gc_runs_total", trigger="sweep") == 1  # the one at start
    last = value(after, "payloadd_gc_last_run_timestamp_seconds", trigger="call")
    assert last >= value(after, "payloadd_gc_last_run_timestamp_seconds", trigger="sweep") > 0


def test_metrics_over_tcp_need_the_token(observed: Observed) -> None:
    with httpx.Client(base_url=observed.url) as tcp, observed.http() as unix:
        before = scrape(unix)
        refused = tcp.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"] == "UnauthorizedError"
        assert HEX16.fullmatch(refused.headers["x-request-id"])
        scrape(tcp, headers={"Authorization": f"Bearer {TOKEN}"})
        after = scrape(unix)  # no token over the Unix socket
    errors = "payloadd_errors_total"
    assert delta(before, after, errors, error="UnauthorizedError", transport="http") == 1
    assert requests_of(after, "/metrics", "4xx") - requests_of(before, "/metrics", "4xx") == 1


def test_gauges_match_the_root_on_disk(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    flags = ("--node", "g", "--data-plane", "false", "--max-root-bytes", str(1 << 30))
    with daemons.run(*flags, socket=sock), PayloadClient(sock) as c:
        segs = c.append(R, np.ones((10, 48, 8), np.uint8), 0, run="g", step=0)
        c.append(M, np.ones((5, 9), np.int32), 0, run="g", step=0)
        c.read_field(segs, R, 0, 10, 0)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d") as h:
            got = scrape(h)
        st = os.statvfs(tmp_path)
    sizes = [p.stat().st_size for p in (tmp_path / "root" / "g").rglob("*.bin")]
    assert value(got, "payloadd_root_bytes") == sum(sizes) == 10 * 384 + 5 * 9 * 4
    free = st.f_bavail * st.f_frsize  # other writers on this machine move it a little
    assert abs(value(got, "payloadd_free_bytes") - free) < max(256 << 20, free // 100)
    assert value(got, "payloadd_max_root_bytes") == 1 << 30
    assert value(got, "payloadd_min_free_bytes") == 1 << 30
    assert value(got, "payloadd_files_open_for_append") == 2
    assert value(got, "payloadd_open_files", use="append") == 2
    assert value(got, "payloadd_open_files", use="read_cache") == 1
    assert value(got, "payloadd_appends_refused_total") == 0
    assert value(got, "payloadd_uptime_seconds") > 0
    assert value(got, "payloadd_build_info", node="g", version="0.1.0") == 1
    assert value(got, "process_open_fds") >= 3
    assert ("payloadd_dataplane_connections", frozenset()) not in got  # no data plane


def _log_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # every line is JSON


def test_json_log_lines_carry_the_request_id_the_answer_showed(observed: Observed) -> None:
    with observed.http() as http, observed.client(data_plane=False) as c:
        c.append(R, np.zeros((1, 48, 8), np.uint8), 0, run="m-log", step=0)
        r = http.post(
            "/v1/admin/gc",
            json={"run": "m-log", "through_step": 0},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert HEX16.fullmatch(rid)
        http.get("/healthz")  # the access line of the gc call is written by now
    lines = _log_lines(observed.log)
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any(line["logger"] == "uvicorn.error" for line in lines)  # uvicorn's lines too
    mine = [line for line in lines if line.get("request_id") == rid]
    by_logger = {str(line["logger"]): line for line in mine}
    # the GC logs from a worker thread: the id goes along
    assert by_logger["payloadd.gc"]["message"] == "gc watermark: run m-log, steps 0..0"
    access = by_logger["payloadd.access"]
    assert access["route"] == "/v1/admin/gc" and access["status"] == 200
    assert access["level"] == "INFO" and isinstance(access["duration_s"], float)


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [("trace-42.a:b", True), ("0" * 64, True), ("0" * 65, False), ("a b", False), ("", False)],
)
def test_a_sane_request_id_is_echoed_and_others_replaced(
    observed: Observed, sent: str, echoed: bool
) -> None:
    with observed.http() as http:
        r = http.get("/healthz", headers={"X-Request-ID": sent})
    assert r.status_code == 200
    got = r.headers["x-request-id"]
    assert got == sent if echoed else HEX16.fullmatch(got)


def test_text_logs_carry_the_request_id_and_uvicorn_follows(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock, log = tmp_path / "s.sock", tmp_path / "log"
    with (
        open(log, "wb") as err,
        daemons.run("--access-log", "true", socket=sock, log_level="info", stderr=err),
        httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d") as h,
    ):
        rid = h.get("/v1/stats", headers={"X-Request-ID": "text-1"}).headers["x-request-id"]
    text = log.read_text()
    assert rid == "text-1"
    assert "INFO uvicorn.error: Application startup complete." in text
    assert re.search(r"^INFO payloadd.access: GET /v1/stats -> 200 in [0-9.]+ ms, \d+ bytes "
                     r"sent \[request text-1\]$", text, re.M), text  # fmt: skip


def test_a_path_with_a_newline_cannot_forge_an_access_log_line(
    tmp_path: Path, daemons: Daemons
) -> None:
    sock, log = tmp_path / "s.sock", tmp_path / "log"
    forged = "/v1/none%0AERROR%20payloadd:%20forged%0D%1B[2J%E2%80%A8x"  # decoded by the server
    with (
        open(log, "wb") as err,
        daemons.run("--access-log", "true", socket=sock, log_level="info", stderr=err),
        httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d") as h,
    ):
        assert h.get(forged, headers={"X-Request-ID": "forge-1"}).status_code == 404
        h.get("/healthz")  # the access line of the first request is written by now
    lines = log.read_text().splitlines()
    assert not any(line.startswith("ERROR payloadd: forged") for line in lines), lines
    mine = [line for line in lines if line.endswith("[request forge-1]")]
    assert mine == [
        "INFO payloadd.access: GET /v1/none\\nERROR payloadd: forged\\r\\x1b[2J\\u2028x -> 404 "
        + mine[0].split(" -> 404 ")[1]
    ], lines


def test_notes_with_absurd_counts_leave_stats_answering(tmp_path: Path, daemons: Daemons) -> None:
    sock = tmp_path / "s.sock"
    huge = 2**63 - 1  # the largest count a note may carry
    with (
        daemons.run(socket=sock),
        httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d") as h,
    ):
        for _ in range(3):  # their sum no longer fits 64 bits
            _note(f"{sock}{DATA_SOCKET_SUFFIX}", NoteRequest(huge, huge, huge, ack=True))
        for accept in ("application/json", "application/msgpack"):
            r = h.get("/v1/stats", headers={"Accept": accept})
            assert r.status_code == 200, r.text
        with PayloadClient(sock, data_plane=False) as c:
            stats = c.stats()
        assert stats.appends == stats.rows_appended == stats.bytes_appended == huge
        assert h.get("/metrics").status_code == 200
