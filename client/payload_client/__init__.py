"""payload_client: segments, their pure operations, and thin clients of the payloadd daemon.

Import what you need from here; the ``_*`` modules are private.

>>> from payload_client import PayloadClient, clip_segments

The package by concern, each importing only those above it::

    _errors       the error tree, rooted at PayloadError
    segments/     the segment model, its pure operations, lists as columns, the codec
    wire/         the wire: Structs of HTTP, the data plane and the peer port; frames; fields
    reads/        window reads: semantics, the planner, the layout of a read's extents, CP
    transports/   one interface, three ways: HTTP, the data plane, the peer port
    clients/      the I/O-free BaseClient, its sync and async shells, the cluster clients

The clients (and `Timeout`) are loaded on first use: an orchestrator that imports segments,
their operations and their codec never loads httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    STATUS_BY_ERROR,
    AppendInDoubtError,
    BusyError,
    ConnectError,
    ConnectionLostError,
    FileGoneError,
    FileMissingError,
    InvalidRequestError,
    InvalidSegmentError,
    PayloadError,
    PayloadTooLargeError,
    ProtocolError,
    RequestTimeoutError,
    SegmentFileError,
    ServerError,
    StepCollectedError,
    StorageFullError,
    TimeoutError,
    TransportError,
    UnauthorizedError,
)
from .reads._cp import cp_chunks
from .reads._windows import (
    CoveredRead,
    Piece,
    ReadResult,
    Window,
    WindowPlan,
    assemble,
    coverage,
    plan_window,
)
from .segments._codec import decode_columns, decode_segments, encode_segments
from .segments._columns import SegmentList, SegmentListWire
from .segments._ops import clip_segments, merge_pd_segments, shift_segments
from .segments._router import merge_pd_responses, prefill_has_routed_experts
from .segments._segment import (
    SUPPORTED_DTYPES,
    PayloadSegment,
    row_nbytes,
    segment_end,
    validate_segment,
    validate_segments,
)
from .wire._http import (
    FieldSpec,
    FieldsTable,
    GcCount,
    GcEntry,
    GcReport,
    Health,
    Prefetched,
    RunUsage,
    Stats,
    StepUsage,
    Usage,
)

if TYPE_CHECKING:
    from .clients._async import AsyncPayloadClient
    from .clients._base import DEFAULT_SOCKET
    from .clients._cluster import NODES_ENV, AsyncClusterClient, ClusterClient, load_nodes
    from .clients._sync import PayloadClient
    from .transports._timeout import Timeout

_LOADED_ON_USE = {
    "AsyncPayloadClient": ".clients._async",
    "DEFAULT_SOCKET": ".clients._base",
    "NODES_ENV": ".clients._cluster",
    "AsyncClusterClient": ".clients._cluster",
    "ClusterClient": ".clients._cluster",
    "load_nodes": ".clients._cluster",
    "PayloadClient": ".clients._sync",
    "Timeout": ".transports._timeout",
}
"""The names whose modules import httpx, and where each is; loaded at their first use."""


if not TYPE_CHECKING:  # type checkers see the imports above: a misspelt name stays an error

    def __getattr__(name: str) -> Any:
        """The clients and `Timeout`, imported at their first use (PEP 562)."""
        module = _LOADED_ON_USE.get(name)
        if module is None:
            raise AttributeError(f"module 'payload_client' has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOCKET",
    "NODES_ENV",
    "STATUS_BY_ERROR",
    "SUPPORTED_DTYPES",
    "AppendInDoubtError",
    "AsyncClusterClient",
    "AsyncPayloadClient",
    "BusyError",
    "ClusterClient",
    "ConnectError",
    "ConnectionLostError",
    "CoveredRead",
    "FileGoneError",
    "FileMissingError",
    "FieldSpec",
    "FieldsTable",
    "Prefetched",
    "GcCount",
    "GcEntry",
    "GcReport",
    "Health",
    "InvalidRequestError",
    "InvalidSegmentError",
    "PayloadClient",
    "PayloadError",
    "PayloadSegment",
    "PayloadTooLargeError",
    "Piece",
    "ProtocolError",
    "ReadResult",
    "RequestTimeoutError",
    "RunUsage",
    "SegmentFileError",
    "SegmentList",
    "SegmentListWire",
    "ServerError",
    "Stats",
    "StepCollectedError",
    "StepUsage",
    "StorageFullError",
    "Timeout",
    "TimeoutError",
    "TransportError",
    "UnauthorizedError",
    "Usage",
    "Window",
    "WindowPlan",
    "assemble",
    "clip_segments",
    "load_nodes",
    "coverage",
    "cp_chunks",
    "decode_columns",
    "decode_segments",
    "encode_segments",
    "merge_pd_responses",
    "merge_pd_segments",
    "plan_window",
    "prefill_has_routed_experts",
    "row_nbytes",
    "segment_end",
    "shift_segments",
    "validate_segment",
    "validate_segments",
]
