"""On the GPU: the layer kernels (hf_paged/csrc/layer_ops.cu) against their references (the Llama modules' own
operators, ``hf_paged.kernels._layer_ops``) on fresh random data, in every dtype they serve, with rows and widths that
take the 16-byte and the one-element paths, strided inputs, inside a CUDA graph; and an engine whose eager layers run
on them against one whose layers keep transformers' modules.

SiLU x up, the rotary embedding and the residual add round where the references round, so they must equal them bit
for bit. RMSNorm sums its squares in another order than torch's reduction: its float32 factor may differ in the last
bit, so an element may be one step of the dtype's rounding away, and no more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
from hf_paged.compile import _layer_kernels as layer_kernels
from hf_paged.kernels import _layer_ops as ops

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

DEVICE = torch.device("cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STEP = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # one rounding step, relative


def _rand(*shape, dtype, seed):
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (7, 4096), (2, 12288), (300, 1000), (3, 8), (2, 5)])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_is_the_modules_up_to_one_rounding_step(dtype, rows, hidden, strided):
    wide = _rand(rows, hidden + (8 if strided else 0), dtype=dtype, seed=rows * hidden) * 3
    x = wide[:, :hidden]  # rows at a stride past their width where strided
    weight = _rand(hidden, dtype=dtype, seed=1) + 1
    got, want = ops.rms_norm(x, weight, 1e-5), ops.rms_norm_reference(x, weight, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= 2 * STEP[dtype] * want.float().abs() + 1e-30).all()), diff.max()
    if dtype != torch.float32:  # (in float32 a row whose factor differs in its last bit differs everywhere)
        assert (diff == 0).float().mean() > 0.9  # most elements exactly the module's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (33, 4096), (2, 12288), (3, 5)])
def test_add_rms_norm_is_the_layers_add_and_norm(dtype, rows, hidden):
    x = _rand(rows, hidden, dtype=dtype, seed=hidden) * 2
    residual = _rand(rows, hidden + 8, dtype=dtype, seed=rows)[:, :hidden]  # rows at a stride of their own
    weight = _rand(hidden, dtype=dtype, seed=2) + 1
    (got_sum, got), (want_sum, want) = (ops.add_rms_norm(x, residual, weight, 1e-6),
                                        ops.add_rms_norm_reference(x, residual, weight, 1e-6))
    assert torch.equal(got_sum, want_sum) and got_sum.is_contiguous() and got.is_contiguous()
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= 2 * STEP[dtype] * want.float().abs() + 1e-30).all()), diff.max()
    with pytest.raises(ValueError, match="residual must be x's shape"):
        ops.add_rms_norm(x, residual[:, :-1], weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 8192), (5, 4096), (257, 1000), (2, 3)])
def test_silu_and_mul_equals_the_modules_bit_for_bit(dtype, rows, width):
    both = _rand(rows, 2 * width, dtype=dtype, seed=width) * 4  # a packed gate/up product: two views
    gate, up = both.split(width, dim=-1)
    got = ops.silu_and_mul(gate, up)
    assert torch.equal(got, ops.silu_and_mul_reference(gate, up)) and got.is_contiguous()
    apart = ops.silu_and_mul(gate.contiguous(), up.contiguous())
    assert torch.equal(apart, got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,tokens,head_dim", [(1, 32, 8, 1, 64), (1, 16, 4, 37, 128),
                                                                  (3, 4, 2, 5, 32), (2, 2, 1, 3, 256)])
def test_rotary_equals_the_modules_bit_for_bit(dtype, batch, heads, kv_heads, tokens, head_dim):
    # as transformers lays them out: [batch, tokens, heads * head_dim] products viewed as [batch, heads, tokens, d]
    q = _rand(batch, tokens, heads * head_dim, dtype=dtype, seed=1).view(batch, tokens, heads, head_dim).transpose(1, 2)
    k = _rand(batch, tokens, kv_heads * head_dim, dtype=dtype, seed=2).view(batch, tokens, kv_heads,
                                                                            head_dim).transpose(1, 2)
    for shared in (True, False):
        rows = 1 if shared else batch
        angle = _rand(rows, tokens, head_dim // 2, dtype=torch.float32, seed=3) * 10
        emb = torch.cat((angle, angle), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        got, want = ops.rotary(q, k, cos, sin), ops.rotary_reference(q, k, cos, sin)
        for g, w, x in zip(got, want, (q, k), strict=True):
            assert torch.equal(g, w) and g.stride() == x.stride()


def test_the_kernels_replay_in_a_cuda_graph():
    x, weight = _rand(4, 2048, dtype=torch.bfloat16, seed=5), _rand(2048, dtype=torch.bfloat16, seed=6)
    gate, up = _rand(4, 8192, dtype=torch.bfloat16, seed=7), _rand(4, 8192, dtype=torch.bfloat16, seed=8)
    ops.rms_norm(x, weight, 1e-6), ops.silu_and_mul(gate, up)  # (warm-up outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = ops.rms_norm(x, weight, 1e-6), ops.silu_and_mul(gate, up)
    for seed in (9, 10):
        x.copy_(_rand(4, 2048, dtype=torch.bfloat16, seed=seed))
        gate.copy_(_rand(4, 8192, dtype=torch.bfloat16, seed=seed + 1))
        graph.replay()
        assert torch.equal(act, ops.silu_and_mul_reference(gate, up))
        assert torch.allclose(normed.float(), ops.rms_norm_reference(x, weight, 1e-6).float(), rtol=2**-6, atol=0)


def test_bad_input_raises_a_clear_error():
    x = _rand(2, 64, dtype=torch.float16, seed=1)
    with pytest.raises(ValueError, match="weight must have dtype"):
        ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous \\[64\\]"):
        ops.rms_norm(x, torch.ones(32, device=DEVICE, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="one shape"):
        ops.silu_and_mul(x, x[:, :32])
    q = _rand(1, 2, 3, 8, dtype=torch.float16, seed=2)
    with pytest.raises(ValueError, match="cos and sin must be"):
        ops.rotary(q, q, q[0, :1, :, :4], q[0, :1, :, :4])
    with pytest.raises(NotImplementedError, match="serves float32"):
        ops.silu_and_mul(x.double(), x.double())


def _engine_tokens(model, prompts, layer_kernels: bool):
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, compile_layers=False,
                             layer_kernels=layer_kernels)
    try:
        assert engine.runner.layer_kernels is layer_kernels
        results = engine.generate(prompts, GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))
        return [r.token_ids for r in results]
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])  # (q/k/v biases; q/k norms)
def test_an_engine_on_the_layer_kernels_gives_the_tokens_of_transformers_modules(family):
    cfg = AutoConfig.for_model(family, vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_paged").to(DEVICE).eval()
    assert layer_kernels.for_engine(model, None)  # norms, MLPs and rotary routed: what the default serves
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 40)]
    want = _engine_tokens(model, prompts, layer_kernels=False)
    got = _engine_tokens(model, prompts, layer_kernels=True)
    assert got == want  # float32: the kernels compute the modules' values (RMSNorm up to its sum's order)


def test_with_no_settings_an_engine_runs_on_the_layer_kernels_and_compiles_nothing():
    """The default on one GPU: a Llama's layers eager on the layer kernels (no torch.compile), the tokens of
    transformers' modules."""
    from torch._dynamo.utils import counters

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="hf_paged").to(DEVICE).eval()
    prompts = [[5, 9, 11, 40, 7], list(range(3, 33))]
    want = _engine_tokens(model, prompts, layer_kernels=False)
    frames = counters["frames"]["total"]
    engine = hf_paged.Engine(model, num_blocks=64, block_size=16, max_num_seqs=4)
    try:
        got = engine.generate(prompts, GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None))
        stats = engine.stats()
        assert stats["layer_kernels"] is True and stats["compiled_layers"] is False and engine.runner.compiled is None
        assert counters["frames"]["total"] == frames  # nothing traced by dynamo
        assert [r.token_ids for r in got] == want
    finally:
        engine.close()
