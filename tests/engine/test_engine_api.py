"""The engine's public contract beyond plain greedy runs: bad input, prompts that cannot fit, stop conditions,
``num_return_sequences`` sharing blocks, logprobs, streaming and seeded sampling that survives preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from hf_paged.cli.default_model import byte_tokenizer, tiny_llama
from tiny_models import EOS

ARCH = "llama_gqa"


def engine(**kwargs):
    return hf_paged.Engine(models(ARCH)[1], **{"num_blocks": 64, "block_size": 4, **kwargs})


def assert_all_free(eng):
    stats = eng.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and not eng.has_unfinished(), stats


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.5), dict(do_sample=True, top_p=0.0), dict(do_sample=True, top_p=1.5), dict(top_k=-1),
    dict(min_p=1.5), dict(repetition_penalty=0.0), dict(max_new_tokens=0), dict(num_return_sequences=0),
    dict(do_sample=True, temperature=0.0), dict(num_beams=2),
])
def test_invalid_sampling_values_raise_at_add_request(bad):
    eng = engine()
    with pytest.raises(ValueError):
        eng.add_request([5, 6, 7], GenerationConfig(**{"max_new_tokens": 4, **bad}))
    assert_all_free(eng)


def test_bad_prompts_and_ids_raise_at_add_request():
    eng = engine()
    for prompt in ([], [5, 10**6], [-1], "text without a tokenizer"):
        with pytest.raises(ValueError):
            eng.add_request(prompt, greedy_config(2))
    eng.add_request([5], greedy_config(2), request_id="x")
    with pytest.raises(ValueError, match="already live"):
        eng.add_request([6], greedy_config(2), request_id="x")
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request([6], GenerationConfig(max_new_tokens=2, stop_strings=["a"]))
    with pytest.raises(ValueError):
        hf_paged.Engine(models(ARCH)[1], max_batch_tokens=0)


def test_requests_that_cannot_fit_finish_with_an_error_and_the_rest_are_unharmed():
    prompts = random_prompts(6, 2, 8, seed=11)
    too_long_prompt = random_prompts(1, 30, 30, seed=12)[0]  # 30 tokens > 6 blocks of 4
    grows_too_long = random_prompts(1, 20, 20, seed=13)[0]  # fits, but not with 10 new tokens
    refs = hf_greedy(ARCH, prompts, 4)
    eng = engine(num_blocks=6)
    ids = [eng.add_request(p, greedy_config(4)) for p in prompts[:3]]
    bad = [eng.add_request(too_long_prompt, greedy_config(4)), eng.add_request(grows_too_long, greedy_config(10))]
    ids += [eng.add_request(p, greedy_config(4)) for p in prompts[3:]]
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    for rid in bad:
        assert done[rid].finish_reason == "error" and "num_blocks" in done[rid].error
    assert [done[i].token_ids for i in ids] == refs
    assert_all_free(eng)


def test_eos_ids_min_new_tokens_and_repetition_penalty_match_generate():
    eager = models(ARCH)[0]
    prompts = random_prompts(4, 3, 12, seed=14)
    free_run = hf_greedy(ARCH, prompts, 10)
    eos = sorted({free_run[0][3], free_run[1][2]})
    configs = [
        GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos),
        GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos, min_new_tokens=5),
        GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=1.8),
    ]
    for cfg in configs:
        outs = engine().generate(prompts, cfg)
        for p, out in zip(prompts, outs):
            ids = torch.tensor([p])
            with torch.no_grad():
                want = eager.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
            want = want[0, len(p):].tolist()
            stops = cfg.eos_token_id or [EOS]  # unset: the model's EOS, for both
            want = want[: next((i + 1 for i, t in enumerate(want) if t in stops), len(want))]
            assert out.token_ids == want, cfg
            assert out.finish_reason == ("stop" if want[-1] in stops else "length")


def test_stop_strings_with_a_tokenizer():
    model, tok = tiny_llama(seed=1), byte_tokenizer()
    free = hf_paged.Engine(model, tokenizer=tok).generate(["abcdef"], greedy_config(12))[0]
    stop = tok.decode(free.token_ids[3:5])
    assert stop
    eng = hf_paged.Engine(model, tokenizer=tok)
    out = eng.generate(["abcdef"], GenerationConfig(max_new_tokens=12, do_sample=False, stop_strings=[stop]))[0]
    free_text = tok.decode(free.token_ids, skip_special_tokens=True)
    # OpenAI style: the stop string and what follows are cut from the text (and the tokens it begins in)
    assert out.finish_reason == "stop" and out.text == free_text[: free_text.index(stop)] and len(out.token_ids) <= 5
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert_all_free(eng)


def test_num_return_sequences_share_the_prompt_blocks():
    prompt = random_prompts(1, 10, 10, seed=15)[0]  # 2.5 blocks: the copies share a partial tail block
    # top_k=1 samples the best token: greedy (GenerationConfig refuses greedy with several sequences)
    ref = hf_greedy(ARCH, [prompt], 6)[0]
    eng = engine(enable_prefix_caching=False)  # copies share blocks only by being forked
    rid = eng.add_request(prompt, GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3))
    done = {}
    while eng.stats()["generated_tokens"] == 0:
        done.update({o.request_id: o for o in eng.step()})
    seqs, alloc = eng.scheduler.running, eng.block_manager.allocator
    prompt_blocks = list(seqs[0].block_table)
    assert [s.request_id for s in seqs] == [rid, f"{rid}__child#0", f"{rid}__child#1"]
    assert len(prompt_blocks) == 3 and all(s.block_table == prompt_blocks for s in seqs)
    assert [alloc.ref_count(b) for b in prompt_blocks] == [3, 3, 3] and eng.stats()["used_blocks"] == 3
    done.update({o.request_id: o for o in eng.step()})  # each writes into its own copy of the tail block
    assert [alloc.ref_count(b) for b in prompt_blocks[:2]] == [3, 3]
    assert len({s.block_table[2] for s in seqs}) == 3
    assert eng.stats()["used_blocks"] == 2 + 3  # 3 x 3 had the copies not shared the prompt's blocks
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step()})
    assert sorted(done) == [rid, f"{rid}__child#0", f"{rid}__child#1"]
    assert all(o.token_ids == ref for o in done.values())
    assert_all_free(eng)
    sampled = engine().generate([prompt], GenerationConfig(max_new_tokens=8, do_sample=True, num_return_sequences=4,
                                                           seed=3))
    assert len(sampled) == 4 and len({tuple(o.token_ids) for o in sampled}) > 1


def test_logprobs_are_the_models_log_probabilities():
    eager = models(ARCH)[0]
    prompts = random_prompts(3, 3, 12, seed=16)
    outs = engine().generate(prompts, GenerationConfig(max_new_tokens=5, do_sample=False, output_logprobs=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logits = eager(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4)


def test_streaming_yields_every_token_once_in_order():
    prompts = random_prompts(5, 2, 20, seed=17)
    refs = hf_greedy(ARCH, prompts, 7)
    eng = engine(num_blocks=12, max_batch_tokens=16)
    got, last = {}, {}
    for delta in eng.stream(prompts, greedy_config(7)):
        assert delta.request_id not in last, "a request streamed after its last delta"
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.finished:
            last[delta.request_id] = delta.finish_reason
    assert [got[str(i)] for i in range(5)] == refs and set(last) == set(got)
    assert_all_free(eng)


def test_seeded_sampling_does_not_depend_on_batch_or_preemption():
    prompts = random_prompts(8, 4, 24, seed=18)
    cfg = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.2, top_k=20, top_p=0.9, seed=42)
    alone = [engine().generate([p], cfg)[0].token_ids for p in prompts]
    tight = engine(num_blocks=12, max_batch_tokens=12)
    together = tight.generate(prompts, cfg)
    assert tight.stats()["preemptions"] > 0  # of the newest running requests: compare every request
    assert [o.token_ids for o in together] == alone
    assert_all_free(tight)


def test_one_generation_config_per_prompt_and_nothing_queued_on_a_bad_one():
    prompts = random_prompts(4, 3, 12, seed=19)
    refs = hf_greedy(ARCH, prompts, 6)
    sampled = GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.9, seed=1)
    eng = engine()
    outs = eng.generate(prompts, [greedy_config(6), sampled, greedy_config(6), sampled])
    assert outs[0].token_ids == refs[0] and outs[2].token_ids == refs[2]
    assert len(outs[1].token_ids) == len(outs[3].token_ids) == 9
    with pytest.raises(ValueError):
        eng.generate(prompts[:2], [greedy_config(6), GenerationConfig(max_new_tokens=3, temperature=-1.0)])
    assert not eng.has_unfinished()
    with pytest.raises(ValueError, match="one each"):
        eng.generate(prompts, [greedy_config(6)])


def test_num_blocks_none_sizes_the_pool_from_memory():
    eng = hf_paged.Engine(models(ARCH)[1], num_blocks=None, block_size=16, max_num_seqs=4)
    assert eng.stats()["num_blocks"] == 4 * 512 // 16  # free memory holds more: capped at what 4 sequences can use


def test_generate_batch_copies_have_transformers_shapes():
    from transformers.generation.continuous_batching import RequestStatus

    prompts = random_prompts(2, 3, 9, seed=20)
    refs = hf_greedy(ARCH, prompts, 5)
    config = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=1, num_return_sequences=2)
    cbc = type("CBConfig", (), dict(num_blocks=8, block_size=4))()
    results = hf_paged.generate_batch(models(ARCH)[1], prompts, config, cbc)
    assert list(results) == ["req_0__child#0", "req_0", "req_1__child#0", "req_1"]  # transformers' order
    for rid in results:
        assert results[rid].generated_tokens == refs[int(rid[4])]
        assert results[rid].status == RequestStatus.FINISHED and results[rid].error is None


def test_add_requests_queues_all_or_nothing_and_matches_add_request():
    prompts = random_prompts(5, 2, 9, seed=21)
    eng = engine()
    bad_prompt = prompts[:2] + [[5, 10**6]] + prompts[3:]
    for args in ((bad_prompt, greedy_config(3)), (prompts, [greedy_config(3)] * 4),
                 (prompts, greedy_config(3), ["a", "b", "c", "a", "e"]), (prompts, greedy_config(3), ["a"])):
        with pytest.raises(ValueError):
            eng.add_requests(*args)
        assert not eng.has_unfinished()  # nothing of the call was queued
    eng.add_request(prompts[0], greedy_config(3), request_id="live")
    with pytest.raises(ValueError, match="already live"):
        eng.add_requests(prompts[1:3], greedy_config(3), request_ids=["fresh", "live"])
    assert eng.stats()["waiting"] == 1  # only the one added before
    ids = eng.add_requests(prompts[1:], greedy_config(3), request_ids=[10, "b", "c", "d"])
    assert ids == ["10", "b", "c", "d"]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in eng.step()})
    one_by_one = engine()
    for rid, p in zip(["live", "10", "b", "c", "d"], prompts):
        one_by_one.add_request(p, greedy_config(3), request_id=rid)
    want = {}
    while one_by_one.has_unfinished():
        want.update({o.request_id: o.token_ids for o in one_by_one.step()})
    assert outs == want and len(outs) == 5 and all(len(t) == 3 for t in outs.values())
    assert_all_free(eng)


def test_generate_batch_indices_give_a_share_what_the_whole_call_gives_it():
    """Two calls over halves of the prompts, each with its prompts' positions as ``indices``, give the ids and the
    seeded samples of one call over all of them (continuous_batching_config.seed seeds by position)."""
    prompts = random_prompts(6, 3, 14, seed=22)
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=2)
    cbc = type("CBConfig", (), dict(seed=5))()
    model = models(ARCH)[1]
    whole = hf_paged.generate_batch(model, prompts, config, cbc)
    halves = {}
    for share in ([0, 2, 5], [1, 3, 4]):
        halves.update(hf_paged.generate_batch(model, [prompts[i] for i in share], config, cbc, indices=share))
    assert sorted(halves) == sorted(whole) and len(whole) == 12
    for rid, out in whole.items():
        assert halves[rid].request_id == rid and halves[rid].generated_tokens == out.generated_tokens, rid


@pytest.mark.parametrize("bad", [[0, 0], [0], [-1, 2], [0, 1.0], "01"])
def test_generate_batch_refuses_bad_indices(bad):
    with pytest.raises(ValueError, match="indices must be 2 distinct non-negative integers"):
        hf_paged.generate_batch(models(ARCH)[1], random_prompts(2, 3, 5, seed=23), greedy_config(3), indices=bad)
