"""Automatic engine sizing: the step budget, the sequences at once, the KV pool and the graph capture of an engine
whose settings leave them open (``None``), from the model, its device, the device's free memory and, for an engine
built for one call (``generate_batch``), that call's workload.

The whole rule is here: :data:`RULES` (one row per kind of device, each with the measurement that set it) and
:func:`size_engine`. An explicit setting always wins. What was chosen, and why, goes to ``Engine.stats()["sizing"]``
and to the engine's start-up log line.

Re-tuning after a sweep (``python -m benchmarks.e2e.throughput --sweep``): change the row of :data:`RULES` and its note.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hf_paged.attention.backends._torch import workspace_bytes
from hf_paged.cache._kv_pool import KVLayout, describe_budget, free_memory_bytes, pool_blocks, pool_room
from hf_paged.cache._kv_quant import kv_storage_dtype
from hf_paged.engine._config import EngineConfig
from hf_paged.hf._support import position_limit
from hf_paged.runner._graph_sizes import one_call_graph_sizes


@dataclass(frozen=True)
class Rule:
    """The automatic sizes on one kind of device: ``max_batch_tokens`` (the step budget) and ``max_num_seqs``,
    before the memory check; ``note``: the measurement that set them."""

    max_batch_tokens: int
    max_num_seqs: int
    note: str


RULES = {
    # Measured on one H200 (2026-11-28; Llama-3.2-1B-shaped bf16, generate_batch on the anchor workload: 256 prompts
    # of 128-1024 tokens, 256 new, greedy), a sweep of max_batch_tokens x max_num_seqs: 16384 x 256 gave 41.0k output
    # tok/s, within 1% of the best point (16384 x 512, 41.2k); 8192 x 256 36.1-38.3k, 2048 x 256 18.4k. With 64
    # requests and at batch 1 the points of 8192 and 16384 were within the run-to-run spread. An H100 is assumed
    # alike until its sweep says otherwise.
    "cuda": Rule(16384, 256, "on CUDA, 16384 x 256 gave 41.0k tok/s on an H200, within 1% of the best point of a "
                             "sweep of budgets and sequences (1B model, bf16, 256 prompts)"),
    # Not measured: the defaults from before automatic sizing (the CPU serves tests and smoke runs).
    "other": Rule(2048, 256, "off CUDA, the defaults from before automatic sizing (not measured)"),
}

#: The share of the memory the KV pool leaves free (what its budget, ``memory_budget``, leaves of free memory) that one
#: step's activations (``max_batch_tokens`` tokens through a layer), sampled logits (``max_num_seqs`` rows) and, off
#: CUDA, attention workspace may take; above it the step budget, then the sequences, are halved.
ACTIVATION_SHARE = 0.5
#: The automatic sizes never go below these (a smaller memory budget or an explicit setting does).
MIN_BATCH_TOKENS = 512
MIN_NUM_SEQS = 16
#: Bytes of a sampled row per vocabulary entry beyond the logits' own dtype: a float32 copy and the sampler's
#: temporaries (softmax, sort for top-k/top-p).
_SAMPLER_BYTES = 12


@dataclass(frozen=True)
class Workload:
    """What an engine built for one call will run (``generate_batch``): each sequence's most tokens (prompt plus
    new tokens; ``num_return_sequences`` copies count once each). ``one_call``: the engine serves this call only (not
    kept for the next one), so its sequences and graph sizes may be cut to the call's."""

    sequence_tokens: tuple[int, ...]
    one_call: bool = True

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_tokens)

    def blocks(self, block_size: int, position_limit: int) -> int:
        """Blocks that hold every sequence at full length at once (so nothing is preempted)."""
        return sum(-(-min(n, position_limit) // block_size) for n in self.sequence_tokens)


def size_engine(cfg: EngineConfig, model_config, dtype: torch.dtype, devices: Sequence[torch.device],
                workload: Workload | None = None) -> tuple[EngineConfig, dict[str, str]]:
    """Fill ``cfg``'s open ``max_batch_tokens``, ``max_num_seqs`` and ``cuda_graph_capture`` (and, for a one-call
    workload with ``cuda_graphs=True``, the graph sizes) for a model of ``model_config`` computing in ``dtype`` on
    ``devices`` (one per layer); returns it (every automatic field filled but ``num_blocks``) and, per automatic
    field, why."""
    rule, reasons = RULES["cuda" if devices and devices[0].type == "cuda" else "other"], {}
    tokens, seqs = cfg.max_batch_tokens, cfg.max_num_seqs
    one_call = workload is not None and workload.one_call
    if seqs is None:
        seqs = rule.max_num_seqs
        reasons["max_num_seqs"] = f"automatic: {rule.note}"
        if one_call and workload.num_sequences < seqs:
            seqs = max(1, workload.num_sequences)
            reasons["max_num_seqs"] = f"automatic: the call's sequences ({workload.num_sequences})"
    if tokens is None:
        tokens = rule.max_batch_tokens
        reasons["max_batch_tokens"] = f"automatic: {rule.note}"
    if reasons:
        tokens, seqs = _fit_memory(cfg, model_config, dtype, devices, tokens, seqs, reasons)
    capture = cfg.cuda_graph_capture
    if capture is None:
        # An engine built for one call captures its largest batch at its first decode step, while the device runs the
        # prompts' steps, and smaller ones once they would have served enough steps; any other engine (a server's)
        # captures its smallest (two rows, which batch 1 replays) and its largest at start, the sizes between at
        # their first step: the first requests of a server run few at a time, and each size then serves many steps.
        capture = "on_demand" if one_call else "first_use"
        reasons["cuda_graph_capture"] = ("automatic: an engine for one call captures its largest batch at its "
                                         "first decode step, smaller ones once they served 32 steps" if one_call else
                                         "automatic: the smallest and the largest at start, the others at their "
                                         "first step")
    graphs = cfg.cuda_graphs
    if graphs is True and one_call:
        # Such an engine never runs more sequences at once than the call has, and captures on every call (each size
        # costs a traced forward, ~25 ms for a 1B model): on an H100 the anchor of the end-to-end benchmark took
        # 1.84 s this way against 2.03-2.28 s with 9 sizes at start.
        graphs = tuple(one_call_graph_sizes(min(workload.num_sequences, seqs)))
        reasons["cuda_graphs"] = "automatic: the powers of two up to the call's sequences at once"
    return replace(cfg, max_batch_tokens=tokens, max_num_seqs=seqs, cuda_graph_capture=capture,
                   cuda_graphs=graphs), reasons


def _fit_memory(cfg: EngineConfig, model_config, dtype: torch.dtype, devices: Sequence[torch.device], tokens: int,
                seqs: int, reasons: dict[str, str]) -> tuple[int, int]:
    """Halve the automatic step budget, then the automatic sequences, while a step's activations, sampled logits and
    attention workspace (:func:`attention_bytes`) would take more than ``ACTIVATION_SHARE`` of the memory the KV pool
    leaves free on the tightest device. ``reasons`` holds the automatic ones of the two (and nothing else yet); a cut
    is noted in it."""
    if not devices:
        return tokens, seqs
    free = {d: free_memory_bytes(d) for d in set(devices)}
    if cfg.num_blocks is None:
        left = min(f - pool_room(d, cfg.memory_budget, f) for d, f in free.items())
    else:  # a given pool takes its own bytes (spread over the devices that hold layers)
        kv = kv_storage_dtype(cfg.kv_cache_dtype, dtype)
        pool = KVLayout.from_config(model_config).bytes_per_block(cfg.block_size, kv) * cfg.num_blocks
        left = max(0.0, min(free.values()) - pool / len(free))
    room = left * ACTIVATION_SHARE
    per_token, per_seq = step_bytes(model_config, dtype)
    attention = attention_bytes(model_config, cfg, dtype, devices[0])
    before = tokens, seqs
    while tokens * per_token + seqs * per_seq + attention > room:
        if "max_batch_tokens" in reasons and tokens // 2 >= MIN_BATCH_TOKENS:
            tokens //= 2
        elif "max_num_seqs" in reasons and seqs // 2 >= MIN_NUM_SEQS:
            seqs //= 2
        else:
            break
    if (tokens, seqs) != before:
        note = f"; cut to fit {ACTIVATION_SHARE:.0%} of the free memory the KV pool leaves ({left / 2**30:.1f} GiB)"
        for name in reasons:  # (the automatic ones of the two)
            reasons[name] += note
    return tokens, seqs


def step_bytes(model_config, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes a step takes per token (one layer's largest live activations: the residual stream and its norms, q/k/v
    and the MLP's gate, up and product) and per sampled sequence (its logits row and the sampler's work on it)."""
    text, kv = model_config.get_text_config(decoder=True), KVLayout.from_config(model_config)
    hidden = text.hidden_size
    inter = getattr(text, "intermediate_size", None) or 4 * hidden
    item = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * hidden + (text.num_attention_heads + 2 * kv.num_kv_heads) * kv.head_dim + 3 * inter) * item
    return per_token, text.vocab_size * (item + _SAMPLER_BYTES)


def attention_bytes(model_config, cfg: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes one layer's attention of a step takes beyond its output off CUDA, where the torch backend serves every
    layer: its bound (``attention/backends/_torch.py``), a piece of the step or one query row over the model's longest
    context, whatever the step's sequences, so no step budget or sequence count caps it. 0 on CUDA, where flash or the
    project's kernels serve (the torch backend's fallback pieces, at most ``WORKSPACE_BYTES["cuda"]``, come out of
    what ``ACTIVATION_SHARE`` leaves)."""
    if device.type == "cuda":
        return 0
    heads, kv = model_config.get_text_config(decoder=True).num_attention_heads, KVLayout.from_config(model_config)
    cache = torch.empty((), dtype=kv_storage_dtype(cfg.kv_cache_dtype, dtype)).element_size()
    return workspace_bytes(device.type, position_limit(model_config), heads, kv.num_kv_heads, kv.head_dim,
                           cfg.block_size, cache_size=cache)


def pool_size(cfg: EngineConfig, layout: KVLayout, dtype: torch.dtype, devices: Sequence[torch.device],
              position_limit: int, workload: Workload | None = None) -> tuple[int, str | None]:
    """The KV pool's blocks and why (None when ``cfg.num_blocks`` was given): as many as ``memory_budget`` of free
    memory holds (automatic: ``cache/_kv_pool.py``'s ``pool_room``, on a CPU a share of its RAM), at most what the
    engine can use: the workload's sequences at full length, else ``max_num_seqs`` sequences of the model's
    ``position_limit``."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks, None
    cache = cfg.cache_config
    if workload is not None:
        cap, use = workload.blocks(cfg.block_size, position_limit), f"the call's sequences ({workload.num_sequences})"
    else:
        cap = cache.blocks_for(cfg.max_num_seqs, position_limit)
        use = f"{cfg.max_num_seqs} sequences of {position_limit} tokens"
    blocks = pool_blocks(cache, layout, dtype, devices, cap=cap)
    kv = kv_storage_dtype(cfg.kv_cache_dtype, dtype)
    budget = describe_budget(cfg.memory_budget, devices)
    room = f"within {budget}" if blocks >= cap else f"cut from {cap} to what {budget} holds"
    size = layout.bytes_per_block(cfg.block_size, kv) * blocks / 2**30
    return blocks, f"automatic: {use} at full length, {str(kv).removeprefix('torch.')} KV; {room}; {size:.2f} GiB"


def size_for(model_config, dtype: torch.dtype, max_len: int, workload: Workload | None, cfg: EngineConfig,
             layout: KVLayout, devices: Sequence[torch.device]) -> tuple[EngineConfig, dict[str, str]]:
    """``cfg`` with every automatic size filled (the pool's too) for a model of ``model_config`` computing in
    ``dtype`` (``max_len``: its position limit), whose KV (``layout``) lies on ``devices``, and per automatic field
    why: the sizing ``ModelRunner`` asks of the engine."""
    sized, reasons = size_engine(cfg, model_config, dtype, devices, workload)
    num_blocks, why = pool_size(sized, layout, dtype, devices, max_len, workload)
    if why is not None:
        reasons["num_blocks"] = why
    return replace(sized, num_blocks=num_blocks), reasons


def describe(config: EngineConfig, reasons: dict[str, str], graphs: bool) -> str:
    """The start-up log line's account of the sizes, each with why (``given`` for an explicit setting);
    ``graphs``: whether decode CUDA graphs are captured (else their capture is not named)."""
    names = ("max_batch_tokens", "max_num_seqs", "num_blocks") + (("cuda_graph_capture",) if graphs else ())
    return "; ".join(f"{name}={getattr(config, name)} ({reasons.get(name, 'given')})" for name in names)
