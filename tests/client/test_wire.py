"""Wire evolution: Structs only gain trailing defaulted fields, and both sides cope.

For `PayloadSegment` and every Struct of ``payload_client.wire._http`` (and ``_dataplane_wire``, ``_peer_wire``) these tests build a "newer"
version (same name, tag and options, one more trailing field with a default) and check, in
msgpack and JSON, that what the newer version encodes decodes in today's (the extra field is
ignored) and that what today's version encodes decodes in the newer one (the new field takes
its default). `GcRequest` is strict on purpose (see ``docs/http-api.md``, "Wire evolution"):
it refuses unknown fields instead, and leaves out the fields at their defaults when encoded. The layout of today's Structs is pinned, so a reordered,
renamed, retyped or non-defaulted field fails here.
"""

from __future__ import annotations

import functools
import operator
import os
import socket
import struct
import types
from collections.abc import Callable
from typing import Annotated, Any, Union, get_args, get_origin

import httpx
import msgspec
import numpy as np
import pytest

from payload_client import PayloadSegment
from payload_client.clients import _base as client_base
from payload_client.transports import _call as client_call
from payload_client.transports.dataplane import _socket as client_drivers
from payload_client.wire import _dataplane as dataplane_wire
from payload_client.wire import _http as wire
from payload_client.wire import _peer as peer_wire
from payload_client.wire._dataplane import (
    DATA_SOCKET_SUFFIX,
    AbortRequest,
    CommitReply,
    CommitRequest,
    ErrorReply,
    FieldsReply,
    FieldsRequest,
    LeaseGrant,
    LeaseReply,
    LeaseRequest,
    NoteRequest,
    OpenReply,
    OpenRequest,
    ReservedExtent,
    ReserveReply,
    ReserveRequest,
    ShapesRequest,
)
from payload_client.wire._frames import FRAME_PREFIX
from payload_client.wire._http import (
    APPEND_CONTENT_TYPE,
    MSGPACK_CONTENT_TYPE,
    AppendItem,
    AppendRequest,
    AppendResponse,
    ErrorBody,
    Extent,
    FieldSpec,
    FieldsTable,
    GcCount,
    GcEntry,
    GcReport,
    GcRequest,
    Health,
    Prefetched,
    ReadRequest,
    RunUsage,
    Stats,
    StepUsage,
    Usage,
)
from payload_client.wire._peer import PeerBytes, PeerHello, PeerRead, PeerWelcome
from payloadd.server.framed import _dataplane_requests as daemon_dataplane
from payloadd.server.http import _routes as daemon_app
from tests.conftest import Daemon

EXTRA = "extra_wire_field"
"""Name of the field the newer versions append."""
EXTRA_VALUE = 7
EXTRA_DEFAULT = 0

STRICT: frozenset[type[msgspec.Struct]] = frozenset({GcRequest})
"""Structs that refuse unknown fields, and are encoded without the fields at their defaults
(documented in docs/http-api.md)."""

SEG = PayloadSegment("routed_experts", "n/r/0/f-1.bin", 12, 40, 3, "uint8", [48, 8])
ITEM = AppendItem("routed_experts", "uint8", [48, 8], 3, 40, "r", 2)

