"""A model that says what a test scripts: the engine runs it as a causal LM, and its greedy token after position
``p`` is ``script[p + 1]``, so the tokens (and the text a tokenizer makes of them) are known exactly."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import GenerationConfig, LlamaConfig

import hf_paged


class ScriptedModel(torch.nn.Module):
    """Quacks like a causal LM for the engine: the token after position ``p`` is always ``script[p + 1]``."""

    def __init__(self, script: list[int], vocab_size: int):
        super().__init__()
        self.config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=512)
        self.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self.generation_config = GenerationConfig(eos_token_id=None)
        self.register_buffer("script", torch.tensor(script + [0]))
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.script.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, input_ids, position_ids=None, logits_to_keep=None, past_key_values=None, cache=None, **kw):
        nxt = self.script[(position_ids[0, logits_to_keep] + 1).clamp(max=len(self.script) - 1)]
        logits = torch.full((1, len(nxt), self.config.vocab_size), -1e4)
        logits[0, torch.arange(len(nxt)), nxt] = 0.0
        return SimpleNamespace(logits=logits)
