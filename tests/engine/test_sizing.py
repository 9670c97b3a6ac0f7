"""Automatic engine sizing (``engine/_sizing.py``): open settings are picked from the device, its free memory and the
workload, explicit ones always win, and ``stats()`` and the start-up log line say what was picked and why."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts
from hf_paged.engine import _sizing as sizing
from hf_paged.engine._sizing import Workload, size_engine

ARCH = "llama_gqa"
GIB = 2**30
LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def _on_cuda(monkeypatch, free_bytes: int) -> list[torch.device]:
    """A CUDA device with ``free_bytes`` free, as the rule sees it (no GPU needed: the rule only reads free memory)."""
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: free_bytes)
    return [torch.device("cuda", 0)] * 16


def test_on_a_large_gpu_the_rule_gives_the_measured_best(monkeypatch):
    devices = _on_cuda(monkeypatch, 130 * GIB)  # an H200 with a 1B model loaded
    sized, reasons = size_engine(hf_paged.EngineConfig(), LLAMA_1B, torch.bfloat16, devices)
    assert (sized.max_batch_tokens, sized.max_num_seqs) == (16384, 256) == (
        sizing.RULES["cuda"].max_batch_tokens, sizing.RULES["cuda"].max_num_seqs)
    assert sized.cuda_graph_capture == "first_use" and sized.cuda_graphs is True
    assert "41.0k" in reasons["max_batch_tokens"] and "cut" not in reasons["max_batch_tokens"]


@pytest.mark.parametrize("free_gib", [0.5, 2, 6, 24])
def test_the_step_budget_then_the_sequences_shrink_to_fit_the_memory_the_pool_leaves(monkeypatch, free_gib):
    devices = _on_cuda(monkeypatch, int(free_gib * GIB))
    cfg = hf_paged.EngineConfig(memory_budget=0.9)
    sized, reasons = size_engine(cfg, LLAMA_1B, torch.bfloat16, devices)
    tokens, seqs = sized.max_batch_tokens, sized.max_num_seqs
    per_token, per_seq = sizing.step_bytes(LLAMA_1B, torch.bfloat16)
    room = free_gib * GIB * 0.1 * sizing.ACTIVATION_SHARE

    def fits(t, s):
        return t * per_token + s * per_seq <= room

    assert tokens >= sizing.MIN_BATCH_TOKENS and seqs >= sizing.MIN_NUM_SEQS
    if fits(16384, 256):
        assert (tokens, seqs) == (16384, 256)
    else:
        assert "cut to fit" in reasons["max_batch_tokens"]
        # the largest of the halvings that fits (the tokens first), or the floors when nothing does
        assert fits(tokens, seqs) or (tokens, seqs) == (sizing.MIN_BATCH_TOKENS, sizing.MIN_NUM_SEQS)
        assert seqs == 256 or tokens == sizing.MIN_BATCH_TOKENS
        assert not fits(2 * tokens, seqs) if seqs == 256 else not fits(tokens, 2 * seqs)


def test_a_given_pool_leaves_the_rest_of_free_memory_to_the_step(monkeypatch):
    devices = _on_cuda(monkeypatch, 8 * GIB)
    small_pool, _ = size_engine(hf_paged.EngineConfig(num_blocks=64), LLAMA_1B, torch.bfloat16, devices)
    assert (small_pool.max_batch_tokens, small_pool.max_num_seqs) == (16384, 256)
    per_block = 2 * 16 * 16 * 8 * 64 * 2  # K and V, 16 layers, 16 tokens, 8 heads of 64, bf16
    whole, _ = size_engine(hf_paged.EngineConfig(num_blocks=8 * GIB // per_block), LLAMA_1B, torch.bfloat16, devices)
    assert (whole.max_batch_tokens, whole.max_num_seqs) == (512, 16)  # nothing left: the floors


def test_a_steps_memory_terms_are_the_documented_formula():
    """The configuration guide's formula, term by term, for a Llama-3.2-1B shape in bfloat16: per token
    (4 h + (H + 2 Hkv) d + 3 i) x b, per sequence V x (b + 12)."""
    per_token, per_seq = sizing.step_bytes(LLAMA_1B, torch.bfloat16)
    assert per_token == (4 * 2048 + (32 + 2 * 8) * 64 + 3 * 8192) * 2 == 71_680
    assert per_seq == 128256 * (2 + 12)
    assert sizing.step_bytes(LLAMA_1B, torch.float32) == (2 * per_token, 128256 * (4 + 12))


def test_off_cuda_the_attention_workspace_is_part_of_a_step(monkeypatch):
    """On a CPU the torch backend serves every layer: its workspace bound (a piece of the step, or one query row over
    the model's longest context) counts with the activations and logits, so a step budget that would fit without it
    is cut; on CUDA (flash, the kernels) it does not count."""
    from hf_paged.attention.backends import _torch

    cpu = [torch.device("cpu")] * 16
    cfg = hf_paged.EngineConfig(num_blocks=1)
    per_token, per_seq = sizing.step_bytes(LLAMA_1B, torch.float32)
    attention = sizing.attention_bytes(LLAMA_1B, cfg, torch.float32, cpu[0])
    assert attention == max(_torch.WORKSPACE_BYTES["cpu"], _torch.piece_bytes(1, 1, 2048, 32, 8, 64, 16)) > 0
    assert sizing.attention_bytes(LLAMA_1B, cfg, torch.float32, torch.device("cuda", 0)) == 0
    full = 2048 * per_token + 256 * per_seq
    left = 2 * (full + attention // 2)  # the room (half of it) holds the step without its attention, not with it
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: left + 16 * 2 * 16 * 16 * 8 * 64 * 4 / 16)
    sized, reasons = size_engine(cfg, LLAMA_1B, torch.float32, cpu)
    assert (sized.max_batch_tokens, sized.max_num_seqs) == (1024, 256) and "cut to fit" in reasons["max_batch_tokens"]
    assert 1024 * per_token + 256 * per_seq + attention <= left * sizing.ACTIVATION_SHARE


def test_explicit_settings_win_whatever_the_memory(monkeypatch):
    devices = _on_cuda(monkeypatch, GIB // 4)
    cfg = hf_paged.EngineConfig(max_batch_tokens=16384, max_num_seqs=512, cuda_graph_capture="start")
    sized, reasons = size_engine(cfg, LLAMA_1B, torch.bfloat16, devices, Workload((600,) * 8))
    assert (sized.max_batch_tokens, sized.max_num_seqs, sized.cuda_graph_capture) == (
        16384, 512, "start")
    assert set(reasons) == {"cuda_graphs"}  # only the graph sizes were open (True: the call's powers of two)


def test_a_one_call_workload_caps_the_sequences_and_graph_sizes_a_kept_engine_does_not(monkeypatch):
    devices = _on_cuda(monkeypatch, 130 * GIB)
    one_call, _ = size_engine(hf_paged.EngineConfig(), LLAMA_1B, torch.bfloat16, devices, Workload((700,) * 64))
    assert one_call.max_num_seqs == 64 and one_call.max_batch_tokens == 16384
    assert one_call.cuda_graphs == (2, 4, 8, 16, 32, 64) and one_call.cuda_graph_capture == "on_demand"
    kept, _ = size_engine(hf_paged.EngineConfig(), LLAMA_1B, torch.bfloat16, devices,
                       Workload((700,) * 64, one_call=False))
    assert kept.max_num_seqs == 256 and kept.cuda_graphs is True
    assert kept.cuda_graph_capture == "first_use"
    latency, _ = size_engine(hf_paged.EngineConfig(), LLAMA_1B, torch.bfloat16, devices, Workload((768,)))
    assert latency.max_num_seqs == 1 and latency.cuda_graphs == (2,)  # batch 1 replays two rows


def test_the_engine_reports_what_it_picked_and_why(caplog):
    model = models(ARCH)[1]
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        engine = hf_paged.Engine(model, block_size=8, max_num_seqs=4)
    stats = engine.stats()
    assert stats["max_batch_tokens"] == engine.config.max_batch_tokens == sizing.RULES["other"].max_batch_tokens
    assert stats["max_num_seqs"] == engine.scheduler.max_num_seqs == 4  # given
    assert set(stats["sizing"]) == {"max_batch_tokens", "num_blocks", "cuda_graph_capture"}
    assert stats["sizing"]["max_batch_tokens"].startswith("automatic: off CUDA")
    limit = model.config.max_position_embeddings
    assert stats["num_blocks"] == 4 * limit // 8 and "4 sequences of 512 tokens" in stats["sizing"]["num_blocks"]
    assert stats["cuda_graph_capture"] is None  # no graphs on the CPU
    lines = [r.getMessage() for r in caplog.records if "engine on cpu" in r.getMessage()]
    assert len(lines) == 1 and "max_batch_tokens=2048 (automatic: off CUDA" in lines[0]
    assert "max_num_seqs=4 (given)" in lines[0] and f"num_blocks={4 * limit // 8} (automatic" in lines[0]


def test_generate_batch_sizes_its_engine_for_the_call_and_gives_the_same_tokens(monkeypatch):
    """No settings: the pool holds the call's sequences at full length, as many run at once as the call has, and
    the tokens are the eager model's."""
    from hf_paged.engine import _generate_batch as module

    prompts = random_prompts(5, 3, 20, seed=31)
    seen = []
    real = module.Engine

    def recording(model, config, workload=None):
        seen.append(real(model, config=config, workload=workload))
        return seen[-1]

    monkeypatch.setattr(module, "Engine", recording)
    out = hf_paged.generate_batch(models(ARCH)[1], prompts, GenerationConfig(max_new_tokens=6, eos_token_id=2))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(ARCH, prompts, 6)
    stats = seen[0].stats()
    assert stats["max_num_seqs"] == 5 and stats["num_blocks"] == sum(-(-(len(p) + 6) // 16) for p in prompts)
    assert "the call's sequences (5)" in stats["sizing"]["num_blocks"]


def test_a_one_call_engine_sizes_its_block_tables_for_the_call_and_checks_each_prompt_once(monkeypatch):
    """The block tables of ``generate_batch``'s one-call engine (and so the decode graphs' captured width and the
    pinned staging) hold the call's longest sequence, not the model's position limit; a kept engine's may serve
    longer sequences later and hold the limit (at most the pool). The call checks each prompt's ids once."""
    from hf_paged.engine import _generate_batch as module
    from hf_paged.engine import _validation as validation

    prompts = random_prompts(5, 3, 40, seed=32)
    seen, checked = [], []
    real, real_check = module.Engine, validation.prompt_token_ids
    monkeypatch.setattr(module, "Engine", lambda model, config, workload=None: seen.append(
        real(model, config=config, workload=workload)) or seen[-1])
    monkeypatch.setattr(validation, "prompt_token_ids", lambda p, *a, **k: checked.append(p) or real_check(p, *a, **k))
    model = models(ARCH)[1]
    config = GenerationConfig(max_new_tokens=6, eos_token_id=2)
    out = hf_paged.generate_batch(model, prompts, config)
    assert [o.generated_tokens for o in out.values()] == hf_greedy(ARCH, prompts, 6)
    assert checked == prompts
    block = seen[0].runner.pool.block_size
    assert seen[0].block_manager.tables.table.shape[1] == -(-(max(map(len, prompts)) + 6 + 1) // block)
    kept = hf_paged.generate_batch(model, prompts, config, persistent_manager=True)
    assert [o.generated_tokens for o in kept.values()] == hf_greedy(ARCH, prompts, 6)
    limit = model.config.max_position_embeddings
    assert seen[1].block_manager.tables.table.shape[1] == min(seen[1].runner.pool.num_blocks, -(-limit // block))
    assert seen[1].block_manager.tables.table.shape[1] > seen[0].block_manager.tables.table.shape[1]
    hf_paged.generate_batch(model, prompts[:1], config)  # (lets the kept engine go)
