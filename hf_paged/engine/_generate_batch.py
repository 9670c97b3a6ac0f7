"""``generate_batch``: the call shape and result shape of transformers' ``model.generate_batch``, on the engine.

Moving over is two lines::

    import hf_paged
    results = hf_paged.generate_batch(model, inputs, generation_config)   # was: model.generate_batch(inputs, ...)

Results are ``{request_id: GenerationOutput}`` (transformers' own class) in input order, ids ``"req_0"``,
``"req_1"``, ... and ``"req_0__child#0"``, ... for the extra ``num_return_sequences`` copies (before their prompt's
own, as transformers orders them).
"""

from __future__ import annotations

import copy
import threading
import time

import torch
from tqdm.auto import tqdm
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_paged import _compat
from hf_paged._compat import GenerationOutput, RequestStatus
from hf_paged.engine import _batch_configs as batch_configs
from hf_paged.engine import _validation as validation
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._core import restore_attention
from hf_paged.engine._engine import Engine
from hf_paged.engine._sampling_params import MAX_RETURN_SEQUENCES, SamplingParams, checked_seed
from hf_paged.engine._sizing import Workload, pool_size
from hf_paged.hf._placement import kv_devices
from hf_paged.hf._register import use_paged_attention
from hf_paged.parallel._lockstep import agreed_min
from hf_paged.parallel._tensor_parallel import kv_layout
from hf_paged._frozen_heap import frozen_heap


