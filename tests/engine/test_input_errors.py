"""Inputs that gave an unclear error or were wrongly accepted (issue 59, item 7): each is refused at the door with one
line that names the field and says what to pass, nothing is queued, and a request already live is served as before."""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

import hf_paged
from engine_helpers import greedy_config, hf_greedy, models

ARCH = "llama_gqa"
PROMPT = [5, 6, 7]


def engine() -> hf_paged.Engine:
    return hf_paged.Engine(models(ARCH)[1], num_blocks=64, block_size=4)


def finish(eng: hf_paged.Engine) -> dict:
    done = {}
    while eng.has_unfinished():
        done.update((out.request_id, out) for out in eng.step())
    return done


def test_abort_of_none_is_refused_and_the_live_request_runs_on():
    """``abort(None)`` was ignored silently; it now names request_id and points to abort_all."""
    eng = engine()
    eng.add_request(PROMPT, greedy_config(6), request_id="live")
    eng.step()
    with pytest.raises(ValueError, match="request_id.*abort_all") as err:
        eng.abort(None)
    assert "\n" not in str(err.value)
    out = finish(eng)["live"]
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(ARCH, [PROMPT], 6)[0]


@pytest.mark.parametrize("eos", [{}, {3: 1}, torch.tensor(3.0), torch.tensor([[3]])], ids=repr)
def test_eos_token_ids_that_are_not_integers_are_refused_at_the_door(eos):
    """An empty dict was taken as "no eos token" (a dict iterates its keys: ``{3: 1}`` was eos 3)."""
    eng = engine()
    eng.add_request(PROMPT, greedy_config(4), request_id="live")
    with pytest.raises(ValueError, match="eos_token_id must be an integer") as err:
        eng.add_request(PROMPT, GenerationConfig(max_new_tokens=4, eos_token_id=eos))
    assert "\n" not in str(err.value)
    assert set(finish(eng)) == {"live"}


@pytest.mark.parametrize("tensor, ints", [(torch.tensor(3), 3), (torch.tensor([3, 4]), [3, 4]),
                                          (torch.tensor([3], dtype=torch.int32), [3])], ids=str)
def test_integer_tensor_eos_ids_stop_as_the_same_ints_do(tensor, ints):
    """A 0-d or 1-d integer tensor is taken as its ints: the tokens match those of the list of ints."""
    reference = hf_greedy(ARCH, [PROMPT], 8)[0]
    eos = reference[2]  # a token the greedy run makes: both runs must stop on it
    tensor = torch.where(tensor == 3, eos, tensor)
    ints = eos if ints == 3 else [eos if e == 3 else e for e in ints]
    outs = []
    for given in (tensor, ints):
        eng = engine()
        eng.add_request(PROMPT, GenerationConfig(max_new_tokens=8, eos_token_id=given), request_id="r")
        outs.append(finish(eng)["r"])
    assert [o.token_ids for o in outs] == [reference[:reference.index(eos) + 1]] * 2
    assert [o.finish_reason for o in outs] == ["stop", "stop"]


@pytest.mark.parametrize("seed", ["x", 1.5, -1, 2**64, 2**70, True], ids=repr)
def test_a_continuous_batching_seed_outside_the_generator_range_is_refused(seed):
    """``seed="x"`` raised TypeError, 1.5 was shown as "1500004.5", -1 and 2**70 were taken."""
    with pytest.raises(ValueError, match=r"continuous_batching_config\.seed must be an integer in \[0, 2\*\*64\)") as err:
        hf_paged.generate_batch(models(ARCH)[1], [PROMPT], GenerationConfig(max_new_tokens=2, do_sample=True),
                                continuous_batching_config=ContinuousBatchingConfig(seed=seed))
    assert "\n" not in str(err.value) and repr(seed) in str(err.value)


def test_the_largest_continuous_batching_seed_runs_and_repeats():
    """The top of the range is served, and the same seed gives the same tokens."""
    runs = [hf_paged.generate_batch(models(ARCH)[1], [PROMPT, [9, 8]],
                                    GenerationConfig(max_new_tokens=4, do_sample=True, top_k=0),
                                    continuous_batching_config=ContinuousBatchingConfig(seed=2**64 - 1))
            for _ in range(2)]
    tokens = [[list(out.generated_tokens) for out in run.values()] for run in runs]
    assert tokens[0] == tokens[1] and all(len(t) == 4 for t in tokens[0])


@pytest.mark.parametrize("seed", [1.5, "x", -1, 2**64], ids=repr)
def test_a_generation_config_seed_is_checked_the_same_way(seed):
    eng = engine()
    config = GenerationConfig(max_new_tokens=4, do_sample=True)
    config.seed = seed  # (a custom attribute)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\) or None, got") as err:
        eng.add_request(PROMPT, config)
    assert "\n" not in str(err.value) and not eng.has_unfinished()


def test_generate_batch_takes_max_new_tokens_as_a_keyword_and_refuses_a_misspelt_one():
    """The keyword wins over the config's ``max_new_tokens`` (as with transformers); a typo is not ignored."""
    model = models(ARCH)[1]
    config = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=None)
    out = hf_paged.generate_batch(model, [PROMPT], config, max_new_tokens=3)
    assert out["req_0"].generated_tokens == hf_paged.generate_batch(model, [PROMPT], config)[
        "req_0"].generated_tokens[:3]
    with pytest.raises(TypeError, match="max_new_token"):
        hf_paged.generate_batch(model, [PROMPT], config, max_new_token=3)
