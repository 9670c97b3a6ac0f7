"""The model ``hf-paged generate`` and the examples run on: a local checkpoint, or the embedded default, a tiny
random-init Llama and a byte-level tokenizer built in code so they run on a fresh CPU machine with no download
(its text is noise; it exercises the machinery)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_paged import _compat

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2; byte b is id 3 + b


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (259 ids with the three special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _byte_of(ch: str) -> int:
    """The byte the GPT-2 byte-level alphabet maps to ``ch`` (printable bytes map to themselves)."""
    code = ord(ch)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A 4-layer GQA Llama over the byte vocabulary, random weights from ``seed``, paged attention, eval mode."""
    config = LlamaConfig(
        vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    return _compat.model_from_config(LlamaForCausalLM, config, attn_implementation="hf_paged", dtype=dtype).eval()


def load_model(
    path: str | None = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, seed: int = 0
):
    """``(model, tokenizer)``: the checkpoint at ``path`` with ``"hf_paged"`` attention, or the embedded default
    (random weights from ``seed``)."""
    if path is None:
        return tiny_llama(seed, dtype or torch.float32).to(device), byte_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_paged", dtype=dtype or "auto")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)
