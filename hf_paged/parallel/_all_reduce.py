"""``hf_paged::tp_all_reduce``: the sum over a tensor-parallel group inside the compiled layers (``tp_linears``).

Small inputs (decode steps: up to :data:`ONE_SHOT_MAX_BYTES`; 64 rows of hidden 4096 in bf16 are 512 KiB) are summed
over buffers every rank of the group can read through NVLink (torch's symmetric memory; peer-to-peer loads only, no
NVLink multicast), in one kernel with no NCCL launch. ``HF_PAGED_TP_ALL_REDUCE`` (``hf_paged.envs``) picks how:

- unset or ``hf_paged`` (the default): hf_paged's own kernel (``csrc/peer_sum.cu``): a fixed grid whose blocks each
  copy their share of the input into this rank's buffer, signal and wait for their peers' matching blocks only, and
  sum every rank's share; two alternating data halves, so that no closing barrier is needed, and a float sum in rank
  order, so every rank gets the bit-identical result. A block that waits longer than ``HF_PAGED_TP_TIMEOUT_S`` for a
  peer traps (a CUDA error) rather than hanging. On two H200s the 8B decode step at batch 64 took 4.59 ms with it
  against 5.13 ms with NCCL, the same call (2026-11-27, ``benchmarks/parallel/tensor_parallel.py``'s steady decode).
- ``nccl``: transformers' own eager all-reduce: ``dist.all_reduce`` in place (on a copy of the op's input), so NCCL
  runs on the caller's stream, which is what the decode CUDA graphs capture (rather than torch's functional
  all-reduce, an asynchronous op on its own stream).

Each group's buffer is allocated and exchanged once, when the layers are installed (every rank at once).
Where that fails (no peer access between the GPUs, more than 8 ranks, no kernels built), the op sums through NCCL
and says so in the log: a warning where the path was asked for by name, an info line where it was the default.
Larger inputs (prefill steps) always take NCCL. On GPUs linked by PCIe only, peer loads may be slower than NCCL's
ring: compare with ``HF_PAGED_TP_ALL_REDUCE=nccl`` there.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hf_paged import _compat, envs
from hf_paged.kernels._build import load
from hf_paged.kernels._layer_ops import add_rms_norm_reference

logger = logging.getLogger("hf_paged")

ONE_SHOT_MAX_BYTES = 1 << 20  # decode steps of up to 128 rows at hidden 4096 in bf16
_PEER_SUM_MAX_RANKS = 8  # csrc/peer_sum.h's kPeerSumMaxRanks
_PEER_CONTROL_BYTES = 64 << 10  # room for peer_sum's flags and epochs (4.5 KiB) after its two data halves
_PEER_SUM_MAX_ROW_BYTES = 512 * 4 * 16  # the fused norm's rows: kPeerSumThreads * kPeerSumMaxRowUnitsPerThread units
_buffers: dict[str, torch.Tensor] = {}  # group name -> this rank's symmetric buffer (kept alive with its mapping)
# group name -> (peer buffer addresses, this rank, buffer bytes, timeout s)
_peers: dict[str, tuple[torch.Tensor, int, int, float]] = {}
one_shot_calls = 0  # calls that took a one-shot path (eager runs and captures; a graph replay runs no Python)


def prepare(group, device: torch.device) -> bool:
    """Set up peer_sum for ``group`` on CUDA unless ``HF_PAGED_TP_ALL_REDUCE=nccl`` (collective: every rank of the
    group calls it at the same point); returns whether peer_sum serves."""
    if envs.tp_all_reduce() == "nccl" or device.type != "cuda":
        return False
    if group.group_name in _peers:
        return True
    try:
        _prepare_peer_sum(group, device)
    except Exception as exc:  # no symmetric memory here (no peer access, an older torch), no kernels: NCCL serves
        asked = envs.tp_all_reduce_asked()
        (logger.warning if asked else logger.info)(
            "hf_paged: %s cannot be served (%s: %s); the tensor-parallel layers all-reduce through NCCL",
            "HF_PAGED_TP_ALL_REDUCE=hf_paged" if asked else "the default all-reduce (hf_paged's peer_sum)",
            type(exc).__name__, str(exc)[:300])
        return False
    logger.info("hf_paged: tensor-parallel all-reduces of up to %d KiB run on peer_sum over symmetric memory",
                ONE_SHOT_MAX_BYTES >> 10)
    return True


def _prepare_peer_sum(group, device: torch.device) -> None:
    if group.size() > _PEER_SUM_MAX_RANKS:
        raise ValueError(f"peer_sum serves groups of up to {_PEER_SUM_MAX_RANKS} ranks, this one has {group.size()}")
    load()  # the kernel, or the reason it cannot be built
    _compat.enable_symmetric_memory(group.group_name)  # needed before rendezvous in older torch, a no-op in newer
    buffer = _compat.symmetric_empty((2 * ONE_SHOT_MAX_BYTES + _PEER_CONTROL_BYTES,), dtype=torch.uint8, device=device)
    buffer.zero_()  # zeroed flags and epochs on every rank
    torch.cuda.synchronize(device)  # every rank's zeros are written before any peer can pass the rendezvous
    handle = _compat.symmetric_rendezvous(buffer, group)
    # The buffer may sit at an offset in each rank's mapped allocation (torch's allocator decides): the ranks
    # exchange theirs.
    offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    if not 0 <= offset <= handle.buffer_size - buffer.numel():
        raise RuntimeError(f"the symmetric buffer lies outside its mapping (offset {offset}, mapping "
                           f"{handle.buffer_size} bytes)")
    offsets: list = [None] * handle.world_size
    dist.all_gather_object(offsets, offset, group=group)
    addresses = torch.tensor([p + o for p, o in zip(handle.buffer_ptrs, offsets, strict=True)], dtype=torch.int64,
                             device=device)
    _buffers[group.group_name] = buffer
    _peers[group.group_name] = (addresses, handle.rank, buffer.numel(), envs.tp_timeout_s())


def _peer_args(x: torch.Tensor, group_name: str, *others: torch.Tensor):
    """peer_sum's trailing arguments where its kernel serves ``x`` (and tensors shaped and typed like it), else
    None."""
    peers = _peers.get(group_name)
    if peers is None or not x.is_cuda or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    nbytes = x.numel() * x.element_size()
    if nbytes > ONE_SHOT_MAX_BYTES or nbytes % 16:
        return None
    if any(t.shape != x.shape or t.dtype != x.dtype or t.device != x.device for t in others):
        return None
    return peers


@torch.library.custom_op("hf_paged::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of the group named ``group_name`` (see the module docstring), opaque to the
    compiler."""
    global one_shot_calls
    if (peers := _peer_args(x, group_name)) is not None:
        one_shot_calls += 1
        return torch.ops.hf_paged.peer_sum(x.contiguous(), *peers)
    out = x.clone()
    dist.all_reduce(out, group=_compat.resolve_process_group(group_name))
    return out


