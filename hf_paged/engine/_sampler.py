"""``Sampler``: picks each row's next token on the logits' device, for all rows at once, without a host sync.

The host sorts the rows when it builds the batch. Plain greedy rows take the argmax of the model's logits as they
are; greedy rows whose only adjustment is EOS suppression until ``min_new_tokens`` take it too, with their EOS
entries set to -inf in place for that argmax and put back after it (no copy of the logits). The other rows get a
float32 copy that is processed in ``model.generate``'s order: repetition penalty, EOS
suppression until ``min_new_tokens``, then the tokens a structured-output grammar forbids (its mask is computed on
the host, from the tokens taken in so far). Greedy rows then take its argmax; sampled rows alone go on to temperature,
top-k, top-p, min-p and a draw.

The draw is the Gumbel-max trick, ``argmax(x - log(-log u))``. Its uniforms ``u`` are a hash of
``(seed, step, token id)`` in int32 tensor ops, so a request's stream depends on its own seed and step only, never
on its batch neighbours, and a preempted request draws the same tokens when it is recomputed.
"""

from __future__ import annotations

import array
import functools
import operator
from itertools import chain

import torch

from hf_paged.engine._sequence import Sequence
from hf_paged.engine._structured_output import allowed_tokens

_NEG_INF = float("-inf")
_GOLDEN = -0x61C88647  # 0x9E3779B9 as a signed 32-bit word
_M2 = -0x7B935975  # 0x846CA68B as a signed 32-bit word
_PARAMS, _LOGPROBS, _PLAIN_GREEDY, _SCHEMA = (operator.attrgetter(a) for a in ("params", "logprobs", "is_plain_greedy",
                                                                              "json_schema"))


