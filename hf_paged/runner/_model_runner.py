"""``ModelRunner``: the model side of an engine, built once from the model and the engine's settings.

It owns what runs the model: the KV pool and the dispatcher of its attention backends, the block-table buffer the
steps read, the compiled layers, the skinny linear routing, a tensor-parallel model's lockstep and vocabulary shards,
and the decode CUDA graphs. The engine hands it a scheduled batch; :meth:`ModelRunner.prepare` reads the sequences
(a step plan, ``runner/_step_plan.py``, or a decode graph's staged inputs) and :meth:`ModelRunner.run` does the
device work, returning the logits of the sampled rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from hf_paged.attention._step import PagedStep
from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.compile import _layer_kernels as layer_kernels
from hf_paged.compile import _layers as compiled_layers
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.hf import _placement as placement
from hf_paged.hf._support import paged_kv
from hf_paged.parallel import _fuse_all_reduce as fuse_all_reduce
from hf_paged.parallel import _linears as tp_linears
from hf_paged.parallel import _lockstep as lockstep
from hf_paged.parallel import _logits as tp_logits
from hf_paged.parallel._tensor_parallel import kv_layout
from hf_paged.runner._decode_graphs import DecodeGraphs
from hf_paged.runner._graph_sizes import graph_batch_sizes, sizes_for
from hf_paged.runner._model_call import call_model, model_call
from hf_paged.runner._staging import StagingBuffer
from hf_paged.runner._step_plan import DecodeColumns, StepPlan, plan_step, step_metadata

logger = logging.getLogger("hf_paged")


#: ``size(config, kv_layout, kv_devices) -> (config, reasons)``: the engine's sizing rules, which fill the
#: automatic sizes (``engine/_sizing.py``).
Sizer = Callable[..., tuple]


class ModelRunner:
    """Runs steps of ``model`` for an engine of settings ``config`` (an ``EngineConfig``).

    ``size`` fills the automatic sizes (see :data:`Sizer`); every rank of a tensor-parallel model then takes the
    smallest of the ranks' sizes. ``longest``: the most tokens one sequence may hold (the block tables' width).

    After construction: ``config`` (every size filled) and ``sizing`` (per automatic field, why) are the engine's.
    """

    def __init__(self, model: torch.nn.Module, config, size: Sizer, longest: int):
        self.model, self.device = model, model.device
        self.kv_devices = placement.kv_devices(model)  # each layer's KV next to its weights (a device_map split)
        self.lockstep, forced = lockstep.for_model(model, config.compile_layers)
        self.vocab_shards = tp_logits.install(model, self.lockstep.tp) if self.lockstep is not None else None
        cfg, self.sizing = size(replace(config, **forced), kv_layout(model), self.kv_devices)
        if self.lockstep is not None:  # every rank takes the same sizes (each read its own free memory)
            if config.cuda_graph_capture is None:
                self.sizing["cuda_graph_capture"] = "tensor parallel: every size at start, on every rank alike"
            agree = self.lockstep.agree_min
            cfg = replace(cfg, num_blocks=agree(cfg.num_blocks), max_batch_tokens=agree(cfg.max_batch_tokens),
                          max_num_seqs=agree(cfg.max_num_seqs))
        self.config = cfg
        self.pool, self.dispatcher = paged_kv(model.config, kv_layout(model), self.kv_devices, model.dtype,
                                              cfg.block_size, cfg.num_blocks, cfg.kv_cache_dtype, cfg.backend)
        self.tables = BlockTableBuffer(cfg.max_num_seqs, min(cfg.num_blocks, -(-longest // cfg.block_size)))
        self.skinny = skinny_linear.for_engine(model, cfg.skinny_linear, routed_elsewhere=tp_linears.installed(model))
        # where the layers run eagerly, their norms, adds, products and rotary run on the layer kernels where those
        # serve the model (routed after the skinny linears: their packed q/k/v and gate/up products come first); then
        # the layers stay eager unless compile_layers asks otherwise: a first process starts as fast as transformers'
        # and runs as fast as compiled (docs/design/decisions.md)
        self.layer_kernels = layer_kernels.for_engine(
            model, cfg.layer_kernels, "the model is tensor parallel" if self.lockstep is not None else None)
        compile_setting = False if cfg.compile_layers is None and self.layer_kernels else cfg.compile_layers
        tp_compile = None if self.lockstep is None else fuse_all_reduce.layer_compile(self.lockstep.tp.group.group_name)
        self.compiled = compiled_layers.for_engine(model, compile_setting, tp_compile)
        self.output_device = None
        if len(set(self.kv_devices)) > 1:
            # the sampled rows' indices go where the hidden states they index are, and accelerate's hook on the
            # model (which moves every tensor argument to the first device) leaves them there
            self.output_device = placement.hidden_states_device(model)
            placement.keep_argument_in_place(model, "logits_to_keep")
        self.pad_logits = self.device.type == "cuda"  # plan_step(pad_logits=...): on a GPU (runner/_step_plan.py)
        self._buffers(cfg.max_num_seqs, cfg.max_batch_tokens)
        self.graphs = self._capture_graphs()
        if self.compiled is not None:
            self.compiled.artifacts.save()  # what the start compiled, for the next process

    def _buffers(self, max_seqs: int, max_tokens: int) -> None:
        """The device buffers every step reads.

        One int64 buffer: [ last sampled tokens (max_seqs) | ids | positions | slots (max_tokens each) ]. The first
        part, at a fixed address, is where a step's in-flight ids are read from (CUDA graphs read it too); a plan's
        int32 ids, positions and slots are widened into the rest in one copy, and a step with in-flight ids gathers
        its ids from the whole buffer in one index_select. Flat, so a step's [1, t] views are contiguous whatever t
        (as compiled layers expect: no new strides). On a GPU a plan's layout travels in one copy through pinned
        memory; on the CPU the plan's own tensors serve.
        """
        device = self.device
        self._max_seqs, self._max_tokens = max_seqs, max_tokens
        self._wide = torch.zeros(max_seqs + 3 * max_tokens, dtype=torch.int64, device=device)
        self.last_tokens = self._wide[:max_seqs]
        self._gathered_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._own_index = np.arange(max_seqs, max_seqs + max_tokens, dtype=np.int32)  # token i's id: entry S + i
        largest = 4 * max_tokens + 5 * max_seqs + 2 + max_seqs * self.tables.table.shape[1]  # a plan's layout
        self._staging = StagingBuffer(largest, device) if device.type == "cuda" else None

    # ----- decode CUDA graphs ----------------------------------------------------------------------------------
    def _capture_graphs(self) -> DecodeGraphs | None:
        """The decode CUDA graphs, captured as ``cuda_graphs`` and ``cuda_graph_capture`` ask, or None where decode
        runs without them (asked so, not on CUDA, a model split over devices, or a capture that failed; the last
        two say why in the log)."""
        cfg = self.config
        if cfg.cuda_graphs is False or self.device.type != "cuda":
            return None
        split = sorted({str(d) for d in self.kv_devices})
        if len(split) > 1:
            logger.info("hf_paged: decode runs without CUDA graphs: the model is split over %s", ", ".join(split))
            return None
        sizes = (graph_batch_sizes(cfg.max_num_seqs) if cfg.cuda_graphs is True
                 else sizes_for(cfg.cuda_graphs, cfg.max_num_seqs))
        graphs = DecodeGraphs(self.model, self.pool, self.dispatcher, self.tables, sizes, self.last_tokens,
                              self.compiled, self.skinny, capture=cfg.cuda_graph_capture,
                              local_logits=self.vocab_shards is not None, layer_kernels=self.layer_kernels)
        if (reason := graphs.capture()) is not None:
            graphs.device_tables.close()
            logger.info("hf_paged: decode runs without CUDA graphs: %s", reason)
            return None
        return graphs

    def release_graphs(self) -> None:
        """Free the decode CUDA graphs now, once the device is done with any step that may still replay one; decode
        runs eager from then on."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graphs, self.graphs = self.graphs, None
        if graphs is not None:
            graphs.release()

    def prepare(self, batch, extra_rows: list[int] | None = None):
        """Read what the step needs of ``batch``'s sequences (``seqs``, ``num_tokens``, ``sample``; ``extra_rows``:
        positions whose logits the step returns after the sampled rows'): when a decode graph serves the step, its
        inputs are staged and this returns the graph's size and ``sample``, else a step plan. Reads the sequences, so
        the caller holds their lock; :meth:`run` does the device work."""
        graphs = self.graphs
        if graphs is not None and extra_rows is None:
            if (size := graphs.size_for(batch.seqs, batch.num_tokens)) is not None:
                graphs.stage(DecodeColumns.of(batch.seqs, batch.sample), size)
                return size, batch.sample
            if self.tables.num_changes > 4096:
                graphs.device_tables.sync()  # (while steps run eager, the graphs' table updates stay bounded)
        return plan_step(batch.seqs, batch.num_tokens, batch.sample, self.tables, self.pool.block_size,
                         extra_rows=extra_rows, pad_logits=self.pad_logits)

    @torch.inference_mode()
    def run(self, prepared) -> torch.Tensor:
        """The device work of a prepared step: ``[N, vocab]`` logits of its sampled rows (then of the extra rows)."""
        if isinstance(prepared, StepPlan):
            return self.forward(prepared)
        size, sample = prepared
        logits = self.graphs.replay(size)
        if not all(sample):
            logits = logits.index_select(0, torch.tensor([i for i, s in enumerate(sample) if s], device=logits.device))
        return logits[: sum(sample)]

    def keep_tokens(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens, where the next step reads its in-flight ids (asynchronous scheduling)."""
        self.last_tokens[: len(tokens)].copy_(tokens, non_blocking=True)

    def _to_device(self, plan: StepPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """The plan's layout and segments on the device: one copy through pinned memory (none on the CPU). The
        token sources become indices into the runner's int64 buffer: row ``r`` of the last sampled tokens, or
        entry ``S + i`` (token ``i``'s own id) where the id is known on the host."""
        n, t = plan.layout.numel(), plan.num_tokens
        if self._staging is None:
            layout = plan.layout.clone() if plan.has_sources else plan.layout
        else:
            host = self._staging.host_array(n)
            host[:] = plan.layout.numpy()
        if plan.has_sources:
            src = (layout.numpy() if self._staging is None else host)[3 * t : 4 * t]
            np.copyto(src, self._own_index[:t], where=src < 0)
        if self._staging is not None:
            layout = self._staging.send(n)
        return layout, plan.segments(layout)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run a planned step eagerly; returns ``[N, vocab]`` logits of the sampled rows (on the model's output
        device), computed for the plan's padded rows."""
        t, m = plan.num_tokens, self._max_tokens
        if t > m:
            raise ValueError(f"a step of {t} tokens exceeds the runner's {m} (max_batch_tokens)")
        layout, seg = self._to_device(plan)
        wide = self._wide[self._max_seqs :].view(3, m)[:, :t]  # rows: ids, positions, slots (each contiguous)
        wide.copy_(layout[: 3 * t].view(3, t))  # int32 -> int64, one copy
        ids, pos, slots = wide
        if seg["token_sources"] is not None:  # in-flight ids: the previous step's tokens, on the device
            ids = torch.index_select(self._wide, 0, seg["token_sources"], out=self._gathered_ids[:t])
        meta = step_metadata(plan, seg, slots, self.pool.block_size)
        # torch.compile specialises a one-token step into graphs of its own, a compile of every layer's code the first
        # time one comes. Beside decode graphs (whose smallest has two rows) a step of one token runs eagerly only now
        # and then (a one-token prompt, a prompt cached up to its last token): it takes the eager modules rather than
        # stall the engine for that compile.
        compiled = self.compiled if t > 1 or self.graphs is None else None
        rows = seg["logits_indices"].long()
        if self.output_device is not None:  # (the hidden states' device: the base model's last module)
            rows = rows.to(self.output_device, non_blocking=True)
        with model_call(PagedStep(meta, self.pool, self.dispatcher), compiled, self.skinny,
                        self.vocab_shards is not None, self.layer_kernels):
            logits = call_model(self.model, ids.view(1, t), pos.view(1, t), rows)
        return logits[: plan.num_sampled]  # (the plan pads the rows: runner/_step_plan.py)

    def stats(self) -> dict:
        """The ``stats()`` keys of the model side."""
        alloc, served, graphs = self.pool.allocator, dict(self.dispatcher.served), self.graphs
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": self.pool.block_size,
            "free_blocks": alloc.num_free,  # blocks kept only by the prefix cache count as free
            "used_blocks": alloc.num_used,
            "prefill_backend": served.get("prefill") or served.get("extend"),
            "decode_backend": served.get("decode"),
            "backends": served,
            "kv_cache_dtype": str(self.pool.dtype).removeprefix("torch."),
            "cuda_graphs": graphs.stats() if graphs is not None else None,
            "compiled_layers": self.compiled is not None and self.compiled.enabled,
            "skinny_linear": self.skinny,
            "layer_kernels": self.layer_kernels and (self.compiled is None or not self.compiled.enabled),
            "cuda_graph_capture": self.config.cuda_graph_capture if graphs is not None else None,
        }
