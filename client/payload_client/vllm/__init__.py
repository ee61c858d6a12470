"""Writing vLLM's per-token side data into payloadd, by handle (``pip install
payload-client[vllm]``; vLLM is imported by nothing here).

An offline engine's ``RequestOutput`` list goes to the daemon in one round trip
(`write_outputs`, `awrite_outputs`): every completion's ``routed_experts`` rows at their
token positions (the delta only, when the request set ``routed_experts_prompt_start``) and
its ``sampling_mask`` rows at the generated tokens' positions; back come the segments of
each completion, to hand to the orchestrator instead of the arrays.

The OpenAI-compatible server's plug-in is `payload_client.vllm.server`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..clients._async import AsyncPayloadClient
from ..clients._sync import PayloadClient
from ..segments._segment import PayloadSegment
from ._outputs import MASK, ROUTED, completion_items, mask_blocks

__all__ = [
    "MASK",
    "ROUTED",
    "awrite_outputs",
    "completion_items",
    "mask_blocks",
    "write_outputs",
]

Items = list[tuple[str, Any, int]]


def _items(outputs: Sequence[Any], fields: Sequence[str]) -> tuple[Items, list[list[int]]]:
    """Every completion's items, and how many items each completion has, by output."""
    items: Items = []
    counts: list[list[int]] = []
    for i, out in enumerate(outputs):
        prompt_len = len(out.prompt_token_ids)
        per: list[int] = []
        for k, completion in enumerate(out.outputs):
            mine = completion_items(prompt_len, completion, fields, f"outputs[{i}].outputs[{k}]")
            items += mine
            per.append(len(mine))
        counts.append(per)
    return items, counts


def _split(
    segments: list[list[PayloadSegment]], counts: list[list[int]]
) -> list[list[list[PayloadSegment]]]:
    out: list[list[list[PayloadSegment]]] = []
    at = 0
    for per in counts:
        mine = []
        for n in per:
            mine.append([s for item in segments[at : at + n] for s in item])
            at += n
        out.append(mine)
    return out


def write_outputs(
    client: PayloadClient,
    outputs: Sequence[Any],
    *,
    run: str,
    step: int,
    fields: Sequence[str] = (ROUTED, MASK),
) -> list[list[list[PayloadSegment]]]:
    """Append the rows of vLLM ``RequestOutput``s in one round trip; their segments.

    Parameters
    ----------
    client : PayloadClient
        A client of the node's daemon.
    outputs : sequence of vllm.RequestOutput
        Finished outputs (``prompt_token_ids``, ``outputs``: the completions).
    run, step
        As in `PayloadClient.append`, for every row.
    fields : sequence of str
        What to write of each completion: ``"routed_experts"``
        (``uint8``/``uint16 [tokens, layers, top_k]``), ``"sampling_mask"`` (``int32
        [tokens, width]`` blocks, a width a block).

    Returns
    -------
    list of list of list of PayloadSegment
        ``[output][completion]``: the completion's segments, ``routed_experts`` first, in
        position order; ``encode_segments`` gives the wire form.

    Raises
    ------
    InvalidRequestError
        A completion lacks a field asked for (the message names the engine argument), or its
        arrays do not fit its lengths; nothing is written.
    PayloadError
        As `PayloadClient.append_many`: nothing is written but for `AppendInDoubtError`.
    """
    items, counts = _items(outputs, fields)
    if not items:
        return [[[] for _ in per] for per in counts]
    return _split(client.append_many(items, run=run, step=step), counts)


async def awrite_outputs(
    client: AsyncPayloadClient,
    outputs: Sequence[Any],
    *,
    run: str,
    step: int,
    fields: Sequence[str] = (ROUTED, MASK),
) -> list[list[list[PayloadSegment]]]:
    """`write_outputs` with an `AsyncPayloadClient`."""
    items, counts = _items(outputs, fields)
    if not items:
        return [[[] for _ in per] for per in counts]
    return _split(await client.append_many(items, run=run, step=step), counts)
