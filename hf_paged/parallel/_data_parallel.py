"""Data parallel: one list of work over the processes of a run, a share each, every result on every process.

Under ``torchrun`` or ``accelerate launch`` every process is given the same work; :func:`run_shares` splits it by
cost (:func:`balanced_shares`), runs this process's share, and gathers every process's results, or raises the first
process's failure on every process. ``hf_paged.engine._data_parallel`` runs ``generate_batch`` this way.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from hf_paged.parallel._lockstep import portable_error

logger = logging.getLogger("hf_paged")


def process_group() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, creating it from a launcher's environment if needed
    (``WORLD_SIZE`` > 1: gloo for the gather, plus NCCL where CUDA is present); ``(1, 0)`` for a process alone."""
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


def run_shares(world_size: int, rank: int, workload: Callable[[], tuple[list, list[int]]],
               run: Callable[[list, list[int]], dict], what: str) -> dict:
    """Every process's results of ``run``, merged (keys must differ between shares).

    ``workload()`` gives the items and each one's cost; ``run(items, indices)`` runs this process's share (the
    items at ``indices`` in ``items``, in increasing order). An exception in either, on any process, is raised on
    every process, naming the process and ``what`` failed, after one gather of each process's outcome, so no process
    is left waiting; so is a difference between the processes' costs (they were given different work).
    """
    failure = None
    try:
        items, costs = workload()
        share = balanced_shares(costs, world_size)[rank]
        logger.info("hf_paged: rank %d of %d runs %d of %d requests (%d of %d tokens)", rank, world_size,
                    len(share), len(items), sum(costs[i] for i in share), sum(costs))
        outcome = (hashlib.sha256(repr(costs).encode()).hexdigest(), None, run([items[i] for i in share], share))
    except Exception as exc:
        outcome, failure = (None, portable_error(exc), None), exc
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, outcome)
    for failed_rank, (_, error, _) in enumerate(everyone):
        if error is not None:
            kind, message = error
            raise kind(f"{what} failed on rank {failed_rank} of {world_size}: {message}") from failure
    if len({digest for digest, _, _ in everyone}) > 1:
        raise ValueError(f"{what}: the processes were given different prompts or max_new_tokens; pass the same "
                         "inputs and settings on every process")
    return {key: out for _, _, results in everyone for key, out in results.items()}


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
