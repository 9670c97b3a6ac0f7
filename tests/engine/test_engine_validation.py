"""Validation at the door: every value a request carries is checked before it is queued (one clear line, nothing
queued), values at the edge of what the sampler holds run without harming other requests, and a request past the
model's position limit ends with ``finish_reason="error"`` instead of making every later step raise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from tiny_models import VOCAB

ARCH = "llama_gqa"
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def engine(arch: str = ARCH, **kwargs) -> hf_paged.Engine:
    return hf_paged.Engine(models(arch)[1], **{"num_blocks": 64, "block_size": 4, **kwargs})


def run(eng: hf_paged.Engine) -> dict:
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id not in done, "reported twice"
            done[out.request_id] = out
    stats = eng.stats()
    assert stats["free_blocks"] == stats["num_blocks"], stats
    return done


@pytest.mark.parametrize("bad", [
    dict(do_sample=True, top_k=2**63), dict(do_sample=True, seed=2**64), dict(do_sample=True, seed=-1),
    dict(eos_token_id=[-1], min_new_tokens=2), dict(eos_token_id="2"), dict(max_new_tokens=True),
    dict(max_new_tokens=2.0), dict(do_sample=True, temperature="0.5"), dict(do_sample=True, top_p=float("nan")),
    dict(repetition_penalty=float("inf")), dict(no_repeat_ngram_size=2), dict(suppress_tokens=[5]),
    dict(do_sample=True, typical_p=0.5), dict(stop_strings=[""]),
], ids=str)
def test_values_the_engine_cannot_serve_raise_one_line_and_queue_nothing(bad):
    eng = engine()
    with pytest.raises(ValueError) as err:
        eng.add_request([5, 6, 7], GenerationConfig(**{"max_new_tokens": 4, **bad}))
    assert "\n" not in str(err.value)
    assert not eng.has_unfinished() and eng.stats()["used_blocks"] == 0


WRONG_TYPES = [
    ("do_sample", "no"), ("do_sample", 1), ("output_logprobs", "yes"), ("max_new_tokens", "5"), ("min_length", "2"),
    ("num_return_sequences", True), ("num_return_sequences", "2"), ("top_k", 2.0), ("temperature", "hot"),
    ("stop_strings", 5), ("stop_strings", b"ab"), ("eos_token_id", b"x"), ("num_beams", 0), ("seed", True),
]
OUT_OF_BOUNDS = [
    dict(max_new_tokens=2**63), dict(max_new_tokens=2**31), dict(min_new_tokens=2**63),
    dict(num_return_sequences=10**6),
    dict(max_new_tokens=None, max_length=2**64),
]


@pytest.mark.parametrize("name, value", WRONG_TYPES, ids=str)
def test_settings_of_the_wrong_type_are_refused_naming_the_setting(name, value):
    """``do_sample="no"`` sampled, and transformers' own checks raised ``TypeError`` on a string count."""
    eng = engine()
    config = GenerationConfig(max_new_tokens=4)
    setattr(config, name, value)  # (past GenerationConfig's constructor, as a deserialised config may be)
    with pytest.raises(ValueError, match=name) as err:
        eng.add_request([5, 6, 7], config)
    assert "\n" not in str(err.value)
    assert not eng.has_unfinished() and eng.stats()["used_blocks"] == 0


@pytest.mark.parametrize("bad", OUT_OF_BOUNDS, ids=str)
def test_counts_beyond_what_the_engine_holds_are_refused_at_the_door(bad):
    """``max_new_tokens=2**63`` made every later step raise OverflowError; 10**6 copies took a minute in one step."""
    eng = engine()
    with pytest.raises(ValueError) as err:
        eng.add_request([5, 6, 7], GenerationConfig(**bad))
    assert "\n" not in str(err.value) and not eng.has_unfinished()


