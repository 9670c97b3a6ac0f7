"""Workloads of the end-to-end benchmark: the model shape, the prompts and the generation settings of each run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SMOKE_SHAPE = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2000}
EOS = 2


@dataclass(frozen=True)
class Workload:
    """``num_requests`` prompts drawn with ``seed`` (lengths uniform in ``prompt_range``, or all ``prompt_len``),
    of which the first ``take`` are sent; ``new_tokens`` each, greedy.

    Without ``min_new`` no EOS is set, so every request runs to ``new_tokens``; with it, EOS is set and suppressed
    until ``new_tokens`` (the older form of the anchor; it takes the sampler's logits-processing path).
    """

    name: str
    num_requests: int
    new_tokens: int
    min_new: bool = False
    take: int | None = None
    prompt_len: int | None = None
    prompt_range: tuple[int, int] = (128, 1024)
    seed: int = 0
    description: str = ""

    @property
    def num_sent(self) -> int:
        return self.take or self.num_requests

    @property
    def is_latency(self) -> bool:
        return self.name == "latency"

    def smoke(self) -> Workload:
        """The same run scaled down for a tiny CPU model: 1/64 of the requests, 1/16 of the prompt lengths, 4 new
        tokens (the profile: 32, enough to stay in decode through its steps)."""
        low, high = self.prompt_range
        return dataclasses.replace(
            self, num_requests=max(1, self.num_requests // 64), take=self.take and max(1, self.take // 64),
            new_tokens=32 if self.name.startswith("profile") else 4,
            prompt_len=self.prompt_len and self.prompt_len // 16, prompt_range=(low // 16, high // 16))

    def prompts(self, vocab: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed)
        if self.prompt_len:
            lengths = [self.prompt_len] * self.num_requests
        else:
            lengths = torch.randint(self.prompt_range[0], self.prompt_range[1] + 1, (self.num_requests,),
                                    generator=gen).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        return prompts[: self.num_sent]

    def generation_config(self, new_tokens: int | None = None) -> GenerationConfig:
        n = new_tokens or self.new_tokens
        if self.min_new:
            return GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=EOS,
                                    pad_token_id=0)
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("anchor", 256, 256, description="256 requests, prompts 128-1024, 256 new tokens, no EOS"),
        Workload("min_new", 256, 256, min_new=True, description="the anchor with EOS set, min_new_tokens=256"),
        Workload("r64", 256, 256, take=64, description="the first 64 anchor prompts"),
        Workload("r1024", 1024, 256, description="1024 requests, same distribution"),
        Workload("latency", 1, 256, prompt_len=512,
                 description="batch 1, 512-token prompt: ms per output token, decode only"),
        Workload("profile", 256, 256, description="hf_paged Engine, steady decode at the anchor's batch: "
                                                  "ms per step and GPU busy fraction"),
        Workload("profile1", 1, 256, prompt_len=512, description="the profile at batch 1: one 512-token prompt"),
        Workload("roofline", 256, 256, description="hf_paged Engine on the anchor, the whole run profiled: GPU time "
                                                   "per phase against the card's measured roofline"),
    )
}
# A small call of each shape before the timed one (compiles, autotunes, allocator warm-up)
WARM = Workload("warm", 16, 16, seed=1)


def load_model(shape: dict, device: str, attn: str, seed: int = 0) -> torch.nn.Module:
    """A random-init Llama of ``shape``; the same ``seed`` gives the same weights in any process and any
    transformers release (initialised here, not by transformers)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation=attn, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                param.normal_(0.0, 0.02, generator=gen)
            else:
                param.fill_(1.0)
    # Without an EOS in the request, hf_paged would fall back to the model's (token 2) and could stop early
    model.generation_config.eos_token_id = None
    return model.eval()