class SamplingBatch:
    """Settings of the ``N`` rows sampled in one step (:meth:`build`). Tensors live on the sampling device; the plain
    fields tell the sampler which work to run, so it never reads a device value. What ``build`` leaves unset keeps
    the class's value: none of that work.

    Attributes:
        num_rows: ``N``.
        want_logprobs: return the model's log-probability of each chosen token.
        top_logprobs: ``K``, with ``want_logprobs``: also each row's ``K`` likeliest tokens and their logprobs.
        rows: ``[M]`` int64 rows that need more than an argmax of the raw logits: ``num_greedy`` processed greedy
            rows, then ``S = M - num_greedy`` sampled rows. None: every row is plain greedy.
        penalty: ``[M]`` float32 repetition penalty of those rows (1.0 = off); None when no row has one.
        penalty_at: ``([P], [P])`` int64 (position in ``rows``, token id) of every token a penalised row has seen.
        banned_at: ``([B], [B])`` int64 (position in ``rows``, EOS id) suppressed by ``min_new_tokens``, or None.
        masked_at: ``([E], [E])`` int64 (row of the logits, EOS id) of the greedy rows that need nothing but EOS
            suppression: masked in place around the plain argmax, or None.
        allowed_at: ``([G], [G, V])`` (int64 position in ``rows``, bool mask) of the rows a grammar constrains.
        temperature, top_p, min_p: ``[S]`` float32. top_k: ``[S]`` int64 (0 = off).
        seeds: ``[S, 2]`` int32 low and high words of each seed. steps: ``[S]`` int32 tokens generated so far.
        max_top_k: largest ``top_k`` of the sampled rows (0: no top-k).
        top_p_in_top_k: some row has both top-k and top-p (its top-p sorts only the top-k list).
        sort_rows: ``[F]`` int64 sampled positions with top-p but no top-k (they need a full sort), or None.
        use_min_p: some sampled row has ``min_p > 0``.
    """

    rows = penalty = penalty_at = banned_at = masked_at = allowed_at = None
    temperature = top_k = top_p = min_p = seeds = steps = sort_rows = None
    num_greedy = max_top_k = 0
    top_p_in_top_k = use_min_p = False

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        """Sort the rows on the host, gather their settings into one int64 and one float32 tensor, move each once."""
        b, params = cls(), list(map(_PARAMS, seqs))  # (map with attrgetter: the all-greedy check costs ~nothing a row)
        b.num_rows, b.want_logprobs = len(seqs), any(map(_LOGPROBS, params))
        b.top_logprobs = max(p.top_logprobs for p in params) if b.want_logprobs else 0
        if all(map(_PLAIN_GREEDY, params)):
            return b
        sampled = [i for i, p in enumerate(params) if p.do_sample]
        greedy = [i for i, (s, p) in enumerate(zip(seqs, params)) if not p.do_sample
                  and (p.repetition_penalty != 1.0 or s.grammar is not None)]
        eos_only = [i for i, (s, p) in enumerate(zip(seqs, params)) if not p.do_sample
                    and p.repetition_penalty == 1.0 and s.grammar is None and s.num_generated < p.min_new_tokens]
        at_rows, at_ids = _banned_eos([seqs[i] for i in eos_only], vocab_size)  # (positions in eos_only)
        if at_ids:
            b.masked_at = _packed(device, "q", [eos_only[j] for j in at_rows], at_ids)
        rows = greedy + sampled
        if not rows:
            return b
        constrained = ([j for j, i in enumerate(rows) if seqs[i].grammar is not None]
                       if any(map(_SCHEMA, params)) else [])
        if constrained:
            mask = allowed_tokens([seqs[rows[j]].grammar for j in constrained], vocab_size)
            b.allowed_at = (torch.tensor(constrained, device=device), mask.to(device, non_blocking=True))
        # how many tokens each row has seen that its penalty applies to, and those token ids, flat
        row_seqs = [seqs[i] for i in rows]
        seen = [len(s.token_ids) if s.params.repetition_penalty != 1.0 else 0 for s in row_seqs]
        seen_ids = list(chain.from_iterable(s.token_ids for s, n in zip(row_seqs, seen) if n))
        ban_pos, ban_ids = _banned_eos(row_seqs, vocab_size)
        ss = [seqs[i] for i in sampled]
        smp = [s.params for s in ss]
        top_k, top_p, min_p = [p.top_k for p in smp], [p.top_p for p in smp], [p.min_p for p in smp]
        sort_pos = [j for j, (k, q) in enumerate(zip(top_k, top_p)) if q < 1.0 and not k]
        seeds = [s.seed for s in ss]
        b.rows, seen_t, seen_ids_t, ban_pos_t, ban_ids_t, sort_t, b.top_k, lo, hi, steps = _packed(
            device, "q", rows, seen, seen_ids, ban_pos, ban_ids, sort_pos, top_k, [_i32(x) for x in seeds],
            [_i32(x >> 32) for x in seeds], [len(s.token_ids) - s.num_prompt_tokens for s in ss])
        penalty, b.temperature, b.top_p, b.min_p = _packed(
            device, "f", [params[i].repetition_penalty for i in rows], [p.temperature for p in smp], top_p, min_p)
        b.num_greedy, b.seeds, b.steps = len(greedy), torch.stack([lo, hi], 1).int(), steps.int()
        if seen_ids:
            b.penalty, b.penalty_at = penalty, (torch.repeat_interleave(seen_t, output_size=len(seen_ids)), seen_ids_t)
        b.banned_at = (ban_pos_t, ban_ids_t) if ban_pos else None
        b.sort_rows = sort_t if sort_pos else None
        b.max_top_k = min(max(top_k, default=0), vocab_size)
        b.top_p_in_top_k, b.use_min_p = any(q < 1.0 and k for k, q in zip(top_k, top_p)), any(min_p)
        return b


def _banned_eos(seqs: list[Sequence], vocab_size: int) -> tuple[list[int], list[int]]:
    """``(position in seqs, EOS id)`` of every EOS a sequence may not emit yet (``min_new_tokens``), as two lists;
    as in transformers, ids outside the vocabulary are ignored."""
    positions, ids = [], []
    for j, s in enumerate(seqs):
        p = s.params
        if p.min_new_tokens and s.num_generated < p.min_new_tokens:
            eos = [e for e in p.eos_token_ids if e < vocab_size]
            positions += [j] * len(eos)
            ids += eos
    return positions, ids


def _packed(device: torch.device, typecode: str, *lists: list) -> tuple[torch.Tensor, ...]:
    """``lists`` packed into one host tensor (``typecode`` "q": int64, "f": float32), copied to ``device`` once and
    split there into views."""
    values = array.array(typecode)  # fromlist is ~8x faster than torch.tensor(list)
    for part in lists:
        values.fromlist(part)
    host = torch.frombuffer(values, dtype=torch.int64 if typecode == "q" else torch.float32)
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return on_device.split([len(part) for part in lists])