EXAMPLES: dict[type[msgspec.Struct], msgspec.Struct] = {
    PayloadSegment: SEG,
    AppendItem: ITEM,
    AppendRequest: AppendRequest([ITEM, ITEM]),
    AppendResponse: AppendResponse([[SEG], [SEG, SEG]]),
    Extent: Extent("n/r/0/f-1.bin", 12, 384, 1164),
    ReadRequest: ReadRequest([Extent("a.bin", 0, 4, 8), Extent("b.bin", 4, 4, 8)]),
    Stats: Stats(
        "n",
        "/root",
        1.5,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
        "interval",
        13,
        14,
        15,
        16,
        17,
        18,
        19,
        20,
        21,
        22,
        23,
        24,
    ),
    Prefetched: Prefetched(2, 4096),
    Health: Health("ok", "n", "1.0", "serving", 7071),
    PeerHello: PeerHello("t" * 32, 2),
    PeerWelcome: PeerWelcome("node-a", 1 << 20, 1 << 30, 1 << 16),
    PeerRead: PeerRead([Extent("a/r/0/f", 0, 10, 10)]),
    PeerBytes: PeerBytes(10),
    ErrorBody: ErrorBody("InvalidRequestError", "bad"),
    GcRequest: GcRequest("r", 3, 60.0, True, "node-b", 2),
    GcCount: GcCount(2, 10),
    GcReport: GcReport(True, 2, 10, 1, {"watermark": GcCount(2, 10)}, 1, [("r", 3)], "no run"),
    OpenRequest: OpenRequest([("a.bin", 8), ("b.bin", 16)]),
    OpenReply: OpenReply(2, [1]),
    ReserveRequest: ReserveRequest([ITEM]),
    ReservedExtent: ReservedExtent(1, 64, 128),
    ReserveReply: ReserveReply(5, ["a.bin", "b.bin"], [ReservedExtent(0, 0, 8)]),
    LeaseRequest: LeaseRequest(
        "r",
        2,
        "routed_experts",
        1536,
        [("r", 2, "sampling_mask", 0)],
        [("n/r/0/routed_experts-1.bin", 0, 4096)],
        [("r", "routed_experts", [48, 8])],
        [("n/r/0/routed_experts-1.bin", 0)],
        [("n/r/0/routed_experts-0.bin", 8192)],
    ),
    LeaseGrant: LeaseGrant(0, "b.bin", 0, 1 << 24),
    LeaseReply: LeaseReply("a.bin", 6, 1 << 24, True, [LeaseGrant(0, "b.bin", 0, 1 << 24)]),
    NoteRequest: NoteRequest(1, 2, 3, True, [("n", "r")], [("f", 2, 3)]),
    CommitRequest: CommitRequest(5),
    AbortRequest: AbortRequest(5),
    CommitReply: CommitReply([[SEG]]),
    ErrorReply: ErrorReply("InvalidRequestError", "bad"),
    FieldSpec: FieldSpec(["uint8", "uint16"], 7, 16, "float32", True),
    FieldsTable: FieldsTable({"f": FieldSpec(["int32"])}, "refuse"),
    FieldsRequest: FieldsRequest(),
    ShapesRequest: ShapesRequest([("r", "sampling_mask", [4, 8])]),
    FieldsReply: FieldsReply(FieldsTable({"f": FieldSpec(["int32"], -1, 8)}, "refuse"), True),
    StepUsage: StepUsage(3, 2, 1616, 8192, 1.5e9),
    RunUsage: RunUsage("r", 4, 3232, 16384, 1.5e9, [StepUsage(3, 2, 1616, 8192, 1.5e9)], 1),
    GcEntry: GcEntry(1.5e9, "watermark", "r", [0, 1], 2, 3072),
    Usage: Usage(
        "n",
        "/root",
        1.6e9,
        5,
        4000,
        20480,
        3,
        [RunUsage("r", 4, 3232, 16384, 1.5e9, [], 2)],
        1,
        2,
        50,
        100,
        1000,
        10,
        [GcEntry(1.5e9, "run", "r", [0], 1, None)],
        7,
        176,
    ),
}
"""One instance of every wire Struct, every field away from its default."""

