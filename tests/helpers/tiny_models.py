"""Tiny random-init models built from configs (no downloads), one per architecture the suite covers."""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 160
PAD, BOS, EOS = 0, 1, 2
_COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)

ARCHS = {
    "llama_mha": ("LlamaConfig", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2, sliding_window=24)),
    "qwen2": ("Qwen2Config", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "gemma": ("GemmaConfig", dict(**_DECODER, num_attention_heads=2, num_key_value_heads=1, head_dim=256)),
    "phi3": ("Phi3Config", dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "gemma2": (
        "Gemma2Config",
        dict(**_DECODER, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=20,
             attn_logit_softcapping=5.0, final_logit_softcapping=None),
    ),
}


def make_config(arch: str, **overrides):
    cls_name, kwargs = ARCHS[arch]
    config = getattr(transformers, cls_name)(**{**_COMMON, **kwargs, **overrides})
    return config


def make_models(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """The same random weights loaded twice: with eager attention and with hf_paged. ``overrides`` (config
    fields, None ones ignored) change the tiny shape, e.g. ``num_hidden_layers``."""
    import hf_paged  # noqa: F401  (registers "hf_paged")

    overrides = {k: v for k, v in overrides.items() if v is not None}
    torch.manual_seed(seed)
    # One config object each: some transformers releases set the attention implementation on the config in place.
    eager = AutoModelForCausalLM.from_config(make_config(arch, **overrides), attn_implementation="eager",
                                             dtype=dtype).eval()
    paged = AutoModelForCausalLM.from_config(make_config(arch, **overrides), attn_implementation="hf_paged",
                                             dtype=dtype).eval()
    paged.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and paged.config._attn_implementation == "hf_paged"
    return eager, paged


def left_padded_batch(lengths: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random prompts of ``lengths``, left-padded with PAD: ``input_ids`` and ``attention_mask`` [B, max_len]."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=generator)
        mask[i, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}
