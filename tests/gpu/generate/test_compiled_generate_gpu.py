"""On the GPU: ``generate`` compiles its decode step by itself on ``PagedAttentionCache(max_new_tokens=...)``
(inductor with CUDA graphs, transformers' default compile config), gives eager's greedy tokens up to bf16 rounding
ties (the rule of ``tests/gpu/greedy_oracle.py``) and skips no CUDA graph. (Its decode plans make no host sync:
``tests/generate/test_paged_cache_decode.py``.)"""

from __future__ import annotations

import pytest
import torch
from greedy_oracle import CONFIG, NEW_TOKENS, assert_matches_up_to_ties, batch, eager_run, models  # noqa: F401
from torch._dynamo.utils import counters

import hf_paged
from hf_paged import kernels
from hf_paged.hf.compat import with_cache

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
# (allowed backends, block size): the capture-safe decode paths
RUNS = [(("cuda", "torch"), 16), (("flash", "torch"), 256), (("flash", "cuda", "torch"), 16)]


def compileable_cache(model, batch, allowed, block_size) -> hf_paged.PagedAttentionCache:
    rows, width = batch["input_ids"].shape
    cache = hf_paged.PagedAttentionCache(
        model.config, num_blocks=rows * -(-(width + NEW_TOKENS) // block_size) + 4, block_size=block_size,
        device="cuda", dtype=torch.bfloat16, backend=allowed, max_new_tokens=NEW_TOKENS)
    if not cache.is_compileable:
        pytest.skip(f"not compileable here: {cache.compile_mode.reason}")
    return cache


@pytest.mark.parametrize("allowed, block_size", RUNS)
def test_compiled_generate_matches_eager_with_cuda_graphs(models, batch, eager_run, allowed, block_size):
    paged = models[1]
    torch._dynamo.reset()
    counters.clear()
    reference = paged.generate(**with_cache(paged, hf_paged.PagedAttentionCache(
        paged.config, num_blocks=512, block_size=block_size, device="cuda", dtype=torch.bfloat16, backend=allowed),
        **batch), max_new_tokens=NEW_TOKENS, **GREEDY)
    cache = compileable_cache(paged, batch, allowed, block_size)
    outs = [paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=NEW_TOKENS, **GREEDY)
            for _ in range(2)]
    label = f"compiled generate {allowed} bs={block_size} backends={cache.stats()['backends']}"
    width = batch["input_ids"].shape[1]
    assert torch.equal(outs[0], outs[1]), "a second call (replaying the graphs) gives the first call's tokens"
    assert_matches_up_to_ties(outs[0][:, width:], *eager_run, label)
    same = int((outs[0] == reference).all(1).sum())
    print(f"{label}: {same}/{outs[0].shape[0]} rows equal to eager hf_paged; counters {dict(counters['inductor'])}")
    assert counters["stats"]["unique_graphs"] == 1, "one graph for every decode step of both calls"
    assert not counters["inductor"].get("cudagraph_skips"), "CUDA graphs were skipped"


def test_a_second_batch_size_compiles_in_the_same_process(models):
    """generate at 4 rows, then 2, then 4 again, each on its own compileable cache, in one process: each batch size
    compiles its own graph. The prompts are long, so decode splits its keys over thread blocks and needs scratch
    for the partials and split tickets: scratch first allocated inside the captured step and kept afterwards (the
    shared workspace, then the kernel's per-stream tickets) made the next batch size fail ("tensors in the cudagraph
    pool not tracked as outputs")."""
    eager, paged = models
    torch._dynamo.reset()
    width = 1200
    ids = torch.randint(3, CONFIG["vocab_size"], (4, width), generator=torch.Generator().manual_seed(2)).cuda()
    long = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    outs = []
    for rows in (4, 2, 4):
        inputs = {k: v[:rows] for k, v in long.items()}
        cache = compileable_cache(paged, inputs, ("cuda", "torch"), 16)
        if rows == 2:  # the step really splits (else this test would not reach the scratch)
            k_cache = cache.pool.kv_caches[0][0]
            query = torch.empty(2, CONFIG["num_attention_heads"], k_cache.shape[-1], dtype=k_cache.dtype,
                                device="cuda")
            split = kernels.decode_split_len(query, k_cache, width + NEW_TOKENS)
            assert kernels.decode_workspace_numel(2, query.shape[1], query.shape[2], width + NEW_TOKENS, split) > 0
        outs.append(paged.generate(**with_cache(paged, cache, **inputs), max_new_tokens=NEW_TOKENS, **GREEDY))
    assert torch.equal(outs[0], outs[2]), "the first batch size again gives its tokens"
    ref = eager.generate(**long, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, output_logits=True,
                         **GREEDY)
    top2 = torch.stack(ref.logits, 1).float().topk(2, dim=-1).values
    want, gaps = ref.sequences[:, width:], top2[..., 0] - top2[..., 1]
    assert_matches_up_to_ties(outs[0][:, width:], want, gaps, "compiled generate, 4 rows")
    assert_matches_up_to_ties(outs[1][:, width:], want[:2], gaps[:2], "compiled generate, then 2 rows")


def test_the_torch_backend_is_not_compiled_on_cuda(models):
    cache = hf_paged.PagedAttentionCache(models[1].config, num_blocks=8, block_size=16, device="cuda",
                                         dtype=torch.bfloat16, backend="torch", max_new_tokens=4)
    assert not cache.is_compileable and "torch backend" in cache.compile_mode.reason