NNI = "Annotated[int, msgspec.Meta(ge=0, le=9223372036854775807)]"
LAYOUT: dict[str, list[str]] = {
    "PayloadSegment": [
        "field: str",
        "file: str",
        "offset: int",
        "pos: int",
        "rows: int",
        "dtype: str",
        "shape: list[int]",
    ],
    "AppendItem": [
        "field: str",
        "dtype: str",
        "shape: list[int]",
        f"rows: {NNI}",
        f"pos: {NNI}",
        "run: str",
        f"step: {NNI}",
    ],
    "AppendRequest": ["items: list[AppendItem]"],
    "AppendResponse": ["segments: list[list[PayloadSegment]]"],
    "Extent": ["file: str", f"offset: {NNI}", f"nbytes: {NNI}", f"end: {NNI}"],
    "ReadRequest": ["extents: list[Extent]"],
    "Stats": [
        "node: str",
        "root: str",
        "uptime_s: float",
        "appends: int",
        "rows_appended: int",
        "bytes_appended: int",
        "reads: int",
        "bytes_read: int",
        "files_open_for_append: int",
        "max_file_bytes: int",
        "data_plane_requests: int = 0",
        "data_plane_fds: int = 0",
        "leases: int = 0",
        "leased_bytes: int = 0",
        "fsync: str = ''",
        "flushes: int = 0",
        "files_flushed: int = 0",
        "files_dirty: int = 0",
        "flush_errors: int = 0",
        "root_bytes: int = 0",
        "max_root_bytes: int = 0",
        "free_bytes: int = 0",
        "min_free_bytes: int = 0",
        "appends_refused: int = 0",
        "prefetches: int = 0",
        "bytes_prefetched: int = 0",
        "reserved_bytes: int = 0",
    ],
    "Prefetched": ["files: int", "bytes: int"],
    "Health": [
        "status: str",
        "node: str",
        "version: str",
        "data_plane: str = ''",
        "peer_port: int = 0",
    ],
    "PeerHello": ["token: str", "version: int = 1"],
    "PeerWelcome": ["node: str", "max_frame: int", "max_read_bytes: int", "max_extents: int"],
    "PeerRead": ["extents: list[Extent]"],
    "PeerBytes": ["nbytes: int"],
    "ErrorBody": ["error: str", "message: str"],
    "GcRequest": [
        "run: str | None = None",
        "through_step: Optional[Annotated[int, msgspec.Meta(ge=0, le=9223372036854775807)]] = None",
        "ttl_s: Optional[Annotated[float, msgspec.Meta(ge=0)]] = None",
        "dry_run: bool = False",
        "node: str | None = None",
        # the watermark was renamed through_step (it always included its step); the old
        # name stays only to be refused with a message naming the new one
        "before_step: Optional[Annotated[int, msgspec.Meta(ge=0, le=9223372036854775807)]] = None",
    ],
    "GcCount": ["files: int = 0", "bytes: int = 0"],
    "GcReport": [
        "dry_run: bool",
        "files: int = 0",
        "bytes: int = 0",
        "dirs: int = 0",
        "by_reason: dict[str, GcCount] = dict()",
        "in_use: int = 0",
        "steps: list[tuple[str, int]] = list()",
        "note: str = ''",
    ],
    "OpenRequest": [f"files: list[tuple[str, {NNI}]]"],
    "OpenReply": ["count: int", "read_once: list[int] = list()"],
    "ReserveRequest": ["items: list[AppendItem]"],
    "ReservedExtent": ["file: int", "offset: int", "nbytes: int"],
    "ReserveReply": ["txn: int", "files: list[str]", "extents: list[ReservedExtent]"],
    "LeaseRequest": [
        "run: str",
        f"step: {NNI}",
        "field: str",
        f"nbytes: {NNI}",
        f"more: list[tuple[str, {NNI}, str, {NNI}]] = list()",
        f"done: list[tuple[str, {NNI}, {NNI}]] = list()",
        "shapes: list[tuple[str, str, list[int]]] = list()",
        f"writing: list[tuple[str, {NNI}]] = list()",
        f"written: list[tuple[str, {NNI}]] = list()",
    ],
    "LeaseGrant": ["index: int", "file: str", "offset: int", "nbytes: int"],
    "LeaseReply": [
        "file: str",
        "offset: int",
        "nbytes: int",
        "fsync: bool",
        "more: list[LeaseGrant] = list()",
    ],
    "NoteRequest": [
        f"appends: {NNI}",
        f"rows: {NNI}",
        f"nbytes: {NNI}",
        "ack: bool = False",
        "runs: list[tuple[str, str]] = list()",
        f"fields: list[tuple[str, {NNI}, {NNI}]] = list()",
    ],
    "CommitRequest": ["txn: int"],
    "AbortRequest": ["txn: int"],
    "CommitReply": ["segments: list[list[PayloadSegment]]"],
    "ErrorReply": ["error: str", "message: str"],
    "FieldSpec": [
        "dtypes: list[str]",
        "fill: int | float = 0",
        "max_width: int = 0",
        "read_dtype: str = 'int32'",
        "ragged: bool | None = None",
    ],
    "FieldsTable": [
        "fields: dict[str, FieldSpec]",
        "unknown_fields: Literal['allow', 'refuse'] = 'allow'",
    ],
    "FieldsRequest": [],
    "ShapesRequest": ["shapes: list[tuple[str, str, list[int]]]"],
    "FieldsReply": ["table: FieldsTable", "generation: bool = False"],
    "StepUsage": ["step: int", "files: int", "bytes: int", "disk_bytes: int", "mtime: float"],
    "RunUsage": [
        "run: str",
        "files: int",
        "bytes: int",
        "disk_bytes: int",
        "mtime: float",
        "steps: list[StepUsage]",
        "more_steps: int = 0",
    ],
    "GcEntry": [
        "at: float",
        "reason: str",
        "run: str",
        "steps: list[int]",
        "files: int",
        "bytes: int | None = None",
    ],
    "Usage": [
        "node: str",
        "root: str",
        "now: float",
        "files: int",
        "bytes: int",
        "disk_bytes: int",
        "steps: int",
        "runs: list[RunUsage]",
        "more_runs: int",
        "more_steps: int",
        "root_bytes: int",
        "max_root_bytes: int",
        "free_bytes: int",
        "min_free_bytes: int",
        "ledger: list[GcEntry]",
        "ledger_entries: int",
        "ledger_bytes: int",
    ],
}
"""Today's fields of every wire Struct, in order: later versions may only append to these."""

