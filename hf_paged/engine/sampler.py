"""``Sampler``: picks each sampled row's next token on the device, for all rows at once, without a host sync.

Per row, in ``model.generate``'s order: repetition penalty, EOS suppression until ``min_new_tokens``, then for
sampled rows temperature, top-k, top-p, min-p and a draw. The draw is an exponential race (``argmax p / E``,
``E ~ Exp(1)``) whose uniforms come from a counter-based hash of ``(seed, step, token id)`` built from integer
tensor ops: a request's stream depends on its own seed and its own step only, never on its batch neighbours, and a
preempted request draws the same tokens when it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.engine.sequence import Sequence

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingBatch:
    """Settings of the ``N`` rows sampled in one step, on the sampling device.

    Attributes:
        greedy_only: every row greedy, no penalty, no suppression (the fast path: one argmax).
        do_sample: ``[N]`` bool. temperature, top_p, min_p, repetition_penalty: ``[N]`` float32.
        top_k: ``[N]`` int64 (0 = off). seeds, steps: ``[N]`` int64 (step = tokens generated so far).
        history: ``[N, L]`` int64 tokens to penalise, padded with ``vocab_size`` (None = no penalty in the batch).
        banned: ``[N, E]`` int64 EOS ids suppressed by ``min_new_tokens``, padded with ``vocab_size`` (or None).
        want_logprobs: return the model's log-probability of each chosen token.
    """

    greedy_only: bool
    want_logprobs: bool
    do_sample: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    steps: torch.Tensor | None = None
    history: torch.Tensor | None = None
    banned: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        """Gather the rows' settings into a few host tensors and move them once."""
        params = [s.params for s in seqs]
        want_logprobs = any(p.logprobs for p in params)
        if all(p.is_plain_greedy for p in params):
            return cls(greedy_only=True, want_logprobs=want_logprobs)
        penalised = [p.repetition_penalty != 1.0 for p in params]
        suppress = [s.num_generated < s.params.min_new_tokens and s.params.eos_token_ids for s in seqs]
        if not any(p.do_sample for p in params) and not any(penalised) and not any(suppress):
            return cls(greedy_only=True, want_logprobs=want_logprobs)
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p, p.repetition_penalty] for p in params])
        ints = torch.tensor([[p.do_sample, p.top_k, s.seed, s.num_generated] for p, s in zip(params, seqs)])
        to = lambda t: t.to(device, non_blocking=True)
        floats, ints = to(floats.float()), to(ints)
        history = _pad_rows([s.token_ids if pen else [] for s, pen in zip(seqs, penalised)], vocab_size)
        banned = _pad_rows([s.params.eos_token_ids if sup else () for s, sup in zip(seqs, suppress)], vocab_size)
        return cls(
            greedy_only=False, want_logprobs=want_logprobs,
            do_sample=ints[:, 0].bool(), top_k=ints[:, 1], seeds=ints[:, 2], steps=ints[:, 3],
            temperature=floats[:, 0], top_p=floats[:, 1], min_p=floats[:, 2], repetition_penalty=floats[:, 3],
            history=None if not any(penalised) else to(history),
            banned=None if not any(suppress) else to(banned),
        )


def _pad_rows(rows: list, pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


class Sampler:
    """Turns ``[N, V]`` logits into ``[N]`` token ids (and optionally their logprobs), all on the logits' device."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = logits.float()
        raw = logits
        if not batch.greedy_only:
            logits = self._process(logits, batch)
            tokens = torch.where(batch.do_sample, self._draw(logits, batch), _argmax(logits))
        else:
            tokens = _argmax(logits)
        logprobs = None
        if batch.want_logprobs:
            logprobs = torch.log_softmax(raw, -1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, logprobs

    @staticmethod
    def _process(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Repetition penalty and EOS suppression, on a padded copy with one spare column for the padding ids."""
        n, v = logits.shape
        x = torch.cat([logits, logits.new_zeros(n, 1)], 1)
        if b.history is not None:
            score = x.gather(1, b.history)
            pen = b.repetition_penalty[:, None]
            x.scatter_(1, b.history, torch.where(score < 0, score * pen, score / pen))
        if b.banned is not None:
            x.scatter_(1, b.banned, float("-inf"))
        return x[:, :v]

    @staticmethod
    def _draw(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p (each renormalised after the one before), then the exponential race."""
        n, v = logits.shape
        x = logits / b.temperature.clamp(min=1e-6)[:, None]
        sorted_x, order = x.sort(-1, descending=True)
        rank = torch.arange(v, device=x.device)[None, :]
        k = torch.where(b.top_k > 0, b.top_k, v)[:, None]
        sorted_x = sorted_x.masked_fill(rank >= k, float("-inf"))
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_x = sorted_x.masked_fill((mass_before >= b.top_p[:, None]) & (rank > 0), float("-inf"))
        probs = sorted_x.softmax(-1)
        sorted_x = sorted_x.masked_fill(probs < b.min_p[:, None] * probs[:, :1], float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
        u = uniforms(b.seeds, b.steps, v)
        return _argmax(x.softmax(-1) / -torch.log(u))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum). On the CPU numpy's vectorised argmax is ~10x torch's."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.detach().numpy().argmax(-1)).long()
    return x.argmax(-1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32) (products stay below 2**63)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` float64 uniforms in (0, 1), a pure function of ``(seeds[i], steps[i], token id)``."""
    key = _mix32(_mix32(seeds & _M32) ^ _mix32((seeds >> 32) & _M32) ^ _mix32((steps * 0x2545F491 + 1) & _M32))
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(_mix32((key[:, None] ^ (cols * 0x9E3779B1 & _M32)[None, :]) & _M32) ^ key[:, None])
    return (h.double() + 0.5) / 2.0**32
