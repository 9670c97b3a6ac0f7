"""Which rows pay for what in the sampler: greedy rows never draw, a seeded row's draw ignores its neighbours and its
row index, only sampled rows hash, the sort runs only for top-p, no int64 tensor is as wide as the vocabulary, and
the plain-greedy path copies nothing. The op-level checks record every aten op with a dispatch mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import hf_paged.engine._sampler as sampler_module
from hf_paged.engine._sampler import Sampler, SamplingBatch, uniforms
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sequence import Sequence

V = 64
GREEDY = SamplingParams(max_new_tokens=8)
MIN_NEW = SamplingParams(max_new_tokens=8, min_new_tokens=4, eos_token_ids=(3, 5))
PENALISED = SamplingParams(max_new_tokens=8, repetition_penalty=1.5)
SAMPLED = {
    "temperature": SamplingParams(max_new_tokens=8, do_sample=True, temperature=0.9),
    "top_k": SamplingParams(max_new_tokens=8, do_sample=True, top_k=12),
    "top_k_top_p": SamplingParams(max_new_tokens=8, do_sample=True, top_k=20, top_p=0.8),
    "top_p": SamplingParams(max_new_tokens=8, do_sample=True, top_p=0.85),
    "min_p": SamplingParams(max_new_tokens=8, do_sample=True, min_p=0.1),
    "penalised": SamplingParams(max_new_tokens=8, do_sample=True, top_k=30, repetition_penalty=1.3,
                                min_new_tokens=2, eos_token_ids=(3,)),
}


def seq(params: SamplingParams, seed: int = 0, prompt: tuple[int, ...] = (1, 2, 9), generated: int = 0) -> Sequence:
    s = Sequence(str(seed), list(prompt), params, (seed, 0), seed=seed)
    s.token_ids += [7] * generated
    return s


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return Sampler()(logits, SamplingBatch.build(seqs, logits.shape[-1], logits.device))[0]


def flat_logits(n: int, gen: torch.Generator) -> torch.Tensor:
    """Close logits, so a draw rarely lands on the argmax: a row that wrongly draws shows up."""
    return torch.randn(n, V, generator=gen) * 0.3


def neighbours(gen: torch.Generator) -> list[Sequence]:
    kinds = [GREEDY, MIN_NEW, PENALISED, *SAMPLED.values()]
    pick = lambda high: int(torch.randint(high, (), generator=gen))  # noqa: E731
    return [seq(kinds[pick(len(kinds))], seed=pick(10**6), generated=pick(6)) for _ in range(1 + pick(6))]


def embed(target: Sequence, row: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, list[Sequence], int]:
    """The target row at a random index among random neighbours with fresh logits."""
    others = neighbours(gen)
    at = int(torch.randint(len(others) + 1, (), generator=gen))
    logits = flat_logits(len(others) + 1, gen)
    logits[at] = row
    return logits, others[:at] + [target] + others[at:], at


def processed_argmax(row: torch.Tensor, s: Sequence) -> int:
    x = row.clone()[None]
    if s.params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(s.params.repetition_penalty)(torch.tensor([s.token_ids]), x)
    if s.num_generated < s.params.min_new_tokens:
        x[0, list(s.params.eos_token_ids)] = float("-inf")
    return int(x.argmax())


@pytest.mark.parametrize("params", [MIN_NEW, PENALISED], ids=["min_new_tokens", "repetition_penalty"])
def test_a_processed_greedy_row_is_the_argmax_of_its_processed_logits_whatever_its_neighbours(params):
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        prompt = tuple(torch.randint(V, (5,), generator=gen).tolist())
        target = seq(params, seed=trial, prompt=prompt, generated=trial % 6)
        row = flat_logits(1, gen)[0]
        row[[3, 5, *target.token_ids[:2]]] += 0.8  # EOS and seen tokens lead: the processing has to move the winner
        expected = processed_argmax(row, target)
        assert sample(row[None], [target]).item() == expected
        logits, batch, at = embed(target, row, gen)
        assert sample(logits, batch)[at].item() == expected


@pytest.mark.parametrize("name", list(SAMPLED))
def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours_and_its_index(name):
    gen = torch.Generator().manual_seed(1)
    alone_tokens = []
    for step in range(25):
        target = seq(SAMPLED[name], seed=4321, generated=step)
        row = flat_logits(1, gen)[0]
        alone = sample(row[None], [target]).item()
        for _ in range(3):
            logits, batch, at = embed(target, row, gen)
            assert sample(logits, batch)[at].item() == alone
        alone_tokens.append((alone, int(row.argmax())))
    assert sum(t != best for t, best in alone_tokens) >= 5  # the draws are random, so equality above means something


def test_a_preempted_request_redraws_the_same_tokens():
    """Recomputing a request (same seed, same steps) after preemption gives back its tokens, in any new batch."""
    gen = torch.Generator().manual_seed(2)
    rows = flat_logits(10, gen)
    first = [sample(rows[i : i + 1], [seq(SAMPLED["top_k_top_p"], seed=99, generated=i)]).item() for i in range(10)]
    again = []
    for i in range(10):
        logits, batch, at = embed(seq(SAMPLED["top_k_top_p"], seed=99, generated=i), rows[i], gen)
        again.append(sample(logits, batch)[at].item())
    assert again == first


class _Ops(TorchDispatchMode):
    """Records (op name, [(dtype, shape) of each new tensor it returns]); views of an input are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[torch.dtype, tuple[int, ...]]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                  if isinstance(a, torch.Tensor)}
        self.calls.append((func.overloadpacket.__name__, [
            (o.dtype, tuple(o.shape)) for o in outs
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs]))
        return out

    def wide(self, dtype: torch.dtype) -> list[tuple[int, ...]]:
        """Shapes of the new ``[rows, V]`` tensors of ``dtype``."""
        return [shape for _, outs in self.calls for dt, shape in outs if dt == dtype and len(shape) == 2
                and shape[1] == V]

    def ran(self, name: str) -> bool:
        return any(op == name for op, _ in self.calls)


