"""Engine greedy output equals ``model.generate`` greedy output (eager attention), prompt by prompt."""

from __future__ import annotations

import pytest

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from hf_paged.attention._metadata import Phase
from hf_paged.runner import _model_runner as model_runner
from hf_paged.runner._step_plan import plan_step


def run_engine(arch: str, prompts, max_new: int, **engine_kwargs):
    engine = hf_paged.Engine(models(arch)[1], **engine_kwargs)
    outs = engine.generate(prompts, greedy_config(max_new))
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"], stats
    assert not engine.has_unfinished()
    return outs, stats


def assert_matches(outs, refs):
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i}: {out.finish_reason} {out.error}"
        assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_a_small_cache(prefix_caching, monkeypatch):
    """Every request ends with the tokens of eager ``generate``. In every step that mixes decode rows with prefill
    chunks (a preempted sequence's recompute included) the decode rows lead, so the metadata's one-token prefix
    (which attention's decode kernel serves) covers every one of them."""
    mixed = []

    def recorded(seqs, num_tokens, sample, tables, block_size, **kwargs):
        plan = plan_step(seqs, num_tokens, sample, tables, block_size, **kwargs)
        if plan.phase is not Phase.DECODE:
            decode_rows = [i for i, (seq, n) in enumerate(zip(seqs, num_tokens))
                           if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens]
            assert all(i < plan.single_token_prefix for i in decode_rows), (list(num_tokens), decode_rows)
            mixed.append(len(decode_rows))
        return plan

    monkeypatch.setattr(model_runner, "plan_step", recorded)
    prompts = random_prompts(14, 4, 36, seed=1)
    refs = hf_greedy("llama_gqa", prompts, 10)
    outs, stats = run_engine("llama_gqa", prompts, 10, num_blocks=14, block_size=4, max_batch_tokens=64,
                             enable_prefix_caching=prefix_caching)
    assert stats["preemptions"] >= 3
    assert_matches(outs, refs)
    assert sum(mixed) > 0  # decode rows beside prefill chunks did occur


def test_prefix_caching_with_shared_prefixes():
    prefixes = random_prompts(2, 17, 24, seed=2)
    first, second = random_prompts(6, 1, 9, 3, prefixes), random_prompts(6, 1, 9, 4, prefixes)
    refs = hf_greedy("llama_gqa", first + second, 8)
    engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=64, block_size=4, max_batch_tokens=32)
    outs = engine.generate(first, greedy_config(8))
    hits_first = engine.stats()["prefix_cache_hit_tokens"]
    outs += engine.generate(second, greedy_config(8))  # finished requests' blocks are free but still cached
    stats = engine.stats()
    assert hits_first > 0 and stats["prefix_cache_hit_tokens"] - hits_first >= 6 * 16
    assert stats["free_blocks"] == stats["num_blocks"]
    assert_matches(outs, refs)


def test_a_later_request_reuses_an_earlier_ones_blocks_and_gets_the_same_tokens():
    first = random_prompts(1, 19, 19, seed=9)[0]  # 4 full blocks of 4, then 3 tokens
    answer = hf_greedy("llama_gqa", [first], 6)[0]
    prompts = [
        first,
        first,  # the last token is always computed: 4 blocks hit
        first[:16] + [3, 4, 5],  # the same 4 full blocks, another tail
        [4 if first[0] == 3 else 3] + first[1:],  # another first block: nothing hits, though later blocks match
        first + answer + [7],  # the next turn: the first request computed 24 tokens, so 6 blocks hit
    ]
    refs = hf_greedy("llama_gqa", prompts, 6)
    hits = {}
    for caching in (True, False):
        engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=64, block_size=4, enable_prefix_caching=caching)
        outs, hits[caching] = [], []
        for p in prompts:  # one at a time: each finds the earlier ones' blocks freed but cached
            outs += engine.generate([p], greedy_config(6))
            hits[caching].append(engine.stats()["prefix_cache_hit_tokens"])
        assert_matches(outs, refs)
    assert hits == {True: [0, 16, 32, 32, 56], False: [0] * 5}


def test_chunked_prefill_under_a_small_token_budget():
    prompts = random_prompts(8, 12, 40, seed=5)
    refs = hf_greedy("llama_gqa", prompts, 8)
    outs, stats = run_engine("llama_gqa", prompts, 8, num_blocks=96, block_size=4, max_batch_tokens=7)
    assert_matches(outs, refs)


def test_lm_head_sees_only_padded_row_counts_and_the_tokens_stay_exact(monkeypatch):
    """On a GPU, steps that run without a CUDA graph compute logits for a padded row count (``logit_rows``: each
    new count costs cuBLAS a kernel choice); the padded rows are dropped, so the tokens still match the oracle.
    Padding on (as on a GPU), on the CPU."""
    prompts = random_prompts(11, 2, 30, seed=9)
    refs = hf_greedy("llama_gqa", prompts, 6)
    model = models("llama_gqa")[1]
    engine = hf_paged.Engine(model, num_blocks=96, block_size=4, max_batch_tokens=37, max_num_seqs=11)
    assert not engine.runner.pad_logits  # (the CPU's default)
    engine.runner.pad_logits = True
    sampled, rows = [], []

    def recorded(*args, **kwargs):
        plan = plan_step(*args, **kwargs)
        sampled.append(plan.num_sampled)
        return plan

    monkeypatch.setattr(model_runner, "plan_step", recorded)
    hook = model.lm_head.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[-2]))
    try:
        outs = engine.generate(prompts, greedy_config(6))
    finally:
        hook.remove()
    assert_matches(outs, refs)
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
    assert set(sampled) - {1, 2, 4, 8, 16}, sampled  # (the padding had work to do)
    assert rows and set(rows) <= {1, 2, 4, 8, 16}, rows


def test_requests_added_between_steps_and_one_aborted():
    prompts = random_prompts(8, 3, 30, seed=6)
    refs = hf_greedy("llama_gqa", prompts, 12)
    engine = hf_paged.Engine(models("llama_gqa")[1], num_blocks=40, block_size=4, max_batch_tokens=32)
    cfg = greedy_config(12)
    ids = [engine.add_request(p, cfg) for p in prompts[:4]]
    done = {}
    for step in range(40):
        if step == 3:
            ids += [engine.add_request(p, cfg) for p in prompts[4:]]
        if step == 5:
            engine.abort(ids[1])
        done.update({o.request_id: o for o in engine.step()})
        if step > 5 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert done[ids[1]].finish_reason == "abort"
    assert done[ids[1]].token_ids == refs[1][: len(done[ids[1]].token_ids)]
    assert_matches([done[i] for i in ids if i != ids[1]], [r for k, r in enumerate(refs) if k != 1])
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2", "qwen3", "gpt2", "mistral", "gemma2"])
def test_architectures(arch):
    prompts = random_prompts(6, 2, 30, seed=7)
    refs = hf_greedy(arch, prompts, 8)
    outs, stats = run_engine(arch, prompts, 8, num_blocks=20, block_size=8, max_batch_tokens=24)
    assert_matches(outs, refs)


def test_generate_batch_matches_generate():
    prompts = random_prompts(6, 2, 30, seed=8)
    refs = hf_greedy("qwen3", prompts, 8)
    results = hf_paged.generate_batch(models("qwen3")[1], prompts, greedy_config(8))
    assert list(results) == [f"req_{i}" for i in range(len(prompts))]
    for i, (rid, res) in enumerate(results.items()):
        assert res.prompt_ids == prompts[i] and res.error is None and res.is_finished()
        assert res.generated_tokens == refs[i]
