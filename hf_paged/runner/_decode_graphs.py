"""``DecodeGraphs``: whole decode steps (every layer, KV write and attention included) as CUDA graphs.

One graph per padded batch size (``graph_batch_sizes``). A decode step of ``n`` sequences replays the graph of the
smallest size ``b >= n``; rows ``n..b`` are padding (token 0, slot -1 so nothing is written, context length 1).

Every input a step changes lives in one device buffer of int32, laid out per size ``b`` as::

    [ input ids (b) | positions (b) | id sources (b) | block-table rows (b) | table updates: int64 flat indices
      (2b) and values (b) ]

The host fills the same layout in pinned memory and sends it with one copy. The block tables themselves stay on the
device (``DeviceBlockTable``): a step brings the entries written since the step before (up to ``b`` of them, about
one per 16 sequences in steady decode; more are queued apart first) and applies them. The graph widens ids and
positions to int64, takes in-flight ids (asynchronous scheduling: source row >= 0) from the previous step's sampled
tokens, gathers its rows' tables and computes the slots, context lengths and their prefix sums, so one launch and
one copy serve a step. Attention metadata that is fixed per size (``max_seqlen_k`` = the table's capacity, which
fixes the decode kernel's split length and workspace in the backend's step plan) is decided at capture.

The graphs run the same code as :meth:`DecodeGraphs.run_eager` (the same step, padded, without a graph), which is
what tests compare them with, bit for bit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceType

import numpy as np
import torch

from hf_paged.attention._dispatch import Dispatcher
from hf_paged.attention._metadata import Phase
from hf_paged.attention._step import PagedStep
from hf_paged.cache._kv_pool import KVPool
from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.runner._device_block_table import DeviceBlockTable
from hf_paged.compile._layers import CompiledLayers
from hf_paged.runner._cuda_graphs import CudaGraphs
from hf_paged.runner._graph_sizes import OnDemandSizes, size_ranges, start_sizes
from hf_paged.runner._model_call import call_model, model_call
from hf_paged.runner._step_plan import _COMPUTED, DecodeColumns, Sequence, StepPlan, step_metadata
from hf_paged.runner._staging import StagingBuffer

logger = logging.getLogger("hf_paged")

#: The staged step's segments, ``b`` int32 values each (the module docstring).
SEGMENTS = 7


def read_stage(stage, b: int, int64=torch.int64) -> tuple:
    """(ids, positions, sources, rows, update indices as int64, update values): views of a staged step of ``b`` in
    ``stage`` (a device tensor, or a host numpy array with ``int64=np.int64``)."""
    return (stage[:b], stage[b : 2 * b], stage[2 * b : 3 * b], stage[3 * b : 4 * b], stage[4 * b : 6 * b].view(int64),
            stage[6 * b : 7 * b])


def _padding(pad_row: int, trash_index: int) -> tuple[int, ...]:
    """What each segment holds past the real rows and updates: token 0 at position 0 with no source, in the all-zero
    table row; updates write 0 at the scratch entry."""
    return 0, 0, -1, pad_row, trash_index, 0


def fill_step(host: np.ndarray, b: int, ids, positions, sources, rows, pad_row: int, flat: np.ndarray,
              values: np.ndarray, trash_index: int) -> None:
    """Write a step of ``len(rows)`` real rows padded to ``b``, and ``len(flat)`` (at most ``b``) table updates, into
    ``host`` (``SEGMENTS * b`` int32)."""
    columns = (ids, positions, sources, rows, flat, values)
    for segment, column, pad in zip(read_stage(host, b, np.int64), columns, _padding(pad_row, trash_index)):
        segment[: len(column)] = column
        segment[len(column) :] = pad


def fill_padding(stage: torch.Tensor, b: int, pad_row: int, trash_index: int) -> None:
    """A step of ``b`` padding rows on the device (nothing written, nothing real read): what warm-up and capture run
    on."""
    for segment, pad in zip(read_stage(stage, b), _padding(pad_row, trash_index)):
        segment.fill_(pad)


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``pool`` (``dispatcher``: its attention backends), one per batch
    size in ``sizes``.

    Args:
        tables: the engine's block-table buffer; its width at construction is the captured table width.
        last_tokens: the fixed device buffer holding the previous step's sampled tokens (``ModelRunner``).
        sizes: batch sizes to capture (ascending, positive); a step of more sequences than the largest runs eager.
        capture: when each size is captured (``EngineConfig.cuda_graph_capture``): ``"start"``, every size at start;
            ``"on_demand"``, the largest at the first step that a graph can serve (its capture is host work while
            the device runs the steps queued before), a smaller one once ``graph_sizes.ON_DEMAND_STEPS`` decode
            steps would have used it (each of them pads up to a larger graph meanwhile); ``"first_use"``, the
            smallest and the largest at start, each other one at the first step that would use it.
        compiled: the model's compiled layers (``Engine(compile_layers=...)``), captured in place of the eager ones.
        skinny: capture with the skinny linear routing on (``Engine(skinny_linear=...)``).
        layer_kernels: capture eager layers on the layer kernels (``Engine(layer_kernels=...)``).
        local_logits: capture a tensor-parallel ``lm_head`` returning this rank's vocabulary columns
            (``tp_logits.install``).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool, dispatcher: Dispatcher, tables: BlockTableBuffer,
                 sizes: SequenceType[int], last_tokens: torch.Tensor, compiled: CompiledLayers | None = None,
                 skinny: bool = False, capture: str = "start", local_logits: bool = False,
                 layer_kernels: bool = False):
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"CUDA graph batch sizes must be positive integers, got {list(sizes)!r}")
        self.model, self.pool, self.dispatcher = model, pool, dispatcher
        self.tables, self.last_tokens = tables, last_tokens
        self.compiled, self.skinny, self.local_logits = compiled, skinny, local_logits
        self.layer_kernels = layer_kernels
        wanted = sorted(set(sizes))
        # Captured at start (``sizes``: kept sorted as later captures join), the largest when none is (captured at
        # the first step a graph can serve), and the others waiting to be needed
        self.sizes = start_sizes(wanted, capture)
        self._first = None if self.sizes else wanted[-1]
        self._waiting = OnDemandSizes([s for s in wanted[:-1] if s not in self.sizes],
                                      first_use=capture == "first_use")
        self.width = tables.table.shape[1]
        self.device = pool.kv_caches[0][0].device
        b_max, w = wanted[-1], self.width
        dev = dict(device=self.device)
        # never grows: the graphs read its address
        self._staging = StagingBuffer(SEGMENTS * b_max, self.device)
        self._stage = self._staging.device_buffer
        self.device_tables = DeviceBlockTable(tables, w, self.device)
        # three tensors, not rows of one: the compiled layers' guards then hold for the graphs' [1, b] views and the
        # eager steps' alike (as rows of one [3, b_max] tensor, the first prompt step after the capture recompiled
        # the rotary embedding and every decoder layer)
        self._ids, self._pos, self._slots = (torch.zeros(b_max, dtype=torch.int64, **dev) for _ in range(3))
        self._lens = torch.zeros(b_max, dtype=torch.int32, **dev)
        self._cu_q = torch.arange(b_max + 1, dtype=torch.int32, **dev)
        self._cu_k = torch.zeros(b_max + 1, dtype=torch.int32, **dev)
        self.graphs = CudaGraphs(self.device)  # by batch size
        self.capture_seconds = 0.0
        self.on_demand_seconds = 0.0  # host time of the captures made after start (warm-ups included)
        self._memory_bytes: int | None = 0  # the graphs' pool, read from the allocator when asked (None: not yet)
        self._live_bytes = 0  # bytes allocated during the captures: the figure where the allocator names no pools

    # ----- which steps a graph serves --------------------------------------------------------------------------
    def size_for(self, seqs: list[Sequence], num_tokens: list[int]) -> int | None:
        """The captured size that serves this step, or None when it must run eager: not every sequence brings
        one token, none has a cached prefix (a prefill), it has more sequences than the largest graph, or a
        context outgrew the captured table width."""
        n = len(seqs)
        largest = self._first or (self.sizes[-1] if self.sizes else 0)
        if n > largest or len(num_tokens) != n or sum(num_tokens) != n:
            return None
        longest = max(map(_COMPUTED, seqs))
        if not longest or longest >= self.width * self.pool.block_size:
            return None
        if self._first is not None:
            self._first = None
            if self._capture_now(largest, None) is None:
                return None
        size = next(s for s in self.sizes if s >= n)
        if (want := self._waiting.due(n, size)) is not None:  # (graph_sizes.OnDemandSizes)
            size = self._capture_now(want, size)
        return size

    def _capture_now(self, want: int, fallback: int | None) -> int | None:
        """Capture size ``want`` for the step being launched and return it; where that fails, ``fallback`` (the
        captured size the step pads up to; None: it runs eager), and no more sizes are captured."""
        began, failed = time.perf_counter(), False
        try:
            reason = self._capture_sizes([want], warm=True)
        except Exception as exc:  # the captured graphs still serve; a failed capture may leave the pool unusable
            self.graphs.drop(want)
            torch.cuda.synchronize(self.device)
            reason, failed = f"capturing it failed ({type(exc).__name__}: {str(exc)[:300]})", True
        if reason is not None:  # (a backend that is not capture-safe: the same for every size)
            self._waiting.stop()
            if self.sizes:
                logger.warning("hf_paged: no decode CUDA graph of batch size %d: %s; no more sizes are captured: "
                               "steps pad up to the captured ones (%s)", want, reason, size_ranges(self.sizes))
            else:  # as an engine that captures at start says it
                (logger.warning if failed else logger.info)(
                    "hf_paged: decode runs without CUDA graphs: batch size %d: %s", want, reason)
            return fallback
        self.on_demand_seconds += time.perf_counter() - began
        self.sizes = sorted(self.graphs.keys())
        logger.info("hf_paged: captured the decode CUDA graph of batch size %d at a step that needed it%s in %.3f s",
                    want, f" (its steps had padded up to {fallback})" if fallback else "", time.perf_counter() - began)
        return want

    # ----- capture and replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> str | None:
        """Capture every size (largest first, sharing one memory pool); None on success, else why graphs are
        off (logged). An eager warm-up of the largest size runs first, so lazy initialisation (libraries,
        workspaces) stays out of the graphs and the dispatcher shows which backends serve decode."""
        if not self.sizes:  # ("on_demand": the first step a graph can serve captures the largest)
            return None
        start = time.perf_counter()
        try:
            reason = self._capture_sizes(self.sizes)
        except Exception as exc:  # e.g. a model whose forward syncs with the host: it runs eager instead
            self.graphs.release()
            torch.cuda.synchronize(self.device)
            return f"capturing the decode step failed ({type(exc).__name__}: {str(exc)[:300]})"
        if reason is not None:
            return reason
        self.capture_seconds = time.perf_counter() - start
        seconds = self.graphs.capture_seconds
        logger.info("hf_paged: captured %d decode CUDA graphs (batch sizes %s) in %.2f s (eager warm-up %.2f s, "
                    "the largest size %.3f s, the smallest %.3f s)", len(self.graphs), size_ranges(self.sizes),
                    self.capture_seconds, self.graphs.warmup_seconds, seconds[self.sizes[-1]],
                    seconds[self.sizes[0]])
        return None

    @property
    def memory_bytes(self) -> int:
        """Bytes the graphs' memory pool holds (its segments, intermediates included), read from the allocator's
        snapshot (a few ms) when first asked after a capture. Where the snapshot does not name pools: the live
        bytes the captures allocated (never below 0; a warm-up's frees can outweigh them)."""
        if self._memory_bytes is None:
            held = self.graphs.held_bytes()
            self._memory_bytes = held if held is not None else max(0, self._live_bytes)
        return self._memory_bytes

    @torch.inference_mode()  # as every step runs: the compiled layers' guards include the grad mode
    def _capture_sizes(self, sizes: list[int], warm: bool = False) -> str | None:
        """Capture ``sizes`` (largest first) into the graphs' shared memory pool, each on a step of padding rows.
        The first capture of this object warms up eagerly first, and so does each size with ``warm`` (on demand:
        whatever the compiler has seen, a recompile must not happen inside a capture); so does every size the
        compiled layers have not run yet (a given size of 1 is a shape of its own)."""
        first = not len(self.graphs)
        self._memory_bytes, allocated = None, torch.cuda.memory_allocated(self.device)

        def step(b: int):
            seen = self.compiled.warm_batch_sizes if self.compiled is not None else None
            warm_up = warm or (first and b == sizes[-1]) or (seen is not None and b not in seen)
            if warm_up and seen is not None:
                seen.add(b)
            return b, (lambda: self._forward(b)), warm_up

        try:
            return self.graphs.capture([step(b) for b in reversed(sizes)], prepare=self._stage_padding,
                                       check=self.dispatcher.graph_unsupported_reason)
        finally:
            self._live_bytes += torch.cuda.memory_allocated(self.device) - allocated

    def stage(self, columns: DecodeColumns, size: int) -> None:
        """Lay the decode step of ``columns`` (one new token per sequence) out for the graph of ``size`` and copy it
        to the device in one go; table updates beyond ``size`` are queued apart first."""
        tables = self.device_tables
        flat, values = tables.changes()
        if len(flat) > size:
            tables.send(flat, values)
            flat, values = flat[:0], values[:0]
        host = self._staging.host_array(SEGMENTS * size)
        fill_step(host, size, columns.ids, columns.positions, columns.sources, columns.rows, tables.pad_row, flat,
                  values, tables.trash_index)
        self._staging.send(SEGMENTS * size)

    @torch.inference_mode()
    def replay(self, size: int) -> torch.Tensor:
        """Run the staged step in the graph of ``size``; returns ``[size, vocab]`` logits whose first rows are the
        staged sequences' (valid until the next replay)."""
        return self.graphs.replay(size)

    @torch.inference_mode()
    def run_eager(self, seqs: list[Sequence], size: int) -> torch.Tensor:
        """The same padded step as a replay of ``seqs``, run without a graph (the oracle of the graph tests)."""
        self.stage(DecodeColumns.of(seqs), size)
        return self._forward(size)

    def _forward(self, b: int) -> torch.Tensor:
        """Everything the graph of size ``b`` records: widen the staged inputs, gather the rows' block tables,
        compute slots and lengths, then the model forward."""
        w, bs = self.width, self.pool.block_size
        ids, pos, src, rows, update_at, update_values = read_stage(self._stage, b)
        self.device_tables.table.view(-1).index_copy_(0, update_at, update_values)
        self._ids[:b].copy_(torch.where(src >= 0, self.last_tokens.index_select(0, src.clamp(min=0)), ids.long()))
        self._pos[:b].copy_(pos)
        tables = self.device_tables.table.index_select(0, rows)  # [b, w]
        block = tables.gather(1, torch.div(pos, bs, rounding_mode="floor").long().unsqueeze(1)).squeeze(1)
        slots = block.long() * bs + torch.remainder(pos, bs)
        self._slots[:b].copy_(torch.where(rows < self.device_tables.pad_row, slots, -1))  # padding writes nothing
        seq_lens = torch.add(pos, 1, out=self._lens[:b])
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=self._cu_k[1 : b + 1])
        plan = StepPlan(None, b, b, b, w, False, 1, w * bs, Phase.DECODE, has_padding=True)  # (computed here)
        segments = {"cu_seqlens_q": self._cu_q[: b + 1], "cu_seqlens_k": self._cu_k[: b + 1], "seq_lens_k": seq_lens,
                    "block_tables": tables}
        meta = step_metadata(plan, segments, self._slots[:b], bs)
        with model_call(PagedStep(meta, self.pool, self.dispatcher), self.compiled, self.skinny, self.local_logits,
                        self.layer_kernels):
            return call_model(self.model, self._ids[:b].view(1, b), self._pos[:b].view(1, b), 0)

    def _stage_padding(self, b: int) -> None:
        fill_padding(self._stage, b, self.device_tables.pad_row, self.device_tables.trash_index)

    def release(self) -> None:
        """Free the captured graphs (and whatever they hold, collectives included) now; no replay follows."""
        self.graphs.release()
        self.device_tables.close()

    def stats(self) -> dict:
        return {
            "batch_sizes": sorted(self.graphs.keys()),
            "capture_seconds": round(self.capture_seconds, 3),
            "waiting_sizes": self._waiting.waiting,  # on-demand sizes not captured yet
            "on_demand_seconds": round(self.on_demand_seconds, 3),
            "warmup_seconds": round(self.graphs.warmup_seconds, 3),
            "memory_bytes": self.memory_bytes,
            "replays": self.graphs.replays,
        }
