"""The ``cuda`` backend: hf_paged's own kernels (``hf_paged/csrc``) for every phase and KV writes.

Tried after flash and before torch. It serves ``Phase.DECODE`` with the split-K decode kernel, ``Phase.PREFILL``
and ``Phase.EXTEND`` with the paged prefill kernel (a mixed step's leading decode rows with the decode kernel), both
for float16, bfloat16 and float32 and every head size in ``kernels.HEAD_DIMS`` (32 to 256), at any block size with
GQA, sliding windows and logit softcapping included (Mistral, Gemma2/3, windowed Qwen2), and the KV write of every
phase. No backend serves ALiBi (docs/design/decisions.md says why). The kernels are built on the first CUDA call; if
that is impossible (no nvcc, no ninja) this backend declines with the reason and the torch backend serves.

An fp8 (e4m3) KV cache: this backend serves every phase over it, decode, prefill and extend, for float16/bfloat16
models with head_dim in ``kernels.FP8_HEAD_DIMS`` (the kernels widen the e4m3 tiles to the model's dtype on the
chip, with the layer's per-kv-head scales), and its quantizing KV write (any head_dim of whole 8-element groups);
decode and the write are capture-safe. Other fp8 models (float32, other head sizes) are left to the torch backend.

On a Hopper GPU (compute capability 9.0, CUDA 12 or newer: the build targets sm_90a) prefill / extend go to the wgmma
prefill kernel (fp16 / bf16 over a cache of the same dtype, every compiled head size), in the form measured faster on
an H100: the serial one at head_dim 32, 64 and 96, the pipelined one at 80, 112, 128, 160, 192 and 256
(docs/benchmarks.md, "Kernels"); other layers and other GPUs keep the mma.sync kernel. Tests and benchmarks pick a kernel by
calling ``hf_paged.kernels._prefill.paged_prefill`` with ``impl=``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from hf_paged import kernels
from hf_paged.attention.backends.base import AttentionBackend, AttentionCall, AttentionInputs, register_backend
from hf_paged.cache._kv_quant import is_fp8
from hf_paged.attention._metadata import PagedMetadata, Phase
from hf_paged.kernels._build import arch_of
from hf_paged.kernels._prefill import paged_prefill, wgmma_unsupported_reason


def _device_reason(device_type: str) -> str | None:
    return None if device_type == "cuda" else f"tensors are on {device_type}, not a CUDA device"


def _dtype_head_dim_reason(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    if device_type != "cuda":
        return _device_reason(device_type)
    if dtype not in kernels.DECODE_DTYPES:
        return f"dtype {dtype} is not compiled (float16, bfloat16, float32 are)"
    if head_dim not in kernels.HEAD_DIMS:
        compiled = ", ".join(str(d) for d in kernels.HEAD_DIMS)
        return f"head_dim {head_dim} is not compiled ({compiled} are)"
    return None


def _kernels_reason() -> str | None:
    """Why the kernels cannot run here, or None; asked last, since it may build them (about a minute, once per
    machine)."""
    reason = kernels.unavailable_reason()
    return None if reason is None else f"CUDA kernels unavailable: {reason}"


def _fp8_reason(call: AttentionCall) -> str | None:
    """Why the kernels cannot read this call's fp8 KV cache (None if they can: fp16/bf16, compiled sizes, any
    phase)."""
    if call.dtype not in kernels.FP8_QUERY_DTYPES:
        return f"fp8 KV {call.phase.value} is compiled for float16 and bfloat16 models, not {call.dtype}"
    if call.head_dim not in kernels.FP8_HEAD_DIMS:
        compiled = ", ".join(str(d) for d in kernels.FP8_HEAD_DIMS)
        return f"fp8 KV {call.phase.value} is compiled for head_dim {compiled}, not {call.head_dim}"
    return None


# The faster kernel per head_dim on an H100 (docs/benchmarks.md, "Kernels", whose table reads this one): the serial
# wgmma form at 32 (two CTAs per SM), 64 and 96, the pipelined one at 80, 112, 128, 160, 192 and 256.
_WGMMA_BY_HEAD_DIM = {32: "wgmma-serial", 64: "wgmma-serial", 80: "wgmma", 96: "wgmma-serial", 112: "wgmma",
                      128: "wgmma", 160: "wgmma", 192: "wgmma", 256: "wgmma"}


@functools.cache
def _has_wgmma(index: int) -> bool:
    """Whether CUDA device ``index`` runs the wgmma kernels: compute capability 9.0 and a build for sm_90a (CUDA 12
    on); asked once per device."""
    major, minor = torch.cuda.get_device_capability(index)
    return arch_of(major, minor, cuda=torch.version.cuda) == "90a"


def _device_has_wgmma(device: torch.device) -> bool:
    """Whether this device runs the wgmma kernels (:func:`_has_wgmma`)."""
    if device.type != "cuda":
        return False
    return _has_wgmma(device.index if device.index is not None else torch.cuda.current_device())


def prefill_impl(dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, device: torch.device) -> str:
    """The prefill kernel for a layer: on a Hopper device the wgmma kernel where it serves these shapes (the form
    of ``_WGMMA_BY_HEAD_DIM``: every compiled head size), else "mma"."""
    impl = _WGMMA_BY_HEAD_DIM.get(head_dim)
    served = impl is not None and wgmma_unsupported_reason(dtype, kv_dtype, head_dim) is None
    return impl if served and _device_has_wgmma(device) else "mma"


@dataclass(frozen=True)
class DecodePlan:
    """What every layer's decode launch of one step shares: the split length, the partials' workspace and (for a
    compiled step's op, whose scratch must stay inside the call) the split tickets."""

    split_len: int
    workspace: torch.Tensor | None
    counters: torch.Tensor | None = None


@dataclass
class CudaPlan:
    """The cuda backend's plan of one step on one device: ``rows``, a mixed step's metadata cut at its
    ``single_token_prefix`` once for every layer (None without one): the decode rows' block tables and lengths, then
    the chunks' ``cu_seqlens_q`` (whose offsets still index the whole query), lengths and block tables; and one
    :class:`DecodePlan` per layer shape (``decodes``), made by the first layer of that shape (:func:`plan_decode`)."""

    rows: tuple[torch.Tensor, ...] | None
    decodes: dict[tuple, DecodePlan] = field(default_factory=dict)


# Split partials, one growing float32 buffer per (device, stream): launches on one stream run one after another,
# so the layers of a step and the steps themselves reuse it. A plan keeps a view of the buffer it was given, so a
# CUDA graph captured with it keeps its memory even after the buffer grows.
_workspaces: dict[tuple[torch.device, int], torch.Tensor] = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        buf = _workspaces[key] = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                                             dtype=torch.float32, device=device)
    return buf[:numel]


