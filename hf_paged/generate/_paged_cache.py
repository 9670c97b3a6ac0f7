"""``PagedAttentionCache``: a ``transformers.Cache`` whose KV lives in fixed-size blocks.

::

    model.generate batch (left-padded)         block tables                 KV pool (per layer, shared ids)
    row 0: . . a b c d e                       row 0: [3, 7]                 block 3: a b c d    (block_size 4)
    row 1: f g h i j k l       --plan-->       row 1: [0, 1]                 block 7: e _ _ _
                                                                              block 0: f g h i
    (. = padding: no slot)                     slot = block * 4 + offset      block 1: j k l _

Each forward, the registered ``"hf_paged"`` mask function asks this cache (by the ways ``generate/_adapter.py``
describes) to *plan* the step (:meth:`PagedAttentionCache.plan_step`): rows get blocks for their new real tokens
(padding takes none), and the plan's flat tensors (slot mapping, block tables, sequence lengths) are built once and
handed to every layer as its ``attention_mask``. The attention function packs the new K/V of the real tokens, writes
them into their slots and attends through the block tables. The rest of the class answers what ``generate``
asks of a cache: sizes, flags, beam reordering, crops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged.attention._metadata import PagedMetadata, build_metadata
from hf_paged.cache._config import DEFAULT_POOL_SEQUENCES, CacheConfig, config_or_keywords
from hf_paged.cache._kv_pool import KVLayout, blocks_for_budget, pool_blocks
from hf_paged.generate._adapter import GenerateHooks
from hf_paged.generate._batch_tables import BatchTables
from hf_paged.generate._static_decode import StaticDecode
from hf_paged.hf._placement import layer_devices
from hf_paged.hf._support import paged_kv, position_limit
from hf_paged.parallel._lockstep import agreed_min
from hf_paged.parallel._tensor_parallel import kv_layout, tensor_parallel


class PagedLayer(CacheLayerMixin):
    """One layer's view of the pool, so transformers code that walks ``cache.layers`` finds real tensors."""

    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: PagedAttentionCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.keys, self.values = owner.pool.kv_caches[layer_idx]
        self.is_initialized = True

    @property
    def is_compileable(self) -> bool:
        return self.owner.is_compileable

    def lazy_initialization(self, key_states, value_states) -> None:
        return None  # the pool is allocated up front

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1


