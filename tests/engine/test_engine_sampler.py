"""The device sampler against its definitions: argmax, HF's repetition penalty, EOS suppression, seeded draws, the
empirical distribution of temperature / top-k / top-p / min-p sampling, and the uniforms behind the draw."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hf_paged.engine._sampler import Sampler, SamplingBatch, uniforms
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sequence import Sequence


def seqs_with(params: SamplingParams, prompts: list[list[int]], generated: list[int] | None = None, seed: int = 0):
    """One sequence per prompt, ``generated[i]`` tokens already generated, seeds ``seed, seed + 1, ...``."""
    out = []
    for i, p in enumerate(prompts):
        seq = Sequence(str(i), p, params, (i, 0), seed=seed + i)
        for _ in range((generated or [0] * len(prompts))[i]):
            seq.token_ids.append(p[0])
        out.append(seq)
    return out


def sample(logits, seqs):
    return Sampler()(logits, SamplingBatch.build(seqs, logits.shape[-1], logits.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_and_logprobs_are_the_models(dtype):
    logits = torch.randn(5, 50).to(dtype)
    tokens, logprobs = sample(logits, seqs_with(SamplingParams(max_new_tokens=1, logprobs=True), [[1]] * 5))
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits.float(), -1).max(-1).values)


def test_logprobs_are_of_the_raw_logits_when_processing_changes_the_token():
    logits = torch.randn(4, 30)
    logits[:, 7] = logits.max() + 3.0  # EOS wins unless suppressed
    params = SamplingParams(max_new_tokens=5, min_new_tokens=3, eos_token_ids=(7,), logprobs=True)
    tokens, logprobs = sample(logits, seqs_with(params, [[1]] * 4, generated=[0, 1, 3, 4]))
    suppressed = logits.clone()
    suppressed[:2, 7] = float("-inf")
    assert torch.equal(tokens, suppressed.argmax(-1))
    assert tokens[0] != 7 and tokens[2] == 7
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    v = 40
    prompts = [torch.randint(v, (n,)).tolist() for n in (4, 1, 6, 3, 5, 2)]
    logits = torch.randn(len(prompts), v)
    for i, p in enumerate(prompts):  # a seen token leads by a margin the penalty removes, so the winner moves
        logits[i, p[-1]] = logits[i].max() + 0.2
    logits[5] = -logits[5].abs() - 1.0  # all negative: the penalty multiplies
    logits[5, prompts[5][0]] = logits[5].max() + 0.05
    params = SamplingParams(max_new_tokens=1, repetition_penalty=1.7)
    tokens, _ = sample(logits, seqs_with(params, prompts))
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    expected = torch.stack([proc(torch.tensor([p]), logits[i : i + 1].clone())[0] for i, p in enumerate(prompts)])
    assert torch.equal(tokens, expected.argmax(-1))
    assert (tokens != logits.argmax(-1)).all()  # the test has teeth: without the penalty every row would differ


def test_eos_is_suppressed_until_min_new_tokens():
    torch.manual_seed(3)
    logits = torch.randn(6, 20)
    logits[:, 6] = logits.max() + 1.0  # the second EOS would win once the first is banned
    logits[:, 4] = logits.max() + 1.0
    params = SamplingParams(max_new_tokens=9, min_new_tokens=2, eos_token_ids=(4, 6, 99))  # 99: outside the vocab
    generated = [0, 1, 2, 3, 0, 1]
    tokens, _ = sample(logits, seqs_with(params, [[1]] * 6, generated=generated))
    banned = logits.clone()
    banned[[0, 1, 4, 5]] = banned[[0, 1, 4, 5]].index_fill(1, torch.tensor([4, 6]), float("-inf"))
    assert torch.equal(tokens, banned.argmax(-1))
    assert tokens.tolist()[2:4] == [4, 4] and 4 not in tokens[[0, 1, 4, 5]] and 6 not in tokens[[0, 1, 4, 5]]


def test_a_seeded_draw_is_random_reproducible_and_ignores_its_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(6, 100) * 0.5
    params = SamplingParams(max_new_tokens=9, do_sample=True, temperature=1.3, top_k=0)
    seqs = seqs_with(params, [[1]] * 6, generated=[0, 1, 2, 3, 4, 5], seed=1234)
    alone = [sample(logits[i : i + 1], [seqs[i]])[0].item() for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    mixed = sample(logits[order], [seqs[i] for i in order])[0].tolist()
    assert mixed == [alone[i] for i in order]
    greedy_neighbour = seqs_with(SamplingParams(max_new_tokens=9), [[1]])[0]
    together = sample(torch.cat([logits[:1], logits[2:3]]), [greedy_neighbour, seqs[2]])[0].tolist()
    assert together[1] == alone[2]
    # The draws are random: over steps and seeds one row's token varies, and it is not the argmax.
    flat = logits[:1].expand(40, -1).clone()
    steps = sample(flat, seqs_with(params, [[1]] * 40, generated=list(range(40)), seed=7))[0]
    seeds = sample(flat, seqs_with(params, [[1]] * 40, seed=100))[0]
    assert len(set(steps.tolist())) > 10 and len(set(seeds.tolist())) > 10
    assert (steps != flat.argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=30, top_p=1e-6)])
def test_filters_that_keep_only_the_best_token_are_greedy(params):
    logits = torch.randn(8, 64)
    seqs = seqs_with(SamplingParams(max_new_tokens=1, do_sample=True, **params), [[1]] * 8, seed=5)
    assert torch.equal(sample(logits, seqs)[0], logits.argmax(-1))


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The sampling distribution by its definition, one filter after another, renormalised between (HF's order)."""
    x = logits.double() / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    x[order[(before >= top_p) & (torch.arange(len(p)) > 0)]] = float("-inf")
    p = x.softmax(-1)
    x[p < min_p * p.max()] = float("-inf")
    return x.softmax(-1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    return float(((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])).sum())