OPTIONS: dict[str, tuple[bool, str | None]] = {
    name: (True, None) for name in ("PayloadSegment", "Extent", "ReservedExtent", "LeaseGrant")
} | {
    "OpenRequest": (True, "open"),
    "OpenReply": (True, "opened"),
    "ReserveRequest": (True, "reserve"),
    "ReserveReply": (True, "reserved"),
    "LeaseRequest": (True, "lease"),
    "LeaseReply": (True, "leased"),
    "NoteRequest": (True, "note"),
    "CommitRequest": (True, "commit"),
    "AbortRequest": (True, "abort"),
    "CommitReply": (True, "committed"),
    "ErrorReply": (True, "error"),
    "FieldsRequest": (True, "fields"),
    "ShapesRequest": (True, "shapes"),
    "FieldsReply": (True, "fieldtable"),
    "PeerHello": (True, "hello"),
    "PeerWelcome": (True, "welcome"),
    "PeerRead": (True, "read"),
    "PeerBytes": (True, "bytes"),
}
"""``(array_like, tag)`` of the Structs that are arrays on the wire; every other is a map."""


def _wire_structs() -> list[type[msgspec.Struct]]:
    found = {
        obj
        for module in (wire, dataplane_wire, peer_wire)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) and obj is not msgspec.Struct
    }
    return sorted(found, key=lambda cls: cls.__name__)


STRUCTS = _wire_structs()
CODECS: dict[str, tuple[Callable[[Any], bytes], Callable[..., Any]]] = {
    "msgpack": (msgspec.msgpack.encode, msgspec.msgpack.decode),
    "json": (msgspec.json.encode, msgspec.json.decode),
}


