"""The L2 prefetch hints of the tensor-parallel all-reduces (``hf_paged.parallel._linears.set_prefetch``): each rowwise
shard's all-reduce is handed the first bytes of the weights of the colwise shards after it (o_proj: the MLP's gate;
down_proj: the next layer's q/k/v, all three where they are packed end to end), never past the limit, and none for
the last layer or with the switch at 0. peer_sum's kernel, which takes the hint, is checked on two GPUs
(benchmarks/all_reduce_latency.py's checks, asserted by tests/gpu/test_peer_sum_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.parallel import _linears as tp_linears

SHAPES = (("q_proj", 16, False), ("k_proj", 8, False), ("v_proj", 8, False), ("o_proj", 12, True),
          ("gate_proj", 20, False), ("up_proj", 20, False), ("down_proj", 12, True))


def _local(weight: torch.Tensor, rowwise: bool) -> tp_linears.LocalLinear:
    """A LocalLinear over a plain local shard (what refresh() takes from a DTensor)."""
    local = tp_linears.LocalLinear.__new__(tp_linears.LocalLinear)
    local.weight, local.rowwise, local.prefetch = weight, rowwise, None
    return local


def _layers(n: int = 2, packed: bool = True) -> torch.nn.ModuleList:
    """``n`` decoder-like layers of linears (input width 12) in a model's module order, each linear's forward a
    LocalLinear; q/k/v's weights end to end in one buffer where ``packed``."""
    layers = torch.nn.ModuleList()
    for _ in range(n):
        layer = torch.nn.Module()
        qkv = torch.randn(32 * 12)
        offset = 0
        for name, rows, rowwise in SHAPES:
            linear = torch.nn.Linear(12, rows, bias=False)
            weight = linear.weight.detach()
            if packed and name in ("q_proj", "k_proj", "v_proj"):
                weight = qkv[offset : offset + rows * 12].view(rows, 12)
                offset += rows * 12
            linear.forward = _local(weight, rowwise)
            setattr(layer, name, linear)
        layers.append(layer)
    return layers


def _span(hint: torch.Tensor) -> tuple[int, int]:
    return hint.data_ptr(), hint.numel() * hint.element_size()


def test_each_rowwise_shard_prefetches_the_weights_of_the_products_after_it():
    layers = _layers()
    assert tp_linears.set_prefetch(layers, 1 << 20) == 3  # two o_proj and the first down_proj
    first, second = layers
    gate = first.gate_proj.forward.weight
    assert _span(first.o_proj.forward.prefetch) == (gate.data_ptr(), gate.numel() * 4)  # gate and up lie apart
    q = second.q_proj.forward.weight
    assert _span(first.down_proj.forward.prefetch) == (q.data_ptr(), 32 * 12 * 4)  # q, k and v: packed
    assert second.down_proj.forward.prefetch is None  # the last layer: no product of the layers after it
    for linear in (first.q_proj, first.gate_proj, second.v_proj):
        assert linear.forward.prefetch is None  # colwise shards sum nothing
    assert first.down_proj.forward.prefetch.is_contiguous()


def test_the_limit_cuts_the_hint_and_zero_gives_none():
    layers = _layers()
    tp_linears.set_prefetch(layers, 100 * 4)  # 100 floats: less than q/k/v, and less than gate
    q = layers[1].q_proj.forward.weight
    assert _span(layers[0].down_proj.forward.prefetch) == (q.data_ptr(), 400)
    assert _span(layers[0].o_proj.forward.prefetch)[1] == 400
    assert tp_linears.set_prefetch(layers, 0) == 0
    assert all(m.forward.prefetch is None for m in layers.modules() if isinstance(m, torch.nn.Linear))


def test_shards_apart_prefetch_only_the_first():
    layers = _layers(packed=False)
    tp_linears.set_prefetch(layers, 1 << 20)
    q = layers[1].q_proj.forward.weight
    assert _span(layers[0].down_proj.forward.prefetch) == (q.data_ptr(), 16 * 12 * 4)


def test_the_switch_reads_mib_and_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.delenv(tp_linears.PREFETCH_ENV, raising=False)
    assert tp_linears.prefetch_bytes() == 0  # opt-in
    monkeypatch.setenv(tp_linears.PREFETCH_ENV, "16")
    assert tp_linears.prefetch_bytes() == 16 << 20
    monkeypatch.setenv(tp_linears.PREFETCH_ENV, "0.5")
    assert tp_linears.prefetch_bytes() == 1 << 19
    for bad in ("lots", "-1", "nan", "4096"):
        monkeypatch.setenv(tp_linears.PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match="HF_PAGED_TP_PREFETCH_MB"):
            tp_linears.prefetch_bytes()


def test_a_hint_the_kernel_cannot_take_is_dropped_not_an_error():
    from hf_paged.parallel._all_reduce import _hint

    x = torch.zeros(8)
    assert _hint(None, x) is None
    assert _hint(torch.zeros(4, 4).t(), x) is None  # not contiguous
    assert _hint(torch.zeros(9)[1:], x) is None  # not on a 16-byte boundary
    ok = torch.zeros(16)
    assert _hint(ok, x) is ok
