"""Per-row checks of attention kernels against the float64 torch oracle, and inputs whose answer is exact.

A relative error over a whole batch dilutes one wrong row among thousands: a token dropped or read twice at a
block or split boundary moves one row of a long context by ~1/n and passes. Two tools close that gap:

- :func:`row_errors` / :func:`assert_rows_close` judge every (query row, head) on its own.
- :func:`position_step` builds a step whose keys are zero (every visible key scores the same) and whose values encode
  their position: ``v[j, h, d] = (-1) ** bit_((d + h) % 16)(j)``. The output is then exactly the mean of the
  visible keys' values (:func:`exact_position_means`), a small sum over a count, which a kernel reproduces up to
  its final rounding; one key missing or counted twice moves dimension ``d = -h mod 16`` (bit 0, which flips at
  every position) by about ``1/n``, four times the allowance :func:`position_allowance` grants. With a sliding
  ``window`` the visible keys are the row's last ``window`` ones (transformers' convention: position ``i`` sees
  ``i - window < j <= i``); zero keys score 0 under any softcap too.
"""

from __future__ import annotations

import torch

from hf_paged.attention import PagedMetadata

from paged_steps import make_paged_step

# Largest relative rounding error of one output element stored in the dtype (round to nearest), with margin 2.
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-22}
# Share of one visible key's weight a structured row may be off by: a dropped or duplicated key moves it by ~1.
TOKEN_SHARE = 0.25


def row_sequences(meta: PagedMetadata) -> torch.Tensor:
    """``[T]`` int64: the sequence of each query row."""
    q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long().cpu()
    return torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)


def key_ranges(meta: PagedMetadata, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T], [T])`` int64: query row ``t`` sees key positions ``first[t] .. end[t] - 1`` (causal, bottom-right
    aligned: ``end`` is its position + 1; ``first`` is 0, or ``end - window`` under a sliding window > 0)."""
    q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).long().cpu()
    k_lens = meta.seq_lens_k.long().cpu()
    seq = row_sequences(meta)
    offset = torch.arange(int(q_lens.sum())) - (torch.cumsum(q_lens, 0) - q_lens)[seq]
    end = k_lens[seq] - q_lens[seq] + offset + 1
    first = (end - window).clamp_min(0) if window > 0 else torch.zeros_like(end)
    return first, end


def visible_keys(meta: PagedMetadata, window: int = 0) -> torch.Tensor:
    """``[T]`` int64: how many keys query row ``t`` sees."""
    first, end = key_ranges(meta, window)
    return end - first


def position_values(positions: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """``[N, Hkv, D]`` float64 values of keys at ``positions`` [N]: +1 or -1 by one bit of the position."""
    bits = (torch.arange(head_dim)[None, :] + torch.arange(num_kv_heads)[:, None]) % 16  # [Hkv, D]
    signs = 1.0 - 2.0 * ((positions[:, None] >> torch.arange(16)) & 1).double()  # [N, 16]: one per bit
    return signs[:, bits]


def exact_position_means(meta: PagedMetadata, num_heads: int, num_kv_heads: int, head_dim: int,
                         drop: dict[int, int] | None = None, repeat: dict[int, int] | None = None,
                         window: int = 0) -> torch.Tensor:
    """``[T, H, D]`` float64: the mean of the position values over each row's visible keys (the exact output for a
    :func:`position_step`; under a sliding ``window`` > 0, its last ``window`` keys). ``drop`` / ``repeat``
    ``{sequence: key position}`` leave one key out or count it twice in that sequence: what a kernel with such a
    bug would produce (used to test the checks themselves)."""
    seq = row_sequences(meta)
    first, end = key_ranges(meta, window)
    longest = int(meta.seq_lens_k.max())
    prefix = torch.cat([torch.zeros(1, num_kv_heads, head_dim, dtype=torch.float64),
                        position_values(torch.arange(longest), num_kv_heads, head_dim).cumsum(0)])
    sums, counts = prefix[end] - prefix[first], (end - first).double()
    for changes, sign in ((drop or {}, -1.0), (repeat or {}, 1.0)):
        for b, pos in changes.items():
            rows = (seq == b) & (first <= pos) & (end > pos)
            sums[rows] += sign * position_values(torch.tensor([pos]), num_kv_heads, head_dim)[0]
            counts[rows] += sign
    # A row left with no key gets zeros, as the kernels write for an empty context.
    means = sums / counts.clamp_min(1)[:, None, None]
    return means.repeat_interleave(num_heads // num_kv_heads, dim=1)


def position_step(prefix_lens: list[int], new_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype, gen: torch.Generator):
    """A step (on the CPU) of :func:`make_paged_step`'s layout whose owned cache slots hold zero keys and position
    values (unowned slots keep ``POISON``); queries are random. Returns ``(meta, query, key, value)`` like it."""
    meta, _, _ = make_paged_step(prefix_lens, new_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    k_cache, v_cache = meta.kv_caches[0]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    values = position_values(torch.arange(int(meta.seq_lens_k.max())), num_kv_heads, head_dim).to(dtype)
    for b, total in enumerate(meta.seq_lens_k.tolist()):
        pos = torch.arange(total)
        slots = meta.block_tables[b, pos // block_size].long() * block_size + pos % block_size
        flat_k[slots] = 0
        flat_v[slots] = values[:total]
    query = torch.randn(int(meta.cu_seqlens_q[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return meta, query, flat_k[meta.slot_mapping].clone(), flat_v[meta.slot_mapping].clone()


def row_errors(out: torch.Tensor, expected: torch.Tensor, allowance: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: the largest ``|out - expected| / allowance`` over each row's dims; a row fails above 1.
    ``allowance`` broadcasts against ``[T, H, D]``."""
    return ((out.double().cpu() - expected.double().cpu()).abs() / allowance.cpu()).amax(dim=-1)


