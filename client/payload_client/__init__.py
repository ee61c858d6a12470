"""payload_client: segments, their pure operations, and thin clients of the payloadd daemon.

Import what you need from here; the ``_*`` modules are private.

>>> from payload_client import PayloadClient, clip_segments
"""

from ._async_client import AsyncPayloadClient
from ._base import DEFAULT_SOCKET
from ._clients import PayloadClient
from ._cluster import NODES_ENV, AsyncClusterClient, ClusterClient, load_nodes
from ._codec import decode_columns, decode_segments, encode_segments
from ._columns import SegmentList, SegmentListWire
from ._cp import cp_chunks
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
from ._ops import clip_segments, merge_pd_segments, shift_segments
from ._router import merge_pd_responses, prefill_has_routed_experts
from ._segment import (
    SUPPORTED_DTYPES,
    PayloadSegment,
    row_nbytes,
    segment_end,
    validate_segment,
    validate_segments,
)
from ._timeout import Timeout
from ._windows import (
    CoveredRead,
    Piece,
    ReadResult,
    Window,
    WindowPlan,
    assemble,
    coverage,
    plan_window,
)
from ._wire import (
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
