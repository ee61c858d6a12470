"""Segment lists on the wire between processes: `encode_segments`, `decode_segments`.

An orchestrator sends each trainer rank its micro batches' segments (over ZMQ, Ray,
``torch.distributed`` object lists, JSON): a segment is the array ``[field, file, offset,
pos, rows, dtype, shape]`` (docs/contract.md, "The segment model"), msgpack by default. Decoding a long list makes one
small ``shape`` list per segment, and Python's cyclic garbage collector, which runs every
few hundred new containers, then walks every object the process holds again and again: on
a list of 100,000 segments it took 60 % of the decode. `decode_segments` decodes with the
collector paused (nothing decoded can form a cycle) and gives the same list.

A list can also travel as columns (``encode_segments(segments, "columns")``, a msgpack map of
binary columns, `payload_client.SegmentList`): `decode_columns` reads it at the cost of a few
copies, whatever its length; both decoders read both forms.
"""

from __future__ import annotations

import difflib
import gc
import itertools
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from .._errors import InvalidRequestError, InvalidSegmentError
from ._columns import SegmentList, SegmentListWire
from ._segment import FirstSeen, PayloadSegment

__all__ = ["decode_columns", "decode_segments", "encode_segments"]

FORMATS = ("msgpack", "json", "columns")
"""The formats of `encode_segments`."""

_MAPS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
"""First bytes of a msgpack map: the columnar form (the array of segments starts otherwise)."""

_columns = msgspec.msgpack.Decoder(SegmentListWire)
_msgpack = msgspec.msgpack.Decoder(list[PayloadSegment])
_json = msgspec.json.Decoder(list[PayloadSegment])
_encoder = msgspec.msgpack.Encoder()