def test_text_that_is_not_well_formed_is_a_value_error_naming_the_field():
    """A lone surrogate (JSON's "\\ud800", half of a split emoji) raised TypeError from inside the tokenizer."""
    from hf_paged.cli.default_model import byte_tokenizer

    tok = byte_tokenizer()
    eng = hf_paged.Engine(models(ARCH)[1], num_blocks=64, block_size=4, tokenizer=tok)
    for call, field in [(lambda: eng.add_request("bad \ud800"), "prompt "),
                        (lambda: eng.generate(["fine", "bad \udfff end"]), r"prompts\[1\]"),
                        (lambda: eng.add_request("ok", GenerationConfig(stop_strings=["x", "\ud83d"])),
                         r"stop_strings\[1\]"),
                        (lambda: eng.add_request([5, 6], request_id="id \ud800"), "request_id")]:
        with pytest.raises(ValueError, match=field) as err:
            call()
        assert "surrogate" in str(err.value) and "\n" not in str(err.value)
    assert not eng.has_unfinished()

    class Refusing:  # a tokenizer that refuses some text with an error of its own
        def encode(self, text):
            raise TypeError("cannot encode\nthis")

        def decode(self, ids, skip_special_tokens=True):
            return ""

    eng = hf_paged.Engine(models(ARCH)[1], num_blocks=64, block_size=4, tokenizer=Refusing())
    with pytest.raises(ValueError, match=r"prompts\[0\]: the tokenizer cannot encode it \(TypeError: cannot encode\)"):
        eng.generate(["x"])
    out = eng.generate([[5, 6, 7]], greedy_config(3))[0]  # the engine still serves
    assert out.token_ids == hf_greedy(ARCH, [[5, 6, 7]], 3)[0]


@pytest.mark.parametrize("prompt", [[True, False], [5, 6.0], [[5, 6]], ["5"], {"input_ids": [5]}, b"\x05",
                                    torch.tensor([[5, 6], [7, 8]]), [5, VOCAB], [-1], np.array([], dtype=np.int64)],
                         ids=repr)
def test_bad_prompts_raise_one_line(prompt):
    eng = engine()
    with pytest.raises(ValueError) as err:
        eng.add_request(prompt, greedy_config(2))
    assert "\n" not in str(err.value) and not eng.has_unfinished()


@ASYNC
def test_numpy_and_torch_integers_are_token_ids_and_settings(async_scheduling):
    prompt = random_prompts(1, 6, 6, seed=1)[0]
    ref = hf_greedy(ARCH, [prompt], 4)[0]
    eng = engine(async_scheduling=async_scheduling)
    forms = [np.array(prompt), [np.int32(t) for t in prompt], torch.tensor(prompt), tuple(prompt),
             [torch.tensor(t) for t in prompt]]
    ids = [eng.add_request(f, GenerationConfig(max_new_tokens=np.int64(4), do_sample=False)) for f in forms]
    done = run(eng)
    assert [done[i].token_ids for i in ids] == [ref] * len(forms)


@ASYNC
def test_settings_at_the_edge_of_the_sampler_run_without_harming_other_requests(async_scheduling):
    """top_k just under 2**63 (clamped to the vocabulary: no filter), the largest 64-bit seed and EOS ids outside
    the vocabulary with min_new_tokens (ignored, as transformers does) used to make every step raise."""
    prompts = random_prompts(4, 3, 10, seed=2)
    refs = hf_greedy(ARCH, prompts, 6)
    eng = engine(async_scheduling=async_scheduling)
    innocent = [eng.add_request(p, greedy_config(6)) for p in prompts]
    sampled = dict(max_new_tokens=6, do_sample=True, temperature=0.9, seed=2**64 - 1)
    huge_k = eng.add_request(prompts[0], GenerationConfig(top_k=2**63 - 1, **sampled))
    no_k = eng.add_request(prompts[0], GenerationConfig(top_k=0, **sampled))
    oov_eos = eng.add_request(prompts[1], GenerationConfig(max_new_tokens=6, min_new_tokens=3, do_sample=False,
                                                           eos_token_id=[VOCAB, 2**70]))
    done = run(eng)
    assert [done[i].token_ids for i in innocent] == refs
    assert done[huge_k].token_ids == done[no_k].token_ids and len(done[huge_k].token_ids) == 6
    assert done[oov_eos].token_ids == refs[1] and done[oov_eos].finish_reason == "length"


