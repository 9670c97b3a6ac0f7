"""The model ``hf-paged generate``, ``hf-paged serve`` and the examples run on.

``model`` names one of:

- ``None``, the default: SmolLM2-135M-Instruct, a real chat model (135M parameters), fetched and converted on first
  use (see :mod:`hf_paged.cli._smollm2`); where it cannot be had, the tiny model, with a warning saying why;
- ``"smollm2"``: SmolLM2-135M-Instruct, or an error saying why it cannot be had;
- ``"tiny"``: a 4-layer random-init Llama and a byte-level tokenizer built in code, so that it runs on a fresh CPU
  machine with no download (its text is noise; it exercises the machinery, and tests use it);
- a local checkpoint folder (write ``./tiny`` for a folder of that name).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hf_paged import _compat
from hf_paged.cli._smollm2 import NAME as SMOLLM2_NAME
from hf_paged.cli._smollm2 import ModelUnavailable, smollm2_checkpoint

logger = logging.getLogger("hf_paged")

TINY = "tiny"
SMOLLM2 = "smollm2"
TINY_NAME = "hf-paged-tiny"

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2; byte b is id 3 + b


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (259 ids with the three special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # each byte's character in the ByteLevel alphabet

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + byte for byte, ch in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32,
               attn_implementation: str = "hf_paged") -> LlamaForCausalLM:
    """A 4-layer GQA Llama over the byte vocabulary, random weights from ``seed``, eval mode."""
    config = LlamaConfig(vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return _compat.model_from_config(LlamaForCausalLM, config, attn_implementation=attn_implementation,
                                     dtype=dtype).eval()


@dataclass(frozen=True)
class ModelChoice:
    """What a ``model`` argument resolved to: the ``name`` clients see, the checkpoint ``path`` (None: the tiny
    model) and the ``dtype`` it runs in unless the caller asks for another (None: the checkpoint's)."""

    name: str
    path: Path | None
    dtype: torch.dtype | None


def choose_model(model: str | None = None, device: str | torch.device = "cpu") -> ModelChoice:
    """Resolve ``model`` (see the module's docstring) on ``device``; fetches and converts SmolLM2 on first use, in
    bfloat16 on a GPU and float32 elsewhere."""
    if model not in (None, TINY, SMOLLM2):
        return ModelChoice(Path(model).resolve().name, Path(model), None)
    if model != TINY:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        try:
            return ModelChoice(SMOLLM2_NAME, smollm2_checkpoint(dtype), dtype)
        except ModelUnavailable as exc:
            if model == SMOLLM2:
                raise
            logger.warning("hf_paged: %s. Running the embedded tiny random-init model instead (its text is noise); "
                           "--model tiny chooses it without this note.", exc)
    return ModelChoice(TINY_NAME, None, torch.float32)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of ``prompt``: as one user message through the tokenizer's chat template where it has one (a
    chat model answers then), else of the plain text."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(prompt))
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def load_model(path: str | None = None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               seed: int = 0, attn_implementation: str = "hf_paged"):
    """``(model, tokenizer)`` of ``path`` (``None``, ``"smollm2"``, ``"tiny"`` or a checkpoint folder; see the
    module's docstring) on ``device`` in eval mode, with ``attn_implementation`` (``"eager"`` gives the oracle of
    a test or an example). The tiny model's random weights come from ``seed``."""
    return load_choice(choose_model(path, device), device, dtype, seed, attn_implementation)


def load_choice(choice: ModelChoice, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int = 0, attn_implementation: str = "hf_paged"):
    """``(model, tokenizer)`` of a :func:`choose_model` result (see :func:`load_model`)."""
    dtype = dtype or choice.dtype
    if choice.path is None:
        return tiny_llama(seed, dtype, attn_implementation).to(device), byte_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(choice.path, attn_implementation=attn_implementation,
                                                 dtype=dtype or "auto")
    return model.to(device).eval(), AutoTokenizer.from_pretrained(choice.path)
