"""The torch backend (every other backend's oracle) against a per-query float64 loop written from the math, and its
attention workspace against the bound its module states."""

from __future__ import annotations

import dataclasses
import math
import zlib
from types import SimpleNamespace

import pytest
import torch
from paged_steps import random_paged_step
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hf_paged.attention import AttentionParams, Dispatcher, Phase
from hf_paged.attention._step import PagedStep, attend_packed
from hf_paged.attention.backends import _torch
from hf_paged.attention.backends._torch import StepPlan, TorchBackend, paged_attention_reference
from hf_paged.attention.backends.base import AttentionInputs
from hf_paged.cache._kv_pool import KVLayout


def naive_attention(query, k_cache, v_cache, q_lens, ctx_lens, tables, params):
    bs, groups = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out, t = torch.zeros(query.shape, dtype=torch.float64), 0
    for b, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        for qi in range(q_len):
            i = ctx - q_len + qi
            for h in range(query.shape[1]):
                scores, values = [], []
                for j in range(i + 1):
                    if params.sliding_window is not None and i - j >= params.sliding_window:
                        continue
                    blk, off = tables[b][j // bs], j % bs
                    k = k_cache[blk, off, h // groups].double()
                    s = float(query[t, h].double() @ k) * params.scale
                    if params.softcap is not None:
                        s = params.softcap * math.tanh(s / params.softcap)
                    scores.append(s)
                    values.append(v_cache[blk, off, h // groups].double())
                p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
                out[t, h] = (p[:, None] * torch.stack(values)).sum(0)
            t += 1
    return out


def one_row(query_row, k_cache, v_cache, table, pos, params):
    """The float64 attention of one query row [H, D] at position ``pos`` of a sequence whose blocks are ``table``,
    vectorized over its keys and heads (for rows of long contexts, where the loop above takes seconds)."""
    bs, groups = k_cache.shape[1], query_row.shape[0] // k_cache.shape[2]
    keys = torch.arange(pos + 1)
    if params.sliding_window is not None:
        keys = keys[pos - keys < params.sliding_window]
    slots = torch.tensor(table)[keys // bs] * bs + keys % bs
    k, v = (c.flatten(0, 1)[slots].double().repeat_interleave(groups, 1) for c in (k_cache, v_cache))
    scores = torch.einsum("hd,jhd->hj", query_row.double(), k) * params.scale
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    return torch.einsum("hj,jhd->hd", torch.softmax(scores, -1), v)


CASES = {
    "prefill": ([5, 1, 9], [5, 1, 9]),
    "extend": ([3, 1, 6], [10, 4, 6]),
    "decode": ([1, 1, 1, 1], [1, 7, 16, 23]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("extra", ["plain", "window", "softcap"])
def test_torch_backend_matches_naive_loop(case, heads, extra):
    q_lens, ctx_lens = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, heads, extra)).encode()))  # not hash(): PYTHONHASHSEED
    query, k_cache, v_cache, meta, tables = random_paged_step(q_lens, ctx_lens, *heads, 8, 4, gen)
    assert meta.phase == Phase(case)
    params = AttentionParams(
        scale=8**-0.5,
        sliding_window=3 if extra == "window" else None,
        softcap=2.0 if extra == "softcap" else None,
    )
    got = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                     compute_dtype=torch.float64)
    want = naive_attention(query, k_cache, v_cache, q_lens, ctx_lens, tables, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_kv_write_skips_padding_slots():
    gen = torch.Generator().manual_seed(0)
    query, k_cache, v_cache, meta, _ = random_paged_step([2, 1], [2, 3], 2, 2, 4, 4, gen)
    backend = Dispatcher().writer(k_cache)
    before = k_cache.clone()
    key = torch.randn(3, 2, 4, generator=gen)
    object.__setattr__(meta, "has_padding_slots", True)
    meta.slot_mapping[1] = -1
    backend.write_kv(key, key, k_cache, v_cache, meta)
    flat = k_cache.view(-1, 2, 4)
    for t in (0, 2):
        assert torch.equal(flat[meta.slot_mapping[t]], key[t])
    changed = (k_cache != before).any(-1).any(-1).sum()
    assert int(changed) == 2


def test_metadata_moves_to_another_device_once_per_step():
    _, _, _, meta, _ = random_paged_step([2, 1], [5, 3], 2, 1, 4, 4, torch.Generator().manual_seed(6))
    step = PagedStep(meta, None, None)
    moved = step.on(torch.device("meta"))
    assert moved.slot_mapping.device.type == "meta" and moved.block_tables.shape == meta.block_tables.shape
    assert step.on(torch.device("meta")) is moved, "a second layer on that device reuses the copy"
    assert step.on(torch.device("cpu")) is meta and moved.phase == meta.phase and moved.num_tokens == meta.num_tokens


def test_layers_share_one_plan_per_step_and_leave_the_metadata_as_built(monkeypatch):
    """Each layer's forward gets the plan its backend made once for the step; the metadata holds no state of its own
    (frozen, no per-step dict), so a forward changes none of its fields, and the output is the reference's."""
    gen = torch.Generator().manual_seed(4)
    query, k_cache, v_cache, meta, _ = random_paged_step([3, 1], [6, 4], 4, 2, 8, 4, gen)
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    plans, seen, forward = [], [], TorchBackend.forward
    monkeypatch.setattr(TorchBackend, "plan", lambda self, m: plans.append(m) or StepPlan.of(m))
    monkeypatch.setattr(TorchBackend, "forward", lambda self, x, plan: seen.append(plan) or forward(self, x, plan))
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)
    pool = SimpleNamespace(layout=layout, kv_caches=[(k_cache, v_cache)] * 2, kv_scales=None)
    step = PagedStep(meta, pool, Dispatcher("torch"))
    key = torch.randn(meta.num_tokens, 2, 8, generator=gen)
    outs = [attend_packed(step, layer, query, key, key, None, None, None) for layer in (0, 1)]
    assert plans == [meta] and len(seen) == 2 and seen[0] is seen[1]
    assert all(getattr(meta, name) is value for name, value in fields.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.num_tokens = 0
    want = paged_attention_reference(query, k_cache, v_cache, meta, AttentionParams(scale=8**-0.5))
    torch.testing.assert_close(outs[1], want)


# Engine-like steps: decode rows first, then prompt chunks over a cached prefix (ragged), then whole prompts.
MIXED = ([1, 1, 1, 1, 1, 7, 3, 12, 30], [9, 30, 4, 17, 1, 25, 3, 12, 40])


@pytest.mark.parametrize("budget", [1, 60000, 10**9])
@pytest.mark.parametrize("heads,extra", [((4, 4), "plain"), ((6, 2), "window"), ((4, 1), "softcap")])
def test_pieces_of_a_step_match_the_naive_loop(monkeypatch, budget, heads, extra):
    """Whatever the piece budget (1 byte: every query row alone; 60 kB: decode rows in groups and the long prompt in
    runs of rows; unbounded: the whole step at once), the output is the float64 loop's."""
    monkeypatch.setitem(_torch.WORKSPACE_BYTES, "cpu", budget)
    q_lens, ctx_lens = MIXED
    gen = torch.Generator().manual_seed(zlib.crc32(repr((budget, heads, extra)).encode()))
    query, k_cache, v_cache, meta, tables = random_paged_step(q_lens, ctx_lens, *heads, 8, 4, gen)
    params = AttentionParams(scale=8**-0.5, sliding_window=5 if extra == "window" else None,
                             softcap=1.5 if extra == "softcap" else None)
    plan = StepPlan.of(meta)
    got = paged_attention_reference(query.double(), k_cache.double(), v_cache.double(), meta, params,
                                    compute_dtype=torch.float64, plan=plan)
    want = naive_attention(query, k_cache, v_cache, q_lens, ctx_lens, tables, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    [pieces] = plan.pieces.values()
    if budget in (1, 10**9):
        assert len(pieces) == {1: sum(q_lens), 10**9: 1}[budget]
    else:  # decode rows grouped, and a prompt cut into runs of its rows
        assert any(p.seqs.stop - p.seqs.start > 1 for p in pieces)
        assert any(p.q < q_lens[p.seqs.start] for p in pieces)
    float32 = paged_attention_reference(query, k_cache, v_cache, meta, params)
    torch.testing.assert_close(float32.double(), want, rtol=1e-5, atol=1e-5)


def test_a_fixed_shape_decode_plan_holds_while_its_lengths_change_in_place():
    """A static decode step (one metadata whose lengths grow in place, one plan kept across steps) is planned from
    its bound, never from the lengths it had when planned."""
    gen = torch.Generator().manual_seed(7)
    ctx_lens = [5, 17, 11, 6]
    query, k_cache, v_cache, meta, tables = random_paged_step([1] * 4, ctx_lens, 4, 2, 8, 4, gen)
    meta = dataclasses.replace(meta, static=True, max_seqlen_k=4 * meta.block_tables.shape[1])
    backend, params = TorchBackend(), AttentionParams(scale=8**-0.5)
    plan = backend.plan(meta)
    for step in range(3):
        lens = [c + step for c in ctx_lens]
        meta.seq_lens_k.copy_(torch.tensor(lens))
        got = backend.forward(AttentionInputs(query, None, None, k_cache, v_cache, meta, params), plan)
        want = naive_attention(query, k_cache, v_cache, [1] * 4, lens, tables, params)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


class PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made by the ops run inside it held at once (storages of the ``inputs`` not
    counted); raises as soon as that passes ``limit``, before a padded step allocates on."""

    def __init__(self, inputs, limit: float = float("inf")):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak, self.limit = 0, limit

    @classmethod
    def _should_skip_dynamo(cls):  # no compiler runs in here: leave torch._dynamo unimported (4 s)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.inputs and (ptr not in self.live or self.live[ptr][0].expired()):
                    self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {p: (ref, n) for p, (ref, n) in self.live.items() if not ref.expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        if self.peak > self.limit:
            raise AssertionError(f"{func} took the workspace to {self.peak / 2**20:.0f} MiB, over the limit")
        return out


def _workspace(q_lens, ctx_lens, heads, head_dim, block_size, seed, params, limit=float("inf")):
    """(peak bytes, the module's bound, output, step) of the torch backend's forward on a random step."""
    gen = torch.Generator().manual_seed(seed)
    query, k_cache, v_cache, meta, tables = random_paged_step(q_lens, ctx_lens, *heads, head_dim, block_size, gen)
    inputs = AttentionInputs(query, None, None, k_cache, v_cache, meta, params)
    with PeakBytes((query, k_cache, v_cache, dataclasses.astuple(meta)), limit) as peak:
        out = TorchBackend().forward(inputs, TorchBackend().plan(meta))
    bound = _torch.workspace_bytes("cpu", max(ctx_lens), *heads, head_dim, block_size) + query.nbytes
    return peak.peak, bound, out, (query, k_cache, v_cache, tables)


def test_a_long_prompt_beside_long_contexts_takes_a_bounded_workspace():
    """16 sequences decoding at 1,500 tokens of context beside a 1,500-token prompt, on the tiny model's heads (8
    of 16, 2 KV heads): under 300 MB, within the module's bound (the padded step took 4 GB); the decode rows and
    the prompt's last rows as the float64 loop has them."""
    q_lens, ctx_lens = [1] * 16 + [1500], [1500] * 17
    params = AttentionParams(scale=16**-0.5)
    peak, bound, out, (query, k_cache, v_cache, tables) = _workspace(q_lens, ctx_lens, (8, 2), 16, 16, 3, params,
                                                                     limit=300e6)
    assert peak <= bound < 300e6
    checked = [(t, t, 1499) for t in range(16)] + [(16 + pos, 16, pos) for pos in (0, 700, 1350, 1499)]
    for t, seq, pos in checked:  # (packed row, its sequence, its position)
        want = one_row(query[t], k_cache, v_cache, tables[seq], pos, params)
        torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_the_workspace_stays_within_the_stated_bound(monkeypatch, seed):
    """Random ragged steps under a small piece budget: the most bytes held at once stay within
    ``workspace_bytes`` (the budget, or one query row over the longest context) plus the output."""
    monkeypatch.setitem(_torch.WORKSPACE_BYTES, "cpu", [2**16, 2**18, 2**20, 2**21][seed])
    rng = torch.Generator().manual_seed(seed)
    decode = int(torch.randint(0, 40, (), generator=rng))
    prompts = torch.randint(1, 300, (int(torch.randint(1, 4, (), generator=rng)),), generator=rng).tolist()
    q_lens = [1] * decode + prompts
    ctx_lens = torch.randint(1, 800, (decode,), generator=rng).tolist() + [p + 100 * seed for p in prompts]
    params = AttentionParams(scale=0.25, sliding_window=[None, 64][seed % 2])
    peak, bound, out, _ = _workspace(q_lens, ctx_lens, [(8, 2), (4, 4), (12, 3), (6, 1)][seed], 16, 16, seed,
                                     params)
    assert peak <= bound
