"""The all-reduce fused with its residual add and RMSNorm (the pass ``hf_paged.compile._fuse_all_reduce``, run by
``hf_paged.parallel._fuse_all_reduce``; the fused ops of ``hf_paged.parallel._all_reduce``), on one CPU process over
gloo (a group of one, where the sum is the input).

peer_sum serves only CUDA groups, so the tests declare the group served (``fused_ready``) where they need the pass to
fire; the fused ops then run their fallback (all-reduce, add, norm one after the other), whose result is checked
against transformers' own LlamaRMSNorm. A real Llama decoder layer, its rowwise linears summing through
``tp_all_reduce`` as the tensor-parallel layers do, compiled with the pass: both all-reduces fused (the norm after
attention's), the layer's output equal to the unfused compile's; the shapes the pass must leave alone left alone.
The kernel itself is checked on two GPUs (tests/gpu/parallel/test_peer_sum_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from hf_paged import envs
from hf_paged.parallel import _fuse_all_reduce as fusion
from hf_paged.parallel import _all_reduce as tp_all_reduce

REDUCE = torch.ops.hf_paged.tp_all_reduce.default
ADD = torch.ops.hf_paged.tp_all_reduce_add.default
ADD_NORM = torch.ops.hf_paged.tp_all_reduce_add_rms_norm.default


@pytest.fixture
def group(single_process_group):
    return single_process_group


@pytest.fixture
def served(monkeypatch, group):
    """The group declared served by peer_sum."""
    monkeypatch.setattr(tp_all_reduce, "fused_ready", lambda name: name == group)
    return group


class RowLinear(torch.nn.Linear):
    """A rowwise shard as the tensor-parallel layers run it in compiled code: the local product, then the sum."""

    def __init__(self, linear: torch.nn.Linear, group_name: str):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.weight = linear.weight
        self.group_name = group_name

    def forward(self, x):
        return torch.ops.hf_paged.tp_all_reduce(F.linear(x, self.weight), self.group_name)


class Layer(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, group_name: str):
        super().__init__()
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=1, vocab_size=32, rms_norm_eps=1e-5)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
        for norm in (self.layer.input_layernorm, self.layer.post_attention_layernorm):
            norm.weight.data.normal_(1.0, 0.2)
        self.layer.self_attn.o_proj = RowLinear(self.layer.self_attn.o_proj, group_name)
        self.layer.mlp.down_proj = RowLinear(self.layer.mlp.down_proj, group_name)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden):
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        out = self.layer(hidden, position_embeddings=self.rotary(hidden, positions), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out


def compiled_graphs(fn, *args):
    """``fn`` compiled with the engine's passes: its output and the post-grad graphs the passes left."""
    graphs = []

    class Seen(fusion.LayerPasses):
        def __call__(self, graph):
            super().__call__(graph)
            graphs.append([n.target for n in graph.nodes])

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, dynamic=True, options={"post_grad_custom_pre_pass": Seen(),
                                                       "fx_graph_cache": False})(*args)
    torch._dynamo.reset()
    return out, graphs


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_llama_layers_all_reduces_take_the_residual_adds_and_the_norm(served, monkeypatch, dtype):
    layer = Layer(dtype, served).eval()
    hidden = torch.randn(1, 7, 64, dtype=dtype)
    fused, graphs = compiled_graphs(layer, hidden)
    targets = [t for g in graphs for t in g]
    assert targets.count(ADD_NORM) == 1 and targets.count(ADD) == 1 and REDUCE not in targets
    monkeypatch.setattr(tp_all_reduce, "fused_ready", lambda name: False)  # NCCL serves: the unfused compile
    plain, graphs = compiled_graphs(layer, hidden)
    targets = [t for g in graphs for t in g]
    assert targets.count(REDUCE) == 2 and ADD not in targets and ADD_NORM not in targets
    with torch.no_grad():
        eager = layer(hidden)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(fused, plain, **tol)
    torch.testing.assert_close(fused, eager, **tol)
    assert fused.abs().sum() > 0