def test_an_armed_step_advances_in_one_launch_as_the_torch_ops_do():
    """``StaticDecode.advance`` on the CUDA kernel (``hf_paged::advance_decode``) leaves lengths, prefix sums,
    positions and slots as the four torch ops do, on random armed state, several steps in a row."""
    if kernels._build.ensure_loaded() is not None:
        pytest.skip("the CUDA kernels are unavailable")
    gen = torch.Generator().manual_seed(3)
    rows, positions = 37, 160
    seq_lens = torch.randint(1, positions - 8, (rows,), generator=gen, dtype=torch.int32)
    state = {
        "seq_lens": seq_lens,
        "cu_seqlens_k": torch.cat([torch.zeros(1, dtype=torch.int32), seq_lens.cumsum(0, dtype=torch.int32)]),
        "position": (seq_lens.long() - 1)[:, None].contiguous(),
        "slot_of": torch.randperm(rows * positions, generator=gen).view(rows, positions),
        "slot_mapping": torch.full((rows,), -1, dtype=torch.int64),
    }
    cu_q = torch.arange(rows + 1, dtype=torch.int32)
    kernel = {k: v.cuda() for k, v in state.items()}
    for step in range(5):
        torch.ops.hf_paged.advance_decode(kernel["seq_lens"], kernel["cu_seqlens_k"], kernel["position"],
                                          kernel["slot_of"], kernel["slot_mapping"])
        state["seq_lens"].add_(1)
        state["cu_seqlens_k"].add_(cu_q)
        state["position"].add_(1)
        torch.gather(state["slot_of"], 1, state["position"], out=state["slot_mapping"].view(-1, 1))
        for name, expected in state.items():
            assert torch.equal(kernel[name].cpu(), expected), f"{name} after step {step + 1}"
    assert torch.equal(state["cu_seqlens_k"][1:], state["seq_lens"].cumsum(0, dtype=torch.int32))


def test_optimized_generate_matches_eager_with_cuda_graphs(models, batch, eager_run):
    """``hf_paged.optimize_generate`` (planned masks, no nn-module guards, the skinny decode linears grouped, the
    prompt forward packed and decode steps run as hf_paged's own calls on the compiled layers, decode replayed from
    its CUDA graphs): eager's tokens up to bf16 ties, at two batch sizes; restored, the model is as before."""
    paged = models[1]
    torch._dynamo.reset()
    counters.clear()
    cache = compileable_cache(paged, batch, ("flash", "cuda", "torch"), 16)
    hf_paged.optimize_generate(paged)
    try:
        assert "post_grad_custom_pre_pass" in paged.generation_config.compile_config.options, "decode linears on"
        outs = [paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=NEW_TOKENS, **GREEDY)
                for _ in range(2)]
        graphs, prefill = paged.get_compiled_call.__self__, paged.forward
        half = {k: v[: v.shape[0] // 2] for k, v in batch.items()}  # another batch size: its own graph
        small = paged.generate(**with_cache(paged, compileable_cache(paged, half, ("flash", "cuda", "torch"), 16),
                                            **half), max_new_tokens=NEW_TOKENS, **GREEDY)
    finally:
        hf_paged.restore_generate(paged)
    width = batch["input_ids"].shape[1]
    assert torch.equal(outs[0], outs[1]), "a second call (replaying the graphs) gives the first call's tokens"
    assert_matches_up_to_ties(outs[0][:, width:], *eager_run, "optimized compiled generate")
    assert graphs.failure is None, graphs.failure
    # per batch size, the first decode step runs eagerly and the second is captured; every other step replays
    assert graphs.replays == 3 * (NEW_TOKENS - 1) - 2, "decode steps replayed from hf_paged's CUDA graphs"
    rows = small.shape[0]
    assert_matches_up_to_ties(small[:, width:], eager_run[0][:rows], eager_run[1][:rows], "optimized, fewer rows")
    assert graphs.compiled is not None and graphs.compiled.enabled, "the decode steps ran the compiled layers"
    assert prefill.packed == 3, "each call's prompt forward ran packed"
    assert "create_masks_for_generate" not in paged.__dict__, "restored"


def test_the_prompt_forward_and_the_decode_steps_share_the_compiled_layers_trace(models, batch):
    """``optimize_generate`` runs the prompt forward packed (``[1, tokens]``) and its decode steps as one row of
    ``[1, rows]``: a call that only prefills compiles the layers, a later call's decode steps compile nothing more
    (as ``[rows, 1]`` they traced every frame again)."""
    paged = models[1]
    torch._dynamo.reset()
    counters.clear()
    hf_paged.optimize_generate(paged)
    try:
        cache = compileable_cache(paged, batch, ("flash", "cuda", "torch"), 16)
        paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=1, **GREEDY)
        prompt_only = counters["stats"]["unique_graphs"]
        out = paged.generate(**with_cache(paged, cache, **batch), max_new_tokens=NEW_TOKENS, **GREEDY)
        prefill, graphs = paged.forward, paged.get_compiled_call.__self__
    finally:
        hf_paged.restore_generate(paged)
    # the decode steps: the first eager, every later one replayed (the second right after its capture)
    assert prefill.packed == 2 and graphs.replays == NEW_TOKENS - 2, "packed prompts, replayed decode steps"
    assert prompt_only > 0, "the prompt forward ran the compiled layers"
    assert counters["stats"]["unique_graphs"] == prompt_only, "the decode steps traced graphs of their own"
    assert out.shape[1] == batch["input_ids"].shape[1] + NEW_TOKENS
