"""On the GPU: a layer's q/k/v products over weights that lie end to end in one buffer run as one
``hf_paged::linear_packed`` product whose output the compiled layer takes as views
(``hf_paged/compile/_group_linears.py``), inside the engine's compiled layers and decode CUDA graphs.

A bf16 Llama's q/k/v weights are moved end to end into one buffer per layer, as ``hf_paged.parallel._linears`` packs a
tensor-parallel rank's shards, so one GPU serves the path. Greedy tokens of the engine equal eager's up to rounding
ties, at decode batches of 6 rows (the skinny kernel over the packed weight) and 20 rows (cuBLAS), and the packed op
served.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from greedy_oracle import CONFIG, NEW_TOKENS, assert_matches_up_to_ties
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

import hf_paged
from hf_paged.kernels import _skinny as skinny

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")
if importlib.util.find_spec("triton") is None:
    pytest.skip("compiled layers need triton on CUDA", allow_module_level=True)

LENGTHS = {6: [1, 15, 17, 100, 300, 7], 20: [3 + 11 * i for i in range(20)]}


def packed_llama(attn_implementation: str) -> torch.nn.Module:
    """The test's bf16 Llama (the same weights each call) with each layer's q/k/v weights end to end in one buffer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation=attn_implementation,
                                             dtype=torch.bfloat16).cuda().eval()
    for layer in model.model.layers:
        projs = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
        buffer = torch.cat([p.weight.detach() for p in projs])
        start = 0
        for proj in projs:
            rows = proj.weight.shape[0]
            proj.weight = torch.nn.Parameter(buffer[start:start + rows], requires_grad=False)
            start += rows
        assert skinny.packed_rows([p.weight for p in projs], [None] * 3) is not None
    return model


def prompts_and_eager(rows: int) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS[rows]]
    eager = packed_llama("eager")
    outs, gaps = [], []
    for prompt in prompts:  # one at a time: no padding in the reference
        out = eager.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values[0]
        outs.append(out.sequences[0, len(prompt):])
        gaps.append(top2[:, 0] - top2[:, 1])
    return prompts, torch.stack(outs), torch.stack(gaps)


@pytest.mark.parametrize("rows", sorted(LENGTHS))
def test_packed_qkv_gives_eager_tokens_as_views_of_one_product(monkeypatch, rows):
    prompts, want, gaps = prompts_and_eager(rows)
    callers = []
    packed_rows = skinny.packed_rows

    def counted(weights, biases):  # who asked: the packed op, or the grouped op's product over a packed weight
        callers.append(inspect.stack()[1].function)
        return packed_rows(weights, biases)

    monkeypatch.setattr(skinny, "packed_rows", counted)
    torch._dynamo.reset()
    model = packed_llama("hf_paged")
    with hf_paged.Engine(model, num_blocks=512, block_size=16, max_batch_tokens=512, max_num_seqs=rows,
                         compile_layers=True) as engine:
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        outs = engine.generate(prompts, config)
        stats = engine.stats()
    got = torch.tensor([o.token_ids for o in outs], device="cuda")
    assert_matches_up_to_ties(got, want, gaps, f"packed q/k/v, {rows} rows, stats={stats}")
    assert "_linear_packed" in callers, f"the packed op did not serve: {sorted(set(callers))}"
    assert stats["free_blocks"] == stats["num_blocks"]
    torch._dynamo.reset()
