"""Log-probabilities with alternatives (``top_logprobs``) and of the prompt (``prompt_logprobs``) against the eager
model's own log-softmax, through chunked prefill, the prefix cache, preemption and ``num_return_sequences``; and
structured output (``json_schema``): every answer parses and matches its schema, synchronously and asynchronously
scheduled alike, and a schema that cannot be compiled is refused at the door."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from engine_helpers import models, random_prompts
from hf_paged import Engine
from hf_paged.cli.default_model import load_model

pytest.importorskip("llguidance")

K = 4


def eager_logprobs(prompt: list[int], new: list[int]) -> torch.Tensor:
    """``[len(prompt) + len(new), V]`` float32 log-softmax of the eager model over the whole sequence."""
    eager, _ = models("llama_gqa")
    with torch.no_grad():
        logits = eager(torch.tensor([prompt + new])).logits[0].float()
    return torch.log_softmax(logits, -1)


def check_against_eager(out, k: int = K) -> None:
    prompt, new = out.prompt_token_ids, out.token_ids
    ref = eager_logprobs(prompt, new)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        assert out.prompt_logprobs[p] == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(k)
        assert [t for t, _ in out.prompt_top_logprobs[p]] == top.indices.tolist()
        assert [v for _, v in out.prompt_top_logprobs[p]] == pytest.approx(top.values.tolist(), abs=1e-4)
    for i, token in enumerate(new):
        row = ref[len(prompt) - 1 + i]
        assert out.logprobs[i] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(k)
        assert [t for t, _ in out.top_logprobs[i]] == top.indices.tolist()
        assert out.top_logprobs[i][0][0] == token  # greedy: the likeliest
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(top.values.tolist(), abs=1e-4)


def scored(max_new_tokens: int = 5, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, output_logprobs=True, top_logprobs=K,
                            prompt_logprobs=K, **kw)


@pytest.mark.parametrize("pad_logits", [False, True])
def test_prompt_and_top_logprobs_equal_the_eager_models_through_chunks_and_the_prefix_cache(pad_logits):
    """Also with the logits rows padded (as on a GPU: ``runner/_step_plan.py``): the scored rows after the
    sampled ones, then the padding, which is dropped."""
    _, paged = models("llama_gqa")
    shared = random_prompts(1, 40, 40, seed=11)[0]
    prompts = random_prompts(5, 3, 30, seed=12, prefixes=[shared])
    engine = Engine(paged, num_blocks=96, block_size=4, max_batch_tokens=24, max_num_seqs=4)
    engine.runner.pad_logits = pad_logits
    engine.generate([shared + [7, 8]], GenerationConfig(max_new_tokens=2, do_sample=False))  # fills the cache
    outs = engine.generate(prompts, scored())
    for out in outs:
        check_against_eager(out)
    plain = engine.generate(prompts, GenerationConfig(max_new_tokens=5, do_sample=False))
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]  # scoring changes no token
    assert plain[0].prompt_logprobs is None and plain[0].top_logprobs is None
    engine.check_invariants()


def test_prompt_logprobs_survive_preemption_and_reach_every_copy():
    _, paged = models("llama_gqa")
    prompts = random_prompts(6, 20, 30, seed=13)
    engine = Engine(paged, num_blocks=24, block_size=4, max_batch_tokens=32, max_num_seqs=6)
    outs = engine.generate(prompts, scored(max_new_tokens=12))
    assert engine.stats()["preemptions"] > 0
    for out in outs:
        check_against_eager(out)
    copies = engine.generate(prompts[:1], GenerationConfig(max_new_tokens=3, do_sample=True, seed=1,
                                                           num_return_sequences=3, prompt_logprobs=0))
    assert len(copies) == 3
    assert all(c.prompt_logprobs == copies[0].prompt_logprobs for c in copies)
    assert copies[0].prompt_logprobs[1:] == pytest.approx(outs[0].prompt_logprobs[1:], abs=1e-5)


def test_streamed_deltas_carry_the_tokens_logprobs():
    _, paged = models("llama_gqa")
    engine = Engine(paged, num_blocks=64, block_size=4)
    prompts = random_prompts(3, 5, 12, seed=14)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, output_logprobs=True, top_logprobs=2)
    outs = engine.generate(prompts, config)
    by_request: dict[str, list] = {}
    for delta in engine.stream(prompts, config):
        assert len(delta.logprobs) == len(delta.token_ids) == len(delta.top_logprobs)
        by_request.setdefault(delta.request_id, []).append(delta)
    for out, deltas in zip(outs, by_request.values()):
        assert [lp for d in deltas for lp in d.logprobs] == pytest.approx(out.logprobs, abs=1e-6)
        streamed = [row for d in deltas for row in d.top_logprobs]
        assert [[t for t, _ in row] for row in streamed] == [[t for t, _ in row] for row in out.top_logprobs]
        assert [v for row in streamed for _, v in row] == pytest.approx(
            [v for row in out.top_logprobs for _, v in row], abs=1e-5)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}


def matches(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "tag", "n"} and isinstance(value["ok"], bool) and value["tag"] in SCHEMA[
        "properties"]["tag"]["enum"] and type(value["n"]) is int and 0 <= value["n"] <= 9)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_output_matches_the_schema(async_scheduling):
    model, tokenizer = load_model("tiny", "cpu", None, 0)
    engine = Engine(model, num_blocks=64, tokenizer=tokenizer, async_scheduling=async_scheduling)
    prompts = ["Answer in JSON:", "Colour?", "The paged cache"]
    greedy = engine.generate(prompts, GenerationConfig(max_new_tokens=40, do_sample=False, json_schema=SCHEMA))
    sampled = engine.generate(prompts, GenerationConfig(max_new_tokens=40, do_sample=True, temperature=1.0, seed=5,
                                                        num_return_sequences=3, json_schema=json.dumps(SCHEMA)))
    for out in greedy + sampled:
        assert out.finish_reason == "stop" and matches(out.text), out.text
    assert len({o.text for o in sampled}) > 1  # sampling still samples, within the grammar
    free = engine.generate(prompts[:1], GenerationConfig(max_new_tokens=10, do_sample=False))[0]
    assert not free.text.startswith("{")  # the random model alone writes no JSON
    if async_scheduling:  # the same tokens as without asynchronous scheduling
        sync = Engine(model, num_blocks=64, tokenizer=tokenizer, async_scheduling=False)
        again = sync.generate(prompts, GenerationConfig(max_new_tokens=40, do_sample=True, temperature=1.0, seed=5,
                                                        num_return_sequences=3, json_schema=SCHEMA))
        assert [o.text for o in again] == [o.text for o in sampled]


def test_a_schema_that_cannot_be_compiled_is_refused_and_nothing_is_queued():
    model, tokenizer = load_model("tiny", "cpu", None, 0)
    engine = Engine(model, num_blocks=32, tokenizer=tokenizer)
    for schema, words in (({"type": "wat"}, "wat"), ({"$ref": "#/nowhere"}, "nowhere"), ("{not json", "JSON")):
        with pytest.raises(ValueError, match=words):
            engine.add_request("hi", GenerationConfig(max_new_tokens=4, json_schema=schema))
    assert not engine.has_unfinished()