def _run_recorded(seqs: list[Sequence], logits: torch.Tensor, monkeypatch) -> tuple[_Ops, list[int]]:
    sorted_rows: list[int] = []
    real = sampler_module._sorted_desc
    monkeypatch.setattr(sampler_module, "_sorted_desc", lambda x: sorted_rows.append(x.shape[0]) or real(x))
    batch = SamplingBatch.build(seqs, V, logits.device)
    with _Ops() as ops:
        Sampler()(logits, batch)
    return ops, sorted_rows


@pytest.mark.parametrize("name", list(SAMPLED))
def test_only_sampled_rows_hash_and_only_top_p_without_top_k_sorts(name, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    seqs = [seq(GREEDY), seq(MIN_NEW, 1), seq(SAMPLED[name], 2), seq(PENALISED, 3), seq(SAMPLED[name], 4), seq(GREEDY)]
    ops, sorted_rows = _run_recorded(seqs, flat_logits(len(seqs), gen), monkeypatch)
    assert set(ops.wide(torch.int32)) == {(2, V)}  # the hash covers the 2 sampled rows only
    assert ops.wide(torch.int64) == [] and ops.wide(torch.float64) == []
    assert sorted_rows == ([2] if name == "top_p" else [])
    assert ops.ran("topk") == (SAMPLED[name].top_k > 0)


def test_greedy_rows_with_processing_never_draw(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    seqs = [seq(MIN_NEW, 0), seq(GREEDY), seq(PENALISED, 2), seq(MIN_NEW, 3, generated=5)]
    ops, sorted_rows = _run_recorded(seqs, flat_logits(4, gen), monkeypatch)
    assert ops.wide(torch.int32) == [] and sorted_rows == [] and not ops.ran("topk") and not ops.ran("log")
    # the float copy holds the penalised row only: a row that only holds back EOS is masked in place
    assert set(ops.wide(torch.float32)) == {(1, V)}


def test_greedy_rows_that_only_hold_back_eos_copy_no_logits_and_leave_them_unchanged(monkeypatch):
    """``min_new_tokens`` on a greedy row: its EOS entries are masked in place around the plain argmax (no float
    copy of the logits, which for 64 rows of a 128k vocabulary cost 12 ms a step on a CPU), and put back."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        seqs = [seq(MIN_NEW, i, generated=(trial + i) % 6) for i in range(3)] + [seq(GREEDY, 9)]
        logits = flat_logits(len(seqs), gen)
        logits[:, [3, 5]] += 1.0  # EOS leads: the mask has to move the winner while min_new_tokens holds
        before = logits.clone()
        batch = SamplingBatch.build(seqs, V, logits.device)
        assert batch.rows is None and batch.masked_at is not None
        with _Ops() as ops:
            tokens, _ = Sampler()(logits, batch)
        assert ops.wide(torch.float32) == []  # no copy of the logits
        assert torch.equal(logits, before)
        expected = [processed_argmax(row.float(), s) for row, s in zip(before, seqs)]
        assert tokens.tolist() == expected
        batch.want_logprobs = True
        tokens, logprobs = Sampler()(logits, batch)
        assert tokens.tolist() == expected and torch.equal(logits, before)
        raw = torch.log_softmax(before, -1)
        assert torch.equal(logprobs, raw.gather(1, tokens[:, None]).squeeze(1))  # of the raw logits, as before


def test_plain_greedy_copies_nothing_and_builds_no_tensor(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    seqs = [seq(GREEDY, i) for i in range(8)] + [seq(MIN_NEW, 8, generated=4)]  # past min_new_tokens: plain again
    logits = flat_logits(len(seqs), gen)
    with _Ops() as building:
        batch = SamplingBatch.build(seqs, V, logits.device)
    assert building.calls == [] and batch.rows is None
    with _Ops() as ops:
        tokens, logprobs = Sampler()(logits, batch)
    assert ops.wide(torch.float32) == [] and logprobs is None
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.cuda
def test_cuda_sampler_has_no_host_sync_and_matches_the_cpu():
    gen = torch.Generator().manual_seed(6)
    seqs = [seq(GREEDY), seq(MIN_NEW, 1), *[seq(p, 10 + i, generated=i) for i, p in enumerate(SAMPLED.values())],
            seq(PENALISED, 3), seq(GREEDY, 4)]
    logits = torch.randn(len(seqs), 32000, generator=gen)
    cpu = sample(logits, seqs)
    dev = torch.device("cuda")
    gpu_logits = logits.to(dev)
    batch = SamplingBatch.build(seqs, 32000, dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = Sampler()(gpu_logits, batch)
        batch = SamplingBatch.build(seqs, 32000, dev)
        tokens2, _ = Sampler()(gpu_logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tokens.cpu(), cpu) and torch.equal(tokens2.cpu(), cpu)
    cpu_batch = SamplingBatch.build(seqs, 32000, torch.device("cpu"))
    assert torch.equal(uniforms(batch.seeds, batch.steps, 32000).cpu(), uniforms(cpu_batch.seeds, cpu_batch.steps, 32000))


@pytest.mark.cuda
def test_cuda_plain_greedy_argmaxes_bf16_without_a_float_copy():
    logits = torch.randn(256, 32000, device="cuda").bfloat16()
    batch = SamplingBatch.build([seq(GREEDY, i) for i in range(256)], 32000, logits.device)
    with _Ops() as ops:
        tokens, _ = Sampler()(logits, batch)
    assert not any(dt == torch.float32 for _, outs in ops.calls for dt, _ in outs)
    assert torch.equal(tokens, logits.float().argmax(-1))
