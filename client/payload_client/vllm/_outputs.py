"""What a vLLM completion holds for payloadd: its rows, as the items of one append.

Pure and free of vLLM: a completion is read by its attributes (``token_ids``,
``routed_experts``, ``sampling_mask.token_ids``) and its request's prompt length, so that
vLLM's ``RequestOutput`` and anything of the same shape serve (tests use plain objects).

Positions are token positions of the sample, prompt then completion (docs/contract.md, "The segment model"):

- ``routed_experts``: vLLM gives ``[n, layers, top_k]`` for the tokens the engine fed
  forward, prompt and completion but the last sampled token, starting at the request's
  ``routed_experts_prompt_start`` ``k`` (``n = prompt_len + gen_len - 1 - k``): the rows go
  at ``[k, k + n)``. ``k`` is not in the output; it follows from the lengths.
- ``sampling_mask``: one list of token ids a generated token (the support set its sampler
  kept), generated token ``j`` at position ``prompt_len + j``; rows of one width in a row
  go in one block ``int32 [c, width]`` (top-k sampling keeps ``top_k`` ids a token: one
  block a completion), so that every row keeps its own width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._errors import InvalidRequestError

__all__ = ["MASK", "ROUTED", "completion_items", "mask_blocks"]

ROUTED = "routed_experts"
MASK = "sampling_mask"
_ROUTED_DTYPES = (np.uint8, np.uint16)
_ASKED_BY = {
    ROUTED: "enable_return_routed_experts=True (--enable-return-routed-experts)",
    MASK: "return_sampling_mask=True and logprobs_mode='processed_logprobs', and sample "
    "with temperature > 0",
}


def completion_items(
    prompt_len: int, completion: Any, fields: Sequence[str] = (ROUTED, MASK), where: str = ""
) -> list[tuple[str, np.ndarray, int]]:
    """The ``(field, rows, pos)`` items of one completion, as `PayloadClient.append_many`
    takes them.

    Parameters
    ----------
    prompt_len : int
        Tokens of the request's prompt (``len(RequestOutput.prompt_token_ids)``).
    completion : vllm.CompletionOutput or alike
        ``token_ids`` (generated ids), ``routed_experts`` (``ndarray [n, layers, top_k]``,
        ``uint8`` or ``uint16``, or ``None``), ``sampling_mask`` (``.token_ids``: a list of
        ids a generated token, or ``None``).
    fields : sequence of str
        The fields to take (``"routed_experts"``, ``"sampling_mask"``).
    where : str
        Names the completion in errors (``"outputs[2].outputs[0]"``).

    Returns
    -------
    list of (str, numpy.ndarray, int)
        ``routed_experts`` first (one item), then ``sampling_mask`` blocks in position order;
        a field of ``fields`` the completion does not hold raises.

    Raises
    ------
    InvalidRequestError
        A field of ``fields`` is not in the completion (the engine was not asked for it:
        the message names the engine argument); the completion's arrays do not fit its
        lengths: more routed rows than tokens fed forward, another dtype or rank, a mask
        row count other than the generated tokens, an empty support set.
    """
    gen_len = len(completion.token_ids)
    items: list[tuple[str, np.ndarray, int]] = []
    for field in fields:
        if field not in _ASKED_BY:
            raise InvalidRequestError(f"vLLM completions hold {sorted(_ASKED_BY)}, not {field!r}")
        if getattr(completion, field, None) is None:
            raise InvalidRequestError(
                f"{where} holds no {field}: start the engine with {_ASKED_BY[field]}"
            )
    if ROUTED in fields:
        rows = completion.routed_experts
        fed = prompt_len + gen_len - 1  # the last sampled token is never fed forward
        if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.dtype not in _ROUTED_DTYPES:
            raise InvalidRequestError(
                f"{where} routed_experts must be an ndarray [tokens, layers, top_k] of uint8 or "
                f"uint16, got {type(rows).__name__} {getattr(rows, 'dtype', '')} "
                f"{getattr(rows, 'shape', '')}"
            )
        start = fed - len(rows)
        if start < 0:
            raise InvalidRequestError(
                f"{where} routed_experts has {len(rows)} rows, more than the {fed} tokens fed "
                f"forward (prompt {prompt_len} + generated {gen_len} - 1)"
            )
        if len(rows):
            items.append((ROUTED, rows, start))
    if MASK in fields:
        mask = completion.sampling_mask
        if len(mask.token_ids) != gen_len:
            raise InvalidRequestError(
                f"{where} sampling_mask has {len(mask.token_ids)} rows for {gen_len} generated "
                "tokens"
            )
        items += [
            (MASK, block, prompt_len + at) for at, block in mask_blocks(mask.token_ids, where)
        ]
    return items


def mask_blocks(rows: Iterable[Sequence[int]], where: str = "") -> list[tuple[int, np.ndarray]]:
    """Support sets, one a token, as ``(first row, int32 [c, width])`` blocks of rows of one
    width in a row.

    Raises
    ------
    InvalidRequestError
        A support set is empty (a sampler keeps one id at least).
    """
    blocks: list[tuple[int, np.ndarray]] = []
    run: list[Sequence[int]] = []
    first = 0
    for j, ids in enumerate(rows):
        if not len(ids):
            raise InvalidRequestError(f"{where} sampling_mask row {j} is empty")
        if run and len(ids) != len(run[0]):
            blocks.append((first, np.asarray(run, dtype=np.int32)))
            run, first = [], j
        run.append(ids)
    if run:
        blocks.append((first, np.asarray(run, dtype=np.int32)))
    return blocks
