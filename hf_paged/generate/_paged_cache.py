"""``PagedAttentionCache``: a ``transformers.Cache`` whose KV lives in fixed-size blocks.

::

    model.generate batch (left-padded)         block tables                 KV pool (per layer, shared ids)
    row 0: . . a b c d e                       row 0: [3, 7]                 block 3: a b c d    (block_size 4)
    row 1: f g h i j k l       --plan-->       row 1: [0, 1]                 block 7: e _ _ _
                                                                              block 0: f g h i
    (. = padding: no slot)                     slot = block * 4 + offset      block 1: j k l _

Each forward, the registered ``"hf_paged"`` mask function asks this cache to *plan* the step: rows get blocks for
their new real tokens (padding takes none), and the plan's flat tensors (slot mapping, block tables, sequence
lengths) are built once and handed to every layer as its ``attention_mask``. Each layer's ``update`` packs the new
K/V of the real tokens; the attention function writes them into their slots and attends through the block tables.
What else ``generate`` asks of a cache (sizes, flags, beam reordering, crops) is :class:`CacheInterface`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged.attention._dispatch import Dispatcher
from hf_paged.cache._kv_quant import kv_storage_dtype
from hf_paged.attention._metadata import PagedMetadata, build_metadata
from hf_paged.generate._batch_tables import BatchTables
from hf_paged.cache._kv_pool import SUPPORTED_DTYPES, KVLayout, KVPool, blocks_for_budget
from hf_paged.attention._calls import basic_calls
from hf_paged.generate._static_decode import CompileMode
from hf_paged.hf import _attention as paged_attention
from hf_paged.hf._support import check_model_supported


class PlanOffset(int):
    """The query offset ``generate``'s mask code asks the cache for, carrying the cache to the mask function.

    It is an ``int`` (the number of columns seen), so any other reader gets the plain offset.
    """

    paged_cache: PagedAttentionCache

    def __new__(cls, value: int, cache: PagedAttentionCache):
        obj = super().__new__(cls, value)
        obj.paged_cache = cache
        return obj


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


class CacheInterface:
    """The ``transformers.Cache`` half of :class:`~hf_paged.PagedAttentionCache` (a mixin: it reads the cache's
    ``pool``, ``rows``, ``compile_mode``, ``_traced_offset`` and ``_passed_to_generate``, and drops ``_plan``)."""

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

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if torch.compiler.is_compiling():  # unread: the plan is made before a compiled forward (and a step-varying
            return query_length, 0  # int read while tracing would recompile every step)
        return self.rows.num_columns + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling():  # the plan comes in attention_mask; the mask function says so if not
            return self._traced_offset
        return PlanOffset(self.rows.num_columns, self)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.rows.num_rows

    @property
    def is_compileable(self) -> bool:
        """Whether decode steps have fixed shapes and no host syncs, so that ``generate`` may compile them (see
        ``compileable``); when not, the reason is logged once."""
        return self.compile_mode.enabled

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_linear(self) -> list[bool]:
        """No layer holds linear-attention state (``generate`` and the mask code ask twice per step; transformers'
        own answer tests every layer's type)."""
        return [False] * len(self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_croppable(self) -> bool:
        return True

    # generate (transformers 5.17 to 5.24) sets this on a cache the caller passed, once at the start of each call:
    # the one sign a cache gets that a new call begins, before generate asks get_seq_length() how much of the input
    # to skip. An empty cache makes it feed the whole input.
    @property
    def _is_user_defined(self) -> bool:
        return self._passed_to_generate

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._passed_to_generate = value
        if value:
            self.reset()

    # ----- batch edits generate performs -----------------------------------------------------------------------
    def reset(self) -> None:
        """Free every sequence's blocks (each generate call starts with this)."""
        self.rows.reset()
        self._plan = None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` columns (negative: drop that many from the end)."""
        if max_length < 0:
            max_length = self.rows.num_columns - abs(max_length)
        self.rows.crop(max(max_length, 0))
        self._plan = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # The block tables live on the host: beam search reads its beam indices back once per step.
        self.rows.select_rows(beam_idx.tolist())
        self._plan = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows.select_rows([r for r in range(self.rows.num_rows) for _ in range(repeats)])
        self._plan = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows.select_rows(torch.as_tensor(indices).tolist())
        self._plan = None


_GIVEN_PLAN = "given"  # plan key of a plan handed over by begin_step


class PagedAttentionCache(CacheInterface, Cache):
    """Paged KV cache for ``model.generate`` on a model loaded with ``attn_implementation="hf_paged"``.

    Args:
        config: the model config (``model.config``).
        num_blocks: blocks in the pool; or None to size the pool from ``memory_budget``.
        block_size: tokens per block (1 to 1024; 16 is a good default, flash-attn's paged kernels want 256).
        device: where the KV lives: one device, or one per decoder layer (a model split with ``device_map``).
        dtype: KV dtype; must be the model's dtype (float16, bfloat16 or float32).
        memory_budget: with ``num_blocks=None``: bytes (int) or a fraction of free device memory (float).
        backend: restrict attention to these backends, tried in the given order: a name, a sequence of names or a
            comma-separated string (see ``hf_paged.available_backends()``); None = automatic (flash, cuda, torch).
        max_new_tokens: the ``max_new_tokens`` of the ``generate`` calls this cache serves. Given, each batch takes
            the blocks for its prompts plus that many tokens before its first forward (``OutOfBlocksError`` up
            front, never mid-decode), and decode steps can have fixed shapes, which ``generate`` may compile.
        compileable: whether decode steps take fixed shapes so that ``generate`` compiles them (``is_compileable``):
            None = where transformers compiles (one CUDA device, capture-safe backends; needs ``max_new_tokens``),
            True = also elsewhere, e.g. on the CPU with a ``compile_config``; False = never.
        layout: the KV shape the model's layers produce, when it is not the config's: a tensor-parallel model's
            layers compute only their process's KV heads (``hf_paged.parallel._tensor_parallel.kv_layout(model)``).
        kv_cache_dtype: what the pool stores: None or ``"auto"``, ``dtype``; ``"fp8"`` (or ``"fp8_e4m3"``),
            ``torch.float8_e4m3fn`` with a float32 scale per layer and KV head, half the bytes of bfloat16 (twice
            the blocks in a memory budget). Decode, prefill and the KV write run on the cuda kernels
            (float16/bfloat16 models on a GPU, head_dim 64, 128 or 256; other layers on the torch backend); no
            compiled decode steps (``is_compileable`` is False);
            ``docs/cache.md`` gives the scale policy and its accuracy.

    Per layer the pool holds ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Reuse: each ``generate`` call starts from an empty cache (what an earlier call left is freed first), so a cache
    may serve call after call and always gives the tokens a new cache gives. The cache never sees token ids, so it
    cannot tell whether a new input continues what it holds; an input that does is recomputed. Direct ``model(...)``
    calls continue the held batch when the attention mask covers the held columns plus the new ones, start afresh
    when it covers only the new ones, and raise otherwise (see ``docs/cache.md``).
    """

    def __init__(
        self,
        config,
        num_blocks: int | None = None,
        block_size: int = 16,
        device: str | torch.device | Sequence[str | torch.device] = "cpu",
        dtype: torch.dtype = torch.float32,
        memory_budget: int | float | None = None,
        backend: str | Sequence[str] | None = None,
        max_new_tokens: int | None = None,
        compileable: bool | None = None,
        layout: KVLayout | None = None,
        kv_cache_dtype: str | None = None,
    ):
        check_model_supported(config)
        if not isinstance(block_size, int) or not 1 <= block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {block_size!r}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {dtype} is not supported for the KV cache; use one of {SUPPORTED_DTYPES}")
        self.kv_cache_dtype = kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        self.config = config
        layout = KVLayout.from_config(config) if layout is None else layout
        devices = _layer_devices(device, layout.num_layers)
        if num_blocks is None:
            if memory_budget is None:
                raise ValueError("give num_blocks, or memory_budget (bytes, or a fraction of free memory)")
            num_blocks = blocks_for_budget(layout, block_size, kv_dtype, devices, memory_budget)
        elif memory_budget is not None:
            raise ValueError("give either num_blocks or memory_budget, not both")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.pool = KVPool(layout, num_blocks, block_size, kv_dtype, devices)
        self.rows = BatchTables(self.pool)
        self.dispatcher = Dispatcher(backend)
        self._checked_config = None
        self.dispatcher.check_restriction(basic_calls(config, layout, devices, dtype, block_size, kv_dtype))
        self.dtype = dtype
        self._plan: PagedMetadata | None = None
        self._plan_key: tuple | None = None
        self._plan_used = False  # whether a layer has read the current plan (a new forward plans afresh)
        self._next_plan: PagedMetadata | None = None
        self._passed_to_generate = False
        self.max_new_tokens = max_new_tokens
        self._traced_offset = PlanOffset(0, self)  # made here: a compiler cannot construct it while tracing
        self.compile_mode = CompileMode(config, layout, devices, dtype, block_size, self.pool.kv_caches,
                                        self.dispatcher, max_new_tokens, compileable, self.pool.kv_scales)
        super().__init__(layers=[PagedLayer(self, i) for i in range(layout.num_layers)])

    # ----- one step --------------------------------------------------------------------------------------------
    def begin_step(self, meta: PagedMetadata) -> None:
        """Hand the next forward a plan made elsewhere (the engine plans its own steps)."""
        self._next_plan = meta

    def plan_step(
        self, attention_mask: torch.Tensor | None, batch_size: int, q_len: int, device: torch.device
    ) -> PagedMetadata:
        """Reserve slots for this forward's real tokens and build the step's metadata (once per forward).

        Args:
            attention_mask: ``[batch, columns + q_len]`` 2D padding mask (1 = real token), or None (all real).
                A decode step's mask (``q_len == 1``, one column wider than the cache holds) is not read: its new
                column is taken as all ones, as ``generate`` makes it, so the step copies nothing to the host.
        """
        if self._next_plan is not None:
            self._plan, self._next_plan = self._next_plan, None
            self._plan_key = _GIVEN_PLAN
            self._plan_used = False
            return self._plan
        key = (batch_size, q_len, self.rows.num_columns)
        # Models with several mask kinds (full + sliding) ask twice in one forward: answer with the same plan.
        if self._plan is not None and not self._plan_used and self._plan_key in (key, _GIVEN_PLAN):
            return self._plan
        valid = self.rows.begin_forward(attention_mask, batch_size, q_len)
        if self.rows.num_columns == 0:  # a new batch: its first write fixes fp8 scales afresh, as in a new cache
            self.pool.clear_scales()
        decode = q_len == 1 and valid is None and self.rows.num_columns > 0
        if decode and self.compile_mode.enabled and self.rows.advance():  # armed rows: no host bookkeeping
            return self._planned(self.compile_mode.static.advance())
        reserve = self.compile_mode.blocks_until_done(self.rows, q_len, valid) if not self.rows.num_columns else None
        slots = self.rows.append(q_len, valid)
        if reserve is not None:
            self.rows.reserve(sum(reserve) - sum(len(t) for t in self.rows.tables))
        if decode and self.compile_mode.enabled:
            self._plan = self.compile_mode.static.plan(self.rows, slots)
        else:
            self._plan = self._build_plan(batch_size, q_len, valid, slots, device)
        return self._planned(self._plan)

    def _planned(self, plan: PagedMetadata) -> PagedMetadata:
        self._plan, self._plan_key, self._plan_used = plan, (plan.grid[0], plan.grid[1], self.rows.num_columns), False
        return plan

    def _build_plan(self, batch_size: int, q_len: int, valid: torch.Tensor | None, slots: torch.Tensor,
                    device: torch.device) -> PagedMetadata:
        return build_metadata(
            q_lens=torch.full((batch_size,), q_len) if valid is None else valid.sum(1),
            seq_lens_k=torch.tensor(self.rows.num_tokens),
            block_tables=self.rows.block_table_tensor(),
            slot_mapping=slots,
            token_index=None if valid is None else valid.flatten().nonzero().squeeze(1),
            grid=(batch_size, q_len),
            block_size=self.block_size,
            kv_caches=self.pool.kv_caches,
            dispatcher=self.dispatcher,
            device=torch.device(device),
            kv_scales=self.pool.kv_scales,
        )

    def check_model_config(self, config) -> None:
        """Refuse a model whose decoder has another number of layers than this cache (the mask function passes the
        model's config each forward; checked once per config object)."""
        if config is None or config is self._checked_config:
            return
        layers = KVLayout.from_config(config).num_layers
        if layers != self.pool.layout.num_layers:
            raise ValueError(
                f"this cache was built for another model ({self.pool.layout}) but this model has {layers} decoder "
                "layers; build the cache from this model's config (PagedAttentionCache(model.config, ...))"
            )
        self._checked_config = config

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Pack this layer's new K/V (``[batch, Hkv, q_len, D]``) to the real tokens: returns ``[T, Hkv, D]`` each.

        The attention function writes them into the pool (its backend picks the write kernel) and attends.
        """
        if torch.compiler.is_compiling():
            if self._plan is not None and self._plan.static:
                self._plan_used = True  # a compiled decode step of fixed shapes: one real token per row, checked eager
                return _pack(key_states, None), _pack(value_states, None)
            if paged_attention.opaque_plans:
                # The engine's compiled layers: its steps are packed (every token real, no token index) and the
                # engine built this cache for this model, so there is nothing to check or select here, and the
                # layer's graph need not break twice (here and at the attention call, which writes the K/V).
                return _pack(key_states, None), _pack(value_states, None)
        return self._update(key_states, value_states, layer_idx)

    # Opaque to torch.compile (a compiled layer breaks its graph here; see hf_paged.compile._layers).
    @torch.compiler.disable
    def _update(self, key_states, value_states, layer_idx: int):
        plan = self._plan
        if plan is None:
            raise RuntimeError(
                "PagedAttentionCache.update ran before a step was planned: load the model with "
                'attn_implementation="hf_paged" (import hf_paged first) so its mask function can plan each step'
            )
        if layer_idx >= len(self.pool.kv_caches) or key_states.shape[1] != self.pool.layout.num_kv_heads or (
                key_states.shape[-1] != self.pool.layout.head_dim):
            raise ValueError(
                f"this cache was built for another model ({self.pool.layout}) but layer {layer_idx} produces "
                f"{key_states.shape[1]} KV heads of {key_states.shape[-1]}; build the cache from this model's config "
                "(PagedAttentionCache(model.config, ...))"
            )
        k_cache = self.pool.kv_caches[layer_idx][0]
        if key_states.dtype != self.dtype:
            raise ValueError(
                f"the model produces {key_states.dtype} keys but the cache holds {self.dtype}; "
                f"create the cache with dtype=model.dtype"
            )
        if key_states.device != k_cache.device:
            raise ValueError(
                f"layer {layer_idx} runs on {key_states.device} but its KV cache is on {k_cache.device}; "
                "create the cache with device=model.device (or one device per layer for a split model)"
            )
        self._plan_used = True
        index = plan.on(k_cache.device).token_index
        return _pack(key_states, index), _pack(value_states, index)

    # ----- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Blocks used and free, tokens stored, internal fragmentation, and which backend served each phase."""
        return {**self.rows.stats(), "kv_cache_dtype": _dtype_name(self.kv_cache_dtype),
                "backends": dict(self.dispatcher.served)}

    def __repr__(self) -> str:
        s = self.rows.stats()
        return (
            f"PagedAttentionCache(num_blocks={s['num_blocks']}, block_size={s['block_size']}, "
            f"used={s['blocks_used']}, rows={self.rows.num_rows}, dtype={self.dtype}, "
            f"kv_cache_dtype={self.kv_cache_dtype})"
        )


def _pack(states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``[batch, H, q_len, D]`` -> ``[T, H, D]`` keeping the real tokens (``index`` into the grid; None = all)."""
    batch, heads, q_len, dim = states.shape
    flat = states.transpose(1, 2).reshape(batch * q_len, heads, dim)
    return flat if index is None else flat.index_select(0, index)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_devices(device, num_layers: int) -> list[torch.device]:
    if isinstance(device, (str, torch.device)):
        return [torch.device(device)] * num_layers
    devices = [torch.device(d) for d in device]
    if len(devices) != num_layers:
        raise ValueError(f"give one device, or one per decoder layer ({num_layers}); got {len(devices)}")
    return devices