class PagedAttentionCache(GenerateHooks, Cache):
    """Paged KV cache for ``model.generate`` on a model loaded with ``attn_implementation="hf_paged"``.

    Args:
        config: the model config (``model.config``).
        num_blocks: blocks in the pool. This and the next four are the pool's settings, as a
            :class:`~hf_paged.CacheConfig` has them (its docstring says what each does), or give ``cache_config``
            instead (not both).
        block_size: tokens per block.
        memory_budget: with ``num_blocks`` unset, the fraction in (0, 1] of free device memory the pool may take.
            With neither ``num_blocks`` nor ``memory_budget`` the pool takes 0.8 of free device memory (on a CPU at
            most 3% of the machine's RAM), at most 256 sequences of the model's full length.
        backend: the attention backends allowed, in the order tried.
        kv_cache_dtype: what the pool stores: None or ``"auto"`` (the model's dtype), or ``"fp8"``.
        device: where the KV lives: one device, or one per decoder layer (a model split with ``device_map``).
        dtype: the model's dtype (float16, bfloat16 or float32); the pool holds it, or fp8 (``kv_cache_dtype``).
        max_new_tokens: the ``max_new_tokens`` of the ``generate`` calls this cache serves. Given, each batch takes
            the blocks for its prompts plus that many tokens before its first forward (``OutOfBlocksError`` up
            front, never mid-decode), and decode steps can have fixed shapes, which ``generate`` may compile.
        compileable: whether decode steps take fixed shapes so that ``generate`` compiles them (``is_compileable``):
            None = where transformers compiles (one CUDA device, capture-safe backends; needs ``max_new_tokens``),
            True = also elsewhere, e.g. on the CPU with a ``compile_config``; False = never.
        layout: the KV shape the model's layers produce, when it is not the config's: a tensor-parallel model's
            layers compute only their process's KV heads (``hf_paged.paged_cache_for`` passes it).
        cache_config: the pool's settings as one :class:`~hf_paged.CacheConfig`.

    An fp8 pool (``kv_cache_dtype="fp8"``): decode, prefill and the KV write run on the cuda kernels (float16/bfloat16
    models on a GPU, head_dim 64, 128 or 256; other layers on the torch backend); no compiled decode steps
    (``is_compileable`` is False); ``docs/guides/cache.md`` gives the scale policy and its accuracy.

    Per layer the pool holds ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Reuse: each ``generate`` call starts from an empty cache (what an earlier call left is freed first), so a cache
    may serve call after call and always gives the tokens a new cache gives. The cache never sees token ids, so it
    cannot tell whether a new input continues what it holds; an input that does is recomputed. Direct ``model(...)``
    calls continue the held batch when the attention mask covers the held columns plus the new ones, start afresh
    when it covers only the new ones, and raise otherwise (see ``docs/guides/cache.md``).
    """

    is_initialized = True  # the pool is allocated up front
    is_croppable = True

    def __init__(self, config, num_blocks: int | None = None, block_size: int = CacheConfig.block_size,
                 device: str | torch.device | Sequence[str | torch.device] = "cpu", dtype: torch.dtype = torch.float32,
                 memory_budget: float | None = None, backend: str | Sequence[str] | None = None,
                 max_new_tokens: int | None = None, compileable: bool | None = None, layout: KVLayout | None = None,
                 kv_cache_dtype: str | None = None, cache_config: CacheConfig | None = None):
        self.config = config
        layout = KVLayout.from_config(config) if layout is None else layout
        one = isinstance(device, (str, torch.device))
        devices = [torch.device(d) for d in ([device] * layout.num_layers if one else device)]  # (KVPool checks them)
        given = dict(num_blocks=num_blocks, block_size=block_size, memory_budget=memory_budget, backend=backend,
                     kv_cache_dtype=kv_cache_dtype)
        if cache_config is None and num_blocks is not None and memory_budget is not None:
            raise ValueError("give either num_blocks or memory_budget, not both")
        cache_config = config_or_keywords(CacheConfig, cache_config, "cache_config", "the pool's settings", **given)
        num_blocks = pool_blocks(cache_config, layout, dtype, devices,
                                 cap=cache_config.blocks_for(DEFAULT_POOL_SEQUENCES, position_limit(config)))
        self.pool, self.dispatcher = paged_kv(config, layout, devices, dtype, cache_config.block_size, num_blocks,
                                              cache_config.kv_cache_dtype, cache_config.backend)
        self.kv_cache_dtype = self.pool.dtype  # what the pool stores
        self.cache_config = dataclasses.replace(cache_config, num_blocks=num_blocks)
        self.rows = BatchTables(self.pool)
        self._checked_config = None
        self.dtype = dtype
        self.plan: PagedMetadata | None = None  # the metadata of the forward planned last (None after a batch edit)
        self._plan_key: tuple | None = None
        self._plan_used = False  # whether a layer has read the current plan (a new forward plans afresh)
        self.compile_mode = StaticDecode(config, self.pool, self.dispatcher, dtype, max_new_tokens, compileable)
        super().__init__(layers=[PagedLayer(self, i) for i in range(layout.num_layers)])

    # ----- sizes transformers asks for -------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of the ``generate`` batch seen so far (padding included, as transformers counts them)."""
        return self.rows.num_columns

    @property
    def batch_size(self) -> int:
        return self.rows.num_rows

    @property
    def is_compileable(self) -> bool:
        """Whether decode steps have fixed shapes and no host syncs, so that ``generate`` may compile them (see
        ``compileable``); when not, the reason is logged once."""
        return self.compile_mode.enabled

    @property
    def is_linear(self) -> list[bool]:
        """No layer holds linear-attention state (``generate`` and the mask code ask twice per step; transformers'
        own answer tests every layer's type)."""
        return [False] * len(self.layers)

    # ----- batch edits generate performs -----------------------------------------------------------------------
    def reset(self) -> None:
        """Free every sequence's blocks (each generate call starts with this)."""
        self.rows.start(0)
        self.plan = None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` columns (negative: drop that many from the end)."""
        if max_length < 0:
            max_length = self.rows.num_columns - abs(max_length)
        self.rows.crop(max(max_length, 0))
        self.plan = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # The block tables live on the host: beam search reads its beam indices back once per step.
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices([r for r in range(self.rows.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor | list[int]) -> None:
        self.rows.select_rows(torch.as_tensor(indices).tolist())
        self.plan = None

    # ----- one step --------------------------------------------------------------------------------------------
    def plan_step(self, attention_mask: torch.Tensor | None, batch_size: int, q_len: int,
                  device: torch.device) -> PagedMetadata:
        """Reserve slots for this forward's real tokens and build the step's metadata (once per forward).

        Args:
            attention_mask: ``[batch, columns + q_len]`` 2D padding mask (1 = real token), or None (all real).
                A decode step's mask (``q_len == 1``, one column wider than the cache holds) is not read: its new
                column is taken as all ones, as ``generate`` makes it, so the step copies nothing to the host.
        """
        key = (batch_size, q_len, self.rows.num_columns)
        # Models with several mask kinds (full + sliding) ask twice in one forward: answer with the same plan.
        if self.plan is not None and not self._plan_used and self._plan_key == key:
            return self.plan
        valid = self.rows.begin_forward(attention_mask, batch_size, q_len)
        if self.rows.num_columns == 0:  # a new batch: its first write fixes fp8 scales afresh, as in a new cache
            self.pool.clear_scales()
        decode = q_len == 1 and valid is None and self.rows.num_columns > 0
        static = self.compile_mode if decode and self.compile_mode.enabled else None
        if static is not None and self.rows.advance():  # armed rows: no host bookkeeping
            plan = static.advance()
        else:
            slots = self.compile_mode.append(self.rows, q_len, valid)
            plan = static.plan(self.rows, slots) if static is not None else build_metadata(
                q_lens=torch.full((batch_size,), q_len) if valid is None else valid.sum(1),
                seq_lens_k=torch.tensor(self.rows.num_tokens), block_tables=self.rows.block_table_tensor(),
                slot_mapping=slots, token_index=None if valid is None else valid.flatten().nonzero().squeeze(1),
                grid=(batch_size, q_len), block_size=self.block_size, device=torch.device(device))
        self.plan, self._plan_key, self._plan_used = plan, (batch_size, q_len, self.rows.num_columns), False
        return plan

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """This layer's new K/V (``[batch, Hkv, q_len, D]``), as they are: the attention function packs the real
        tokens, writes them into the pool and attends."""
        if self.plan is None and not torch.compiler.is_compiling():
            raise RuntimeError(
                "PagedAttentionCache.update ran before a step was planned: load the model with "
                'attn_implementation="hf_paged" (import hf_paged first) so its mask function can plan each step')
        self._plan_used = True
        return key_states, value_states

    def mark_step_read(self) -> None:
        """Count the planned step as read, as a layer's :meth:`update` does (a forward run without them: a replayed
        graph), so that the next forward plans afresh."""
        self._plan_used = True

    # ----- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks used and free, tokens stored, internal fragmentation, and which backend served each phase."""
        return {**self.rows.stats(), "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                "backends": dict(self.dispatcher.served)}

    def __repr__(self) -> str:
        return (f"PagedAttentionCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={self.pool.allocator.num_used}, rows={self.rows.num_rows}, dtype={self.dtype}, "
                f"kv_cache_dtype={self.kv_cache_dtype})")


def paged_cache_for(model: torch.nn.Module, **kwargs) -> PagedAttentionCache:
    """A ``PagedAttentionCache`` for ``model`` with each layer's KV on that layer's device (``kwargs`` as for
    ``PagedAttentionCache``: ``num_blocks`` or ``memory_budget``, ``block_size``, ``backend``).

    For a tensor-parallel model (``tp_plan``), call it on every process: each pool holds the process's own KV heads,
    and a ``memory_budget`` is turned into the number of blocks the tightest process can hold, so that every process
    runs out of blocks (or not) at the same step."""
    if "device" in kwargs or "layout" in kwargs:
        raise ValueError("paged_cache_for places and shapes the KV by the model; do not pass device= or layout=")
    kwargs.setdefault("dtype", model.dtype)
    layout, devices = kv_layout(model), layer_devices(model)
    if tensor_parallel(model) is not None and kwargs.get("num_blocks") is None and kwargs.get("memory_budget"):
        block_size = kwargs.get("block_size", CacheConfig.block_size)
        budget = CacheConfig(memory_budget=kwargs.pop("memory_budget")).memory_budget  # (checked as everywhere)
        mine = blocks_for_budget(layout, block_size, kwargs["dtype"], devices, budget)
        kwargs["num_blocks"] = agreed_min(model, mine)
    return PagedAttentionCache(model.config, device=devices, layout=layout, **kwargs)