def _newer_type(tp: Any) -> Any:
    """``tp`` with every wire Struct inside it replaced by its newer version."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return newer(tp) if tp in EXAMPLES else tp
    origin = get_origin(tp)
    if origin is None:
        return tp
    args = get_args(tp)
    if origin is Annotated:
        return Annotated[(_newer_type(args[0]), *args[1:])]
    new_args = tuple(_newer_type(a) for a in args)
    if origin in (Union, types.UnionType):
        return functools.reduce(operator.or_, new_args)
    return origin[new_args]


@functools.cache
def newer(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A later version of ``cls``: same name, tag and options, one more defaulted field."""
    config = cls.__struct_config__
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        default = (
            f.default
            if f.default is not msgspec.NODEFAULT
            else msgspec.field(default_factory=f.default_factory)
            if f.default_factory is not msgspec.NODEFAULT
            else msgspec.NODEFAULT
        )
        if default is msgspec.NODEFAULT:
            fields.append((f.name, _newer_type(f.type)))  # type: ignore[arg-type]
        else:
            fields.append((f.name, _newer_type(f.type), default))
    fields.append((EXTRA, int, EXTRA_DEFAULT))
    return msgspec.defstruct(
        cls.__name__,
        fields,
        tag=config.tag,
        tag_field=config.tag_field,
        array_like=config.array_like,
        forbid_unknown_fields=config.forbid_unknown_fields,
        frozen=config.frozen,
        omit_defaults=config.omit_defaults,
    )


def to_newer(value: Any, extra: int) -> Any:
    """``value`` with every wire Struct in it turned into its newer version, ``extra`` set."""
    if isinstance(value, msgspec.Struct):
        cls = type(value)
        attrs = {f: to_newer(getattr(value, f), extra) for f in cls.__struct_fields__}
        return newer(cls)(**attrs, **{EXTRA: extra})
    if isinstance(value, list):
        return [to_newer(v, extra) for v in value]
    if isinstance(value, tuple):
        return tuple(to_newer(v, extra) for v in value)
    if isinstance(value, dict):
        return {k: to_newer(v, extra) for k, v in value.items()}
    return value


def _layout(cls: type[msgspec.Struct]) -> list[str]:
    out = []
    for f in msgspec.structs.fields(cls):
        text = f"{f.name}: {f.type.__name__ if isinstance(f.type, type) else f.type}"
        for prefix in (
            "typing.",
            "payload_client.wire._http.",
            "payload_client.wire._dataplane.",
            "payload_client.segments._segment.",
        ):
            text = text.replace(prefix, "")
        if f.default is not msgspec.NODEFAULT:
            text += f" = {f.default!r}"
        elif f.default_factory is not msgspec.NODEFAULT:
            text += f" = {f.default_factory.__name__}()"
        out.append(text)
    return out


# -- the inventory -------------------------------------------------------------------------


def test_every_wire_struct_has_an_example_and_a_pinned_layout() -> None:
    names = {cls.__name__ for cls in STRUCTS}
    assert set(EXAMPLES) == {*STRUCTS, PayloadSegment}
    assert set(LAYOUT) == names | {"PayloadSegment"}
    for cls, example in EXAMPLES.items():
        assert type(example) is cls
        for f in msgspec.structs.fields(cls):  # every field away from its default
            assert f.required or getattr(example, f.name) != (
                f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            ), (cls.__name__, f.name)


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_layout_only_grows_at_the_end_with_defaults(cls: type[msgspec.Struct]) -> None:
    """Today's fields stay first, in order, with their names, types and defaults; later
    fields all have defaults; tag and array-ness do not change."""
    pinned = LAYOUT[cls.__name__]
    layout = _layout(cls)
    assert layout[: len(pinned)] == pinned
    later = msgspec.structs.fields(cls)[len(pinned) :]
    assert all(not f.required for f in later), [f.name for f in later if f.required]
    config = cls.__struct_config__
    assert (config.array_like, config.tag) == OPTIONS.get(cls.__name__, (False, None))
    assert config.forbid_unknown_fields == (cls in STRICT)
    assert config.omit_defaults == (cls in STRICT)
    assert all(f.encode_name == f.name for f in msgspec.structs.fields(cls))  # no renaming


