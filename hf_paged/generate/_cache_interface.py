"""``CacheInterface``: what ``generate`` asks of a ``transformers.Cache``, answered from a paged cache's rows.

The sizes and flags transformers reads (sequence length, mask sizes, query offset, compileability), the sign that a
new ``generate`` call begins, and the batch edits it performs between forwards (reset, crop, beam reordering, row
repeats and selections). Each edit changes the host block tables and drops the current plan.
"""

from __future__ import annotations

import torch

from hf_paged.generate._paged_layer import PlanOffset


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
