"""``hf_paged::tp_all_reduce``: the sum over a tensor-parallel group inside the compiled layers (``tp_linears``).

By default it is transformers' own eager all-reduce: ``dist.all_reduce`` in place (on a copy of the op's input), so
NCCL runs on the caller's stream, which is what the decode CUDA graphs capture. Rather than torch's functional
all-reduce: that one runs NCCL as an asynchronous op (its own stream, events to join it); on two H100s the 8B
decode at batch 64 went from 8,749 to 10,424 tok/s with this op (two calls on different machines; one GPU 6,956 and
7,370 in them).

``HF_PAGED_TP_ALL_REDUCE=one_shot`` (experimental, not yet measured) sums inputs of up to
:data:`ONE_SHOT_MAX_BYTES` with torch's symmetric-memory one-shot all-reduce instead
(``torch.ops.symm_mem.one_shot_all_reduce_copy``): each rank copies its input into a buffer every rank of the group
can read over NVLink, and every rank sums all the buffers, in one kernel with no NCCL launch. A decode step's
all-reduces are small (64 rows of hidden 4096 in bf16 are 512 KiB) and latency-bound, which is where it can win
(NCCL's ring took 7-11 us per all-reduce there). It uses peer-to-peer loads only, no NVLink multicast. The buffer
is allocated and exchanged once per group and dtype when the layers are installed (every rank at once); where that
fails, the op keeps NCCL and says so in the log. Larger inputs (prefill steps) always take NCCL.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

logger = logging.getLogger("hf_paged")

ONE_SHOT_MAX_BYTES = 1 << 20  # decode steps of up to 128 rows at hidden 4096 in bf16
_MODES = ("nccl", "one_shot")
_buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # (group name, dtype) -> this rank's symmetric buffer
one_shot_calls = 0  # calls that took the one-shot path (eager runs and captures; a graph replay runs no Python)


def mode() -> str:
    """``HF_PAGED_TP_ALL_REDUCE``: ``nccl`` (default) or ``one_shot``."""
    value = os.environ.get("HF_PAGED_TP_ALL_REDUCE", "nccl")
    if value not in _MODES:
        raise ValueError(f"HF_PAGED_TP_ALL_REDUCE={value!r} is not one of {', '.join(_MODES)}")
    return value


def prepare(group, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up the one-shot path for ``group`` (collective: every rank of the group calls it at the same point) when
    ``HF_PAGED_TP_ALL_REDUCE=one_shot`` asks for it on CUDA; returns whether the path serves."""
    if mode() != "one_shot" or device.type != "cuda":
        return False
    key = (group.group_name, dtype)
    if key in _buffers:
        return True
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        with warnings.catch_warnings():  # needed before rendezvous in older torch, deprecated (a no-op) in newer
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group)
        torch.ops.symm_mem.one_shot_all_reduce_copy  # noqa: B018  (present in this torch?)
    except Exception as exc:  # no symmetric memory here (no peer access, an older torch): NCCL serves
        logger.warning("hf_paged: HF_PAGED_TP_ALL_REDUCE=one_shot cannot be served (%s: %s); the tensor-parallel "
                       "layers all-reduce through NCCL", type(exc).__name__, str(exc)[:300])
        return False
    _buffers[key] = buffer
    logger.info("hf_paged: tensor-parallel all-reduces of up to %d KiB run one-shot over symmetric memory",
                ONE_SHOT_MAX_BYTES >> 10)
    return True


@torch.library.custom_op("hf_paged::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of the group named ``group_name`` (see the module docstring), opaque to the
    compiler."""
    buffer = _buffers.get((group_name, x.dtype))
    if buffer is not None and x.is_cuda and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
        global one_shot_calls
        one_shot_calls += 1
        staged = buffer[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x.contiguous(), "sum", group_name)
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = x.clone()
    torch.distributed.all_reduce(out, group=_resolve_process_group(group_name))
    return out


@_tp_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x)
