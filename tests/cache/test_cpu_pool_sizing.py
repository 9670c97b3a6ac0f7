"""An automatic KV pool on a CPU holds what its owner can use (an engine: ``max_num_seqs`` sequences at the model's
position limit), at most ``CPU_MEMORY_SHARE`` of the machine's RAM and ``DEFAULT_MEMORY_BUDGET`` of its free memory;
a GPU's automatic pool is 0.8 of its free memory as before; an explicit ``num_blocks`` or ``memory_budget`` wins; the
engine's start-up line says what the pool took and why.

The machine's memory is simulated (``free_memory_bytes``, ``total_memory_bytes``), so the rule is checked on RAM
sizes this box does not have; the expected block counts are computed here from the rule's numbers."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from engine_helpers import hf_greedy, models, random_prompts
from hf_paged.cache import _kv_pool
from hf_paged.engine import _sizing

ARCH = "llama_gqa"
GIB = 2**30
CPU_SHARE, FREE_SHARE = 0.03, 0.8  # the rule's numbers, written out: a change of them must show here


def _machine(monkeypatch, total: float, free: float) -> None:
    """Make every reader of the CPU's memory see ``total`` bytes of RAM, ``free`` of them free."""
    for module in (_kv_pool, _sizing):
        monkeypatch.setattr(module, "free_memory_bytes", lambda device: int(free))
    monkeypatch.setattr(_kv_pool, "total_memory_bytes", lambda device: int(total))


def _tiny():
    model = models(ARCH)[1]
    text = model.config
    head_dim = text.hidden_size // text.num_attention_heads
    # K and V, per layer, block_size 16 tokens, float32
    per_block = 2 * text.num_hidden_layers * 16 * text.num_key_value_heads * head_dim * 4
    return model, per_block, text.max_position_embeddings


def test_the_rule_constants_are_the_ones_written_here():
    assert (_kv_pool.CPU_MEMORY_SHARE, _kv_pool.DEFAULT_MEMORY_BUDGET) == (CPU_SHARE, FREE_SHARE)
    assert hf_paged.EngineConfig().memory_budget is None and hf_paged.CacheConfig().memory_budget is None


@pytest.mark.parametrize("max_num_seqs", [1, 4, 16])
def test_with_room_enough_the_pool_holds_max_num_seqs_sequences_at_the_position_limit(monkeypatch, max_num_seqs):
    model, per_block, limit = _tiny()
    _machine(monkeypatch, total=64 * GIB, free=60 * GIB)
    engine = hf_paged.Engine(model, max_num_seqs=max_num_seqs)
    work = max_num_seqs * -(-limit // 16)
    assert work * per_block < CPU_SHARE * 64 * GIB  # (the work binds here)
    assert engine.runner.pool.num_blocks == engine.config.num_blocks == work
    assert "within 3% of the machine's RAM" in engine.stats()["sizing"]["num_blocks"]
    engine.close()


@pytest.mark.parametrize("blocks_in_share", [5.5, 40.25, 100.75])
def test_on_a_small_machine_the_pool_takes_the_ram_share_and_never_more(monkeypatch, blocks_in_share, caplog):
    model, per_block, limit = _tiny()
    total = blocks_in_share * per_block / CPU_SHARE  # a machine whose RAM share holds blocks_in_share blocks
    _machine(monkeypatch, total=total, free=total * 0.9)
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        engine = hf_paged.Engine(model, max_num_seqs=16)
    assert 16 * -(-limit // 16) > blocks_in_share  # (the work would take more)
    assert engine.runner.pool.num_blocks == int(blocks_in_share)
    assert engine.runner.pool.num_blocks * per_block <= CPU_SHARE * total
    why = engine.stats()["sizing"]["num_blocks"]
    assert why.startswith(f"automatic: 16 sequences of {limit} tokens at full length, float32 KV; cut from "
                          f"{16 * -(-limit // 16)} to what 3% of the machine's RAM")
    line = [r.getMessage() for r in caplog.records if "engine on cpu" in r.getMessage()]
    assert len(line) == 1 and f"num_blocks={int(blocks_in_share)} ({why})" in line[0]
    # the small pool serves all the same (sequences wait their turn): the tokens are eager attention's
    prompts = random_prompts(6, 30, 60, seed=61)
    outs = engine.generate(prompts, GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None))
    assert [o.token_ids for o in outs] == hf_greedy(ARCH, prompts, 5)
    engine.close()


def test_free_memory_bounds_the_pool_below_the_ram_share(monkeypatch):
    model, per_block, limit = _tiny()
    total = 1000.5 * per_block / CPU_SHARE
    _machine(monkeypatch, total=total, free=12.5 * per_block / FREE_SHARE)  # 0.8 of free memory: 12.5 blocks
    engine = hf_paged.Engine(model, max_num_seqs=16)
    assert engine.runner.pool.num_blocks == 12
    assert "cut from" in engine.stats()["sizing"]["num_blocks"] and "80% of free memory" in engine.stats()[
        "sizing"]["num_blocks"]


def test_an_explicit_budget_or_pool_wins_over_the_ram_share(monkeypatch):
    model, per_block, limit = _tiny()
    total = 10.5 * per_block / CPU_SHARE  # the share would hold 10 blocks
    _machine(monkeypatch, total=total, free=total)
    half = hf_paged.Engine(model, max_num_seqs=2, memory_budget=0.5)
    assert half.runner.pool.num_blocks == min(2 * -(-limit // 16), int(0.5 * total // per_block)) > 10
    assert "50% of free memory" in half.stats()["sizing"]["num_blocks"]
    half.close()
    given = hf_paged.Engine(model, max_num_seqs=2, num_blocks=48)
    assert given.runner.pool.num_blocks == 48 and "num_blocks" not in given.stats()["sizing"]
    given.close()


def test_a_gpu_keeps_its_rule_a_fraction_of_free_memory(monkeypatch):
    """No GPU needed: the rule only reads free memory (simulated), and the RAM share is not read for a GPU."""
    _, per_block, _ = _tiny()
    model_config = models(ARCH)[1].config
    layout = _kv_pool.KVLayout.from_config(model_config)
    free = 1000.5 * per_block / FREE_SHARE
    monkeypatch.setattr(_kv_pool, "free_memory_bytes", lambda device: int(free))
    monkeypatch.setattr(_kv_pool, "total_memory_bytes", lambda device: pytest.fail("the RAM share read for a GPU"))
    devices = [torch.device("cuda", 0)] * layout.num_layers
    assert _kv_pool.pool_blocks(hf_paged.CacheConfig(), layout, torch.float32, devices, cap=10**6) == 1000
    assert _kv_pool.describe_budget(None, devices) == "80% of free memory"
    # and PagedAttentionCache's automatic pool follows the same rule on a CPU
    _machine(monkeypatch, total=20.5 * per_block / CPU_SHARE, free=10**12)
    assert hf_paged.PagedAttentionCache(model_config).num_blocks == 20
