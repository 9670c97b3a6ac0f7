"""An engine step is launched without the host waiting for the device: under asynchronous scheduling the host
schedules step ``k + 1`` while the device computes step ``k``, and under tensor parallel a rank whose peer failed
must reach the next step's check rather than wait in a collective that never completes. torch's sync debug mode
turns every implicit synchronisation (``.item()``, a blocking device-to-host copy, ``nonzero``, a ``.all()`` read
on the host) into an error; the step's one intended wait, for its sampled tokens, happens after the launch."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
from hf_paged import envs
from hf_paged.engine._core import EngineCore

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


@pytest.mark.parametrize("backend", ["flash", "cuda"])
def test_a_step_launches_without_waiting_for_the_device(backend, request, monkeypatch):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    else:
        request.getfixturevalue("hf_paged_kernels")
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    envs.refresh()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation="hf_paged",
                                             dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 90))] for _ in range(10)]
    # greedy, greedy holding its EOS back (the sampler masks the EOS column in place), and sampled
    configs = [GenerationConfig(max_new_tokens=12, do_sample=False),
               GenerationConfig(max_new_tokens=12, min_new_tokens=12, eos_token_id=2, do_sample=False),
               GenerationConfig(max_new_tokens=12, do_sample=True, top_k=20, top_p=0.9, temperature=0.8, seed=3)]
    # small steps: chunked prefills beside decodes; eager decode (a capture on demand would wait on purpose)
    # flash-attn reads a paged cache in extend steps only with blocks of 256 tokens
    block_size = 256 if backend == "flash" else 16
    engine = hf_paged.Engine(model, num_blocks=4096 // block_size, block_size=block_size, max_batch_tokens=64,
                             max_num_seqs=6, cuda_graphs=False, compile_layers=False)
    engine.generate(prompts[:2], configs[0])  # lazy initialisation (libraries, workspaces) out of the way
    launch, launched = EngineCore._launch, []

    def strict(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        launched.append(1)
        return out

    monkeypatch.setattr(EngineCore, "_launch", strict)
    for config in configs:
        outputs = engine.generate(prompts, config)
        # a launch that synchronised raised; its sequences would have ended with finish_reason="error"
        assert "error" not in [o.finish_reason for o in outputs]
        if config.min_new_tokens:
            assert all(len(o.token_ids) == 12 for o in outputs)  # no EOS before the minimum
    assert len(launched) > 3 * 12
    stats = engine.stats()
    assert stats["prefill_backend"] == backend
