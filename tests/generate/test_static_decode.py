"""Armed decode steps (``hf_paged/generate/_static_decode.py``, ``BatchTables.arm``/``advance``): the host work a compiled
``generate`` step is left with, and the bookkeeping it defers.

The oracles: the per-row path (``BatchTables.append``) for slots and lists, eager hf_paged for tokens.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import EOS, PAD, left_padded_batch, make_models
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig

import hf_paged
from hf_paged.generate._batch_tables import BatchTables
from hf_paged.cache._kv_pool import KVLayout, KVPool
from hf_paged.generate._static_decode import StaticDecode
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


class TensorOps(TorchDispatchMode):
    """Records the name and mutability of every tensor op run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func._schema.name, func._schema.is_mutable))
        return func(*args, **(kwargs or {}))


class CountCalls:
    """A torch.compile backend ("eager") counting the calls of its graphs."""

    def __init__(self):
        self.calls = 0

    def __deepcopy__(self, memo) -> CountCalls:
        return self  # generate deep-copies its compile_config

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        def counted(*args):
            self.calls += 1
            return gm.forward(*args)

        return counted


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_decode_step_plans_with_in_place_ops_only(monkeypatch):
    """Structural guard on the host work of a compiled decode step: after the step that arms the rows, planning runs
    only in-place tensor ops (no new tensor, no copy: on a GPU, no allocation and no host-to-device upload), a few of
    them whatever the batch, and generate's tokens stay eager hf_paged's."""
    _, paged = make_models("llama_gqa", seed=51)
    batch = left_padded_batch([5, 14, 9], torch.Generator().manual_seed(51))
    kwargs = dict(max_new_tokens=15, **GREEDY)
    want = paged.generate(**with_cache(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4),
                                       **batch), **kwargs)
    per_step: list[list[tuple[str, bool]]] = []
    plan_step = hf_paged.PagedAttentionCache.plan_step

    def recorded(self, *args, **kw):
        with TensorOps() as mode:
            plan = plan_step(self, *args, **kw)
        per_step.append(mode.ops)
        return plan

    monkeypatch.setattr(hf_paged.PagedAttentionCache, "plan_step", recorded)
    cache = hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4, max_new_tokens=15,
                                         compileable=True)
    backend = CountCalls()
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    got = paged.generate(**with_cache(paged, cache, **batch), compile_config=config, **kwargs)
    assert torch.equal(got, want)
    assert len(per_step) == got.shape[1] - batch["input_ids"].shape[1] and backend.calls == len(per_step) - 1
    prefill, first_decode, *armed = per_step
    assert any(not mutable for _, mutable in first_decode), "the first decode step uploads (it arms the rows)"
    assert armed, "the batch decoded past its first step"
    for ops in armed:
        assert all(mutable and name != "aten::copy_" for name, mutable in ops), ops
        assert len(ops) <= 4, ops


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_advanced_steps_give_the_slots_and_lists_of_appended_ones(block_size: int):
    """Rows armed after a decode step and advanced k steps: the device slots of each step are the slots the per-row
    path gives the same positions, and the lists caught up hold what k appends would; a reorder then settles the
    rows (blocks not written go back to the free list) and the block counts stay consistent."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
    pool = KVPool(layout, 64, block_size, torch.float32, [torch.device("cpu")])
    rows = BatchTables(pool)
    prompts, new = [3, 11, 6], 9
    rows.start(len(prompts))
    valid = torch.arange(max(prompts))[None, :] >= (max(prompts) - torch.tensor(prompts))[:, None]
    rows.append(max(prompts), valid, ahead=new)
    assert [len(t) for t in rows.tables] == [-(-(n + new) // block_size) for n in prompts]
    static = StaticDecode(None, pool, None, torch.float32, None, compileable=False)
    static.size_for(len(prompts), max(-(-(n + new) // block_size) for n in prompts))
    slots = rows.append(1)
    static.plan(rows, slots)
    assert rows._advances_left >= new - 1, "armed after a decode step, for the tokens reserved"
    stepped = []
    for _ in range(new - 1):
        assert rows.advance()
        stepped.append(static.advance().slot_mapping.clone())
    tables, lens = rows.tables, rows.num_tokens
    assert lens == [n + new for n in prompts]
    assert [len(t) for t in tables] == [-(-n // block_size) for n in lens]
    for k, got in enumerate(stepped):
        pos = [n + 1 + k for n in prompts]
        assert got.tolist() == [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pos)]
    assert static.meta.seq_lens_k.tolist() == lens
    assert static.meta.cu_seqlens_k.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert rows.stats()["blocks_reserved"] == 0 and rows.stats()["tokens_stored"] == sum(lens)
    rows.select_rows([2, 2, 0])
    rows.manager.check_invariants(rows._rows)
    assert rows.num_tokens == [lens[2], lens[2], lens[0]] and rows.tables == [tables[2], tables[2], tables[0]]
    rows.start(0)
    pool.allocator.check_invariants()
    assert pool.allocator.num_used == 0


def test_reading_mid_batch_catches_up_and_stays_armed():
    """stats() and the lists, read between armed steps, show every step so far; the rows stay armed."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4)
    pool = KVPool(layout, 32, 4, torch.float32, [torch.device("cpu")])
    rows = BatchTables(pool)
    rows.start(2)
    rows.append(5, ahead=8)
    static = StaticDecode(None, pool, None, torch.float32, None, compileable=False)
    static.size_for(2, 4)
    static.plan(rows, rows.append(1))
    left = rows._advances_left
    for _ in range(3):
        rows.advance()
        static.advance()
    stats = rows.stats()
    assert stats["tokens_stored"] == 2 * 9 and stats["blocks_used"] == 8
    assert stats["blocks_reserved"] == 8 - 2 * 3, "blocks not yet written (each row wrote 3) stay reserved"
    assert rows._advances_left == left - 3 and rows.advance()