# -- both directions, every Struct, both encodings ------------------------------------------


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_newer_peer_decodes_todays_encoding(cls: type[msgspec.Struct], codec: str) -> None:
    encode, decode = CODECS[codec]
    example = EXAMPLES[cls]
    got = decode(encode(example), type=newer(cls))
    assert got == to_newer(example, EXTRA_DEFAULT)  # the new field (everywhere) its default
    assert getattr(got, EXTRA) == EXTRA_DEFAULT


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda c: c.__name__)
def test_today_decodes_a_newer_peers_encoding(cls: type[msgspec.Struct], codec: str) -> None:
    encode, decode = CODECS[codec]
    example = EXAMPLES[cls]
    data = encode(to_newer(example, EXTRA_VALUE))
    raw = decode(data)
    if cls.__struct_config__.array_like:  # one more element on the wire, at the end
        assert len(raw) == len(decode(encode(example))) + 1 and raw[-1] == EXTRA_VALUE
    else:
        assert raw[EXTRA] == EXTRA_VALUE
    if cls in STRICT:
        with pytest.raises(msgspec.ValidationError, match=f"unknown field `{EXTRA}`"):
            decode(data, type=cls)
    else:
        assert decode(data, type=cls) == example


# -- the decoders the daemon and the client really use ------------------------------------

PEER_DECODERS: list[tuple[str, Any, type[msgspec.Struct]]] = [
    ("daemon append header", daemon_app._append_header, AppendRequest),
    ("daemon read msgpack", daemon_app._read_msgpack, ReadRequest),
    ("daemon read json", daemon_app._read_json, ReadRequest),
    ("client append answer", client_base._append_response, AppendResponse),
    ("client error json", client_call._error_json, ErrorBody),
    *[
        ("daemon data plane", daemon_dataplane._decoder, cls)
        for cls in (
            OpenRequest,
            LeaseRequest,
            ReserveRequest,
            CommitRequest,
            AbortRequest,
            NoteRequest,
        )
    ],
    ("daemon note", daemon_dataplane._note_decoder, NoteRequest),
    *[
        ("client data plane", client_drivers._decoder, cls)
        for cls in (OpenReply, LeaseReply, ReserveReply, CommitReply, ErrorReply)
    ],
]


@pytest.mark.parametrize(
    ("decoder", "cls"),
    [(d, c) for _, d, c in PEER_DECODERS],
    ids=[f"{n}-{c.__name__}" for n, _, c in PEER_DECODERS],
)
def test_peer_decoders_take_newer_messages(decoder: Any, cls: type[msgspec.Struct]) -> None:
    """The daemon's and the client's own decoders (tagged unions included) ignore the extra
    trailing fields of a newer peer, at every level."""
    message = to_newer(EXAMPLES[cls], EXTRA_VALUE)
    json = isinstance(decoder, msgspec.json.Decoder)
    data = msgspec.json.encode(message) if json else msgspec.msgpack.encode(message)
    assert decoder.decode(data) == EXAMPLES[cls]


@pytest.mark.parametrize("decoder", [daemon_app._gc_json, daemon_app._gc_msgpack])
def test_daemon_refuses_unknown_gc_fields(decoder: Any) -> None:
    message = to_newer(EXAMPLES[GcRequest], EXTRA_VALUE)
    json = isinstance(decoder, msgspec.json.Decoder)
    data = msgspec.json.encode(message) if json else msgspec.msgpack.encode(message)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        decoder.decode(data)
    # a newer daemon's GcRequest still takes today's body
    assert msgspec.json.decode(msgspec.json.encode(EXAMPLES[GcRequest]), type=newer(GcRequest))


