"""Prefill/decode stitching of whole generate responses, for a P/D router (docs/contract.md, "Pure segment operations").

A router under prefill/decode disaggregation gets two JSON responses of the same request
and returns one. This module applies `merge_pd_segments` to the segments those responses
carry by handle, without reading any payload file.

Accepted shapes (already decoded JSON: ``dict``/``list``/``str``/``int``)::

    response = {"choices": [choice, ...], ...}          # other keys: anything, kept
    choice   = {"payload": [segment, ...], ...}          # "payload" absent or null: none
    segment  = [field, file, offset, pos, rows, dtype, shape]

A segment is the 7-element array `PayloadSegment` encodes to (``array_like``), e.g.
``["routed_experts", "node0/r1/0/routed_experts-aaaa0001-000001.bin", 0, 0, 100, "uint8",
[48, 8]]``. Longer arrays (fields a newer version appended at the end: docs/contract.md, "The segment model") are
accepted and passed through with their extra elements; the object form
``{"field": ..., ...}`` is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import InvalidRequestError, InvalidSegmentError
from ._ops import merge_pd_segments
from ._segment import PayloadSegment, validate_segment

__all__ = ["merge_pd_responses", "prefill_has_routed_experts"]

_NFIELDS = len(PayloadSegment.__struct_fields__)


def _choices(response: Any, side: str) -> list[Any]:
    if not isinstance(response, Mapping):
        raise InvalidRequestError(
            f"{side} response must be a JSON object, got {type(response).__name__}"
        )
    choices = response.get("choices")
    if not isinstance(choices, list):
        raise InvalidRequestError(
            f"{side} response must have a 'choices' list, got {type(choices).__name__}"
        )
    for i, choice in enumerate(choices):
        if not isinstance(choice, Mapping):
            raise InvalidRequestError(
                f"{side} choices[{i}] must be a JSON object, got {type(choice).__name__}"
            )
    return choices


def _payload(choice: Mapping[str, Any], where: str) -> tuple[list[list[Any]], list[PayloadSegment]]:
    """Decode and validate ``choice["payload"]`` (absent or null: no segments).

    Returns the arrays as given and the segments they decode to, index for index.
    """
    raw = choice.get("payload")
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise InvalidRequestError(
            f"{where}.payload must be a list of segments, got {type(raw).__name__}"
        )
    segments = []
    for k, item in enumerate(raw):
        at = f"{where}.payload[{k}]"
        if not isinstance(item, list) or len(item) < _NFIELDS:
            raise InvalidSegmentError(
                f"{at} must be an array [field, file, offset, pos, rows, dtype, shape], "
                f"got {item!r:.200}"
            )
        # validate_segment checks every element's type itself, naming the bad one
        seg = PayloadSegment(*item[:_NFIELDS])
        try:
            segments.append(validate_segment(seg))
        except InvalidSegmentError as exc:
            raise InvalidSegmentError(f"{at}: {exc}", field=exc.field) from None
    return raw, segments


def prefill_has_routed_experts(prefill: Any, field: str = "routed_experts") -> bool:
    """Tell whether a prefill response carries routed data, inline or by handle.

    A router refuses to stream a P/D request when this is true: the decode response must
    be stitched whole (see `merge_pd_responses`).

    Parameters
    ----------
    prefill : dict
        The prefill instance's generate response, of the shape in this module's docstring.
    field : str, default "routed_experts"
        The routed field.

    Returns
    -------
    bool
        True when ``choices[0]`` has a non-null ``field`` key (inline data) or a segment of
        ``field`` in its ``payload`` (by handle). False when there are no choices.

    Raises
    ------
    InvalidRequestError
        If ``field`` is not a non-empty string or the response is not of the accepted shape.
    InvalidSegmentError
        If any segment of ``choices[0].payload`` is malformed or invalid (docs/contract.md, "The segment model").
    """
    if not isinstance(field, str) or not field:
        raise InvalidRequestError("field must be a non-empty string")
    choices = _choices(prefill, "prefill")
    if not choices:
        return False
    first = choices[0]
    _, segments = _payload(first, "prefill choices[0]")
    return first.get(field) is not None or any(s.field == field for s in segments)


def merge_pd_responses(
    prefill: Any, decode: Any, field: str | Sequence[str] = "routed_experts"
) -> dict[str, Any]:
    """Stitch the by-handle segments of a prefill and a decode generate response.

    Parameters
    ----------
    prefill : dict
        The prefill instance's response; only the ``field`` segments of
        ``choices[0].payload`` are used.
    decode : dict
        The decode instance's response, of the same shape.
    field : str or sequence of str, default "routed_experts"
        The field to stitch; several (``("routed_experts", "sampling_mask")``: the prefill
        holds the mask of the first generated token) are stitched one after the other,
        each as alone.

    Returns
    -------
    dict
        A copy of ``decode`` (the inputs are not modified; the segment arrays are deep
        copies, other values are shared) in which every choice's
        ``payload`` is ``merge_pd_segments(prefill_segments, choice_segments, field)``:
        the prefill ``field`` segments first, then the choice's own segments in order,
        its ``field`` ones dropped or front-trimmed at ``cut`` (the prefill coverage end);
        segments of other fields are the decode side's, in order. Segment arrays are
        passed through as they came (trailing elements of a newer wire version
        included); a trimmed one gets new ``offset``, ``pos`` and ``rows``. A choice
        without ``payload`` gets one only when prefill has ``field`` segments. With no
        ``field`` segment on either side the result equals ``decode``. Inline data
        (``choices[i][field]``) is left alone.

    Raises
    ------
    InvalidRequestError
        If a response is not of the accepted shape, ``field`` is not a non-empty string,
        or a decode choice has ``field`` segments while prefill ``choices[0]`` has none.
    InvalidSegmentError
        If any segment on either side is malformed, invalid (docs/contract.md, "The segment model") or overflows int64.
    """
    fields = [field] if isinstance(field, str) else list(field)
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise InvalidRequestError("field must be a non-empty string or a sequence of them")
    _choices(decode, "decode")  # its shape checked before anything is copied
    out: Any = decode
    for f in fields:
        out = _merge_field(prefill, out, f)
    return dict(out)


def _merge_field(prefill: Any, decode: Any, field: str) -> dict[str, Any]:
    """`merge_pd_responses` of one field."""
    pre_choices = _choices(prefill, "prefill")
    head_raw: list[list[Any]] = []
    head: list[PayloadSegment] = []
    if pre_choices:
        raws, segs = _payload(pre_choices[0], "prefill choices[0]")
        head_raw = [r for r, s in zip(raws, segs, strict=True) if s.field == field]
        head = [s for s in segs if s.field == field]
    cut = max((s.pos + s.rows for s in head), default=0)
    new_choices = []
    for i, choice in enumerate(_choices(decode, "decode")):
        where = f"decode choices[{i}]"
        raws, segs = _payload(choice, where)
        try:
            merged = merge_pd_segments(head, segs, field)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
        # the decode arrays merge_pd_segments kept, in order (its rule: docs/contract.md, "Pure segment operations")
        kept = [
            r
            for r, s in zip(raws, segs, strict=True)
            if not head or s.field != field or s.pos + s.rows > cut
        ]
        payload = [copy.deepcopy(r) for r in head_raw]
        for raw, seg in zip(kept, merged[len(head) :], strict=True):
            raw = copy.deepcopy(raw)
            raw[2:5] = [seg.offset, seg.pos, seg.rows]
            payload.append(raw)
        new = dict(choice)
        if head or choice.get("payload") is not None:
            new["payload"] = payload
        new_choices.append(new)
    out = dict(decode)
    out["choices"] = new_choices
    return out
