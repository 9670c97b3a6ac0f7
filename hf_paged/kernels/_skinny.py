"""A linear layer for decode-sized inputs: ``x @ weight.T + bias`` streaming the weight at close to copy bandwidth.

At a few rows of ``x`` (a decode step at small batch) a linear layer is bound by reading its weight, and cuBLAS's
GEMMs reach only part of the bandwidth there. ``hf_paged/csrc/skinny_gemm.cu`` serves up to :data:`MAX_ROWS` rows
on tensor cores (fp32 accumulation). Everything else goes to ``torch.nn.functional.linear``, and so do the small
weights where cuBLAS is as fast (:func:`kernel_wins`).
:func:`linear_group` runs 2 to 4 products that share x (q/k/v, gate/up) in one launch: at batch 1 such products are
bound by launch latency more than by bytes, so the group always takes the kernel where it serves.

:func:`linear` is the ``hf_paged::linear`` custom op under ``torch.compile`` (dynamic shapes too): the compiler sees
one opaque call with the output's shape, and the choice between the kernel and ``F.linear`` is taken inside the op
when it runs, so a compiled graph holds no guard on the row count. Eager calls run the op's code directly.
:func:`linear_group` is the ``hf_paged::linear_group`` op the same way (``hf_paged.compile._group_linears`` puts it in
the engine's compiled graphs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from hf_paged.kernels._build import ensure_loaded

MAX_ROWS = 8  # rows of x the kernel serves (kSkinnyMaxRows in csrc/skinny_gemm.h)
MAX_GROUP = 4  # weights one grouped launch serves (kSkinnyMaxGroup)
# A single product goes to cuBLAS below both: on an H100 at M=1, cuBLAS takes 6.1 us for Llama-3.2-1B's q/o
# (2048 x 2048, 8 MiB) against the kernel's 7.0, and ties on its k/v (512 x 2048); from K=4096 on the kernel wins
# even at 8 MiB (Llama-3.1-8B's k/v: 7.9 us against 8.2), and from 16 MiB at any K (gate/up, down, lm_head).
CUBLAS_BELOW_BYTES = 16 << 20
CUBLAS_MAX_K = 2048
DTYPES = (torch.float16, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the skinny kernel where it serves (see :func:`kernel_serves`).

    Args:
        x: ``[..., K]``.
        weight: ``[N, K]``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in x's dtype, contiguous. The kernel accumulates in fp32 and rounds once.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return F.linear(x, weight, bias)  # the op has no backward: training keeps autograd's linear
    if torch.compiler.is_compiling():
        return torch.ops.hf_paged.linear(x, weight, bias)
    return _linear(x, weight, bias)  # eager: the same code without the custom op's dispatch (microseconds a call)


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor],
                 biases: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` in one launch of the skinny kernel where it serves
    every pair (see :func:`kernel_serves`, without the size rule of :func:`kernel_wins`), else one ``F.linear`` over
    all of them where they lie end to end in one buffer (:func:`packed_rows`), else one ``F.linear`` each.

    Args:
        x: ``[..., K]``.
        weights: 1 to :data:`MAX_GROUP` tensors ``[N_i, K]``.
        biases: one per weight, ``[N_i]`` or None.

    Returns:
        One ``[..., N_i]`` contiguous tensor per weight, in x's dtype.
    """
    if len(weights) != len(biases):
        raise ValueError(f"linear_group needs one bias (or None) per weight, got {len(weights)} and {len(biases)}")
    tensors = (x, *weights, *(b for b in biases if b is not None))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    if torch.compiler.is_compiling():
        return torch.ops.hf_paged.linear_group(x, list(weights), list(biases))
    return _linear_group(x, list(weights), list(biases))


def linear_packed(x: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)``: the products of weights that lie end
    to end in one buffer (:func:`packed_rows`) as one product, through :func:`linear` (the kernel or ``F.linear``), in
    one contiguous ``[..., sum N_i]`` output. The engine's graph pass (``hf_paged.compile._group_linears``) takes the
    outputs as views of it, so no copy splits them. Weights that do not (or no longer) lie end to end still give the
    right result: one product each, concatenated.
    """
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"linear_packed needs weights and one bias (or None) per weight, got {len(weights)} and "
                         f"{len(biases)}")
    if torch.compiler.is_compiling():
        return torch.ops.hf_paged.linear_packed(x, list(weights), list(biases))
    return _linear_packed(x, list(weights), list(biases))


def kernel_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs a kernel for these tensors: :func:`kernel_wins` for the weight, x on CUDA in
    float16/bfloat16 with 1 to :data:`MAX_ROWS` rows (the product of its leading dims), K a multiple of 8, weight
    contiguous ``[N, K]`` of x's dtype and device, bias contiguous ``[N]`` of the same, rows and weight 16-byte
    aligned, and the kernels load."""
    return kernel_wins(weight) and _kernel_input(x, weight, bias) is not None


