"""Through a real daemon on a real Unix socket: round trips, windows, errors, the OpenAPI document."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payload_client import (
    FileMissingError,
    InvalidRequestError,
    PayloadClient,
    PayloadTooLargeError,
    SegmentFileError,
    Window,
    clip_segments,
    shift_segments,
)
from payload_client.transports.dataplane import _descriptors
from payload_client.transports.dataplane._steps import Exchange
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import APPEND_CONTENT_TYPE, AppendItem, AppendRequest
from tests.conftest import Daemon
from tests.reference import dense_read

R, M = "routed_experts", "sampling_mask"
rng = np.random.default_rng(1234)


@pytest.fixture
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    """Raw HTTP to the daemon, for requests the client would never send."""
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://d"
    ) as c:
        yield c


@pytest.mark.parametrize(
    ("dtype", "shape", "high"),
    [("uint8", (48, 8), 256), ("uint16", (48, 8), 65536), ("int32", (64,), 2**31 - 1),
     ("int8", (3,), 127), ("int16", (2, 2), 32767)],
)  # fmt: skip
def test_round_trip_integer_fields(client: PayloadClient, dtype: str, shape: tuple[int, ...],
                                   high: int) -> None:  # fmt: skip
    rows = rng.integers(0, high, (37, *shape)).astype(dtype)
    fld = "f"  # a field of the tests' table taking every integer dtype
    run = f"rt-{dtype}"  # a run per row shape: its first append fixes it
    segs = client.append(fld, rows, 100, run=run, step=1)
    assert len(segs) == 1 and segs[0].pos == 100 and segs[0].rows == 37 and segs[0].dtype == dtype
    got = client.read_field(segs, fld, 100, 137, 0)
    assert got is not None and got.dtype == np.int32 and got.shape == (37, *shape)
    np.testing.assert_array_equal(got, rows.astype(np.int32))


def test_float_field_reads_as_float32(client: PayloadClient, run_name: str) -> None:
    rows = rng.standard_normal((5, 1)).astype(np.float16)
    segs = client.append("weights", rows, 0, run=run_name, step=1)
    got = client.read_field(segs, "weights", 0, 6, 0.5)
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(got[:5], rows.astype(np.float32))
    assert got[5, 0] == 0.5


def test_windows_inside_outside_straddling(client: PayloadClient, run_name: str) -> None:
    rows = rng.integers(0, 128, (20, 48, 8)).astype(np.uint8)
    segs = client.append(R, rows, 50, run=run_name, step=0)
    inside = client.read_field(segs, R, 55, 60, 0)
    assert inside is not None
    np.testing.assert_array_equal(inside, rows[5:10])
    outside = client.read_field(segs, R, 0, 10, 9)
    assert outside is not None and outside.shape == (10, 48, 8) and (outside == 9).all()
    straddle = client.read_field(segs, R, 45, 55, 3)
    assert straddle is not None
    assert (straddle[:5] == 3).all()
    np.testing.assert_array_equal(straddle[5:], rows[:5])
    tail = client.read_field(segs, R, 68, 75, 3)
    assert tail is not None
    np.testing.assert_array_equal(tail[:2], rows[18:])
    assert (tail[2:] == 3).all()


def test_ragged_widths_later_wins_absent_field_and_empty_window(
    client: PayloadClient, run_name: str
) -> None:
    wide = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    narrow = np.array([[70, 71]], dtype=np.int32)
    a, b = client.append_many([(M, wide, 10), (M, narrow, 12)], run=run_name, step=0)
    segs = a + b
    got = client.read_field(segs, M, 9, 15, -1)
    assert got is not None
    expected = np.full((6, 6), -1, np.int32)
    expected[1:5] = wide
    expected[3] = [70, 71, -1, -1, -1, -1]  # the later, narrower row wins whole
    np.testing.assert_array_equal(got, expected)
    assert client.read_field(segs, R, 0, 10, 0) is None
    empty = client.read_field(segs, M, 11, 11, -1)
    assert empty is not None and empty.shape == (0, 6)
    only_narrow = client.read_field(b, M, 12, 13, -1)
    assert only_narrow is not None and only_narrow.shape == (1, 2)


def test_byte_order_and_layout_are_normalised(
    client: PayloadClient, daemon: Daemon, run_name: str
) -> None:
    big = np.arange(12, dtype=">u2").reshape(4, 3)
    strided = np.arange(40, dtype=np.int32).reshape(4, 10)[:, ::3]  # not contiguous
    (s1,), (s2,) = client.append_many([(R, big, 0), (M, strided, 0)], run=run_name, step=0)
    assert (daemon.root / s1.file).read_bytes()[s1.offset : s1.offset + 24] == big.astype(
        "<u2"
    ).tobytes()
    np.testing.assert_array_equal(client.read_field([s1], R, 0, 4, 0), big)
    np.testing.assert_array_equal(client.read_field([s2], M, 0, 4, 0), strided)


def test_read_many_in_one_round_trip(
    client: PayloadClient, monkeypatch: pytest.MonkeyPatch, run_name: str
) -> None:
    monkeypatch.setattr(_descriptors, "TELL_USE_S", 1e9)  # no note of runs in use: counted here
    routed = rng.integers(0, 128, (16, 48, 8)).astype(np.uint8)
    mask = rng.integers(0, 1000, (16, 8)).astype(np.int32)
    (r,), (m,) = client.append_many([(R, routed, 0), (M, mask, 0)], run=run_name, step=0)
    segs = [r, m]
    before = client.stats()
    got = client.read_many(
        [Window(segs, R, 4, 8, 0), Window(segs, M, 5, 9, -1), (segs, "f", 0, 1, 0)]
    )
    after = client.stats()
    if client.data_socket:  # one request for the descriptors of both files, then preads
        assert after.data_plane_requests - before.data_plane_requests == 1
        assert after.data_plane_fds - before.data_plane_fds == 2
        assert after.reads == before.reads
    else:
        assert after.reads == before.reads + 1
    np.testing.assert_array_equal(got[0], routed[4:8])
    np.testing.assert_array_equal(got[1], mask[5:9])
    assert got[2] is None  # a field of the table with no segment in the list
    with pytest.raises(InvalidRequestError, match=r"^window 2: unknown field 'x'"):
        client.read_many(
            [Window(segs, R, 4, 8, 0), Window(segs, M, 5, 9, -1), (segs, "x", 0, 1, 0)]
        )
    now = client.stats()  # refused before any request
    assert (now.reads, now.data_plane_requests) == (after.reads, after.data_plane_requests)


def test_rotation_through_the_daemon(small_daemon: Daemon, run_name: str) -> None:
    with PayloadClient(small_daemon.socket) as c:
        one = c.append(R, np.zeros((10, 48, 8), np.uint8), 0, run=run_name, step=0)  # 3840 <= 4096
        assert len(one) == 1
        rows = rng.integers(0, 128, (25, 48, 8)).astype(np.uint8)  # 9600 bytes > 4096
        segs = c.append(R, rows, 1000, run=run_name, step=0)
        assert len(segs) > 1
        assert [s.pos for s in segs] == list(np.cumsum([1000] + [s.rows for s in segs[:-1]]))
        assert sum(s.rows for s in segs) == 25
        assert all(os.path.getsize(small_daemon.root / s.file) <= 4096 for s in segs)
        np.testing.assert_array_equal(c.read_field(segs, R, 1000, 1025, 0), rows)


def test_files_live_under_node_run_step(client: PayloadClient, daemon: Daemon) -> None:
    (s,) = client.append(R, np.ones((1, 2), np.uint8), 0, run="layout.run-1", step=42)
    assert s.file.startswith("test/layout.run-1/42/")
    assert (daemon.root / s.file).is_file()


def test_stats_and_health(client: PayloadClient, run_name: str) -> None:
    before = client.stats()
    client.append(R, np.ones((3, 2), np.uint8), 0, run=run_name, step=0)
    after = client.stats()
    assert after.appends == before.appends + 1
    assert after.rows_appended == before.rows_appended + 3
    assert after.bytes_appended == before.bytes_appended + 6
    assert after.node == "test"
    assert client.health().status == "ok"


# -- bad input: a clear error naming the problem, and the daemon keeps serving -------------


def test_bad_segments_get_clear_errors(
    client: PayloadClient, daemon: Daemon, run_name: str
) -> None:
    (s,) = client.append(R, np.ones((4, 2), np.uint8), 0, run=run_name, step=0)
    missing = msgspec.structs.replace(s, file=f"test/{run_name}/0/never-written.bin")
    with pytest.raises(FileMissingError, match=r"never-written\.bin"):
        client.read_field([missing], R, 0, 1, 0)
    longer = msgspec.structs.replace(s, rows=5)  # the file holds 4 rows
    with pytest.raises(SegmentFileError, match="ends at byte"):
        client.read_field([longer], R, 0, 1, 0)  # even though row 0 is there
    (tmp := daemon.root.parent / "secret.bin").write_bytes(b"secret")
    link = f"link-{'dp' if client.data_socket else 'http'}.bin"
    os.symlink(tmp, daemon.root / "test" / run_name / link)
    escape = msgspec.structs.replace(s, file=f"test/{run_name}/{link}", rows=1, shape=[1])
    with pytest.raises(SegmentFileError, match="outside the payload root"):
        client.read_field([escape], R, 0, 1, 0)
    assert client.health().status == "ok"


def _append_body(items: list[AppendItem], rows: bytes) -> bytes:
    header = msgspec.msgpack.encode(AppendRequest(items))
    return FRAME_PREFIX.pack(len(header)) + header + rows


@pytest.mark.parametrize(
    ("body", "ctype", "status", "match"),
    [
        (_append_body([AppendItem(R, "uint64", [1], 1, 0, "r", 0)], bytes(8)), None, 400, "dtype"),
        (_append_body([AppendItem(R, "uint8", [1], 1, 0, "..", 0)], bytes(1)), None, 400, "run"),
        (_append_body([AppendItem(R, "uint8", [1], 2, 0, "r", 0)], bytes(1)), None, 400, "announces"),
        (_append_body([AppendItem(R, "uint8", [0], 1, 0, "r", 0)], b""), None, 400, "shape"),
        (_append_body([], b""), None, 400, "at least one"),
        (FRAME_PREFIX.pack(5) + b"\xc1\xc1\xc1\xc1\xc1", None, 400, "bad append header"),
        (b"\x01", None, 400, "header"),
        (_append_body([AppendItem(R, "uint8", [1], 1, 0, "r", 0)], b"x"), "application/json", 400, "Content-Type"),
    ],
)  # fmt: skip
def test_bad_append_bodies(http: httpx.Client, body: bytes, ctype: str | None, status: int,
                           match: str) -> None:  # fmt: skip
    r = http.post(
        "/v1/append", content=body, headers={"Content-Type": ctype or APPEND_CONTENT_TYPE}
    )
    assert r.status_code == status, r.text
    err = r.json()
    assert err["error"] == "InvalidRequestError" and match in err["message"]
    assert http.get("/healthz").status_code == 200


def test_negative_and_non_integer_metadata_over_http(http: httpx.Client) -> None:
    for extents in ([["a.bin", -1, 1, 1]], [["a.bin", 0, 1.5, 2]], [["a.bin", 0, True, 1]],
                    [["a.bin", 0, 2**64, 1]]):  # fmt: skip
        r = http.post("/v1/read", json={"extents": extents})
        assert r.status_code == 400 and "extents" in r.json()["message"], r.text
    r = http.post("/v1/read", json={"extents": [["/etc/passwd", 0, 1, 1]]})
    assert r.status_code == 422 and "relative" in r.json()["message"]
    r = http.post("/v1/read", json={"extents": [["test/x/../../y", 0, 1, 1]]})
    assert r.status_code == 422
    r = http.post("/v1/read", json={"extents": [["test/nope.bin", 0, 1, 1]]})
    assert r.status_code == 404 and r.json()["error"] == "FileMissingError"


def test_too_large_body_is_413(small_daemon: Daemon, run_name: str) -> None:
    with PayloadClient(small_daemon.socket) as c:
        with pytest.raises(PayloadTooLargeError, match="above the limit"):
            c.append(R, np.zeros((3000, 48, 8), np.uint8), 0, run=run_name, step=0)
        assert c.health().status == "ok"


def test_openapi_document_is_valid_and_complete(http: httpx.Client) -> None:
    from openapi_spec_validator import validate

    doc = http.get("/openapi.json").json()
    validate(doc)
    assert {"/healthz", "/v1/stats", "/v1/append", "/v1/read"} <= set(doc["paths"])
    append = doc["paths"]["/v1/append"]["post"]
    assert APPEND_CONTENT_TYPE in append["requestBody"]["content"]
    assert append["responses"]["200"]["content"]["application/msgpack"]["schema"]["$ref"].endswith(
        "/AppendResponse"
    )
    assert "507" in append["responses"] and "404" not in append["responses"]
    assert "410" in doc["paths"]["/v1/read"]["post"]["responses"]
    assert "PayloadSegment" in doc["components"]["schemas"]


# -- property: daemon reads equal the dense model, through clip and shift ---------------


W = "weights"
G = "g"  # rows [4, width]: the last dimension ragged, the first fixed (the run's first append)
K = "m"  # rows [width] (sampling_mask takes int32 only): any integer dtypes
PROP_DTYPES: dict[str, list[type[np.generic]]] = {
    R: [np.uint8, np.uint16],  # rows [4, 8], every dimension fixed
    G: [np.uint8, np.uint16],
    K: [np.int32, np.int8],
    W: [np.float32, np.float16],
}
PROP_FILLS: dict[str, int | float] = {R: 0, G: 0, K: -1, W: 0.5}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(
        st.tuples(
            st.sampled_from([R, G, K, W]), st.integers(0, 1), st.integers(0, 6),
            st.integers(0, 30), st.integers(1, 5),
        ),
        min_size=1,
        max_size=6,
    ),
    clip=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    delta=st.integers(0, 20),
    window=st.tuples(st.integers(0, 60), st.integers(0, 15)),
)  # fmt: skip
def test_daemon_reads_match_dense_model(daemon: Daemon, blocks: list[tuple[str, int, int, int, int]],
                                        clip: tuple[int, int], delta: int,
                                        window: tuple[int, int]) -> None:  # fmt: skip
    """Random segment lists (ragged fields of varying widths, a field of fixed rows, dtypes
    mixed within a field), clipped, shifted and read through random windows on both
    transports, equal the dense model."""
    items = []
    for field, which, n, pos, width in blocks:
        shape = {R: (n, 4, 8), G: (n, 4, width)}.get(field, (n, width))
        dtype = PROP_DTYPES[field][which]
        high = 100 if dtype == np.int8 else 250
        items.append((field, rng.integers(0, high, shape).astype(dtype), pos))
    with PayloadClient(daemon.socket) as c, PayloadClient(daemon.socket, data_plane=False) as h:
        segs = [s for group in c.append_many(items, run="prop", step=0) for s in group]
        segs = shift_segments(clip_segments(segs, min(clip), max(clip)), delta)
        files = {s.file: (daemon.root / s.file).read_bytes() for s in segs}
        lo, n = window
        for field, fill in PROP_FILLS.items():
            want = dense_read(files, segs, field, lo, lo + n, fill)
            for reader in (c, h):  # both transports: later segments win, whatever the dtype
                got = reader.read_field(segs, field, lo, lo + n, fill)
                if want is None:
                    assert got is None
                else:
                    assert got is not None and got.shape == want.shape
                    assert got.dtype == want.dtype
                    np.testing.assert_array_equal(got, want)


def test_zero_row_append_is_a_placeholder(client: PayloadClient, run_name: str) -> None:
    (p,) = client.append(M, np.zeros((0, 5), np.int32), 7, run=run_name, step=0)
    assert (p.pos, p.rows, p.shape) == (7, 0, [5])
    got = client.read_field([p], M, 0, 3, -1)
    assert got is not None and got.shape == (3, 5) and (got == -1).all()


def test_unknown_routes_and_methods_get_error_bodies(http: httpx.Client) -> None:
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/read", 405)):
        r = http.request(method, path)
        assert r.status_code == status and r.json()["error"] == "HTTPError"


def test_huge_row_counts_are_refused_before_anything_is_reserved(
    http: httpx.Client, daemon: Daemon
) -> None:
    for rows in (2**63 - 1, 2**42):
        body = _append_body([AppendItem(R, "uint8", [1], rows, 0, "huge", 0)], b"")
        r = http.post("/v1/append", content=body, headers={"Content-Type": APPEND_CONTENT_TYPE})
        assert r.status_code == 400 and "announces" in r.json()["message"]
    assert not (daemon.root / "test" / "huge").exists()


def test_media_types_are_matched_case_insensitively(http: httpx.Client) -> None:
    r = http.post(
        "/v1/read",
        content=b'{"extents": [["test/nope.bin", 0, 1, 1]]}',
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert r.status_code == 404 and "nope.bin" in r.json()["message"]
    body = _append_body([AppendItem(R, "uint8", [1], 1, 0, "r", 0)], b"x")
    r = http.post("/v1/append", content=body, headers={"Content-Type": APPEND_CONTENT_TYPE + "FOO"})
    assert r.status_code == 400


def test_too_many_items_is_413(http: httpx.Client) -> None:
    items = [AppendItem(R, "uint8", [1], 0, 0, "many", 0)] * 65537
    r = http.post("/v1/append", content=_append_body(items, b""),
                  headers={"Content-Type": APPEND_CONTENT_TYPE})  # fmt: skip
    assert r.status_code == 413 and "items" in r.json()["message"]


def test_reads_into_caller_arrays_and_other_dtypes(client: PayloadClient, run_name: str) -> None:
    rows = rng.integers(0, 256, (30, 48, 8)).astype(np.uint8)
    mask = rng.integers(0, 9, (30, 5)).astype(np.int32)
    (r,), (m,) = client.append_many([(R, rows, 10), (M, mask, 10)], run=run_name, step=0)
    stored = client.read_field([r], R, 10, 40, 0, dtype=np.uint8)
    assert stored is not None and stored.dtype == np.uint8
    np.testing.assert_array_equal(stored, rows)
    pinned = np.empty((64, 48, 8), np.int64)  # reused every step; a view per window
    mask_buf = np.full((20, 64), 7, np.int32)
    got = client.read_many(
        [Window([r, m], R, 20, 30, 0, pinned[:10]), Window([r, m], M, 25, 45, -1, mask_buf)]
    )
    assert got[0] is not None and got[0].base is pinned and got[1] is mask_buf
    np.testing.assert_array_equal(pinned[:10], rows[10:20])
    np.testing.assert_array_equal(mask_buf[:15, :5], mask[15:])
    assert (mask_buf[15:] == -1).all() and (mask_buf[:, 5:] == -1).all()


def test_large_http_reads_stream_and_errors_still_come_first(
    daemon: Daemon, http: httpx.Client, run_name: str
) -> None:
    rows = np.random.default_rng(11).integers(0, 256, (9000, 48, 8)).astype(np.uint8)  # 3.5 MB
    with PayloadClient(daemon.socket, data_plane=False) as c:
        segs = c.append_many([(R, rows[:5000], 0), (R, rows[5000:], 5000)], run=run_name, step=0)
        flat = [s for group in segs for s in group]
        before = c.stats()
        got = c.read_field(flat, R, 100, 8900, 0, dtype=np.uint8)
        after = c.stats()
    np.testing.assert_array_equal(got, rows[100:8900])
    assert after.reads == before.reads + 1 and after.bytes_read - before.bytes_read == 8800 * 384
    s = flat[0]
    big = [[s.file, s.offset, 5000 * 384, s.offset + 5000 * 384], ["nope/missing.bin", 0, 1, 1]]
    r = http.post("/v1/read", json={"extents": big})
    assert r.status_code == 404 and "missing.bin" in r.json()["message"]


# -- file paths stay inside the root; request limits ---------------------------------------


def test_symlinked_directories_cannot_lead_out_of_the_root(
    client: PayloadClient, daemon: Daemon
) -> None:
    tag = "dp" if client.data_socket else "http"
    (seg,) = client.append(R, np.full((2, 2), 9, np.uint8), 0, run=f"dirlink-{tag}", step=0)
    outside = daemon.root.parent / f"outside-{tag}"
    outside.mkdir()
    (outside / "x.bin").write_bytes(bytes(64))
    base = daemon.root / "test" / f"dirlink-{tag}"
    os.symlink(outside, base / "out")  # a directory outside the root
    os.symlink("../../..", base / "up")  # a relative link up to the root's parent
    os.symlink(base / "0", base / "in")  # a directory inside the root: fine
    for file in (f"test/dirlink-{tag}/out/x.bin", f"test/dirlink-{tag}/up/outside-{tag}/x.bin"):
        escape = msgspec.structs.replace(seg, file=file)
        with pytest.raises(SegmentFileError, match="outside the payload root"):
            client.read_field([escape], R, 0, 2, 0)
    inside = msgspec.structs.replace(seg, file=f"test/dirlink-{tag}/in/{seg.file.split('/')[-1]}")
    np.testing.assert_array_equal(client.read_field([inside], R, 0, 2, 0), np.full((2, 2), 9))


@pytest.mark.parametrize(
    ("path", "match"),
    [("/etc/passwd", "relative"), ("../secret.bin", "normalised"), ("test/../../x", "normalised"),
     ("test/a\x00.bin", "NUL"), ("test/./a.bin", "normalised"), ("test//a.bin", "normalised"),
     ("./test/a.bin", "normalised"), ("test\\a.bin", "normalised"), ("", "non-empty")],
)  # fmt: skip
def test_file_paths_that_leave_the_root_are_refused_on_both_planes(
    http: httpx.Client, daemon: Daemon, path: str, match: str
) -> None:
    from payload_client.transports import SyncDataPlane
    from payload_client.wire._dataplane import ErrorReply, OpenRequest

    r = http.post("/v1/read", json={"extents": [[path, 0, 1, 1]]})
    assert r.status_code == 422 and r.json()["error"] == "InvalidSegmentError", r.text
    assert match in r.json()["message"]
    dp = SyncDataPlane(f"{daemon.socket}.data", timeout=10.0)
    try:
        reply, fds = dp._exchange(Exchange(OpenRequest([(path, 1)])))
    finally:
        dp.close()
    assert fds == [] and isinstance(reply, ErrorReply), reply
    assert reply.error == "InvalidSegmentError" and match in reply.message


def test_request_limits_answer_413_before_reading_the_body(small_daemon: Daemon) -> None:
    """Content-Length above the limit: 413 at once, though not a byte of the body was sent."""
    for path, ctype, n in (("/v1/append", APPEND_CONTENT_TYPE, (1 << 20) + 1),
                           ("/v1/read", "application/json", (16 << 20) + 1)):  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(30)
            raw.connect(str(small_daemon.socket))
            raw.sendall(
                f"POST {path} HTTP/1.1\r\nHost: d\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {n}\r\n\r\n".encode()
            )
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                answer += raw.recv(1 << 16)  # the JSON error body ends with "}"
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), answer
        assert b"PayloadTooLargeError" in body and f"body of {n} bytes".encode() in body


def test_append_header_and_read_answer_limits_are_413(small_daemon: Daemon, run_name: str) -> None:
    with httpx.Client(
        transport=httpx.HTTPTransport(uds=str(small_daemon.socket)), base_url="http://d"
    ) as http:
        body = FRAME_PREFIX.pack((16 << 20) + 1) + b"\x90" * 16  # a header above 16 MiB
        r = http.post("/v1/append", content=body, headers={"Content-Type": APPEND_CONTENT_TYPE})
        assert r.status_code == 413 and "append header of" in r.json()["message"], r.text
    rows = np.ones((200, 48, 8), np.uint8)  # 75 KiB a call, 1.1 MiB in all: above 1 MiB
    with PayloadClient(small_daemon.socket, data_plane=False) as c:
        segs = [s for i in range(15) for s in c.append(R, rows, 200 * i, run=run_name, step=0)]
        assert c.read_field(segs, R, 0, 2000, 0) is not None  # 750 KiB: within the limit
        with pytest.raises(PayloadTooLargeError, match="above the limit"):
            c.read_field(segs, R, 0, 3000, 0)
        assert c.health().status == "ok"
