"""A tiny random-weight Qwen3-MoE model and its tokenizer on disk, for a real vLLM engine on a
CPU (no hub downloads): 2 layers of 8 experts, 2 routed per token, float32, fixed seed.

Run as ``python -m tests.vllm.tiny_model DIR`` to write one; the tests call `make_tiny_model`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "LAYERS",
    "TOP_K",
    "EXPERTS",
    "VOCAB",
    "EOS",
    "CHAT_TEMPLATE",
    "make_tiny_model",
    "make_tokenizer",
]

LAYERS = 2
"""Decoder layers, each a mixture of experts (the first dimension of a routing row)."""
TOP_K = 2
"""Experts routed per token (the second dimension of a routing row)."""
EXPERTS = 8
"""Experts per layer: the routing ids are in ``[0, EXPERTS)`` (``uint8``)."""
VOCAB = 1024
"""The model's vocabulary, and the tokenizer's (trained merges padded with plain tokens)."""
EOS = "<|endoftext|>"
SPECIALS = [EOS, "<|im_start|>", "<|im_end|>"]
SEED = 1234

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as Qwen writes it (no tools, no thinking): enough for ``/v1/chat/completions``."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts routes every token to two of its eight experts.",
    "Router replay keeps the same experts at training time as at inference time.",
    "Sampling masks record which tokens the sampler could have chosen.",
    "The daemon stores per-token rows and hands back segments by handle.",
    "Reinforcement learning needs rollouts, rewards, and a trainer that reads them.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "Hello world! How are you today? I am fine, thank you.",
]
"""A few sentences the byte-level BPE learns its merges from."""


def make_tokenizer(out: Path) -> Any:
    """Train a byte-level BPE on `CORPUS`, pad it to `VOCAB` ids, and save it in ``out`` as a
    ``PreTrainedTokenizerFast`` (with `CHAT_TEMPLATE`).

    Every id below `VOCAB` decodes: the trained merges cover a few hundred ids, the rest are
    plain added tokens ``<|t123|>`` (the random model samples any id).

    Returns
    -------
    transformers.PreTrainedTokenizerFast
        The tokenizer saved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found, unused-ignore]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found, unused-ignore]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    missing = VOCAB - tok.get_vocab_size(with_added_tokens=True)
    if missing < 0:
        raise RuntimeError(f"the trained vocabulary is larger than {VOCAB}")
    tok.add_tokens([f"<|t{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIALS[1:],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    if len(fast) != VOCAB:
        raise RuntimeError(f"the tokenizer has {len(fast)} ids, not {VOCAB}")
    return fast


def make_tiny_model(out: Path | str, *, seed: int = SEED) -> Path:
    """Write the tiny model (config, random ``float32`` weights) and its tokenizer into ``out``.

    Idempotent: a folder that already holds the model (``config.json`` and weights) is kept.

    Parameters
    ----------
    out
        The model folder (created).
    seed
        The weights' seed: the same seed gives the same weights, bit for bit.

    Returns
    -------
    Path
        ``out``, for ``vllm.LLM(model=...)`` and the server's ``--model``.
    """
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch  # type: ignore[import-not-found, unused-ignore]
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # type: ignore[import-not-found, unused-ignore]

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    eos = tok.convert_tokens_to_ids(EOS)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes 32, 64, 80 and up
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    meta = json.loads((out / "config.json").read_text())
    if meta.get("head_dim") != 32:  # the attention backend refuses another width
        raise RuntimeError(f"head_dim {meta.get('head_dim')} in {out / 'config.json'}")
    return out


if __name__ == "__main__":
    print(make_tiny_model(Path(sys.argv[1])))
