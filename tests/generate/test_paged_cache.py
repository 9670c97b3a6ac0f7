"""PagedAttentionCache: sizing, bad input, copy-on-write, crop, stats."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st
from tiny_models import EOS, PAD, left_padded_batch, make_config, make_models

import hf_paged
from hf_paged.generate._batch_tables import BatchTables
from hf_paged.cache._kv_pool import KVLayout, KVPool, blocks_for_budget
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=-4), "num_blocks"),
        (dict(num_blocks=8, block_size=0), "block_size"),
        (dict(num_blocks=8, block_size=4096), "block_size"),
        (dict(num_blocks=8, block_size=2.5), "block_size"),
        (dict(num_blocks=8, dtype=torch.int8), "dtype"),
        (dict(num_blocks=8, memory_budget=0.5), "not both"),
        (dict(memory_budget=1.5), r"\(0, 1\]"),
        (dict(memory_budget=1e-15), "holds no block"),
        (dict(memory_budget=1 << 20), "for a pool of an exact size pass num_blocks"),  # bytes: no longer taken
        (dict(memory_budget=True), "a fraction in"),
        (dict(num_blocks=4, device=["cpu"]), "one per decoder layer"),
        (dict(num_blocks=4, backend="nope"), "unknown attention backend"),
    ],
)
def test_invalid_configuration_raises_at_once(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_paged.PagedAttentionCache(make_config("llama_gqa"), **kwargs)


def test_memory_budget_sizes_the_pool():
    """A fraction of free memory, as the engine takes it; with neither size given, the automatic budget (its rule:
    ``tests/cache/test_cpu_pool_sizing.py``), at most 256 sequences of the model's full length; ``num_blocks``
    exactly (a budget in bytes is refused: ``test_invalid_configuration_raises_at_once``)."""
    config = make_config("llama_gqa")
    layout = KVLayout.from_config(config)
    assert hf_paged.PagedAttentionCache(config, block_size=16, num_blocks=10).num_blocks == 10
    frac = hf_paged.PagedAttentionCache(config, block_size=16, memory_budget=1e-4)
    free = blocks_for_budget(layout, 16, torch.float32, [torch.device("cpu")] * layout.num_layers, 1e-4)
    assert frac.num_blocks >= 1 and abs(frac.num_blocks - free) <= max(2, free // 100)  # (free memory moves)
    auto = hf_paged.PagedAttentionCache(config)
    assert auto.num_blocks == min(256 * -(-config.max_position_embeddings // 16),
                                  blocks_for_budget(layout, 16, torch.float32, [torch.device("cpu")] * layout.num_layers, None))
    same = hf_paged.PagedAttentionCache(config, cache_config=hf_paged.CacheConfig(num_blocks=12, block_size=8))
    assert (same.num_blocks, same.block_size) == (12, 8)
    with pytest.raises(ValueError, match="either as cache_config.*not both \\(got cache_config and num_blocks\\)"):
        hf_paged.PagedAttentionCache(config, num_blocks=3, cache_config=hf_paged.CacheConfig())
    with pytest.raises(ValueError, match=r"cache_config must be an hf_paged.CacheConfig, got dict: pass CacheConfig"):
        hf_paged.PagedAttentionCache(config, cache_config={"num_blocks": 12})
    assert hf_paged.CacheConfig(memory_budget=1).memory_budget == 1.0  # all of free memory, written as an integer


@pytest.mark.parametrize(
    "cls, kwargs, feature",
    [
        ("T5Config", dict(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=32, vocab_size=64), "encoder-decoder"),
        ("BloomConfig", dict(hidden_size=32, n_layer=1, n_head=2, vocab_size=64), "ALiBi"),
        ("GemmaConfig", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, intermediate_size=32, vocab_size=64, use_bidirectional_attention=True),
         "non-causal"),
    ],
)
def test_unservable_architectures_are_named(cls, kwargs, feature):
    config = getattr(transformers, cls)(**kwargs)
    with pytest.raises(NotImplementedError, match=feature):
        hf_paged.PagedAttentionCache(config, num_blocks=4)


def test_linear_attention_layers_are_refused():
    config = make_config("llama_gqa")
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="linear_attention"):
        hf_paged.PagedAttentionCache(config, num_blocks=4)


def test_dtype_and_device_mismatch_say_what_to_change():
    _, paged = make_models("llama_gqa")
    batch = left_padded_batch([4, 6], torch.Generator().manual_seed(0))
    half = hf_paged.PagedAttentionCache(paged.config, num_blocks=16, block_size=4, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype=model.dtype"):
        paged.generate(**with_cache(paged, half, **batch), max_new_tokens=2, **GREEDY)
    meta_dev = hf_paged.PagedAttentionCache(paged.config, num_blocks=16, block_size=4, device="meta")
    with pytest.raises(ValueError, match="device=model.device"):
        paged.generate(**with_cache(paged, meta_dev, **batch), max_new_tokens=2, **GREEDY)


def test_cache_too_small_raises_and_leaks_nothing():
    _, paged = make_models("llama_gqa")
    batch = left_padded_batch([30, 30], torch.Generator().manual_seed(1))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=6, block_size=8)
    with pytest.raises(hf_paged.OutOfBlocksError, match="8 needed, 6 free"):
        paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=4, **GREEDY)
    assert cache.stats()["blocks_used"] == 0
    cache.pool.allocator.check_invariants()


def test_model_without_paged_attention_is_told_to_load_hf_paged():
    eager, _ = make_models("llama_gqa")
    batch = left_padded_batch([3], torch.Generator().manual_seed(2))
    cache = hf_paged.PagedAttentionCache(eager.config, num_blocks=8, block_size=4)
    with pytest.raises(RuntimeError, match='attn_implementation="hf_paged"'):
        eager.generate(**with_cache(eager, cache, **batch), max_new_tokens=2, **GREEDY)


def _tiny_pool(num_blocks=8, block_size=4) -> KVPool:
    return KVPool(KVLayout(num_layers=2, num_kv_heads=1, head_dim=2), num_blocks, block_size, torch.float32,
                  [torch.device("cpu")] * 2)


def test_copy_on_write_of_a_shared_partial_block():
    pool = _tiny_pool()
    rows = BatchTables(pool)
    rows.start(1)
    slots = rows.append(6)  # 1.5 blocks
    for k, v in pool.kv_caches:
        k.view(-1, 1, 2)[slots] = torch.arange(6.0)[:, None, None]
    rows.select_rows([0, 0])  # two rows share both blocks
    assert pool.allocator.ref_count(rows.tables[0][1]) == 2
    new = rows.append(1)
    assert rows.tables[0][0] == rows.tables[1][0], "full blocks stay shared"
    assert rows.tables[0][1] != rows.tables[1][1], "the written partial block was copied"
    assert pool.allocator.num_used == 3, "one copy: the last writer keeps the original block"
    k = pool.kv_caches[1][0].view(-1, 1, 2)
    for r in range(2):
        b = rows.tables[r][1]
        assert torch.equal(k[b * 4 : b * 4 + 2, 0, 0], torch.tensor([4.0, 5.0])), "copy kept the shared tokens"
    assert new.tolist()[0] // 4 == rows.tables[0][1] and new.tolist()[1] // 4 == rows.tables[1][1]
    rows.start(0)
    assert pool.allocator.num_free == 8
    pool.allocator.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_block_table_tensor_follows_the_tables_and_never_changes_a_given_one(seed: int):
    """Decode steps update the block-table tensor in place of a rebuild; it must equal one built from the lists, and a
    tensor handed out earlier (a plan keeps it) must keep its values."""
    gen = torch.Generator().manual_seed(seed)
    pool = _tiny_pool(num_blocks=256, block_size=3)
    rows = BatchTables(pool)
    rows.start(4)
    rows.append(7, torch.rand(4, 7, generator=gen) < 0.7)
    handed = []
    for step in range(40):
        op = torch.randint(0, 10, (1,), generator=gen).item()
        if op == 0:  # beam-style reorder: rows share blocks, later writes copy the shared partial block
            rows.select_rows(torch.randint(0, rows.num_rows, (rows.num_rows,), generator=gen).tolist())
        elif op == 1:
            rows.crop(rows.num_columns - 1)
        else:
            rows.append(1)
        table = rows.block_table_tensor()
        handed.append((table, table.clone()))
        width = max(len(t) for t in rows.tables)
        want = torch.tensor([t + [0] * (width - len(t)) for t in rows.tables], dtype=torch.int32)
        assert torch.equal(table[:, :width], want) and not table[:, width:].any()
    assert all(torch.equal(t, copy) for t, copy in handed)
    rows.start(0)
    pool.allocator.check_invariants()
    assert pool.allocator.num_free == 256


def test_crop_then_recompute_gives_the_same_logits():
    eager, paged = make_models("llama_gqa", seed=9)
    batch = left_padded_batch([5, 11], torch.Generator().manual_seed(9))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    extra = torch.randint(3, 100, (2, 3))
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    pos = (full_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        paged(**with_cache(paged, cache, input_ids=ids, attention_mask=mask, position_ids=pos[:, :11]))
        step_logits = [
            paged(**with_cache(paged, cache, input_ids=extra[:, i : i + 1], attention_mask=full_mask[:, : 12 + i],
                               position_ids=pos[:, 11 + i : 12 + i])).logits[:, -1]
            for i in range(3)
        ]
        before = cache.stats()
        cache.crop(-3)
        assert cache.get_seq_length() == 11
        assert cache.stats()["tokens_stored"] == before["tokens_stored"] - 6
        chunk = paged(**with_cache(paged, cache, input_ids=extra, attention_mask=full_mask,
                                   position_ids=pos[:, 11:])).logits  # one 3-token extend step
        want = eager(input_ids=torch.cat([ids, extra], 1), attention_mask=full_mask).logits[:, -3:]
    torch.testing.assert_close(chunk, torch.stack(step_logits, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunk, want, rtol=1e-4, atol=1e-5)
    assert cache.stats()["backends"]["extend"] == "torch"


def test_stats_count_tokens_blocks_and_fragmentation():
    _, paged = make_models("llama_gqa")
    batch = left_padded_batch([5, 8], torch.Generator().manual_seed(3))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4)
    with torch.no_grad():
        paged(**with_cache(paged, cache, **batch))
    s = cache.stats()
    assert s["tokens_stored"] == 13 and s["blocks_used"] == 2 + 2 and s["blocks_free"] == 28
    assert s["internal_fragmentation"] == pytest.approx(1 - 13 / 16)


def test_backend_restriction_orders_and_refuses():
    config = make_config("llama_gqa")
    cache = hf_paged.PagedAttentionCache(config, num_blocks=4, backend="flash,torch")
    assert [b.name for b in cache.dispatcher._order] == ["flash", "torch"]
    with pytest.raises(NotImplementedError, match="Allow more backends"):  # refused when built, not at generate
        hf_paged.PagedAttentionCache(config, num_blocks=16, block_size=4, backend=["flash"])


def test_repeat_interleave_and_select_share_blocks_and_keep_results():
    eager, paged = make_models("qwen3", seed=12)
    batch = left_padded_batch([6, 10], torch.Generator().manual_seed(12))
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=32, block_size=4)
    nxt = torch.tensor([[7], [9]])
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        paged(**with_cache(paged, cache, **batch, position_ids=pos[:, :-1]))
        used = cache.stats()["blocks_used"]
        cache.batch_repeat_interleave(2)
        assert cache.batch_size == 4 and cache.stats()["blocks_used"] == used, "repeats share blocks"
        got = paged(**with_cache(paged, cache, input_ids=nxt.repeat_interleave(2, 0),
                                 attention_mask=mask.repeat_interleave(2, 0),
                                 position_ids=pos[:, -1:].repeat_interleave(2, 0))).logits[:, -1]
        want = eager(input_ids=torch.cat([batch["input_ids"], nxt], 1), attention_mask=mask,
                     position_ids=pos).logits[:, -1]
        torch.testing.assert_close(got, want.repeat_interleave(2, 0), rtol=1e-4, atol=1e-5)
        cache.batch_select_indices(torch.tensor([3]))
        assert cache.batch_size == 1
        assert cache.stats()["tokens_stored"] == 11
    cache.reset()
    assert cache.stats()["blocks_used"] == 0
    cache.pool.allocator.check_invariants()


def test_every_mask_call_of_one_forward_gets_its_one_step():
    """Models with full and sliding layers ask for two masks per forward: both get the step planned once (the rows
    take blocks for the forward's tokens once), and the next forward is planned anew."""
    _, paged = make_models("gemma2", seed=13)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=8, block_size=4)
    asked = [cache.plan_forward(paged.config, None, 1, 5, torch.device("cpu")) for _ in range(2)]
    assert asked[0] is asked[1] and asked[0].step.pool is cache.pool
    assert cache.stats()["tokens_stored"] == 5
    cache.update(torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8), 0)  # a layer read the step: the forward ran
    following = cache.plan_forward(paged.config, None, 1, 1, torch.device("cpu"))
    assert following is not asked[0] and cache.stats()["tokens_stored"] == 6