@pytest.mark.slow
def test_nothing_is_fused_without_peer_sum(group, monkeypatch):
    layer = Layer(torch.float32, group).eval()
    hidden = torch.randn(1, 5, 64)
    monkeypatch.setattr(tp_all_reduce, "fused_ready", lambda name: False)  # NCCL serves the group: nothing to gain
    _, graphs = compiled_graphs(layer, hidden)
    targets = [t for g in graphs for t in g]
    assert targets.count(REDUCE) == 2 and ADD not in targets and ADD_NORM not in targets
    assert tp_all_reduce.fused_ready("no such group") is False  # the real one: no peer_sum buffers on CPU


@pytest.mark.slow
def test_other_shapes_are_left_alone(served):
    weight = torch.randn(64)
    bias = torch.randn(64)

    def gemma_norm(x, residual):  # another norm: the add is fused, the norm is not
        h = residual + torch.ops.hf_paged.tp_all_reduce(x, served)
        hf = h.float()
        return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + weight)

    def biased(x, residual):  # the bias after the sum is the all-reduce's user: nothing is fused
        return residual + (torch.ops.hf_paged.tp_all_reduce(x, served) + bias)

    def shared(x, residual):  # the norm's squares are used elsewhere too: the add alone is fused
        h = residual + torch.ops.hf_paged.tp_all_reduce(x, served)
        squares = h.pow(2)
        return weight * (h * torch.rsqrt(squares.mean(-1, keepdim=True) + 1e-6)), squares.sum()

    def broadcast(x, residual_row):  # the add broadcasts: left alone
        return residual_row + torch.ops.hf_paged.tp_all_reduce(x, served)

    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    for fn, args, want in ((gemma_norm, (x, residual), {ADD: 1}), (biased, (x, residual), {REDUCE: 1}),
                           (shared, (x, residual), {ADD: 1}), (broadcast, (x, torch.randn(64)), {REDUCE: 1})):
        out, graphs = compiled_graphs(fn, *args)
        targets = [t for g in graphs for t in g]
        got = {op: targets.count(op) for op in (REDUCE, ADD, ADD_NORM) if targets.count(op)}
        assert got == want, fn.__name__
        with torch.no_grad():
            torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_ops_fall_back_to_their_parts(group, dtype):
    """Without peer_sum (CPU, NCCL, shapes its kernel does not serve) the ops are the sum, the add and the norm:
    the norm equal to transformers' LlamaRMSNorm of the same sum, with eps given as a number or a 0-d tensor."""
    torch.manual_seed(1)
    x, residual = torch.randn(4, 48, dtype=dtype), torch.randn(4, 48, dtype=dtype)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    norm.weight.data.normal_(1.0, 0.3)
    h = torch.ops.hf_paged.tp_all_reduce_add(x, residual, group)
    assert torch.equal(h, residual + x)
    with torch.no_grad():
        want = norm(residual + x)
    for eps, eps_tensor in ((1e-5, None), (0.0, torch.tensor(1e-5, dtype=torch.float64))):
        h2, normed = torch.ops.hf_paged.tp_all_reduce_add_rms_norm(x, residual, norm.weight.detach(), eps,
                                                                   eps_tensor, group)
        assert torch.equal(h2, residual + x)
        assert torch.equal(normed, want)


def test_the_all_reduce_choice_keys_the_fx_graph_cache(monkeypatch):
    """The pass fuses only where peer_sum serves, so a graph compiled under HF_PAGED_TP_ALL_REDUCE=nccl must not be
    served from the cache to a process on peer_sum, nor the other way round."""
    monkeypatch.setenv(envs.TP_ALL_REDUCE, "nccl")
    envs.refresh()
    nccl = fusion.LayerPasses().uuid()
    monkeypatch.setenv(envs.TP_ALL_REDUCE, "hf_paged")
    envs.refresh()
    peer_sum = fusion.LayerPasses().uuid()
    monkeypatch.delenv(envs.TP_ALL_REDUCE)
    envs.refresh()
    assert nccl != peer_sum and fusion.LayerPasses().uuid() == peer_sum  # peer_sum is the default
