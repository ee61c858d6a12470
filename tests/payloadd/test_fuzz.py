"""Contract fuzzing: schemathesis cases from the served OpenAPI document, against a real daemon.

Every answer must be documented (status and content type), conform to its schema, and none may
be a 5xx. The framed append body is documented as opaque binary, so its cases get bodies from
`framed_bodies`: a u32 length, a msgpack header of items both valid and not, and row bytes of
the announced length or off by a little.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import APPEND_CONTENT_TYPE, MSGPACK_CONTENT_TYPE
from tests.conftest import Daemons

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]

# (method, path) -> examples of valid and of invalid input; the sum is what CI runs. Calls
# without inputs have nothing to negate; the append body is opaque binary to the schema, so
# `framed_bodies` makes its invalid bodies as well as its valid ones.
OPERATIONS: dict[tuple[str, str], tuple[int, int]] = {
    ("GET", "/healthz"): (1, 0),
    ("GET", "/v1/stats"): (1, 0),
    ("GET", "/metrics"): (1, 0),
    ("GET", "/v1/fields"): (1, 0),
    ("POST", "/v1/append"): (200, 0),
    ("POST", "/v1/read"): (60, 60),
    ("POST", "/v1/prefetch"): (60, 60),
    ("POST", "/v1/admin/gc"): (30, 30),
    ("DELETE", "/v1/admin/runs/{run}"): (30, 30),
    ("GET", "/v1/admin/usage"): (10, 10),
    ("DELETE", "/v1/admin/nodes/{node}/runs/{run}"): (30, 30),
}


@schemathesis.serializer(MSGPACK_CONTENT_TYPE)
def _msgpack(ctx: Any, value: Any) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # an integer msgpack cannot hold: such a body cannot be sent
        assume(False)
        raise


@schemathesis.serializer(APPEND_CONTENT_TYPE)
def _framed(ctx: Any, value: Any) -> bytes:
    assert isinstance(value, bytes), "append cases carry bodies from framed_bodies"
    return value


@pytest.fixture(scope="module")
def fuzz_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A daemon of its own (the fuzzer calls GC and deletes runs), reached over raw HTTP."""
    extra = ("--node", "fuzz", "--max-request-bytes", str(1 << 20))
    with Daemons(tmp_path_factory.mktemp("fuzz")) as d:
        transport = httpx.HTTPTransport(uds=str(d.start(*extra).socket))
        with httpx.Client(transport=transport, base_url="http://d") as c:
            yield c


@pytest.fixture(scope="module")
def api(fuzz_http: httpx.Client) -> Any:
    """The schema as the daemon serves it."""
    return schemathesis.openapi.from_dict(fuzz_http.get("/openapi.json").json())


def test_every_served_operation_is_fuzzed(api: Any) -> None:
    served = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert served == set(OPERATIONS)


# -- framed append bodies ----------------------------------------------------------------

DTYPES = ["uint8", "uint16", "int8", "int16", "int32", "float32", "uint64", "float16", "<u2", "x"]
_names = st.sampled_from(["routed_experts", "sampling_mask", "weights", "fz", "..", "", "a/b"])
_small = st.integers(-2, 6)
_item = st.fixed_dictionaries(
    {
        "field": _names,
        "dtype": st.sampled_from(DTYPES),
        "shape": st.lists(_small, max_size=3),
        "rows": st.one_of(_small, st.sampled_from([2**31, 2**63 - 1])),
        "pos": st.one_of(st.integers(-1, 50), st.sampled_from([2**53, 2**63 - 1])),
        "run": st.sampled_from(["fz", "r-1", "..", "", "a/b", "x" * 129]),
        "step": st.one_of(st.integers(-1, 3), st.just(2**63 - 1)),
    }
)
_valid_item = st.fixed_dictionaries(
    {
        "field": st.sampled_from(["routed_experts", "sampling_mask"]),
        "dtype": st.sampled_from(["uint8", "uint16", "int32"]),
        "shape": st.lists(st.integers(1, 6), min_size=1, max_size=2),
        "rows": st.integers(0, 4),
        "pos": st.integers(0, 50),
        "run": st.just("fz"),
        "step": st.integers(0, 3),
    }
)
_odd_item = st.dictionaries(st.sampled_from(["field", "rows", "shape", "extra"]),
                            st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=3)))  # fmt: skip


def _nbytes(items: list[dict[str, Any]]) -> int | None:
    """The row bytes a header announces, if it can be worked out (and is small)."""
    total = 0
    for it in items:
        try:
            size = np.dtype(it["dtype"]).itemsize * int(np.prod(it["shape"])) * it["rows"]
        except (KeyError, TypeError):
            return None
        if size < 0 or size > 1 << 16:
            return None
        total += size
    return total


@st.composite
def framed_bodies(draw: st.DrawFn) -> bytes:
    """Framed append bodies, mostly well framed with valid or invalid items, sometimes not."""
    kind = draw(st.sampled_from(["items", "items", "items", "odd", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=40))
    items: list[dict[str, Any]] = draw(
        st.lists(st.one_of(_valid_item, _item) if kind == "items" else _odd_item, max_size=4)
    )
    header = msgspec.msgpack.encode({"items": items})
    n = _nbytes(items) if kind == "items" else 0
    rows = bytes(draw(st.integers(0, 64)) if n is None else max(0, n + draw(st.integers(-1, 1))))
    return FRAME_PREFIX.pack(len(header)) + header + rows


# -- the fuzzing itself --------------------------------------------------------------------


def _send(http: httpx.Client, case: Any) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url="http://d")
    content = msgspec.json.encode(kw["json"]) if "json" in kw else kw.get("data")
    return http.request(kw["method"], kw["url"], headers=kw.get("headers"),
                        params=kw.get("params"), content=content)  # fmt: skip


def _fuzz(
    api: Any, http: httpx.Client, method: str, path: str, mode: GenerationMode, n: int
) -> set[int]:
    """Run ``n`` cases of one operation; the statuses answered."""
    op: APIOperation[Any, Any, Any, Any] = api[path][method]
    cases = op.as_strategy(generation_mode=mode)
    if path == "/v1/append":
        cases = st.tuples(cases, framed_bodies()).map(lambda cb: _with_body(*cb))

    @settings(max_examples=n, deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=cases)
    def run(case: Any) -> None:
        response = _send(http, case)
        statuses.add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    statuses: set[int] = set()
    run()
    return statuses


def _with_body(case: Any, body: bytes) -> Any:
    case.body = body
    case.media_type = APPEND_CONTENT_TYPE
    return case


RUNS = [(m, p, mode, n) for (m, p), counts in OPERATIONS.items()
        for mode, n in zip((GenerationMode.POSITIVE, GenerationMode.NEGATIVE), counts, strict=True)
        if n]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "mode", "n"), RUNS, ids=lambda v: str(v))
def test_fuzzed_calls_get_documented_answers_and_no_5xx(
    api: Any, fuzz_http: httpx.Client, method: str, path: str, mode: GenerationMode, n: int
) -> None:
    statuses = _fuzz(api, fuzz_http, method, path, mode, n)
    assert fuzz_http.get("/healthz").status_code == 200
    if method == "POST" or mode is GenerationMode.NEGATIVE:  # the cases reach past the checks
        assert any(400 <= s < 500 for s in statuses), statuses
    if mode is GenerationMode.POSITIVE:
        assert 200 in statuses, statuses