def _chi2_limit(dof: int) -> float:
    """The chi-square quantile with upper tail ~1e-6 (Wilson-Hilferty, z = 4.75): a correct sampler fails once
    in a million runs."""
    z = 4.75
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.5, 0, 0.8, 0.0), (1.0, 8, 0.7, 0.0),
     (1.0, 0, 1.0, 0.2), (1.2, 10, 0.9, 0.05)],
)
def test_sampled_frequencies_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    """6000 draws from one row of logits, each from its own (seed, step). Pearson's chi-square against the exact
    renormalised distribution, at a 1e-6 false-alarm rate; filtered-out tokens must never be drawn. The same counts
    must reject the distribution without the filters (and at temperature 1), so a filter that stopped working fails.
    """
    torch.manual_seed(2)
    v, n = 16, 6000
    logits = torch.randn(v) * 1.5
    params = SamplingParams(max_new_tokens=64, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p)
    seqs = seqs_with(params, [[1]] * n, generated=[i % 50 for i in range(n)], seed=77)
    tokens, _ = sample(logits.expand(n, -1).clone(), seqs)
    counts = torch.bincount(tokens, minlength=v).double()
    expected = _expected(logits, temperature, top_k, top_p, min_p)
    dof = int((expected > 0).sum()) - 1
    assert counts[expected == 0].sum() == 0
    assert _chi2(counts, expected) < _chi2_limit(dof)
    if (temperature, top_k, top_p, min_p) != (1.0, 0, 1.0, 0.0):
        assert _chi2(counts, logits.double().softmax(-1)) > 10 * _chi2_limit(v - 1)


