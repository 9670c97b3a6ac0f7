"""A linear layer for decode-sized inputs: ``x @ weight.T + bias`` streaming the weight at close to copy bandwidth.

At a few rows of ``x`` (a decode step at small batch) a linear layer is bound by reading its weight, and cuBLAS's
GEMMs reach only part of the bandwidth there. ``hf_paged/csrc/skinny_gemm.cu`` serves up to :data:`MAX_ROWS` rows
on tensor cores (fp32 accumulation); everything else goes to ``torch.nn.functional.linear``.

:func:`linear` is the ``hf_paged::linear`` custom op under ``torch.compile`` (dynamic shapes too): the compiler sees
one opaque call with the output's shape, and the choice between the kernel and ``F.linear`` is taken inside the op
when it runs, so a compiled graph holds no guard on the row count. Eager calls run the op's code directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels.build import ensure_loaded

MAX_ROWS = 8  # rows of x the kernel serves (kSkinnyMaxRows in csrc/skinny_gemm.h)
DTYPES = (torch.float16, torch.bfloat16)
_kernels_ready: bool | None = None  # asked once: a failed build is not retried per call

__all__ = ["DTYPES", "MAX_ROWS", "kernel_serves", "linear"]


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


def kernel_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the kernel for these tensors: x on CUDA in float16/bfloat16 with 1 to
    :data:`MAX_ROWS` rows (the product of its leading dims), K a multiple of 8, weight contiguous ``[N, K]`` of x's
    dtype and device, bias contiguous ``[N]`` of the same, rows and weight 16-byte aligned, and the kernels load."""
    return _kernel_input(x, weight, bias) is not None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x2 = _kernel_input(x, weight, bias)
    if x2 is None:
        return F.linear(x, weight, bias).contiguous()  # the fake promises a contiguous output
    return torch.ops.hf_paged.skinny_gemm(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


_op = torch.library.custom_op("hf_paged::linear", _linear, mutates_args=())


@_op.register_fake
def _(x, weight, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _kernel_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x as the kernel's ``[rows, K]`` (a view where its strides allow), or None where F.linear serves."""
    k = x.shape[-1]
    if not (x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and weight.dim() == 2 and weight.shape[1] == k and k % 8 == 0 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0):
        return None
    if bias is not None and not (bias.dtype == x.dtype and bias.device == x.device and bias.dim() == 1
                                 and bias.is_contiguous()):
        return None
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS:
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1 or (rows > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16:
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:
            return None
    return x2 if _kernels_loaded() else None


def _kernels_loaded() -> bool:
    global _kernels_ready
    if _kernels_ready is None:
        _kernels_ready = ensure_loaded() is None
    return _kernels_ready
