"""Decode with programmatic dependent launch (the default from compute capability 9.0 on, ``paged_decode(...,
pdl=False)`` launches plainly; skipped below): each decode launch may start while the kernel before it finishes, reading
its sequence length and block-table slice and copying the K/V of keys older than each sequence's newest one before it
waits for that kernel (csrc/decode_common.cuh).

- Eagerly, the answer is the plain launch's (``pdl=False``) bit for bit (same kernel, same split) for bf16, fp16 and
  float32, GQA and MQA, a window and a softcap, and an e4m3 cache.
- In a CUDA graph whose decode launches each follow the kernel that writes their input (the query, or the new
  token's K/V through ``write_kv``), every replay equals the eager, plain answer over that step's inputs: a CTA that
  read the query or the cache before the previous kernel finished would read the previous step's values.
"""

from __future__ import annotations

import pytest
import torch

from kernel_rows import seeded
from kernel_steps import decode_step, reference, relative_error
from kernel_steps import run_decode as decode

from hf_paged import kernels
from hf_paged.cache import _kv_quant as kv_quant

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer", allow_module_level=True)

@pytest.mark.parametrize(("dtype", "heads", "ctx", "options"), [
    (torch.bfloat16, (32, 8), [8192], {}),
    (torch.bfloat16, (32, 8), [1, 16, 17, 300, 4097], {}),
    (torch.float16, (8, 1), [2000, 33], {"window": 100, "softcap": 30.0}),
    (torch.float32, (32, 8), [1000, 7], {}),
], ids=["bf16-b1-8192", "bf16-edges", "fp16-mqa-window-cap", "fp32-simt"])
def test_pdl_launch_gives_the_plain_launchs_bits(dtype, heads, ctx, options):
    meta, query, _, _, k_cache, v_cache, params = decode_step(ctx, 16, *heads, 128, dtype, seeded("eager", dtype, ctx))
    plain = decode(query, k_cache, v_cache, meta, params, pdl=False, **options)
    assert torch.equal(decode(query, k_cache, v_cache, meta, params, **options), plain)
    if not options:
        assert relative_error(plain, reference(query, k_cache, v_cache, meta, params)) < 1e-2


def test_pdl_launch_over_an_e4m3_cache_gives_the_plain_launchs_bits():
    meta, query, _, _, k_cache, v_cache, params = decode_step([3000, 5], 16, 32, 8, 128, torch.bfloat16,
                                                              seeded("fp8"))
    scale = torch.full((8,), 0.05, device=query.device)
    k8, v8 = (kv_quant.quantize(c.flatten(0, 1), scale).view(c.shape) for c in (k_cache, v_cache))
    plain = decode(query, k8, v8, meta, params, k_scale=scale, v_scale=scale, pdl=False)
    assert torch.equal(decode(query, k8, v8, meta, params, k_scale=scale, v_scale=scale), plain)


def test_graph_replays_see_what_the_kernel_before_each_decode_wrote():
    """Steps of [query.copy_(source_i) and write_kv(new token of step i), in either order; decode] captured with PDL
    on, replayed; each output equals the plain eager decode over step i's query and cache."""
    steps = 6
    meta, query, key, value, k_cache, v_cache, params = decode_step([8192, 700], 16, 32, 8, 128, torch.bfloat16,
                                                                    seeded("graph"))
    gen = seeded("graph", "inputs")
    sources = [torch.randn(query.shape, generator=gen).to(query) for _ in range(steps)]
    new_k = [torch.randn(key.shape, generator=gen).to(key) for _ in range(steps)]
    new_v = [torch.randn(value.shape, generator=gen).to(value) for _ in range(steps)]
    slots = meta.slot_mapping
    outs = [torch.empty_like(query) for _ in range(steps)]

    def step(i: int) -> None:  # the kernel right before the decode writes the cache, or (odd steps) the query
        if i % 2:
            kernels.write_kv(new_k[i], new_v[i], k_cache, v_cache, slots)
            query.copy_(sources[i])
        else:
            query.copy_(sources[i])
            kernels.write_kv(new_k[i], new_v[i], k_cache, v_cache, slots)
        decode(query, k_cache, v_cache, meta, params, out=outs[i])  # PDL: the default

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(0)  # warm-up: workspace and tickets exist before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            step(i)
    for replay in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(steps):
            query.copy_(sources[i])
            kernels.write_kv(new_k[i], new_v[i], k_cache, v_cache, slots)
            want = decode(query, k_cache, v_cache, meta, params, pdl=False)
            assert torch.equal(outs[i], want), f"replay {replay}, step {i}: not the plain decode of its own inputs"