def kernel_wins(weight: torch.Tensor) -> bool:
    """Whether a single product with ``weight`` is faster on the kernel than on cuBLAS at decode row counts: false
    for weights under :data:`CUBLAS_BELOW_BYTES` with K up to :data:`CUBLAS_MAX_K` (measured on an H100 up to
    :data:`MAX_ROWS` rows)."""
    return weight.numel() * weight.element_size() >= CUBLAS_BELOW_BYTES or weight.shape[-1] > CUBLAS_MAX_K


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = _kernel_input(x, weight, bias) if kernel_wins(weight) else None
    if x2 is None:
        return F.linear(x, weight, bias).contiguous()  # the fake promises a contiguous output
    return torch.ops.hf_paged.skinny_gemm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


torch.library.custom_op("hf_paged::linear", _linear, mutates_args=()).register_fake(
    lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))


def _linear_group(x: torch.Tensor, weights: list[torch.Tensor],
                  biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    x2 = _kernel_input(x, weights[0], biases[0]) if 0 < len(weights) <= MAX_GROUP else None
    if x2 is None or not all(_weight_fits(x, w, b) for w, b in zip(weights[1:], biases[1:], strict=True)):
        if (packed := packed_rows(weights, biases)) is not None:  # rows of one buffer: one product, split
            return list(torch.split_with_sizes_copy(F.linear(x, *packed), [w.shape[0] for w in weights], dim=-1))
        return [F.linear(x, w, b).contiguous() for w, b in zip(weights, biases, strict=True)]
    outs = torch.ops.hf_paged.skinny_gemm_group(x2, weights, biases)
    return [out.view(*x.shape[:-1], w.shape[0]) for out, w in zip(outs, weights, strict=True)]


torch.library.custom_op("hf_paged::linear_group", _linear_group, mutates_args=()).register_fake(
    lambda x, weights, biases: [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights])


def _linear_packed(x: torch.Tensor, weights: list[torch.Tensor],
                   biases: list[torch.Tensor | None]) -> torch.Tensor:
    packed = packed_rows(weights, biases) if len(weights) > 1 else (weights[0], biases[0])
    if packed is not None:
        return _linear(x, *packed)
    return torch.cat([_linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)


torch.library.custom_op("hf_paged::linear_packed", _linear_packed, mutates_args=()).register_fake(
    lambda x, weights, biases: x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights))))


def packed_rows(weights: Sequence[torch.Tensor],
                biases: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight, bias)`` views spanning every weight (and bias) when they lie end to end in one buffer, in order
    (contiguous ``[N_i, K]`` of one dtype, device and K; biases all None or likewise end to end), else None.
    ``hf_paged.parallel._linears`` packs the q/k/v shards of a tensor-parallel model so; the group then runs as one
    product where the skinny kernel does not serve it (more than :data:`MAX_ROWS` rows)."""
    if len(weights) < 2 or not end_to_end(weights, matrix=True):
        return None
    first = weights[0]
    weight = first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases) or not end_to_end(biases, matrix=False):
        return None
    return weight, biases[0].as_strided((weight.shape[0],), (1,))


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def end_to_end(tensors: Sequence[torch.Tensor], matrix: bool,
               same_storage: Callable[[torch.Tensor, torch.Tensor], bool] = _same_data) -> bool:
    """Whether ``tensors`` (``[N_i, K]`` matrices of one K where ``matrix``, else vectors) are contiguous, of one
    dtype and device, and lie end to end in one storage, in order. ``same_storage`` tells whether two tensors share
    a storage (by default its data pointer; the fake tensors of a graph have none: ``hf_paged.compile._group_linears``
    passes its own test)."""
    first = tensors[0]
    if any(t.dim() != (2 if matrix else 1) or not t.is_contiguous() or t.dtype != first.dtype
           or t.device != first.device or (matrix and t.shape[1] != first.shape[1]) for t in tensors):
        return False
    return all(same_storage(b, first) and b.storage_offset() == a.storage_offset() + a.numel()
               for a, b in zip(tensors, tensors[1:]))


def _kernel_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x as the kernel's ``[rows, K]`` (a view where its strides allow), or None where F.linear serves."""
    if not _weight_fits(x, weight, bias):
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS:
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1 or (rows > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            return None
    return x2 if _kernels_loaded() else None


def _weight_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    k = x.shape[-1]
    if not (x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and weight.dim() == 2 and weight.shape[1] == k and k % 8 == 0 and k < 2**30 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0):
        return False
    return bias is None or (bias.dtype == x.dtype and bias.device == x.device and bias.dim() == 1
                            and bias.shape[0] == weight.shape[0] and bias.is_contiguous())


@functools.cache  # asked once: a failed build is not retried per call
def _kernels_loaded() -> bool:
    return ensure_loaded() is None