def position_allowance(meta: PagedMetadata, expected: torch.Tensor, dtype: torch.dtype,
                       window: int = 0) -> torch.Tensor:
    """What a row of a :func:`position_step` may be off by: the dtype's rounding of the exact mean plus a quarter of
    one key's weight (``0.25 / visible keys``), far below what one missing or repeated key moves it by."""
    share = TOKEN_SHARE / visible_keys(meta, window).double()[:, None, None]
    return ROUNDING[dtype] * expected.double().cpu().abs() + share


def random_allowance(expected: torch.Tensor, tolerance: float) -> torch.Tensor:
    """For random inputs: ``tolerance`` times each row's rms (floored at a tenth of the batch's rms, so that a row
    that averages to almost nothing is not judged on noise)."""
    expected = expected.double().cpu()
    rms = expected.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return tolerance * rms.clamp_min(0.1 * expected.pow(2).mean().sqrt().item())


def sparse_allowance(expected: torch.Tensor, dtype: torch.dtype, tolerance: float) -> torch.Tensor:
    """For outputs with few non-zero dims (one-hot values: each output element is a sum of probabilities): the row
    allowance of :func:`random_allowance` plus the dtype's rounding of each element. A flash-style kernel rounds P to
    the dtype before P V and rounds the output once more; on a sparse row those two roundings of its largest element
    exceed a share of the row's rms (rms over head_dim dims, most of them zero), so the rms alone fails correct
    kernels at head_dim 256 (shown on the CPU with :func:`flash_rounded`)."""
    return random_allowance(expected, tolerance) + ROUNDING[dtype] * expected.double().cpu().abs()


def flash_rounded(query: torch.Tensor, meta: PagedMetadata, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a correct flash-style kernel computes, on the CPU (causal, no window): S = Q K^T in float32 from the
    dtype's inputs, P = exp(S - max) rounded to ``dtype`` for P V, its float32 row sum, the output rounded to
    ``dtype``. Returns float64 ``[T, H, D]``; used to prove that the allowances pass correct kernels."""
    k_cache, v_cache = meta.kv_caches[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    out = torch.empty(query.shape, dtype=torch.float64)
    cu = meta.cu_seqlens_q.tolist()
    for b, total in enumerate(meta.seq_lens_k.tolist()):
        pos = torch.arange(total)
        slots = meta.block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        q = query[cu[b]:cu[b + 1]].float()
        group = q.shape[1] // num_kv_heads
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->thk", q, keys) * scale
        rows = torch.arange(total - q.shape[0], total)
        scores = scores.masked_fill(pos[None, None, :] > rows[:, None, None], float("-inf"))
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        o = torch.einsum("thk,khd->thd", probs.to(dtype).float(), values) / probs.sum(-1, keepdim=True)
        out[cu[b]:cu[b + 1]] = o.to(dtype).double()
    return out


def failing_rows(errors: torch.Tensor) -> list[tuple[int, int, float]]:
    """(row, head, error) of every row whose error exceeds 1, worst first (at most 8)."""
    bad = (errors > 1).nonzero().tolist()
    bad.sort(key=lambda rh: -errors[rh[0], rh[1]].item())
    return [(r, h, round(errors[r, h].item(), 2)) for r, h in bad[:8]]


def assert_rows_close(out: torch.Tensor, expected: torch.Tensor, allowance: torch.Tensor, label: str) -> None:
    """Every (row, head) of ``out`` within ``allowance`` of ``expected`` (NaN fails)."""
    errors = row_errors(out, expected, allowance).nan_to_num(float("inf"))
    bad = failing_rows(errors)
    count = int((errors > 1).sum())
    assert not bad, f"{label}: {count} (row, head) pairs off, worst (row, head, error/allowance): {bad}"
