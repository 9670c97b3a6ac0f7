"""``distributed_generate_batch``: ``generate_batch`` over the processes of a data-parallel run, one engine each.

Under ``torchrun`` or ``accelerate launch``, with the model on each process's own device, every process passes the
same prompts; each generates for a share of them balanced by tokens, and every process gets all the results
(``hf_paged.parallel._data_parallel``).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from hf_paged._compat import GenerationOutput
from hf_paged.engine._generate_batch import generate_batch, most_tokens, read_call, result_order
from hf_paged.parallel import _data_parallel as data_parallel


def distributed_generate_batch(
    model: torch.nn.Module,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    **engine_kwargs,
) -> dict[str, GenerationOutput]:
    """``hf_paged.generate_batch`` over every process of a data-parallel run: the same call, the same result.

    Every process passes the same ``inputs`` (lists of token ids) and settings, with ``model`` on its own device.
    The prompts are split by ``balanced_shares`` (cost: prompt length + ``max_new_tokens``), each process runs
    ``generate_batch`` on its share, and every process returns the dict ``generate_batch`` would return for all of
    ``inputs``: ids ``"req_<i>"`` (and ``"req_<i>__child#<k>"``) by position in ``inputs``, in input order.
    ``engine_kwargs`` go to ``generate_batch`` unchanged.

    Uses the default ``torch.distributed`` process group; when a launcher set ``WORLD_SIZE`` > 1 and none exists, it
    is created (gloo for the gather, plus NCCL where CUDA is present). One process alone is plain ``generate_batch``.
    An exception on any process is raised on every process, naming the process, after one gather of each process's
    outcome, so no process is left waiting.
    """
    world_size, rank = data_parallel.process_group()
    if world_size == 1:
        return generate_batch(model, inputs, generation_config, **engine_kwargs)
    results = data_parallel.run_shares(
        world_size, rank, lambda: _workload(model, inputs, generation_config, engine_kwargs),
        lambda prompts, share: generate_batch(model, prompts, generation_config, indices=share, **engine_kwargs),
        "distributed_generate_batch")
    return {rid: results[rid] for rid in sorted(results, key=result_order)}  # by prompt, each prompt's copies first


def _workload(model, inputs, generation_config, engine_kwargs) -> tuple[list[list[int]], list[int]]:
    """The prompts as token-id lists and each one's cost in tokens (prompt + new tokens at most)."""
    prompts, gc = read_call(model, inputs, generation_config, engine_kwargs.get("max_new_tokens"),
                            "distributed_generate_batch")
    return prompts, [most_tokens(p, gc) for p in prompts]
