"""Random paged attention steps over shuffled block tables: the inputs the backend tests (on the CPU) and the kernel
tests (tests/gpu) share."""

from __future__ import annotations

import dataclasses
import math

import torch

from hf_paged.attention._metadata import PagedMetadata, build_metadata

POISON = 1.0e4  # fills cache slots no sequence owns: a backend that reads them produces garbage


def random_paged_step(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, gen, dtype=torch.float32):
    """Random cache contents plus a scattered block table for sequences with ``ctx_lens`` tokens after the step."""
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, width = [], max(-(-c // block_size) for c in ctx_lens)
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(perm[:n] + [0] * (width - n))
        perm = perm[n:]
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
    meta = build_metadata(
        q_lens=torch.tensor(q_lens), seq_lens_k=torch.tensor(ctx_lens), block_tables=torch.tensor(tables),
        slot_mapping=torch.tensor(slots), token_index=None, grid=(1, sum(q_lens)), block_size=block_size,
        device=torch.device("cpu"),
    )
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, meta, tables


def make_paged_step(
    prefix_lens: list[int], new_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, gen: torch.Generator,
) -> tuple[PagedMetadata, torch.Tensor, torch.Tensor]:
    """A step whose new tokens are already in a shuffled paged cache (on the CPU; also used by the GPU tests).

    Returns ``(meta, key, value)``: ``key``/``value`` [T, Hkv, D] are the new tokens read back from their slots;
    the cache is ``meta.kv_caches[0]``, [num_blocks, block_size, Hkv, D], ``POISON`` in slots no sequence owns.
    """
    totals = [p + n for p, n in zip(prefix_lens, new_lens)]
    needed = [max(1, math.ceil(t / block_size)) for t in totals]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, POISON, dtype=dtype), torch.full(shape, POISON, dtype=dtype)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    slots = []
    for table, prefix, total in zip(tables, prefix_lens, totals):
        owned = torch.tensor([table[pos // block_size] * block_size + pos % block_size for pos in range(total)],
                             dtype=torch.long)
        flat_k[owned] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        flat_v[owned] = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots.append(owned[prefix:])
    slot_mapping = torch.cat(slots)
    width = max(needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = build_metadata(
        q_lens=torch.tensor(new_lens), seq_lens_k=torch.tensor(totals), block_tables=block_tables,
        slot_mapping=slot_mapping, token_index=None, grid=(1, int(slot_mapping.numel())), block_size=block_size,
        device=torch.device("cpu"),
    )
    meta = CachedStep(**{f.name: getattr(meta, f.name) for f in dataclasses.fields(PagedMetadata)},
                      kv_caches=[(k_cache, v_cache)])
    return meta, flat_k[slot_mapping].clone(), flat_v[slot_mapping].clone()


@dataclasses.dataclass(frozen=True)
class CachedStep(PagedMetadata):
    """A step's metadata with the paged cache its new tokens are in (``kv_caches[0]``), as the tests pass it round."""

    kv_caches: list = dataclasses.field(default_factory=list, repr=False)