@frozen_heap()  # the whole call: a collection that falls in it walks only what the call made (hf_paged/_frozen_heap.py)
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
    *,
    max_new_tokens: int | None = None,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt of ``inputs`` with continuous batching on a paged cache.

    The configs mean what they mean to transformers' own ``model.generate_batch`` (``engine/_batch_configs.py`` has
    the table of every field): ``generation_config`` (default: the model's) is read alone, an unset sampling setting
    being off; ``eos_token_id`` None or -1 is no EOS; without ``max_new_tokens`` (here a keyword too, as with
    transformers) requests run to EOS or the model's position limit. ``min_new_tokens``, ``min_length`` and
    ``repetition_penalty``, whose processors transformers' ``generate_batch`` drops, are applied as ``generate``
    applies them; settings the engine cannot apply (beam search, ``typical_p``, ``stop_strings`` without a
    tokenizer, ...) raise ``ValueError`` naming them.

    From ``continuous_batching_config`` (transformers' ``ContinuousBatchingConfig``, or any object with its
    attribute names): ``num_blocks`` (of ``page_size``/``block_size`` tokens: the same KV capacity), ``block_size``
    (256, transformers' default, reads as hf_paged's 16), ``max_batch_tokens``, ``max_requests_per_batch``,
    ``max_memory_percent``, ``allow_block_sharing``, ``use_async_batching``, ``use_cuda_graph``, ``return_logprobs``,
    ``seed``, and hf_paged's own ``cuda_graphs``, ``cuda_graph_capture``, ``compile_layers``, ``skinny_linear``,
    ``layer_kernels``, ``kv_cache_dtype`` and ``logprobs_mode`` (what ``return_logprobs``' logprobs are of:
    ``"raw_logprobs"``, the default, or ``"processed_logprobs"``, the distribution each token was drawn from); the
    knobs of transformers' own runner change nothing here. An :class:`~hf_paged.EngineConfig` is taken as it is. Unset sizes are automatic and
    fit the call (``engine/_sizing.py``): the pool holds the whole workload within the memory budget (default 0.8 of
    free device memory; on a CPU at most 3% of its RAM).

    ``persistent_manager=True`` keeps the engine (its KV pool and captured CUDA graphs) on the model for the next
    call with the same settings whose workload fits its pool, as transformers keeps its manager; the memory stays
    held until a call without it. A kept engine notices changes of the model's weights (an optimizer step, fused or
    not, ``load_state_dict``, a write through ``param.data``) and computes again what they invalidate, and is replaced
    by a new one where parameters were replaced or changed dtype or device (``EngineCore.check_weights``);
    ``reset_prefix_cache=True`` (hf_paged's own) makes it forget its cached prefixes in any case.
    ``record_timestamps=True`` fills each result's ``timestamps`` (the time each token reached the host,
    ``time.perf_counter``); ``warmup`` is accepted for compatibility (the engine captures what it needs itself).
    Results are ordered as transformers orders them: for each prompt its copies (``"req_0__child#0"``, ...) and then
    its own ``"req_0"``.
    ``indices`` (hf_paged's own): each prompt's position in a larger workload that this call serves part of (distinct,
    non-negative); request ids (``"req_<index>"``) and the per-request seeds of ``continuous_batching_config.seed``
    follow it, so a share of the prompts gets what one call over all of them gives its prompts (data parallel).
    The model runs the paged attention during the call and the one it was loaded with again after it (as transformers
    switches and restores it), so its own ``generate`` and ``generate_batch`` serve it as before; it runs in eval mode
    (no dropout) and each module goes back to its training mode after the call.
    Identical prompts run as one request with a copy per prompt (one prefill: ``_shared_prefills``), their results
    under the ids and in the order of the prompts as given.
    Calls from several threads run one at a time: a second call waits until the first has ended.
    A request that fails (a prompt the pool or the model's position limit cannot hold, a fault of the model) makes the
    call raise :class:`GenerateBatchError` (a ``RuntimeError``) naming each failed request and why, once the others
    are done; its ``results`` hold every output, the failed ones with their error. No result comes back empty.
    """
    if not isinstance(reset_prefix_cache, bool):
        raise ValueError(f"reset_prefix_cache must be True or False, got {reset_prefix_cache!r}")
    if continuous_batching_config is None and isinstance(getattr(generation_config, "continuous_batching_config",
                                                                 None), ContinuousBatchingConfig):
        continuous_batching_config = generation_config.continuous_batching_config  # (transformers' older route)
    config = batch_configs.engine_config(continuous_batching_config)
    seed = checked_seed(getattr(continuous_batching_config, "seed", None), "continuous_batching_config.seed")
    inputs, gc = read_call(model, inputs, generation_config, max_new_tokens, "generate_batch")
    if indices is None:
        indices = list(range(len(inputs)))
    elif (not isinstance(indices, (list, tuple)) or len(indices) != len(inputs) or len(set(indices)) != len(indices)
          or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices)):
        raise ValueError(f"indices must be {len(inputs)} distinct non-negative integers (each prompt's position in "
                         f"the whole workload), one per prompt; got {indices!r}")
    if not inputs:
        return {}
    if getattr(continuous_batching_config, "return_logprobs", None):
        gc.output_logprobs = True
    # (checked before the engine is built; the engine checks each prompt's config again, not its ids)
    copies = SamplingParams.from_generation_config(gc, len(inputs[0])).num_return_sequences
    workload = Workload(tuple(most_tokens(p, gc) for p in inputs for _ in range(copies)),
                        one_call=not persistent_manager and not isinstance(continuous_batching_config, EngineConfig))
    prompts, configs, request_ids, names = _shared_prefills(inputs, gc, indices, seed, copies)
    finished, stamps = {}, {} if record_timestamps else None
    desc = f"Solving {len(inputs) * copies} requests"
    # one call at a time in the process (_CALLS); the caller's attention and training mode, put back however the call
    # ends (as transformers' generate_batch puts the attention back), so that the model's own generate and
    # generate_batch work on it afterwards and a trainer goes on training; the call runs in eval mode (no dropout)
    with _CALLS, tqdm(total=len(inputs) * copies, disable=not progress_bar, desc=desc, unit="request") as bar:
        attention = _compat.attn_implementation(model.config)
        training = [module for module in model.modules() if module.training]
        model.eval()
        try:
            engine = _engine_for(model, config, workload, persistent_manager)
            use_paged_attention(model)  # (a kept engine's model was switched back after its last call)
            if reset_prefix_cache:
                engine.reset_prefix_cache()
            start = time.perf_counter()
            engine._enqueue(engine._new_sequences(prompts, configs, "generate_batch", request_ids,
                                                  checked=True))  # (the ids were checked above)
            while engine.has_unfinished():
                outs, deltas = engine.step_with_deltas() if stamps is not None else (engine.step(), [])
                now = time.perf_counter()
                for delta in deltas:  # (none without record_timestamps)
                    stamps.setdefault(names[delta.request_id], []).extend([now] * len(delta.token_ids))
                for out in outs:
                    rid = names[out.request_id]
                    finished[rid] = GenerationOutput(
                        request_id=rid, prompt_ids=list(out.prompt_token_ids), generated_tokens=list(out.token_ids),
                        logprobs=list(out.logprobs or []), error=out.error, created_time=start,
                        status=RequestStatus.FAILED if out.finish_reason == "error" else RequestStatus.FINISHED,
                        lifespan=(start, time.perf_counter()),
                        timestamps=None if stamps is None else stamps.get(rid, []))
                bar.update(len(outs))
        finally:
            restore_attention(model, attention)
            for module in training:
                module.training = True
    place = {i: position for position, i in enumerate(indices)}
    results = {rid: finished[rid] for rid in sorted(finished, key=lambda rid: result_order(rid, place))}
    if failed := [f"{rid}: {out.error}" for rid, out in results.items() if out.error is not None]:
        raise GenerateBatchError(f"generate_batch: {len(failed)} of {len(results)} requests failed: "
                                 + "; ".join(failed[:3]) + ("; ..." if len(failed) > 3 else ""), results)
    return results


def read_call(model, inputs, generation_config: GenerationConfig | None, max_new_tokens: int | None,
              what: str) -> tuple[list[list[int]], GenerationConfig]:
    """The prompts of a ``generate_batch``-shaped call (``what``) as checked token-id lists, and the generation config
    the engine runs for them (``batch_configs.generation_config``)."""
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    prompts = [validation.prompt_token_ids(p, vocab_size) for p in validation.prompt_list(inputs, what)]
    return prompts, batch_configs.generation_config(validation.generation_config(generation_config), model,
                                                    max_new_tokens, validation.position_limit(model.config))


def most_tokens(prompt: list[int], gc: GenerationConfig) -> int:
    """A request's most tokens, prompt and new ones; without ``max_new_tokens`` the model's position limit (which
    ``batch_configs.generation_config`` sets as ``max_length``)."""
    return len(prompt) + gc.max_new_tokens if gc.max_new_tokens is not None else gc.max_length


class GenerateBatchError(RuntimeError):
    """Raised by :func:`generate_batch` when a request failed; ``results`` holds every request's output, the failed
    ones with their ``error`` and status ``FAILED``, so the work of the others is not lost."""

    def __init__(self, message: str, results: dict[str, GenerationOutput]):
        super().__init__(message)
        self.results = results


_KEPT = "_hf_paged_engine"  # model attribute holding the engine kept by persistent_manager=True
#: Held by each call while it runs: calls from several threads run one after the other. A kept engine serves one
#: call at a time, and the flag of hf_paged's own model calls that the attention reads is one for the process
#: (``hf_paged/_forward_context.py``), so two engines stepping at once in two threads would read each other's.
_CALLS = threading.RLock()


def _engine_for(model, config: EngineConfig, workload: Workload, persistent: bool) -> Engine:
    """An engine of ``config`` for ``workload`` (automatic sizes fit it: ``engine/_sizing.py``); with ``persistent``,
    the one kept on the model when it has the same settings, is idle and its pool holds the workload."""
    kept = model.__dict__.pop(_KEPT, None)
    if (persistent and kept is not None and kept[0] == config and not kept[1].has_unfinished()
            and kept[1].check_weights()):  # (False: parameters replaced, or of another dtype or device)
        fits = config.num_blocks is not None  # (a given pool size is the kept engine's: its config is the same)
        if not fits:  # the blocks a new pool would take; every rank under tensor parallel decides alike
            blocks, _ = pool_size(config, kv_layout(model), model.dtype, kv_devices(model),
                                  validation.position_limit(model.config), workload)
            fits = kept[1].config.num_blocks >= agreed_min(model, max(1, blocks))
        if fits:
            model.__dict__[_KEPT] = kept
            return kept[1]
    del kept  # a kept engine that does not fit goes before the new one takes memory
    engine = Engine(model, config=config, workload=workload)
    if persistent:
        model.__dict__[_KEPT] = (config, engine)
    return engine


def _shared_prefills(inputs: list[list[int]], gc: GenerationConfig, indices: list[int], seed: int | None,
                     copies: int) -> tuple[list[list[int]], list[GenerationConfig], list[str], dict[str, str]]:
    """Identical prompts of the call as one request each, whose prompt is computed once for all of their copies (an
    RL trainer sends each prompt once per completion it wants): the request of the first of them with
    ``num_return_sequences`` covering every copy of every one of them (at most ``MAX_RETURN_SEQUENCES``: more
    identical prompts make more requests). Its copies draw as copies do, from the first one's seed.

    Each request's config is a copy of ``gc`` with its seed (``continuous_batching_config.seed``, by position in the
    workload), its copies and, where ``gc`` sets no ``max_new_tokens``, the room left to the model's position limit
    (transformers' "no limit"; set here so that the model's generation config fills nothing in); requests whose
    configs are alike share one.

    Returns the requests' prompts, configs and ids, and each engine result id's name in the call (the ids the
    prompts would have had alone, ``"req_<index>"`` and its ``"req_<index>__child#<k>"``)."""
    alike: dict[tuple[int, ...], list[int]] = {}
    for position, prompt in enumerate(inputs):
        alike.setdefault(tuple(prompt), []).append(position)
    prompts, configs, request_ids, names = [], [], [], {}
    shared: dict[tuple, GenerationConfig] = {}
    most = max(1, MAX_RETURN_SEQUENCES // copies)
    for positions in alike.values():
        for group in (positions[j : j + most] for j in range(0, len(positions), most)):
            index, prompt = indices[group[0]], inputs[group[0]]
            key = (len(prompt) if gc.max_new_tokens is None else None, index if seed is not None else None, len(group))
            if key not in shared:
                config = shared[key] = copy.deepcopy(gc)
                if gc.max_new_tokens is None:
                    config.max_new_tokens = max(1, gc.max_length - len(prompt))
                if seed is not None:
                    config.seed = (seed * 1_000_003 + index) % 2**62
                if len(group) > 1:
                    config.num_return_sequences = copies * len(group)  # (on the object: no check of greedy copies)
            prompts.append(prompt)
            configs.append(shared[key])
            request_ids.append(f"req_{index}")
            names.update(zip(_result_ids(index, copies * len(group)),
                             (name for p in group for name in _result_ids(indices[p], copies))))
    return prompts, configs, request_ids, names


def _result_ids(index: int, copies: int) -> list[str]:
    """The result ids of the prompt at ``index`` with ``copies`` copies, in transformers' order."""
    rid = f"req_{index}"
    return [f"{rid}{validation.CHILD_MARK}{k}" for k in range(copies - 1)] + [rid]


def result_order(rid: str, place: dict[int, int] | None = None) -> tuple[int, int]:
    """Where a result of ``generate_batch`` goes, in transformers' order: by its prompt's index (``"req_<index>"``;
    with ``place``, that index's place there), then the prompt's copies ``"req_<index>__child#0"``, ... before
    ``"req_<index>"`` itself."""
    parent, _, copy_index = rid.partition(validation.CHILD_MARK)
    index = int(parent.removeprefix("req_"))
    return place[index] if place is not None else index, int(copy_index) if copy_index else 2**62