def plan_decode(query: torch.Tensor, k_cache: torch.Tensor, meta: PagedMetadata, plan: CudaPlan,
                window: int = 0) -> DecodePlan:
    """The step's decode plan for layers shaped like ``query`` [B, H, D] over ``k_cache`` with this sliding
    ``window`` (0 = none), made by the first such layer and kept in the step's ``plan`` for the others (one split
    decision and one workspace per step, not per layer). A window shortens what the splits cover to
    ``min(max_seqlen_k, window)`` keys, so windowed and full layers of one model (Gemma2) get a plan each."""
    key = (*query.shape, k_cache.shape[2], k_cache.dtype, window)
    if key not in plan.decodes:
        split = kernels.decode_split_len(query, k_cache, meta.max_seqlen_k, window)
        numel = kernels.decode_workspace_numel(*query.shape, meta.max_seqlen_k, split, window)
        workspace = counters = None  # (one split: no partials)
        if numel and meta.scratch_per_call:
            # A compiled step's op: under CUDA graph trees every allocation of the step lands in the graph's pool,
            # and one that outlives the call (the shared workspace, the kernel's own per-stream tickets) breaks the
            # next graph. So both are the call's own; the tickets must start at zero.
            workspace = torch.empty(numel, dtype=torch.float32, device=query.device)
            counters = torch.zeros(query.shape[0] * query.shape[1], dtype=torch.int32, device=query.device)
        elif numel:
            workspace = _workspace(query.device, numel)
        plan.decodes[key] = DecodePlan(split, workspace, counters)
    return plan.decodes[key]


