"""Where hf_paged bends transformers' ``generate`` to a paged cache: the one module that knows how.

``generate`` drives a cache through the ``Cache`` API, which has no room for a paged step; so:

- **The cache-carrying mask argument.** transformers gives an attention implementation one channel per forward: its
  registered mask function, whose result every layer gets as ``attention_mask`` (flex attention's ``BlockMask``
  travels the same way). The one argument of that function that comes from the cache is the query offset
  (``Cache.get_query_offset``): a :class:`PagedAttentionCache` answers it with a :class:`CacheOffset`, an ``int`` that
  carries the cache, and the mask function (``hf_paged.hf``'s ``paged_mask``) asks that cache for the forward's
  planned step (:meth:`GenerateHooks.plan_forward`), which reaches every layer wrapped as a ``StepMask``.
- **The new-call detection.** ``generate`` sets ``Cache._is_user_defined`` on a cache the caller passed, once at the
  start of each call, before it asks ``get_seq_length()`` how much of the input to skip: the one sign a cache gets
  that a new call begins. The cache answers it with a property whose setter resets it (``_compat``'s
  ``user_defined_flag_from``), so that each call starts from an empty cache and feeds the whole input.
- **The planned masks of** ``optimize_generate`` (:class:`PlannedMasks`): the model's ``create_masks_for_generate``
  that hands a decode step its plan directly (``generate/_optimize.py`` installs it, with its other replacements).
"""

from __future__ import annotations

import logging

import torch
from transformers.masking_utils import create_masks_for_generate

from hf_paged import _compat
from hf_paged.attention._step import PagedStep, choose_decode_routes
from hf_paged.cache._kv_pool import KVLayout
from hf_paged.hf._attention import StepMask
from hf_paged.hf.compat import cache_in

logger = logging.getLogger("hf_paged")

_PLAIN, _NEVER = "plain", "never"  # mask layouts: the plan itself; the usual path always


class CacheOffset(int):
    """The query offset a paged cache gives transformers' mask code: an ``int`` (the columns seen) that also carries
    the cache as ``planner``, so that the mask function can plan the forward on it."""

    def __new__(cls, value: int, planner: GenerateHooks):
        obj = super().__new__(cls, value)
        obj.planner = planner
        return obj


@_compat.user_defined_flag_from("_generate_call_flag")
class GenerateHooks:
    """What :class:`~hf_paged.PagedAttentionCache` answers ``generate`` beyond the ``Cache`` API (a mixin: it calls
    the cache's ``plan_step`` and ``reset`` and reads its ``rows``, ``pool`` and ``dispatcher``)."""

    def __init__(self, **kwargs):
        self._passed_to_generate = False
        self._masks: dict[bool, StepMask] = {}  # the latest plan's mask, and the fixed decode steps' (key: static)
        self._traced_offset = CacheOffset(0, self)  # made here: a compiler cannot construct it while tracing
        super().__init__(**kwargs)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling():  # the plan comes in attention_mask; the mask function says so if not
            return self._traced_offset
        return CacheOffset(self.rows.num_columns, self)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if torch.compiler.is_compiling():  # unread: the plan is made before a compiled forward (and a step-varying
            return query_length, 0  # int read while tracing would recompile every step)
        return self.rows.num_columns + query_length, 0

    # generate (transformers 5.17 to 5.25) sets this on a cache the caller passed, once at the start of each call
    @property
    def _generate_call_flag(self) -> bool:
        return self._passed_to_generate

    @_generate_call_flag.setter
    def _generate_call_flag(self, value: bool) -> None:
        self._passed_to_generate = value
        if value:
            self.reset()

    def plan_forward(self, config, attention_mask: torch.Tensor | None, batch_size: int, q_length: int,
                     device: torch.device | None = None) -> StepMask:
        """The step of a forward on this cache, as the mask function hands it to every layer (``attention_mask``:
        the 2D padding mask or None; ``device``: where the step's tensors go, default the pool's first device).
        Asked again in one forward: the same object; every step of a compiled batch: one object, its decode routes
        chosen. A model (``config``, checked once per config object) whose decoder has another number of layers
        than this cache is refused."""
        if config is not None and config is not self._checked_config:
            layers = KVLayout.from_config(config).num_layers
            if layers != self.pool.layout.num_layers:
                raise ValueError(
                    f"this cache was built for another model ({self.pool.layout}) but this model has {layers} decoder "
                    "layers; build the cache from this model's config (PagedAttentionCache(model.config, ...))")
            self._checked_config = config
        plan = self.plan_step(attention_mask, batch_size, q_length, device or self.pool.kv_caches[0][0].device)
        mask = self._masks.get(plan.static)
        if mask is None or mask.step.metadata is not plan:
            mask = self._masks[plan.static] = StepMask(PagedStep(plan, self.pool, self.dispatcher))
        if plan.static:
            choose_decode_routes(mask.step)
        return mask


def planned_step(mask) -> PagedStep | None:
    """The step a forward got as its mask: the mask's, or that of the one mask every layer type got (models with
    sliding layers get one per type); None for anything else."""
    if isinstance(mask, dict) and mask and len({id(m) for m in mask.values()}) == 1:
        mask = next(iter(mask.values()))
    return mask.step if isinstance(mask, StepMask) else None


class PlannedMasks:
    """A model's ``create_masks_for_generate`` under ``optimize_generate``: a compileable paged cache's decode steps
    get their plan directly, without transformers' mask preprocessing; everything else (prefill, another cache,
    extra mask functions) transformers' function. The first decode step goes the usual way too: its answer is what
    the direct path then returns (the plan alone, or one plan per layer type). ``generate`` passes every argument
    by keyword."""

    def __init__(self):
        self.layout: str | tuple[str, ...] | None = None  # learnt from the usual path's first decode-step answer

    def __call__(self, *args, **kwargs):
        decode = not args and _paged_decode_step(kwargs)
        if decode and self.layout not in (None, _NEVER):
            embeds = kwargs["inputs_embeds"]
            mask = cache_in(kwargs).plan_forward(kwargs.get("config"), kwargs.get("attention_mask"),
                                                 embeds.shape[0], 1, embeds.device)
            return mask if self.layout == _PLAIN else dict.fromkeys(self.layout, mask)
        masks = create_masks_for_generate(*args, **kwargs)
        if decode and self.layout is None:
            self.layout = _layout_of(masks)
        return masks


def _paged_decode_step(kwargs: dict) -> bool:
    """Whether ``create_masks_for_generate(**kwargs)`` asks for a decode step's masks on a compileable paged cache
    that already holds the batch, with no extra mask function."""
    cache, embeds, mask = cache_in(kwargs), kwargs.get("inputs_embeds"), kwargs.get("attention_mask")
    extra = ("or_mask_function", "and_mask_function", "block_sequence_ids")
    return (isinstance(cache, GenerateHooks) and cache.is_compileable and cache.get_seq_length() > 0
            and isinstance(embeds, torch.Tensor) and embeds.ndim == 3 and embeds.shape[1] == 1
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.ndim == 2))
            and all(kwargs.get(name) is None for name in extra))


def _layout_of(masks) -> str | tuple[str, ...]:
    """How the usual path answered a decode step: the plan (``_PLAIN``), one plan per layer type, or otherwise."""
    if planned_step(masks) is not None:
        return tuple(masks) if isinstance(masks, dict) else _PLAIN
    logger.info("hf_paged: optimize_generate keeps transformers' mask path for this model (its decode-step masks "
                "are not the step's plan: %s)", type(masks).__name__)
    return _NEVER