def test_a_budget_in_bytes_is_refused_as_the_engine_refuses_it():
    """Bytes are no longer a memory budget (pre-1.0 removal): the cache and the engine's config both refuse one with
    one message, which names the two ways to size a pool; ``1`` is all of free memory in both."""
    config = make_config("llama_gqa")
    assert hf_paged.EngineConfig(memory_budget=1).memory_budget == 1.0
    for budget in (1 << 30, 2):
        with pytest.raises(ValueError) as cache_error:
            hf_paged.PagedAttentionCache(config, memory_budget=budget)
        with pytest.raises(ValueError) as engine_error:
            hf_paged.EngineConfig(memory_budget=budget)
        assert str(cache_error.value) == str(engine_error.value)
        assert "fraction in (0, 1] of free device memory" in str(cache_error.value)
        assert "pass num_blocks" in str(cache_error.value)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 4]),
       ops=st.lists(st.tuples(st.sampled_from(["extend", "decode", "ahead", "select", "crop"]), st.integers(0, 10**6)),
                    max_size=30))
def test_random_row_edits_keep_every_rows_tokens_and_the_block_counts(block_size: int, ops):
    """Random forwards (padding, blocks ahead), beam-style reorders and crops on the rows: every row reads back the
    tokens it was given (shared blocks, copies on write and crops included), each append takes the blocks the block
    manager said it would (or raises, changing nothing), and reference counts match the rows' tables."""
    pool = KVPool(KVLayout(num_layers=1, num_kv_heads=1, head_dim=1), 48, block_size, torch.float32,
                  [torch.device("cpu")])
    kv = pool.kv_caches[0][0].view(-1)  # one value a slot
    rows, tokens, values = BatchTables(pool), [[] for _ in range(3)], iter(range(1, 10**6))  # tokens: (column, value)
    rows.start(3)
    for op, seed in ops:
        gen = torch.Generator().manual_seed(seed)
        if op in ("extend", "decode", "ahead"):
            q_len = 1 if op == "decode" else 1 + seed % 5
            valid = None if op == "decode" else torch.rand(rows.num_rows, q_len, generator=gen) < 0.7
            real = torch.ones(rows.num_rows, q_len, dtype=torch.bool) if valid is None else valid
            ahead, free, start = (seed % 9 if op == "ahead" else 0), pool.allocator.num_free, rows.num_columns
            predicted = rows.manager.blocks_to_reserve(rows._rows, [int(n) + ahead for n in real.sum(1)])
            if predicted > free:
                with pytest.raises(hf_paged.OutOfBlocksError):
                    rows.append(q_len, valid, ahead)
                assert pool.allocator.num_free == free and rows.num_columns == start
                continue
            slots = rows.append(q_len, valid, ahead)
            assert free - pool.allocator.num_free == predicted
            new = [[(start + j, next(values)) for j in range(q_len) if real[r, j]] for r in range(rows.num_rows)]
            kv[slots] = torch.tensor([v for row in new for _, v in row], dtype=torch.float32)
            tokens = [old + added for old, added in zip(tokens, new)]
        elif op == "select":
            picked = torch.randint(0, rows.num_rows, (rows.num_rows,), generator=gen).tolist()
            rows.select_rows(picked)
            tokens = [list(tokens[r]) for r in picked]
        else:
            keep = seed % (rows.num_columns + 1)
            rows.crop(keep)
            tokens = [[(c, v) for c, v in row if c < keep] for row in tokens]
        rows.manager.check_invariants(rows._rows)
        assert rows.num_tokens == [len(row) for row in tokens]
        for table, row in zip(rows.tables, tokens):
            slots = [table[p // block_size] * block_size + p % block_size for p in range(len(row))]
            assert kv[slots].tolist() == [float(v) for _, v in row]
    rows.start(0)
    assert pool.allocator.num_free == 48
