"""``distributed_generate_batch``: ``generate_batch`` over the processes of a data-parallel run, one engine each.

Under ``torchrun`` or ``accelerate launch``, with the model on each process's own device, every process passes the
same prompts; each generates for a share of them balanced by tokens, and every process gets all the results.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import logging
import os

import torch
import torch.distributed as dist
from transformers import GenerationConfig

from hf_paged._compat import GenerationOutput
from hf_paged.engine import _validation as validation
from hf_paged.engine._generate_batch import generate_batch
from hf_paged.engine._sampling_params import resolve_generation_config
from hf_paged.parallel._lockstep import KEPT_ERROR_TYPES

logger = logging.getLogger("hf_paged")


def distributed_generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    **engine_kwargs,
) -> dict[str, GenerationOutput]:
    """``hf_paged.generate_batch`` over every process of a data-parallel run: the same call, the same result.

    Every process passes the same ``inputs`` (lists of token ids) and settings, with ``model`` on its own device.
    The prompts are split by :func:`balanced_shares` (cost: prompt length + ``max_new_tokens``), each process runs
    ``generate_batch`` on its share, and every process returns the dict ``generate_batch`` would return for all of
    ``inputs``: ids ``"req_<i>"`` (and ``"req_<i>__child#<k>"``) by position in ``inputs``, in input order.
    ``engine_kwargs`` go to ``generate_batch`` unchanged.

    Uses the default ``torch.distributed`` process group; when a launcher set ``WORLD_SIZE`` > 1 and none exists, it
    is created (gloo for the gather, plus NCCL where CUDA is present). One process alone is plain ``generate_batch``.
    An exception on any process is raised on every process, naming the process, after one gather of each process's
    outcome, so no process is left waiting.
    """
    world_size, rank = _process_group()
    if world_size == 1:
        return generate_batch(model, inputs, generation_config, **engine_kwargs)
    try:
        prompts, costs = _workload(model, inputs, generation_config, engine_kwargs)
        share = balanced_shares(costs, world_size)[rank]
        logger.info("hf_paged: rank %d of %d generates %d of %d requests (%d of %d tokens)", rank, world_size,
                    len(share), len(prompts), sum(costs[i] for i in share), sum(costs))
        results = generate_batch(model, [prompts[i] for i in share], generation_config, indices=share,
                                 **engine_kwargs)
        outcome = (_digest(costs), None, results)
    except Exception as exc:
        kind = next((k for k in KEPT_ERROR_TYPES if isinstance(exc, k)), RuntimeError)  # a class every process has
        outcome, failure = (None, (kind, f"{type(exc).__name__}: {exc}"), None), exc
    else:
        failure = None
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    _raise_on_failure(everyone, rank, failure)
    merged = {rid: out for _, _, results in everyone for rid, out in results.items()}
    return {rid: merged[rid] for rid in sorted(merged, key=_request_order)}


def balanced_shares(costs: list[int], world_size: int) -> list[list[int]]:
    """The indices of ``costs`` each of ``world_size`` processes takes, each share in increasing order.

    Longest processing time first: the costliest request goes to the least loaded process (the lowest rank on a
    tie), ties between requests broken by index, so every process computes the same split. The largest load is
    within 4/3 of the best possible.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += costs[i]
        shares[rank].append(i)
    return [sorted(share) for share in shares]


def _process_group() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, creating it from a launcher's environment if needed."""
    if not dist.is_available():
        return 1, 0
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return 1, 0
        # Results travel as Python objects: gloo carries them from host memory whatever the model's device.
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        # The group is ours: leave it before the interpreter exits (a group torn down at exit can abort the process).
        atexit.register(_leave_process_group)
        logger.info("hf_paged: joined a process group of %d processes from the launcher's environment",
                    dist.get_world_size())
    return dist.get_world_size(), dist.get_rank()


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _workload(model, inputs, generation_config, engine_kwargs) -> tuple[list[list[int]], list[int]]:
    """The prompts as token-id lists and each one's cost in tokens (prompt + new tokens at most)."""
    vocab_size = model.config.get_text_config(decoder=True).vocab_size
    what = "distributed_generate_batch"
    prompts = [validation.prompt_token_ids(p, vocab_size) for p in validation.prompt_list(inputs, what)]
    gc = copy.deepcopy(validation.generation_config(generation_config) or getattr(model, "generation_config", None)
                       or GenerationConfig())
    if engine_kwargs.get("max_new_tokens") is not None:
        gc.max_new_tokens = engine_kwargs["max_new_tokens"]
    resolved = resolve_generation_config(gc, getattr(model, "generation_config", None))
    new = lambda n: resolved.max_new_tokens or max(1, (resolved.max_length or 20) - n)
    return prompts, [len(p) + new(len(p)) for p in prompts]


def _digest(costs: list[int]) -> str:
    return hashlib.sha256(repr(costs).encode()).hexdigest()


def _request_order(rid: str) -> tuple[int, int]:
    """``generate_batch``'s order: by prompt, each prompt's copies first."""
    parent, rank = validation.family_and_rank(rid)
    return int(parent.removeprefix("req_")), rank


def _raise_on_failure(everyone: list, rank: int, failure: Exception | None) -> None:
    """Raise the first process's failure on every process, or a mismatch of the processes' workloads."""
    for failed_rank, (_, error, _) in enumerate(everyone):
        if error is not None:
            kind, message = error
            raise kind(f"distributed_generate_batch failed on rank {failed_rank} of {len(everyone)}: "
                       f"{message}") from failure
    if len({digest for digest, _, _ in everyone}) > 1:
        raise ValueError("distributed_generate_batch: the processes were given different prompts or "
                         "max_new_tokens; pass the same inputs and settings on every process")