def _gc_request_before_node() -> type[msgspec.Struct]:
    """`GcRequest` as daemons had it before ``node``: four fields, strict."""
    fields = [(f.name, f.type, f.default) for f in msgspec.structs.fields(GcRequest)]
    assert fields[4][0] == "node"
    return msgspec.defstruct("GcRequest", fields[:4], forbid_unknown_fields=True)


@pytest.mark.parametrize("codec", list(CODECS))
def test_an_older_daemon_takes_gc_requests_without_node_and_refuses_node(codec: str) -> None:
    encode, decode = CODECS[codec]
    older = _gc_request_before_node()
    plain = GcRequest("r", 3, None, True)  # fields at their defaults are not sent at all
    assert set(decode(encode(plain))) == {"run", "through_step", "dry_run"}
    assert decode(encode(plain), type=older) == older("r", 3, None, True)
    assert decode(encode(GcRequest()), type=older) == older()
    with pytest.raises(msgspec.ValidationError, match="unknown field `node`"):
        decode(encode(GcRequest("r", 3, node="b")), type=older)


# -- end to end, against a real daemon -------------------------------------------------------


def _http(daemon: Daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.socket)), base_url="http://d")


def test_daemon_takes_a_newer_append_header_and_extent(daemon: Daemon) -> None:
    rows = np.arange(12, dtype=np.uint8).reshape(4, 3)
    item = AppendItem("f", "uint8", [3], 4, 100, "wire-run", 1)  # a field of the table
    header = msgspec.msgpack.encode(to_newer(AppendRequest([item]), EXTRA_VALUE))
    assert EXTRA.encode() in header
    body = FRAME_PREFIX.pack(len(header)) + header + rows.tobytes()
    with _http(daemon) as http:
        r = http.post(
            "/v1/append",
            content=body,
            headers={"Content-Type": APPEND_CONTENT_TYPE, "Accept": MSGPACK_CONTENT_TYPE},
        )
        assert r.status_code == 200, r.text
        [[seg]] = msgspec.msgpack.decode(r.content, type=AppendResponse).segments
        assert (seg.field, seg.pos, seg.rows, seg.dtype, seg.shape) == (
            "f",
            100,
            4,
            "uint8",
            [3],
        )
        # a read whose extent has a fifth, unknown element: ignored, the bytes come back
        extent = [seg.file, seg.offset + 3, 6, seg.offset + 12, "unknown"]
        r = http.post(
            "/v1/read",
            content=msgspec.json.encode({"extents": [extent]}),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 200, r.text
        assert r.content == rows[1:3].tobytes()
        # GcRequest is strict: an unknown field is a 400, nothing is collected
        r = http.post(
            "/v1/admin/gc",
            content=msgspec.json.encode({"dry_run": True, EXTRA: EXTRA_VALUE}),
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400
        assert r.json()["error"] == "InvalidRequestError" and EXTRA in r.json()["message"]


def test_data_plane_takes_a_newer_lease_request(daemon: Daemon) -> None:
    request = to_newer(LeaseRequest("wire-run", 1, "f", 6), EXTRA_VALUE)
    body = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.decode(body)[-1] == EXTRA_VALUE
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(daemon.socket) + DATA_SOCKET_SUFFIX)
        conn.sendall(struct.pack("<I", len(body)) + body)
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 4)
        try:
            (n,) = FRAME_PREFIX.unpack_from(data)
            while len(data) < FRAME_PREFIX.size + n:
                data += conn.recv(FRAME_PREFIX.size + n - len(data))
            reply = msgspec.msgpack.decode(data[FRAME_PREFIX.size :], type=LeaseReply)
            assert reply.nbytes >= 6 and len(fds) == 1
        finally:
            for fd in fds:
                os.close(fd)
