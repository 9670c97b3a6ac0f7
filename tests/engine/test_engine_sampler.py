"""The device sampler against its definitions: argmax, HF's repetition penalty, EOS suppression, seeded draws that
ignore batch neighbours, and the empirical distribution of temperature / top-k / top-p / min-p sampling."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hf_paged.engine.sampler import Sampler, SamplingBatch, uniforms
from hf_paged.engine.sampling_params import SamplingParams
from hf_paged.engine.sequence import Sequence


def seqs_with(params: SamplingParams, prompts: list[list[int]], generated: list[int] | None = None, seed: int = 0):
    out = []
    for i, p in enumerate(prompts):
        seq = Sequence(str(i), p, params, (i, 0), seed=seed)
        for _ in range((generated or [0] * len(prompts))[i]):
            seq.append_token(p[0], None)
        out.append(seq)
    return out


def sample(logits, seqs):
    return Sampler()(logits, SamplingBatch.build(seqs, logits.shape[-1], logits.device))


def test_greedy_is_argmax_and_logprobs_are_the_models():
    logits = torch.randn(5, 50)
    tokens, logprobs = sample(logits, seqs_with(SamplingParams(max_new_tokens=1, logprobs=True), [[1]] * 5))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    prompts = [[1, 5, 5, 7], [2], [9, 3, 30, 31, 32]]
    params = SamplingParams(max_new_tokens=1, repetition_penalty=1.7)
    batch = SamplingBatch.build(seqs_with(params, prompts), 40, torch.device("cpu"))
    ours = Sampler._process(logits.clone(), batch)
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    for i, p in enumerate(prompts):
        assert torch.allclose(ours[i], proc(torch.tensor([p]), logits[i : i + 1].clone())[0])


def test_eos_is_suppressed_until_min_new_tokens():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 10.0  # EOS would win
    params = SamplingParams(max_new_tokens=9, min_new_tokens=2, eos_token_ids=(4, 6))
    tokens, _ = sample(logits, seqs_with(params, [[1], [1]], generated=[1, 2]))
    assert tokens.tolist()[0] != 4 and tokens.tolist()[1] == 4


def test_a_seeded_draw_ignores_its_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(6, 100)
    params = SamplingParams(max_new_tokens=9, do_sample=True, temperature=1.3, top_k=0)
    seqs = seqs_with(params, [[1]] * 6, generated=[0, 1, 2, 3, 4, 5], seed=1234)
    alone = [sample(logits[i : i + 1], [seqs[i]])[0].item() for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    mixed = sample(logits[order], [seqs[i] for i in order])[0].tolist()
    assert mixed == [alone[i] for i in order]
    greedy_neighbour = seqs_with(SamplingParams(max_new_tokens=9), [[1]])[0]
    together = sample(torch.cat([logits[:1], logits[2:3]]), [greedy_neighbour, seqs[2]])[0].tolist()
    assert together[1] == alone[2]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_only_the_best_token_are_greedy(params):
    logits = torch.randn(8, 64)
    seqs = seqs_with(SamplingParams(max_new_tokens=1, do_sample=True, **params), [[1]] * 8, seed=5)
    assert torch.equal(sample(logits, seqs)[0], logits.argmax(-1))


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The sampling distribution by its definition, one filter after another (HF's order)."""
    x = logits / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    drop = order[(before >= top_p) & (torch.arange(len(p)) > 0)]
    x[drop] = float("-inf")
    p = x.softmax(-1)
    x[p < min_p * p.max()] = float("-inf")
    return x.softmax(-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.5, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2)]
)
def test_sampled_frequencies_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    torch.manual_seed(2)
    logits = torch.randn(12) * 1.5
    n = 6000
    params = SamplingParams(max_new_tokens=n + 1, do_sample=True, temperature=temperature, top_k=top_k,
                            top_p=top_p, min_p=min_p)
    batch = SamplingBatch(
        greedy_only=False, want_logprobs=False, do_sample=torch.ones(n, dtype=torch.bool),
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k), top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p), repetition_penalty=torch.ones(n), seeds=torch.full((n,), 77),
        steps=torch.arange(n),
    )
    tokens, _ = Sampler()(logits.expand(n, -1).clone(), batch)
    freq = torch.bincount(tokens, minlength=12).double() / n
    assert params.do_sample
    assert (freq - _expected(logits, temperature, top_k, top_p, min_p).double()).abs().max() < 0.025


def test_uniforms_are_uniform_and_reproducible():
    u = uniforms(torch.tensor([3, 2**40 + 3]), torch.tensor([0, 0]), 20000)
    assert bool(((u > 0) & (u < 1)).all())
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert torch.equal(u, uniforms(torch.tensor([3, 2**40 + 3]), torch.tensor([0, 0]), 20000))
    assert (u[0] != u[1]).float().mean() > 0.99
