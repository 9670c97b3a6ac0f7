"""Shared pieces of the engine tests: random prompts and the ``model.generate`` greedy oracle."""

from __future__ import annotations

import functools
import random

import torch
from transformers import GenerationConfig

from tiny_models import VOCAB, make_models


@functools.lru_cache(maxsize=None)
def models(arch: str):
    return make_models(arch)


def random_prompts(n: int, lo: int, hi: int, seed: int, prefixes: list[list[int]] | None = None) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` random tokens (ids 3.. so no PAD/BOS/EOS), each after a random one of
    ``prefixes`` when given."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
        out.append((rng.choice(prefixes) if prefixes else []) + body)
    return out


def greedy_config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False)


@functools.lru_cache(maxsize=None)
def _hf_greedy(arch: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    eager, _ = models(arch)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = eager.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy_config(max_new_tokens))
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(arch: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``model.generate`` greedy new tokens per prompt, one prompt at a time, eager attention (the oracle)."""
    return [list(_hf_greedy(arch, tuple(p), max_new_tokens)) for p in prompts]
