"""``generate_batch``: the call shape and result shape of transformers' ``model.generate_batch``, on the engine.

Moving over is two lines::

    import hf_paged
    results = hf_paged.generate_batch(model, inputs, generation_config)   # was: model.generate_batch(inputs, ...)

Results are ``{request_id: GenerationOutput}`` (transformers' own class) in input order, ids ``"req_0"``,
``"req_1"``, ... and ``"req_0__child#0"``, ... for the extra ``num_return_sequences`` copies.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace

import torch
from transformers import GenerationConfig

from hf_paged._compat import GenerationOutput, RequestStatus
from hf_paged.cache._config import CacheConfig
from hf_paged.engine import _validation as validation
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._engine import Engine
from hf_paged.runner._graph_sizes import one_call_graph_sizes
from hf_paged.parallel._lockstep import agreed_min
from hf_paged.engine._sampling_params import SamplingParams, resolve_generation_config
from hf_paged.hf._placement import kv_devices
from hf_paged.parallel._tensor_parallel import kv_layout

logger = logging.getLogger("hf_paged")


def generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config=None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    indices: list[int] | None = None,
    reset_prefix_cache: bool = False,
    **kwargs,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt of ``inputs`` with continuous batching on a paged cache.

    Reads ``block_size``, ``num_blocks``, ``max_batch_tokens``, ``max_requests_per_batch``, ``allow_block_sharing``,
    ``return_logprobs``, ``seed``, ``max_memory_percent`` and hf_paged's own ``cuda_graphs``,
    ``cuda_graph_capture``, ``compile_layers``, ``skinny_linear`` and ``kv_cache_dtype``
    from ``continuous_batching_config`` when given (an
    :class:`~hf_paged.EngineConfig` is taken as it is; its ``num_blocks=None`` sizes the pool for the workload);
    ``max_new_tokens`` may be passed as a keyword, as with transformers. Without ``num_blocks`` the cache is sized
    for the whole workload, within ``max_memory_percent`` (default 0.8) of free device memory.
    ``persistent_manager=True`` keeps the engine (its KV pool and captured CUDA graphs) on the model for the next
    call with the same settings whose workload fits its pool, as transformers keeps its manager; the memory stays
    held until a call without it. A kept engine notices in-place changes of the model's weights (an optimizer step,
    ``load_state_dict``) and computes again what they invalidate; ``reset_prefix_cache=True`` (hf_paged's own) makes it
    forget its cached prefixes in any case (after weights were changed through ``param.data`` or replaced).
    ``record_timestamps`` and ``warmup`` are accepted for compatibility and ignored.
    ``indices`` (hf_paged's own): each prompt's position in a larger workload that this call serves part of (distinct,
    non-negative); request ids (``"req_<index>"``) and the per-request seeds of ``continuous_batching_config.seed``
    follow it, so a share of the prompts gets what one call over all of them gives its prompts (data parallel).
    """
    validation.check_names(kwargs, ["max_new_tokens"], "generate_batch()")
    if not isinstance(reset_prefix_cache, bool):
        raise ValueError(f"reset_prefix_cache must be True or False, got {reset_prefix_cache!r}")
    if isinstance(continuous_batching_config, dict):
        raise ValueError("continuous_batching_config must be transformers' ContinuousBatchingConfig (or an object "
                         "with its attributes), got a dict: pass ContinuousBatchingConfig(**settings)")
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    inputs = [validation.prompt_token_ids(p, vocab_size) for p in validation.prompt_list(inputs, "generate_batch")]
    if indices is None:
        indices = list(range(len(inputs)))
    elif (not isinstance(indices, (list, tuple)) or len(indices) != len(inputs) or len(set(indices)) != len(indices)
          or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)):
        raise ValueError(f"indices must be {len(inputs)} distinct non-negative integers (each prompt's position in "
                         f"the whole workload), one per prompt; got {indices!r}")
    if not inputs:
        return {}
    opt = lambda name, default: default if getattr(continuous_batching_config, name, None) is None else getattr(
        continuous_batching_config, name)
    generation_config = validation.generation_config(generation_config)
    gc = copy.deepcopy(generation_config or getattr(model, "generation_config", None) or GenerationConfig())
    if kwargs.get("max_new_tokens") is not None:
        gc.max_new_tokens = kwargs.pop("max_new_tokens")
    if opt("return_logprobs", False):
        gc.output_logprobs = True
    SamplingParams.from_generation_config(gc, 1, getattr(model, "generation_config", None))  # (checked before sizing)
    engine = _engine_for(model, inputs, gc, opt, persistent_manager, continuous_batching_config)
    if reset_prefix_cache:
        engine.reset_prefix_cache()
    seed = opt("seed", None)
    start = time.perf_counter()
    configs = gc
    if seed is not None:
        configs = [copy.deepcopy(gc) for _ in inputs]
        for i, cfg in zip(indices, configs):
            cfg.seed = (seed * 1_000_003 + i) % 2**62
    queued = engine.add_requests(inputs, configs, request_ids=[f"req_{i}" for i in indices])
    ids = {rid: i for i, rid in enumerate(queued)}
    finished = {}
    from tqdm.auto import tqdm

    desc = f"Solving {len(inputs)} requests"
    with tqdm(total=len(inputs), disable=not progress_bar, desc=desc, unit="request") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                finished[out.request_id] = _to_generation_output(out, start)
                bar.update(out.request_id in ids)
    failed = [k for k, o in finished.items() if o.error is not None]
    if failed:
        logger.error("Requests %s failed during generation.", failed)
    order = lambda rid: (ids[rid.partition("__child#")[0]], int(rid.partition("__child#")[2] or -1))
    return {rid: finished[rid] for rid in sorted(finished, key=order)}


