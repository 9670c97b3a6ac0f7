"""Decode with the split-K combine inside a thread-block cluster (``HF_PAGED_DECODE_CLUSTER=1``, compute capability
9.0 on; skipped elsewhere; csrc/decode_cluster.cuh).

- The answer is the plain launch's bit for bit (same split, same merge order) for bf16 and fp16, every compiled head
  size, GQA, MQA with two head groups, a window and a softcap, sequences whose later splits are empty (their CTAs
  only take part in the cluster's barriers), and the 16-CTA (non-portable) cluster of B=1 x 8192.
- The cluster path really ran: it writes no split partials, so a workspace filled with NaN stays NaN, while the plain
  launch fills it; with more than 16 splits (or one) the plain launch serves.
- Launches where clusters do not apply (float32, an e4m3 cache) give the plain answer.
- In a CUDA graph (with programmatic dependent launch too), replays give the plain eager answer.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("thread-block clusters need compute capability 9.0 or newer", allow_module_level=True)

from hf_paged import kernels  # noqa: E402
from hf_paged.cache import _kv_quant as kv_quant  # noqa: E402

from kernel_rows import seeded  # noqa: E402  (same folder)
from test_cuda_kernels import decode_step, reference, relative_error  # noqa: E402
from test_cuda_kernels import run_ours as decode  # noqa: E402

if kernels.unavailable_reason() is not None:
    pytest.skip(f"hf_paged kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)

CLUSTER_ENV = "HF_PAGED_DECODE_CLUSTER"


def nan_workspace(query, meta, split_len: int, window: int = 0) -> torch.Tensor:
    numel = kernels.decode_workspace_numel(query.shape[0], query.shape[1], query.shape[2], meta.max_seqlen_k,
                                           split_len, window)
    return torch.full((max(numel, 4),), float("nan"), dtype=torch.float32, device=query.device)


def both(monkeypatch, query, k_cache, v_cache, meta, params, **options):
    """(plain answer, cluster answer, splits, whether the cluster launch left the workspace untouched)."""
    window = options.get("window", 0)
    split = kernels.decode_split_len(query, k_cache, meta.max_seqlen_k, window)
    split = options.pop("split_len", split)
    splits = -(-kernels.decode_keys(meta.max_seqlen_k, window) // split)
    monkeypatch.delenv(CLUSTER_ENV, raising=False)
    plain_ws = nan_workspace(query, meta, split, window)
    plain = decode(query, k_cache, v_cache, meta, params, split_len=split, workspace=plain_ws, **options)
    monkeypatch.setenv(CLUSTER_ENV, "1")
    ws = nan_workspace(query, meta, split, window)
    clustered = decode(query, k_cache, v_cache, meta, params, split_len=split, workspace=ws, **options)
    monkeypatch.delenv(CLUSTER_ENV)
    if splits > 1:
        assert not plain_ws.isnan().all(), "the plain launch wrote no partial: the test cannot tell the paths apart"
    return plain, clustered, splits, bool(ws.isnan().all())


@pytest.mark.parametrize(("dtype", "heads", "ctx", "options"), [
    (torch.bfloat16, (32, 8), [8192], {}),
    (torch.bfloat16, (32, 8), [1, 16, 17, 300, 4097], {}),
    (torch.float16, (8, 1), [2000, 33], {"window": 1000, "softcap": 30.0, "split_len": 256}),
    (torch.bfloat16, (32, 1), [5000, 3], {}),
    (torch.float16, (16, 4), [6000, 6000, 129], {"softcap": 50.0}),
], ids=["bf16-b1-8192", "bf16-empty-splits", "fp16-mqa-window-cap", "bf16-two-head-groups", "fp16-gqa-cap"])
def test_cluster_launch_gives_the_plain_launchs_bits(monkeypatch, dtype, heads, ctx, options):
    meta, query, _, _, k_cache, v_cache, params = decode_step(ctx, 16, *heads, 128, dtype, seeded("eager", dtype, ctx))
    plain, clustered, splits, untouched = both(monkeypatch, query, k_cache, v_cache, meta, params, **options)
    assert torch.equal(clustered, plain)
    # (one split never touches the workspace on either path: every case splits, so the check below can fail)
    assert splits >= 2, f"{splits} split: the case cannot tell the paths apart"
    # (a failure with 2-16 splits may also mean this GPU cannot schedule such a cluster: cluster_fits said no)
    assert untouched == (splits <= 16), f"{splits} splits: the cluster path should run exactly for 2 to 16"
    if not options:
        assert relative_error(plain, reference(query, k_cache, v_cache, meta, params)) < 1e-2


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 112, 128, 160, 192, 256])
def test_every_head_size(monkeypatch, head_dim: int):
    meta, query, _, _, k_cache, v_cache, params = decode_step([3000, 700], 16, 32, 8, head_dim, torch.bfloat16,
                                                              seeded("hd", head_dim))
    plain, clustered, splits, untouched = both(monkeypatch, query, k_cache, v_cache, meta, params, split_len=512)
    assert splits == 6 and untouched
    assert torch.equal(clustered, plain)


def test_more_than_sixteen_splits_or_one_take_the_plain_launch(monkeypatch):
    meta, query, _, _, k_cache, v_cache, params = decode_step([4097, 50], 16, 32, 8, 128, torch.bfloat16,
                                                              seeded("many"))
    plain, clustered, splits, untouched = both(monkeypatch, query, k_cache, v_cache, meta, params, split_len=128)
    assert splits == 33 and not untouched and torch.equal(clustered, plain)
    plain, clustered, splits, _ = both(monkeypatch, query, k_cache, v_cache, meta, params, split_len=4160)
    assert splits == 1 and torch.equal(clustered, plain)


def test_float32_and_e4m3_launches_keep_the_plain_kernel(monkeypatch):
    meta, query, _, _, k_cache, v_cache, params = decode_step([3000, 5], 16, 32, 8, 128, torch.float32,
                                                              seeded("fp32"))
    plain, clustered, splits, untouched = both(monkeypatch, query, k_cache, v_cache, meta, params, split_len=1024)
    assert splits == 3 and torch.equal(clustered, plain) and not untouched
    meta, query, _, _, k_cache, v_cache, params = decode_step([3000, 5], 16, 32, 8, 128, torch.bfloat16,
                                                              seeded("fp8"))
    scale = torch.full((8,), 0.05, device=query.device)
    k8, v8 = (kv_quant.quantize(c.flatten(0, 1), scale).view(c.shape) for c in (k_cache, v_cache))
    plain, clustered, splits, untouched = both(monkeypatch, query, k8, v8, meta, params, split_len=1024,
                                               k_scale=scale, v_scale=scale)
    assert splits == 3 and torch.equal(clustered, plain) and not untouched


@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replays_give_the_plain_answer(monkeypatch, pdl: bool):
    steps = 4
    meta, query, key, value, k_cache, v_cache, params = decode_step([8192, 700], 16, 32, 8, 128, torch.bfloat16,
                                                                    seeded("graph", pdl))
    gen = seeded("graph", "inputs", pdl)
    sources = [torch.randn(query.shape, generator=gen).to(query) for _ in range(steps)]
    new_k = [torch.randn(key.shape, generator=gen).to(key) for _ in range(steps)]
    new_v = [torch.randn(value.shape, generator=gen).to(value) for _ in range(steps)]
    outs = [torch.empty_like(query) for _ in range(steps)]

    def step(i: int) -> None:
        query.copy_(sources[i])
        kernels.write_kv(new_k[i], new_v[i], k_cache, v_cache, meta.slot_mapping)
        decode(query, k_cache, v_cache, meta, params, out=outs[i])

    monkeypatch.setenv(CLUSTER_ENV, "1")
    monkeypatch.setenv("HF_PAGED_DECODE_PDL", "1" if pdl else "0")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            step(i)
    monkeypatch.delenv(CLUSTER_ENV)
    monkeypatch.delenv("HF_PAGED_DECODE_PDL", raising=False)
    for replay in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(steps):
            query.copy_(sources[i])
            kernels.write_kv(new_k[i], new_v[i], k_cache, v_cache, meta.slot_mapping)
            assert torch.equal(outs[i], decode(query, k_cache, v_cache, meta, params)), f"replay {replay}, step {i}"