_tp_all_reduce.register_fake(lambda x, group_name: torch.empty_like(x))


# ----- the all-reduce fused with what follows it in a decoder layer ---------------------------------------------------
# The engine's graph pass (hf_paged.compile._fuse_all_reduce) puts these where a layer adds the all-reduce's output
# to its residual stream (and, after attention, takes the next RMSNorm of it), so that peer_sum's kernel does the add
# and the norm instead of a kernel of their own after it.

fused_calls = 0  # calls that took a fused peer_sum kernel (eager runs and captures)


def fused_ready(group_name: str) -> bool:
    """Whether peer_sum serves the group named ``group_name`` in this process (set up by :func:`prepare`): only
    then does the graph pass fuse, since elsewhere the fused ops run their parts one after the other."""
    return group_name in _peers


def _aligned(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors contiguous and 16-byte aligned (copied where they are not)."""
    contiguous = [t.contiguous() for t in tensors]
    return [t if t.data_ptr() % 16 == 0 else t.clone() for t in contiguous]


@torch.library.custom_op("hf_paged::tp_all_reduce_add", mutates_args=())
def _tp_all_reduce_add(x: torch.Tensor, residual: torch.Tensor, group_name: str) -> torch.Tensor:
    """``residual + tp_all_reduce(x)``, on one peer_sum kernel where it serves (each rounded to the dtype, as the
    unfused layer rounds them)."""
    global fused_calls
    if (peers := _peer_args(x, group_name, residual)) is not None:
        fused_calls += 1
        return torch.ops.hf_paged.peer_sum_add(*_aligned(x, residual), *peers)
    return (residual + torch.ops.hf_paged.tp_all_reduce(x, group_name)).contiguous()


def _contiguous_like(x: torch.Tensor, *args) -> torch.Tensor:
    """The fused ops' fake output: their outputs are contiguous whatever the inputs' strides (the kernel's and the
    fallback's alike)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_tp_all_reduce_add.register_fake(_contiguous_like)


@torch.library.custom_op("hf_paged::tp_all_reduce_add_rms_norm", mutates_args=())
def _tp_all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                eps_tensor: torch.Tensor | None, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, RMSNorm(h, weight, eps))`` with ``h = residual + tp_all_reduce(x)``, on one peer_sum kernel where it
    serves. The epsilon is ``eps_tensor`` where given (a 0-d tensor: torch.compile passes a module's float attribute
    as one), else ``eps``."""
    global fused_calls
    peers = _peer_args(x, group_name, residual)
    hidden = x.shape[-1] if x.dim() else 0
    row_bytes = hidden * x.element_size()
    if (peers is not None and (eps_tensor is None or (eps_tensor.device.type == "cpu" and eps_tensor.dim() == 0))
            and weight.dtype == x.dtype and weight.shape == (hidden,) and weight.device == x.device
            and row_bytes and row_bytes % 16 == 0 and row_bytes <= _PEER_SUM_MAX_ROW_BYTES):
        fused_calls += 1
        value = float(eps_tensor) if eps_tensor is not None else eps
        return torch.ops.hf_paged.peer_sum_add_rms_norm(*_aligned(x, residual), *_aligned(weight), value, *peers)
    # (Llama's RMSNorm, float32 inside: what the graph pass recognizes)
    h, normed = add_rms_norm_reference(torch.ops.hf_paged.tp_all_reduce(x, group_name), residual, weight,
                                       eps_tensor if eps_tensor is not None else eps)
    return h.contiguous(), normed.contiguous()


_tp_all_reduce_add_rms_norm.register_fake(lambda x, *args: (_contiguous_like(x), _contiguous_like(x)))