_KEPT = "_hf_paged_engine"  # model attribute holding the engine kept by persistent_manager=True


def _engine_for(model, inputs, gc: GenerationConfig, opt, persistent: bool, given) -> Engine:
    """An engine sized for this workload (``given``: an ``EngineConfig`` to use as it is, else the engine settings
    read from transformers' continuous-batching config); transformers' default block size (256) is read as "not
    chosen"."""
    defaults = EngineConfig()
    block_size = opt("block_size", defaults.block_size)
    try:
        config = given if isinstance(given, EngineConfig) else EngineConfig(
            num_blocks=opt("num_blocks", None), block_size=defaults.block_size if block_size == 256 else block_size,
            max_batch_tokens=opt("max_batch_tokens", defaults.max_batch_tokens),
            max_num_seqs=opt("max_requests_per_batch", defaults.max_num_seqs),
            enable_prefix_caching=opt("allow_block_sharing", defaults.enable_prefix_caching),
            memory_budget=opt("max_memory_percent", defaults.memory_budget),
            cuda_graphs=opt("cuda_graphs", defaults.cuda_graphs),
            compile_layers=opt("compile_layers", defaults.compile_layers),
            skinny_linear=opt("skinny_linear", defaults.skinny_linear),
            kv_cache_dtype=opt("kv_cache_dtype", defaults.kv_cache_dtype),
            cuda_graph_capture=opt("cuda_graph_capture", defaults.cuda_graph_capture))
    except ValueError as exc:
        raise ValueError(f"continuous_batching_config: {exc}") from None
    if config.num_blocks is None:
        needed = workload_blocks(model, inputs, gc, config.cache_config)
    if not persistent and config.cuda_graphs is True and not isinstance(given, EngineConfig):
        # This engine serves this call only: it never runs more sequences at once than the call has, and it
        # captures on every call (each size costs a traced forward, ~25 ms for a 1B model), so it captures that
        # count at start and the powers of two below it on demand: a call's batch passes each smaller size only
        # for the few steps in which its sequences finish, unless their lengths differ a lot. On an H100 the
        # anchor of the end-to-end benchmark took 1.84 s this way against 2.03-2.28 s with 9 sizes at start.
        most = min(len(inputs) * _copies(model, gc), config.max_num_seqs)
        config = replace(config, cuda_graphs=tuple(one_call_graph_sizes(most)),
                         cuda_graph_capture=opt("cuda_graph_capture", "on_demand"))
    kept = model.__dict__.pop(_KEPT, None)
    key = replace(config, num_blocks=None)
    if persistent and kept is not None and kept[0] == key and not kept[1].has_unfinished():
        size = kept[1].pool.num_blocks
        if size >= needed if config.num_blocks is None else size == config.num_blocks:
            model.__dict__[_KEPT] = kept
            return kept[1]
    del kept  # a kept engine that does not fit goes before the new one takes memory
    engine = Engine(model, config=config if config.num_blocks is not None else replace(config, num_blocks=needed))
    if persistent:
        model.__dict__[_KEPT] = (key, engine)
    return engine


def _to_generation_output(out, start: float) -> GenerationOutput:
    return GenerationOutput(
        request_id=out.request_id,
        prompt_ids=list(out.prompt_token_ids),
        generated_tokens=list(out.token_ids),
        logprobs=list(out.logprobs or []),
        error=out.error,
        status=RequestStatus.FAILED if out.finish_reason == "error" else RequestStatus.FINISHED,
        created_time=start,
        lifespan=(start, time.perf_counter()),
    )


def _copies(model, gc: GenerationConfig) -> int:
    """Sequences per prompt (``num_return_sequences``)."""
    return resolve_generation_config(gc, getattr(model, "generation_config", None)).num_return_sequences or 1


def workload_blocks(model, inputs, gc: GenerationConfig, config: CacheConfig) -> int:
    """Blocks for every request at full length at once (so nothing is preempted), within the memory budget."""
    block_size = config.block_size
    resolved = resolve_generation_config(gc, getattr(model, "generation_config", None))
    copies = resolved.num_return_sequences or 1
    limit, needed = validation.position_limit(model.config), 0
    for prompt in inputs:
        new = resolved.max_new_tokens or max(1, (resolved.max_length or 20) - len(prompt))
        needed += copies * -(-min(len(prompt) + new, limit) // block_size)
    fits = config.pool_blocks(kv_layout(model), model.dtype, kv_devices(model), cap=needed)
    return max(1, agreed_min(model, fits))  # tensor parallel: every rank sizes (and reuses) its engine alike
