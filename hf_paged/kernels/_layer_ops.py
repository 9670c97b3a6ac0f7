"""The layer kernels (``hf_paged/csrc/layer_ops.cu``): RMSNorm (alone, or with the residual add before it),
SiLU(gate) * up and the rotary embedding of queries and keys, one launch each, for decoder layers that run eagerly
(``hf_paged.compile._layer_kernels`` routes a model's modules to them).

transformers' modules run each of these as several operators (RMSNorm as six, the rotary embedding as about ten per
tensor), each a kernel launch and a pass over memory. A kernel here rounds where those operators round (to the
tensors' dtype after each of them), so its result equals the module's but for the order of RMSNorm's float32 sum.
Beside each kernel is its torch reference: the Llama-family modules' own operators, the oracle of the tests and
what the model side compares a module with before it routes it.

The kernels serve CUDA tensors of float32, float16 and bfloat16 (:func:`serves`); they raise ``ValueError`` for a
shape they do not take and ``KernelsUnavailable`` where the kernels cannot be built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_paged.kernels._ops import _lib

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def serves(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: CUDA tensors of one dtype of :data:`DTYPES`."""
    first = tensors[0]
    return first.is_cuda and first.dtype in DTYPES and all(t.dtype == first.dtype for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_reference` in one launch: ``x`` ``[..., hidden]`` (hidden contiguous), ``weight``
    ``[hidden]`` of x's dtype; a new contiguous tensor."""
    return _lib().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_reference` in one launch: ``(residual + x, rms_norm(residual + x))``, ``x`` and
    ``residual`` of one shape ``[..., hidden]`` (hidden contiguous); two new contiguous tensors."""
    return _lib().add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul_reference` in one launch: ``gate`` and ``up`` of one shape ``[..., width]`` (width
    contiguous, any row strides: two views of one packed product serve); a new contiguous tensor."""
    return _lib().silu_and_mul(gate, up)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_reference` for queries and keys in one launch: ``q`` ``[batch, heads, tokens, head_dim]`` and
    ``k`` ``[batch, kv_heads, tokens, head_dim]`` (head_dim contiguous and even), ``cos``/``sin`` ``[batch or 1,
    tokens, head_dim]``; new tensors laid out as q and k."""
    return _lib().rotary(q, k, cos, sin)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: in float32, ``x * rsqrt(mean(x**2) + eps)``, cast back, times the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama decoder layer's residual add and the norm after it: ``h = residual + x``, then ``(h, RMSNorm(h))``."""
    h = residual + x
    return h, rms_norm_reference(h, weight, eps)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP between its products: ``silu(gate) * up``."""
    return F.silu(gate) * up


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``apply_rotary_pos_emb`` (cos/sin broadcast over the heads): ``x * cos + rotate_half(x) * sin``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