def encode_segments(
    segments: Sequence[PayloadSegment],
    format: Literal["msgpack", "json", "columns"] = "msgpack",
) -> bytes:
    """A segment list as bytes for another process (`decode_segments` reads it back).

    Parameters
    ----------
    segments : list of PayloadSegment or SegmentList
        The segments (a list is not validated here; a read validates it).
    format : {"msgpack", "json", "columns"}, default "msgpack"
        msgpack (compact), JSON (for a channel that carries text), or columns: a msgpack
        map of little-endian binary columns (`payload_client.SegmentListWire`), decoded
        without a Python object a segment (`decode_columns`; a list is validated first).

    Returns
    -------
    bytes
        A msgpack (or JSON) array of segment arrays, or the columnar map.

    Raises
    ------
    InvalidRequestError
        ``format`` is none of these (naming the closest).
    InvalidSegmentError
        ``"columns"`` of an invalid list.

    Examples
    --------
    >>> s = PayloadSegment("routed_experts", "n0/r1/3/a.bin", 0, 0, 4, "uint8", [48, 8])
    >>> decode_segments(encode_segments([s])) == [s]
    True
    >>> encode_segments([s], "json")
    b'[["routed_experts","n0/r1/3/a.bin",0,0,4,"uint8",[48,8]]]'
    """
    if format not in FORMATS:
        near = difflib.get_close_matches(str(format), FORMATS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise InvalidRequestError(
            f'format must be "msgpack", "json" or "columns", got {format!r}{hint}'
        )
    if format == "columns":
        return _encoder.encode(SegmentList(segments).to_wire())
    if isinstance(segments, SegmentList):
        segments = segments.to_list()
    return _encoder.encode(segments) if format == "msgpack" else msgspec.json.encode(segments)


def decode_segments(data: Any) -> list[PayloadSegment]:
    """A segment list from what another process sent.

    Parameters
    ----------
    data : bytes, bytearray, memoryview, str, list or SegmentList
        msgpack bytes (`encode_segments` in any format, or
        ``msgspec.msgpack.encode(segments)``); JSON
        text or bytes (told apart by its first character, ``[``); or an already decoded
        list whose items are segments or their arrays ``[field, file, offset, pos, rows,
        dtype, shape]`` (``json.loads``, a ``torch.distributed`` object list, Ray).

    Returns
    -------
    list of PayloadSegment
        The segments, in order. Their values are checked by the reads that use them
        (docs/contract.md, "The segment model"): decoding checks only the types.

    Raises
    ------
    InvalidSegmentError
        ``data`` is not a list of segments (naming the item and the attribute), or bytes
        that are neither msgpack nor JSON of one.
    """
    data = _contiguous(data)
    enabled = gc.isenabled()
    gc.disable()  # the decoded objects hold no cycle: nothing for the collector to find
    try:
        if isinstance(data, str):
            return _json.decode(data)
        if isinstance(data, bytes | bytearray | memoryview):
            if _is_columns(data):
                return _from_columns(data).to_list()
            head = bytes(memoryview(data)[:64]).lstrip()
            return (_json if head[:1] == b"[" else _msgpack).decode(data)
        if isinstance(data, SegmentList):
            return data.to_list()
        if isinstance(data, list) and all(type(s) is PayloadSegment for s in data):
            return data
        return msgspec.convert(data, list[PayloadSegment])
    except msgspec.ValidationError as exc:
        raise InvalidSegmentError(f"not a list of segments: {_where(exc)}") from None
    except msgspec.DecodeError as exc:
        raise InvalidSegmentError(f"not a msgpack or JSON list of segments: {exc}") from None
    finally:
        if enabled:
            gc.enable()


def decode_columns(data: Any) -> SegmentList:
    """A `SegmentList` from what another process sent, in any form.

    Parameters
    ----------
    data : bytes, bytearray, memoryview, str, list or SegmentList
        The columnar form (``encode_segments(segments, "columns")``): its columns are
        copied out of the bytes, nothing made a segment; or any form `decode_segments`
        reads (then decoded as it does and taken into columns).

    Returns
    -------
    SegmentList
        The segments, validated (docs/contract.md, "The segment model").

    Raises
    ------
    InvalidSegmentError
        Not a segment list (as `decode_segments`), another version of the columnar form,
        or an invalid segment (naming the first, its index and attribute).

    Examples
    --------
    >>> s = PayloadSegment("routed_experts", "n0/r1/3/a.bin", 0, 0, 4, "uint8", [48, 8])
    >>> decode_columns(encode_segments([s], "columns")) == [s]
    True
    """
    if isinstance(data, SegmentList):
        return data
    data = _contiguous(data)
    if isinstance(data, bytes | bytearray | memoryview | str):
        if not isinstance(data, str) and _is_columns(data):
            return _from_columns(data)
        got = _from_arrays(data)
        if got is not None:
            return got
    return SegmentList(decode_segments(data))


_Row = tuple[str, str, int, int, int, str, tuple[int, ...]]
_rows_msgpack = msgspec.msgpack.Decoder(list[_Row])
_rows_json = msgspec.json.Decoder(list[_Row])


def _from_arrays(data: bytes | bytearray | memoryview | str) -> SegmentList | None:
    """The array-of-arrays form straight into columns (no `PayloadSegment` made), checked
    column by column; ``None`` when it is not of the usual types (the caller then decodes
    it segment by segment, for the exact error)."""
    enabled = gc.isenabled()
    gc.disable()  # tuples of strings and integers: no cycle
    try:
        if isinstance(data, str):
            rows = _rows_json.decode(data)
        else:
            head = bytes(memoryview(data)[:64]).lstrip()
            rows = (_rows_json if head[:1] == b"[" else _rows_msgpack).decode(data)
        field, file, offset, pos, count, dtype, shape = zip(*rows, strict=True) or ((),) * 7
        fields, files, kinds = FirstSeen(), FirstSeen(), FirstSeen()
        n = len(rows)
        codes = [
            np.fromiter(map(fields.__getitem__, field), np.intp, n),
            np.fromiter(map(files.__getitem__, file), np.intp, n),
            np.fromiter(map(kinds.__getitem__, zip(dtype, shape, strict=True)), np.intp, n),
        ]
        ints = np.fromiter(itertools.chain(offset, pos, count), np.int64, 3 * n).reshape(3, n)
    except (msgspec.ValidationError, msgspec.DecodeError, OverflowError, ValueError):
        return None
    finally:
        if enabled:
            gc.enable()
    return SegmentList.from_columns(
        tuple(fields), codes[0], tuple(files), codes[1], tuple(kinds), codes[2], *ints
    )


def _contiguous(data: Any) -> Any:
    """``data``, a memoryview of scattered bytes as the bytes themselves (the decoders read
    contiguous buffers only)."""
    if isinstance(data, memoryview) and not data.c_contiguous:
        return data.tobytes()
    return data


def _is_columns(data: bytes | bytearray | memoryview) -> bool:
    head = memoryview(data)[:1].tobytes()
    return bool(head) and head[0] in _MAPS


def _from_columns(data: bytes | bytearray | memoryview) -> SegmentList:
    try:
        wire = _columns.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidSegmentError(f"not a columnar segment list: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidSegmentError(f"not a msgpack columnar segment list: {exc}") from None
    return SegmentList.from_wire(wire)


def _where(exc: msgspec.ValidationError) -> str:
    """msgspec's message with its path ``$[i][k]`` said as item ``i``, attribute ``name``."""
    message = str(exc)
    head, sep, path = message.partition(" - at `$[")
    if not sep:
        return message
    parts = path.rstrip("`").replace("]", "").split("[")
    if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
        k = int(parts[1])
        names = PayloadSegment.__struct_fields__
        name = names[k] if k < len(names) else f"#{k}"
        return f"item {parts[0]}, {name}: {head}"
    return f"item {parts[0]}: {head}" if parts[0].isdigit() else message