@ASYNC
def test_a_request_past_the_position_limit_ends_with_an_error_and_keeps_its_tokens(async_scheduling):
    """GPT-2 (512 learned positions) raised an IndexError on every step once one request went past them."""
    limit = models("gpt2")[1].config.n_positions
    long_prompt = random_prompts(1, limit - 5, limit - 5, seed=3)[0]
    short = random_prompts(3, 3, 9, seed=4)
    eng = engine("gpt2", num_blocks=300, async_scheduling=async_scheduling)
    grows = eng.add_request(long_prompt, greedy_config(20))  # 5 new tokens fit
    full = eng.add_request(long_prompt + [5] * 5, greedy_config(1))  # the prompt alone fills the model
    ids = [eng.add_request(p, greedy_config(7)) for p in short]
    done = run(eng)
    assert done[grows].finish_reason == "error" and "position limit" in done[grows].error
    assert done[grows].token_ids == hf_greedy("gpt2", [long_prompt], 5)[0]
    assert done[full].finish_reason == "error" and done[full].token_ids == []
    assert [done[i].token_ids for i in ids] == hf_greedy("gpt2", short, 7)


def test_unclear_calls_get_one_clear_line():
    eng = engine()
    with pytest.raises(ValueError, match=r"\[\[5, 6, 7\]\]"):
        eng.generate([5, 6, 7])
    with pytest.raises(ValueError, match="list of prompts"):
        eng.generate("one prompt")
    with pytest.raises(ValueError, match="GenerationConfig"):
        eng.add_request([5], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="GenerationConfig"):
        eng.generate([[5]], [{"max_new_tokens": 2}])
    with pytest.raises(ValueError, match="request_id"):
        eng.abort(["7"])
    with pytest.raises(TypeError, match="max_new_token"):
        hf_paged.generate_batch(models(ARCH)[1], [[5, 6]], greedy_config(2), max_new_token=7)
    with pytest.raises(ValueError, match="ContinuousBatchingConfig"):
        hf_paged.generate_batch(models(ARCH)[1], [[5, 6]], greedy_config(2), {"num_blocks": 8})
    with pytest.raises(ValueError, match="token ids"):
        hf_paged.generate_batch(models(ARCH)[1], [[5, True]], greedy_config(2))
    assert not eng.has_unfinished()


@ASYNC
def test_abort_takes_the_integer_id_the_request_was_added_with(async_scheduling):
    eng = engine(async_scheduling=async_scheduling)
    rid = eng.add_request([5, 6, 7], greedy_config(50), request_id=7)
    other = eng.add_request([8, 9], greedy_config(3))
    eng.step()
    eng.abort(7)
    eng.abort(12345)  # not live: ignored
    done = run(eng)
    assert rid == "7" and done["7"].finish_reason == "abort" and done[other].finish_reason == "length"


@ASYNC
def test_automatic_ids_never_take_an_id_a_user_chose(async_scheduling):
    prompts = random_prompts(6, 3, 9, seed=6)
    refs = hf_greedy(ARCH, prompts, 3)
    eng = engine(async_scheduling=async_scheduling)
    chosen = [eng.add_request(prompts[0], greedy_config(3), request_id="1"),
              eng.add_request(prompts[1], greedy_config(3), request_id=3),
              eng.add_request(prompts[2], greedy_config(3), request_id="007")]
    first = run(eng)
    auto = [eng.add_request(p, greedy_config(3)) for p in prompts[3:]]  # "1" is finished: still not reused
    auto += [o.request_id for o in eng.generate(prompts[:2], greedy_config(3))]
    assert chosen == ["1", "3", "007"] and auto == ["0", "2", "4", "5", "6"]
    done = run(eng)
    assert [first[i].token_ids for i in chosen] == refs[:3] and [done[i].token_ids for i in auto[:3]] == refs[3:]
    with pytest.raises(ValueError, match="already live"):
        eng.add_request(prompts[0], greedy_config(3), request_id="x")
        eng.add_request(prompts[0], greedy_config(3), request_id="x")
