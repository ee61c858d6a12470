"""Segment lists on the wire between processes: `encode_segments`, `decode_segments`.

An orchestrator sends each trainer rank its micro batches' segments (over ZMQ, Ray,
``torch.distributed`` object lists, JSON): a segment is the array ``[field, file, offset,
pos, rows, dtype, shape]`` (docs/contract.md, "The segment model"), msgpack by default. Decoding a long list makes one
small ``shape`` list per segment, and Python's cyclic garbage collector, which runs every
few hundred new containers, then walks every object the process holds again and again: on
a list of 100,000 segments it took 60 % of the decode. `decode_segments` decodes with the
collector paused (nothing decoded can form a cycle) and gives the same list.
"""

from __future__ import annotations

import difflib
import gc
from typing import Any, Literal

import msgspec

from ._errors import InvalidRequestError, InvalidSegmentError
from ._segment import PayloadSegment

__all__ = ["decode_segments", "encode_segments"]

FORMATS = ("msgpack", "json")
"""The formats of `encode_segments`."""

_msgpack = msgspec.msgpack.Decoder(list[PayloadSegment])
_json = msgspec.json.Decoder(list[PayloadSegment])
_encoder = msgspec.msgpack.Encoder()


def encode_segments(
    segments: list[PayloadSegment], format: Literal["msgpack", "json"] = "msgpack"
) -> bytes:
    """A segment list as bytes for another process (`decode_segments` reads it back).

    Parameters
    ----------
    segments : list of PayloadSegment
        The segments (not validated here; a read validates them).
    format : {"msgpack", "json"}, default "msgpack"
        msgpack (compact), or JSON (for a channel that carries text).

    Returns
    -------
    bytes
        A msgpack (or JSON) array of segment arrays.

    Raises
    ------
    InvalidRequestError
        ``format`` is neither ``"msgpack"`` nor ``"json"`` (naming the closest).

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
        raise InvalidRequestError(f'format must be "msgpack" or "json", got {format!r}{hint}')
    return _encoder.encode(segments) if format == "msgpack" else msgspec.json.encode(segments)


def decode_segments(data: Any) -> list[PayloadSegment]:
    """A segment list from what another process sent.

    Parameters
    ----------
    data : bytes, bytearray, memoryview, str or list
        msgpack bytes (`encode_segments`, or ``msgspec.msgpack.encode(segments)``); JSON
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
    enabled = gc.isenabled()
    gc.disable()  # the decoded objects hold no cycle: nothing for the collector to find
    try:
        if isinstance(data, str):
            return _json.decode(data)
        if isinstance(data, bytes | bytearray | memoryview):
            head = bytes(memoryview(data)[:64]).lstrip()
            return (_json if head[:1] == b"[" else _msgpack).decode(data)
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