def test_uniforms_are_uniform_independent_and_reproducible():
    """Kolmogorov-Smirnov: sqrt(n) * D exceeds 1.95 with probability ~0.001 for true uniforms. Correlations between
    neighbouring tokens, steps and seeds are ~N(0, 1/sqrt(n)); 5 sigma bounds them."""
    words = SamplingBatch.build(seqs_with(SamplingParams(1, do_sample=True), [[1]] * 2, seed=2**40 + 3), 8, torch.device("cpu"))
    u = uniforms(words.seeds, torch.tensor([0, 0], dtype=torch.int32), 20000)
    assert u.dtype == torch.float32 and u.shape == (2, 20000)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(words.seeds.clone(), torch.tensor([0, 0], dtype=torch.int32), 20000))
    assert (u[0] != u[1]).float().mean() > 0.99
    flat = u.double().flatten().sort().values
    n = flat.numel()
    ks = torch.maximum(torch.arange(1, n + 1) / n - flat, flat - torch.arange(n) / n).max() * math.sqrt(n)
    assert ks < 1.95
    assert abs(flat.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n) and abs(flat.var() - 1 / 12) < 0.002

    s = 4000
    seeds = torch.stack([torch.arange(s, dtype=torch.int32), torch.zeros(s, dtype=torch.int32)], 1)
    by_step = uniforms(seeds[:1].expand(s, -1), torch.arange(s, dtype=torch.int32), 64).double()
    by_seed = uniforms(seeds, torch.zeros(s, dtype=torch.int32), 64).double()
    for a, b in [(by_step[:-1], by_step[1:]), (by_seed[:-1], by_seed[1:]), (by_seed[:, :-1], by_seed[:, 1:])]:
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(r) < 5 / math.sqrt(a.numel())


def _reference_uniform(seed: int, step: int, token: int) -> float:
    """The uniforms' definition in plain Python integers (mod 2**32), independent of torch's int32 arithmetic."""
    m = 0xFFFFFFFF

    def mix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D & m
        x ^= x >> 15
        x = x * 0x846CA68B & m
        return x ^ (x >> 16)

    key = mix(mix(mix((step + 0x9E3779B9) & m) ^ (seed >> 32 & m)) ^ (seed & m))
    h = (key ^ mix(token * 0x9E3779B9 & m)) * 0x7FEB352D & m
    h = (h ^ (h >> 15)) * 0x846CA68B & m
    return ((h >> 9) * 2 + 1) / 2**24


def test_uniforms_match_their_definition_in_python_integers():
    """Pins the stream: int32 products must wrap and shifts be logical, on any platform and torch version."""
    gen = torch.Generator().manual_seed(11)
    cases = [(int(torch.randint(2**62, (), generator=gen)), int(torch.randint(5000, (), generator=gen)))
             for _ in range(6)] + [(0, 0), (2**32 - 1, 2**31 - 1)]
    seqs = [Sequence("r", [1], SamplingParams(1, do_sample=True), (0, 0), seed=seed) for seed, _ in cases]
    b = SamplingBatch.build(seqs, 1000, torch.device("cpu"))
    u = uniforms(b.seeds, torch.tensor([step for _, step in cases], dtype=torch.int32), 1000)
    for i, (seed, step) in enumerate(cases):
        for token in (0, 1, 2, 500, 999):
            assert u[i, token].item() == _reference_uniform(seed, step, token)


def test_from_generation_config_resolves_as_generate_does():
    """The public one-call form: the user's config over the model's over the defaults, ``max_length`` less the
    prompt when ``max_new_tokens`` is unset; equal to resolving once and reading per prompt."""
    model_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, max_length=40, eos_token_id=[5, 6])
    user = GenerationConfig(temperature=0.3)
    params = SamplingParams.from_generation_config(user, 12, model_config)
    assert (params.do_sample, params.temperature, params.top_k, params.max_new_tokens) == (True, 0.3, 20, 28)
    assert params.eos_token_ids == (5, 6) and not params.is_greedy
    assert params == SamplingParams.from_resolved(SamplingParams.resolve(user, model_config), 12)
    assert SamplingParams.from_generation_config(GenerationConfig(max_new_tokens=3), 12).is_greedy