def _i32(word: int) -> int:
    """The low 32 bits of ``word`` as a signed int32 value."""
    return ((word & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


class Sampler:
    """Turns ``[N, V]`` logits into ``[N]`` token ids (and optionally their logprobs), all on the logits' device;
    ``logprobs_mode``: what the logprobs are of (``EngineConfig.logprobs_mode``)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.processed = logprobs_mode == "processed_logprobs"

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits: ``[N, V]`` in the model's dtype, left unchanged. Returns ``[N]`` int64 tokens and, if asked,
        ``[N]`` float32 log-probabilities of the raw logits or of the processed distribution (``logprobs_mode``);
        with ``batch.top_logprobs = K``, ``[N, 1 + 2K]`` rows instead: the chosen token's logprob, the ``K`` largest
        logprobs, their token ids (as floats, exact below 2**24; :func:`split_logprob_row` reads a row)."""
        n, k = batch.num_rows, batch.top_logprobs
        rows, masked = batch.rows, batch.masked_at
        processed = self.processed and batch.want_logprobs
        out = drawn = None
        if rows is None or rows.shape[0] < n:
            if masked is None:
                tokens = _argmax(logits)
            else:  # EOS held back until min_new_tokens: out of the argmax's way, then back
                with torch.inference_mode():  # (the logits may be an inference tensor; the sampler may run outside)
                    kept = logits[masked]
                    logits.index_put_(masked, logits.new_full((), _NEG_INF))  # (a device value: no sync)
                tokens = _argmax(logits)
                out = logprob_rows(logits, tokens, k) if processed else None  # (of the logits EOS was held from)
                with torch.inference_mode():
                    logits.index_put_(masked, kept)
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        if rows is not None:
            x = logits.index_select(0, rows).float()  # [M, V] float32, ours to edit in place
            _process(x, batch)
            g = batch.num_greedy
            if g:
                tokens.index_copy_(0, rows[:g], _argmax(x[:g]))
            if g < rows.shape[0]:
                _filter(x[g:], batch)
            drawn = torch.log_softmax(x, -1) if processed else None  # (before the draw's noise)
            if g < rows.shape[0]:
                tokens.index_copy_(0, rows[g:], _draw(x[g:], batch))
        if not batch.want_logprobs:
            return tokens, None
        if out is None:
            out = logprob_rows(logits, tokens, k)
        if drawn is not None:
            out.index_copy_(0, rows, logprob_rows(drawn, tokens.index_select(0, rows), k))
        return tokens, out


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """``[N]`` float32 log-probabilities of ``tokens`` under ``logits`` (``[N, V]``); with ``k``, ``[N, 1 + 2k]``
    rows: the token's logprob, the ``k`` largest logprobs, their token ids (as floats, exact below 2**24;
    :func:`split_logprob_row` reads a row)."""
    logprobs = torch.log_softmax(logits, -1, dtype=torch.float32)
    chosen = logprobs.gather(1, tokens[:, None])
    if not k:
        return chosen.squeeze(1)
    top = logprobs.topk(min(k, logits.shape[-1]), -1)
    return torch.cat([chosen, top.values, top.indices.float()], 1)


def split_logprob_row(row: float | list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """A row of the sampler's logprobs as ``(logprob of the chosen token, [(token id, logprob)] of its k
    likeliest)``."""
    if not isinstance(row, list):
        return row, []
    width = (len(row) - 1) // 2
    return row[0], [(int(row[1 + width + j]), row[1 + j]) for j in range(min(k, width))]


def _process(x: torch.Tensor, b: SamplingBatch) -> None:
    """Repetition penalty (HF's: divide positive logits, multiply negative ones), EOS suppression and grammar
    masks, in place."""
    if b.penalty_at is not None:
        score = x[b.penalty_at]
        pen = b.penalty[b.penalty_at[0]]
        x[b.penalty_at] = torch.where(score < 0, score * pen, score / pen)
    if b.banned_at is not None:
        x.index_put_(b.banned_at, x.new_full((), _NEG_INF))  # a device value: a Python one is copied with a sync
    if b.allowed_at is not None:
        at, allowed = b.allowed_at
        x.index_copy_(0, at, x.index_select(0, at).masked_fill_(~allowed, _NEG_INF))


def _filter(x: torch.Tensor, b: SamplingBatch) -> None:
    """x: ``[S, V]`` float32 processed logits of the sampled rows: temperature, then -inf wherever top-k, top-p or
    min-p drop a token, in place.

    Each filter only raises the row's floor (the smallest logit it keeps), so they compose in one mask: top-k,
    then top-p on the top-k survivors, then min-p (``p < min_p * p_max`` is ``x < x_max + log(min_p)``).
    """
    s = x.shape[0]
    x.div_(b.temperature[:, None])
    floor = x.new_full((s,), _NEG_INF)
    top = None  # [S, K] each row's K largest logits, descending
    if b.max_top_k:
        top = x.topk(b.max_top_k, -1).values
        kth = top.gather(1, (b.top_k.clamp(1, b.max_top_k) - 1)[:, None]).squeeze(1)
        floor = torch.where(b.top_k > 0, kth, floor)
    if b.top_p_in_top_k:
        cut = _top_p_floor(top, b.top_p, b.top_k.clamp(0, b.max_top_k))
        floor = torch.maximum(floor, torch.where(b.top_k > 0, cut, _NEG_INF))
    if b.sort_rows is not None:
        full = _sorted_desc(x.index_select(0, b.sort_rows))  # [F, V]
        floor = floor.index_copy(0, b.sort_rows, _top_p_floor(full, b.top_p[b.sort_rows]))  # rows without top-k
    if b.use_min_p:
        peak = top[:, 0] if top is not None else x.amax(-1)
        floor = torch.maximum(floor, peak + b.min_p.log())
    if b.max_top_k or b.sort_rows is not None or b.use_min_p:
        x.masked_fill_(x < floor[:, None], _NEG_INF)


def _draw(x: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """x: ``[S, V]`` the sampled rows' filtered logits (``_filter``), edited in place. Returns ``[S]`` int64 tokens:
    the Gumbel-max draw of the module's docstring."""
    return _argmax(x.sub_(uniforms(b.seeds, b.steps, x.shape[1]).log_().neg_().log_()))


def _sorted_desc(x: torch.Tensor) -> torch.Tensor:
    """Each row's values, descending (indices are not needed). On the CPU numpy's sort is ~4x torch's."""
    if x.device.type != "cpu":
        return x.sort(-1, descending=True).values
    x.numpy().sort(-1)  # in place: x is our own copy
    return x.flip(-1)


def _top_p_floor(desc: torch.Tensor, top_p: torch.Tensor, k: torch.Tensor | None = None) -> torch.Tensor:
    """desc: ``[R, K]`` logits, descending, of which each row's first ``k`` count (None: all). Returns ``[R]`` the
    smallest logit top-p keeps: a token stays while the mass before it is below ``top_p``; -inf where top-p is off.

    Unnormalised prefix sums, so a row's answer does not depend on how long its list is."""
    e = (desc - desc[:, :1]).exp_()
    if k is not None:
        e.masked_fill_(torch.arange(desc.shape[1], device=desc.device)[None, :] >= k[:, None], 0.0)
    mass = e.cumsum_(-1)
    keep = 1 + (mass[:, :-1] < top_p[:, None] * mass[:, -1:]).sum(-1)
    cut = desc.gather(1, (keep - 1)[:, None]).squeeze(1)
    return torch.where(top_p < 1.0, cut, _NEG_INF)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum) as int64. On the CPU numpy's argmax is ~10x torch's (numpy has no bf16)."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    if x.dtype == torch.bfloat16:
        x = x.float()
    return torch.from_numpy(x.detach().numpy().argmax(-1)).long()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, a bijection of 32-bit words, in place on an int32 tensor: products wrap, and masks make the
    arithmetic right shifts logical."""
    x ^= (x >> 16) & 0xFFFF
    x *= 0x7FEB352D
    x ^= (x >> 15) & 0x1FFFF
    x *= _M2
    x ^= (x >> 16) & 0xFFFF
    return x


@functools.lru_cache(maxsize=4)
def _token_words(vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[V]`` int32 hashed token ids, distinct (read only)."""
    return _mix32(torch.arange(vocab_size, dtype=torch.int32, device=device) * _GOLDEN)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[S, V]`` float32 uniforms in (0, 1), a pure function of ``(seeds[i], steps[i], token id)``.

    seeds: ``[S, 2]`` int32 (low, high word of each seed); steps: ``[S]`` int32. Every op is int32 or float32: a
    fully mixed key per row, xor a fully mixed word per token, then a multiply-xorshift-multiply whose top 23 bits
    become the mantissa of a float in [1, 2)."""
    key = _mix32(_mix32(_mix32(steps + _GOLDEN) ^ seeds[:, 1]) ^ seeds[:, 0])
    h = key[:, None] ^ _token_words(vocab_size, seeds.device)[None, :]
    h *= 0x7FEB352D
    shifted = h >> 15
    h ^= shifted.bitwise_and_(0x1FFFF)
    del shifted
    h *= _M2
    h >>= 9
    h &= 0x7FFFFF
    h |= 0x3F800000  # exponent of 1.0
    return h.view(torch.float32).sub_(1.0 - 2.0**-24)  # (2 * mantissa + 1) / 2**24, exact
