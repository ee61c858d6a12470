"""The fields table: dtypes, widths and unknown fields checked on both transports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from payload_client import AsyncPayloadClient, FieldsTable, InvalidRequestError, PayloadClient
from payloadd.settings._settings import Settings

from ..conftest import TRANSPORTS, Daemons, default_env

TABLE = {
    "routed_experts": {"dtypes": ["uint8", "uint16"], "fill": 0},
    "sampling_mask": {"dtypes": ["int32"], "fill": -1, "max_width": 8},
    "weights": {"dtypes": ["float32"], "fill": 0.25},
}


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A daemon with a custom fields table that refuses unknown fields; its socket."""
    flags = ("--node", "f", "--fields", json.dumps(TABLE), "--unknown-fields", "refuse")
    with Daemons(tmp_path_factory.mktemp("fields")) as d:
        yield d.start(*flags, socket=d.folder / "payloadd.sock").socket


@pytest.fixture(params=TRANSPORTS)
def sc(strict: Path, request: pytest.FixtureRequest) -> Iterator[PayloadClient]:
    with PayloadClient(strict, data_plane=request.param == "data-plane") as c:
        yield c


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A daemon started with no fields table of its own (the default one); its socket."""
    with Daemons(tmp_path_factory.mktemp("default")) as d:
        yield d.start("--node", "d", socket=d.folder / "payloadd.sock", env=default_env()).socket


@pytest.fixture(params=TRANSPORTS)
def dc(default_daemon: Path, request: pytest.FixtureRequest) -> Iterator[PayloadClient]:
    with PayloadClient(default_daemon, data_plane=request.param == "data-plane") as c:
        yield c


def _files(root: Path) -> int:
    return sum(os.path.getsize(Path(d) / f) for d, _, fs in os.walk(root) for f in fs)


def test_default_table(dc: PayloadClient) -> None:
    table = dc.fields()
    assert table.unknown_fields == "refuse"  # unknown fields refused unless allowed
    assert sorted(table.fields) == ["routed_experts", "sampling_mask"]
    assert table.fields["routed_experts"].dtypes == ["uint8", "uint16"]
    assert table.fields["routed_experts"].fill == 0
    assert table.fields["routed_experts"].max_width == 0
    assert table.fields["routed_experts"].ragged is False  # every row dimension fixed
    assert table.fields["routed_experts"].read_dtype == "int32"
    assert table.fields["sampling_mask"].dtypes == ["int32"]
    assert table.fields["sampling_mask"].fill == -1
    assert table.fields["sampling_mask"].max_width == 1 << 16
    assert table.fields["sampling_mask"].ragged is True  # its width may differ
    assert table.fields["sampling_mask"].read_dtype == "int32"


def test_custom_table(sc: PayloadClient) -> None:
    table = sc.fields()
    assert isinstance(table, FieldsTable)
    assert table.unknown_fields == "refuse"
    assert table.fields["weights"].read_dtype == "float32"
    assert table.fields["sampling_mask"].max_width == 8


@pytest.mark.parametrize(
    ("field", "rows", "match"),
    [
        ("routed_experts", np.full((2, 4, 2), 300, np.int64), "got int64"),
        ("routed_experts", np.zeros((2, 4, 2), np.int32), "takes dtype uint8 or uint16"),
        ("sampling_mask", np.zeros((2, 9), np.int32), "at most 8 wide, got 9"),
        ("sampling_mask", np.zeros((2, 4), np.int16), "takes dtype int32"),
        ("weights", np.zeros((2, 1), np.float16), "takes dtype float32"),
        ("other", np.zeros((2, 1), np.int32), "unknown field 'other'"),
    ],
)
def test_refused_loses_nothing(
    sc: PayloadClient, strict: Path, field: str, rows: np.ndarray, match: str
) -> None:
    root = strict.parent / "root"
    before = _files(root)
    ok = np.ones((1, 2), np.int32)
    with pytest.raises(InvalidRequestError, match=match):
        sc.append_many([("sampling_mask", ok, 0), (field, rows, 0)], run="r", step=0)
    assert _files(root) == before  # no partial segment, no reserved bytes


def test_accepted_and_big_endian_stored_little(sc: PayloadClient) -> None:
    ids = np.arange(2 * 4 * 2, dtype=">u2").reshape(2, 4, 2) + 250
    mask = np.arange(24, dtype=">i4").reshape(3, 8)[:, ::2]  # big-endian and non-contiguous
    w = np.array([[0.5], [1.5]], ">f4")
    segs = sc.append_many(
        [("routed_experts", ids, 0), ("sampling_mask", mask, 0), ("weights", w, 0)],
        run="r",
        step=1,
    )
    assert [s[0].dtype for s in segs] == ["uint16", "int32", "float32"]
    flat = [s for group in segs for s in group]
    np.testing.assert_array_equal(sc.read_field(flat, "routed_experts", 0, 2, 0), ids)
    np.testing.assert_array_equal(sc.read_field(flat, "sampling_mask", 0, 3, -1), mask)
    np.testing.assert_array_equal(sc.read_field(flat, "weights", 0, 2, 0.0), w)
    seg = segs[1][0]
    raw = np.fromfile(sc_root(sc) / seg.file, "<i4", seg.rows * 4, offset=seg.offset)
    np.testing.assert_array_equal(raw.reshape(3, 4), mask)


def test_float_field_reads_float32_and_table_fills_uncovered_positions(sc: PayloadClient) -> None:
    table = sc.fields().fields
    w = np.array([[np.nan, 1.5], [np.inf, -np.inf]], np.float32)
    mask = np.array([[3, 4]], np.int32)
    # a run of its own: "weights" rows are [2] here, and run "r" fixed them at [1]
    segs = sc.append_many([("weights", w, 1), ("sampling_mask", mask, 2)], run="floats", step=2)
    flat = [s for group in segs for s in group]
    got, covered = sc.read_field(flat, "weights", 0, 4, table["weights"].fill, coverage=True)
    want = np.full((4, 2), 0.25, np.float32)
    want[1:3] = w
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)  # NaN where NaN was stored, inf kept
    assert covered.tolist() == [False, True, True, False]
    got = sc.read_field(flat, "sampling_mask", 0, 4, table["sampling_mask"].fill)
    np.testing.assert_array_equal(got, [[-1, -1], [-1, -1], [3, 4], [-1, -1]])


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_async_clients_check_the_table_too(strict: Path, transport: str) -> None:
    async with AsyncPayloadClient(strict, data_plane=transport == "data-plane") as c:
        with pytest.raises(InvalidRequestError, match="at most 8 wide, got 9"):
            await c.append("sampling_mask", np.zeros((1, 9), np.int32), 0, run="a", step=0)
        with pytest.raises(InvalidRequestError, match="takes dtype uint8 or uint16"):
            await c.append("routed_experts", np.zeros((1, 2), np.int8), 0, run="a", step=0)
        (seg,) = await c.append("sampling_mask", np.ones((1, 8), ">i4"), 0, run="a", step=0)
        got = await c.read_field([seg], "sampling_mask", 0, 2, -1)
        np.testing.assert_array_equal(got, [[1] * 8, [-1] * 8])


def sc_root(sc: PayloadClient) -> Path:
    return Path(sc.stats().root)


def test_settings_refuse_bad_tables() -> None:
    with pytest.raises(ValueError, match="mix integer and float"):
        Settings(fields={"x": {"dtypes": ["int32", "float32"]}})
    with pytest.raises(ValueError, match="not among"):
        Settings(fields={"x": {"dtypes": ["int64"]}})
    with pytest.raises(ValueError, match="fill must be an integer"):
        Settings(fields={"x": {"dtypes": ["int32"], "fill": 0.5}})
    with pytest.raises(ValueError, match="field name"):
        Settings(fields={"a/b": {"dtypes": ["int32"]}})
    with pytest.raises(ValueError, match="JSON object"):
        Settings(fields="{nope")
    with pytest.raises(ValueError, match="finite"):  # JSON has no NaN: GET /v1/fields would lie
        Settings(fields='{"x": {"dtypes": ["float32"], "fill": NaN}}')
    with pytest.raises(ValueError, match="finite"):
        Settings(fields={"x": {"dtypes": ["float16"], "fill": float("-inf")}})
    with pytest.raises(ValueError, match="fit int32"):
        Settings(fields={"x": {"dtypes": ["uint8"], "fill": 2**31}})
    with pytest.raises(ValueError, match="fit float32"):
        Settings(fields={"x": {"dtypes": ["float32"], "fill": 1e39}})
    for dtype in ("int32", "float32"):  # an integer no float holds
        with pytest.raises(ValueError, match=f"fit {dtype}"):
            Settings(fields=f'{{"x": {{"dtypes": ["{dtype}"], "fill": 1{"0" * 400}}}}}')
    with pytest.raises(ValueError, match="not a boolean"):
        Settings(fields={"x": {"dtypes": ["int32"], "fill": True}})
    with pytest.raises(ValueError, match="not a boolean"):
        Settings(fields={"x": {"dtypes": ["int32"], "max_width": True}})
    with pytest.raises(ValueError, match="max_width"):  # more than msgpack carries
        Settings(fields={"x": {"dtypes": ["int32"], "max_width": 2**64}})
    assert Settings(fields={"x": {"dtypes": ["int32"], "fill": -(2**31)}}).fields["x"].fill < 0
    s = Settings(fields=json.dumps(TABLE), unknown_fields="refuse")
    assert s.fields_table().fields["weights"].read_dtype == "float32"


BAD_TABLES = [
    "{nope",
    "",
    "null",
    "[]",
    '{"x": {"dtypes": ["float32"], "fill": NaN}}',
    '{"x": {"dtypes": ["int32"], "fill": true}}',
    '{"x": {"dtypes": ["int32"], "max_width": 100000000000000000000000}}',
]


@pytest.mark.parametrize(
    ("source", "table"), [("env", t) for t in BAD_TABLES] + [("flag", t) for t in BAD_TABLES[::4]]
)
def test_serve_exits_2_naming_a_bad_fields_table(tmp_path: Path, source: str, table: str) -> None:
    cmd = [sys.executable, "-m", "payloadd", "serve", "--root", str(tmp_path / "r")]
    cmd += ["--socket", str(tmp_path / "s")]
    env = dict(os.environ)
    if source == "flag":
        cmd += ["--fields", table]
    else:
        env["PAYLOADD_FIELDS"] = table
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"payloadd serve started with fields {table!r}")
    assert out.returncode == 2, out.stderr
    assert "invalid settings" in out.stderr and "fields" in out.stderr
    assert "Traceback" not in out.stderr
