"""A forward that starts from nothing, with no paged cache, run paged: the step of a transient KV that lives for
that forward only.

A plain ``model(input_ids)`` (log-likelihood scoring, as lm-evaluation-harness's ``hf`` model does it) or the first
forward on a cache transformers made itself gets no ``PagedAttentionCache``. When its mask is plain causal attention
over the input's real tokens (transformers then allows the causal skip: no extra mask function, no packed sequences),
nothing came before it and autograd is off (the paged path serves no gradients), the ``"hf_paged"`` mask function
plans it here: each row's real tokens get consecutive blocks of a :class:`TransientKV`, whose per-layer tensors are
made when the layer first writes (on the layer's device, in its dtype and KV-head count, so a model split over devices
or sharded by tensor parallel is served as it is), and every layer writes its new K/V there and attends through the
block tables as on any paged cache. The blocks hold just this forward's tokens and go with the step.
"""

from __future__ import annotations

import torch

from hf_paged.attention._dispatch import Dispatcher
from hf_paged.attention._metadata import build_metadata
from hf_paged.attention._step import PagedStep
from hf_paged.cache._config import CacheConfig
from hf_paged.cache._kv_pool import SUPPORTED_DTYPES, KVLayout
from hf_paged.hf._support import check_model_supported


class TransientKV:
    """The KV of one forward, as a pool's attributes that attention reads (``layout``, ``block_size``, ``kv_caches``,
    ``kv_scales``). ``claim(layer_idx, key)`` makes the layer's ``[num_blocks, block_size, Hkv, D]`` tensors for its
    ``key`` (``[batch, Hkv, q_len, D]``) before the layer writes."""

    kv_scales = None

    def __init__(self, num_layers: int, num_blocks: int, block_size: int):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.layout: KVLayout | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def claim(self, layer_idx: int, key: torch.Tensor) -> bool:
        """Make layer ``layer_idx``'s tensors for ``key``; False where they cannot serve it (a layer index or head
        shape outside this forward's, a dtype no pool holds)."""
        if not 0 <= layer_idx < self.num_layers or key.dtype not in SUPPORTED_DTYPES:
            return False
        heads, dim = key.shape[1], key.shape[-1]
        if self.layout is None:
            self.layout = KVLayout(num_layers=self.num_layers, num_kv_heads=heads, head_dim=dim)
        if (heads, dim) != (self.layout.num_kv_heads, self.layout.head_dim):
            return False
        caches = self.kv_caches[layer_idx]
        if caches is None or caches[0].device != key.device or caches[0].dtype != key.dtype:
            shape = (self.num_blocks, self.block_size, heads, dim)
            self.kv_caches[layer_idx] = (key.new_zeros(shape), key.new_zeros(shape))
        return True


def real_tokens(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor | None:
    """The host ``[batch, q_len]`` bool of which of a forward's ``q_len`` new tokens are real, read from its padding
    mask (``[batch, columns]``, the new tokens last; one copy to the host), or None when all are."""
    valid = attention_mask[:, -q_len:].to("cpu", torch.bool)
    return None if bool(valid.all()) else valid


def fresh_step(config, attention_mask: torch.Tensor | None, batch_size: int, q_length: int,
               device: torch.device) -> PagedStep | None:
    """The paged step of a forward of ``batch_size x q_length`` tokens with nothing before them (``attention_mask``:
    the ``[batch, q_length]`` padding mask, True = real, or None = all real), on a :class:`TransientKV`; None for a
    model hf_paged does not serve."""
    try:
        check_model_supported(config)
    except (ValueError, NotImplementedError):
        return None
    bs = CacheConfig.block_size
    valid = None if attention_mask is None else real_tokens(attention_mask, q_length)
    q_lens = torch.full((batch_size,), q_length) if valid is None else valid.sum(1)
    blocks = (q_lens + bs - 1) // bs
    first = torch.cumsum(blocks, 0) - blocks  # each row's blocks are consecutive, from its first
    width = max(1, int(blocks.max()) if batch_size else 1)
    columns = torch.arange(width)
    tables = torch.where(columns < blocks[:, None], first[:, None] + columns, 0)
    grid = torch.ones(batch_size, q_length, dtype=torch.bool) if valid is None else valid
    position = grid.long().cumsum(1) - 1  # each real token's place in its row
    slots = (first[:, None] * bs + position)[grid]
    meta = build_metadata(q_lens=q_lens, seq_lens_k=q_lens, block_tables=tables, slot_mapping=slots,
                          token_index=None if valid is None else valid.flatten().nonzero().squeeze(1),
                          grid=(batch_size, q_length), block_size=bs, device=torch.device(device))
    layers = KVLayout.from_config(config).num_layers
    return PagedStep(meta, TransientKV(layers, max(1, int(blocks.sum())), bs), Dispatcher())