@register_backend
class CudaBackend(AttentionBackend):
    """Decode, prefill / extend and KV write through hf_paged's CUDA kernels."""

    name = "cuda"
    priority = 10
    capture_safe_write = True  # the write kernel skips -1 slots on the device
    capture_safe_decode = True  # split length and workspace are fixed by the step's plan, lengths read on the device

    def unsupported_reason(self, call: AttentionCall) -> str | None:
        reason = _fp8_reason(call) if call.kv_dtype is not None and is_fp8(call.kv_dtype) else None
        reason = reason or _dtype_head_dim_reason(call.device_type, call.dtype, call.head_dim)
        if reason is None and (call.num_kv_heads <= 0 or call.num_heads % call.num_kv_heads):
            reason = f"num_heads {call.num_heads} is not a multiple of num_kv_heads {call.num_kv_heads}"
        return reason or _kernels_reason()

    def write_unsupported_reason(self, device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
        if is_fp8(dtype):  # the quantizing write takes any head_dim of whole 8-element groups
            reason = _device_reason(device_type)
            if reason is None and head_dim % 8:
                reason = f"the fp8 KV write needs head_dim a multiple of 8, not {head_dim}"
        else:
            reason = _dtype_head_dim_reason(device_type, dtype, head_dim)
        return reason or _kernels_reason()

    def write_kv(self, key, value, k_cache, v_cache, meta, kv_scales=None) -> None:
        if not is_fp8(k_cache.dtype):
            kernels.write_kv(key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, meta.slot_mapping)
        elif kv_scales is None:
            raise RuntimeError("an fp8 KV cache was written without its scales")
        else:  # quantized on the device from the model's dtype; unset scales fixed first
            kernels.write_kv(key, value, k_cache, v_cache, meta.slot_mapping, k_scale=kv_scales.k, v_scale=kv_scales.v)

    def plan(self, meta: PagedMetadata) -> CudaPlan:
        d = meta.single_token_prefix
        return CudaPlan((meta.block_tables[:d], meta.seq_lens_k[:d], meta.cu_seqlens_q[d:], meta.seq_lens_k[d:],
                         meta.block_tables[d:]) if d else None)

    def forward(self, inputs: AttentionInputs, plan: CudaPlan) -> torch.Tensor:
        query, meta, params, scales = inputs.query, inputs.meta, inputs.params, inputs.kv_scales
        extras = dict(window=params.sliding_window or 0, softcap=params.softcap or 0.0,
                      k_scale=None if scales is None else scales.k, v_scale=None if scales is None else scales.v)
        if meta.phase is Phase.DECODE:
            return self._decode(inputs, plan, query, meta.block_tables, meta.seq_lens_k, **extras)
        # query [T, H, D] packed by cu_seqlens_q; the new tokens' K/V are already in the cache, so one kernel serves
        # prefill and extend alike. max_seqlen_q is a host int: no sync. The decode rows in front of a mixed step's
        # prefill chunks (single_token_prefix) go to the decode kernel: in the prefill kernel each would fill a whole
        # query tile with one row (and size the grid by the longest chunk), 7% of the copy-rate roofline on the
        # anchor's mixed steps (docs/design/kernels.md, "Mixed steps"). Not in float32, whose prefill runs every
        # query row as a decode of its own (kernels/_prefill.py): it gains nothing from the split, and it would
        # write the decode rows too (each row of the query belongs to a sequence of its cu_seqlens_q there).
        d = meta.single_token_prefix if query.dtype != torch.float32 else 0
        out = None
        if d:
            decode_tables, decode_lens, cu_q, lens, tables = plan.rows
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            self._decode(inputs, plan, query[:d], decode_tables, decode_lens, out=out[:d], **extras)
            if d == meta.num_seqs:
                return out
        else:
            cu_q, lens, tables = meta.cu_seqlens_q, meta.seq_lens_k, meta.block_tables
        return paged_prefill(query, inputs.k_cache, inputs.v_cache, cu_q, lens, tables, params.scale,
                             max_seqlen_q=meta.max_seqlen_q, out=out, **extras,
                             impl=prefill_impl(query.dtype, inputs.k_cache.dtype, query.shape[-1], query.device))

    @staticmethod
    def _decode(inputs: AttentionInputs, plan: CudaPlan, query: torch.Tensor, block_tables: torch.Tensor,
                seq_lens_k: torch.Tensor, out: torch.Tensor | None = None, **extras) -> torch.Tensor:
        """One token per row: ``query`` ``[B, H, D]`` (the step's, or a mixed step's leading rows); ``extras``:
        the kernels' window, softcap and fp8 scales. meta.max_seqlen_k is a host int (no sync) that sizes the grid;
        under a CUDA graph it is the capture's upper bound and each CTA reads its real length."""
        decode = plan_decode(query, inputs.k_cache, inputs.meta, plan, extras["window"])
        return kernels.paged_decode(query, inputs.k_cache, inputs.v_cache, block_tables, seq_lens_k,
                                    inputs.params.scale, max_seq_len=inputs.meta.max_seqlen_k, out=out,
                                    split_len=decode.split_len, workspace=decode.workspace,
                                    counters=decode.counters, **extras)
