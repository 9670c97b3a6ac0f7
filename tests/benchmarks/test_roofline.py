"""The roofline table of ``benchmarks/e2e/roofline.py`` (``benchmarks.e2e.throughput --workloads roofline``): kernels
are sorted into phases by their real names, the work formulas give what a hand count gives, kernels without a link to a
host operator land in the step that ran them, and a CPU smoke run gives every phase row, rows that sum to the total and
roofline times computed from the rates it measured."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from benchmarks.e2e import roofline
from benchmarks.e2e import throughput as e2e_throughput
from benchmarks.e2e.roofline import Kernel, Shape, Step, classify_kernel, phase_of, place, step_work

# Names as the profiler reports them: hf_paged's kernels (hf_paged/csrc), cuBLAS / cuBLASLt, flash-attn 2 and 3,
# inductor's, torch's own, copies and NCCL.
KERNELS = {
    "void hf_paged::(anonymous namespace)::write_kv_kernel<__nv_bfloat16>(uint4 const*, uint4 const*, uint4*, uint4*, "
    "long const*, long, int, int, long, long)": "kv_write",
    "void hf_paged::write_kv_e4m3_kernel<__nv_bfloat16>(__nv_bfloat16 const*, __nv_bfloat16 const*, uint2*, uint2*, "
    "float const*, float const*, long const*, long, int, long, long)": "kv_write",
    "void hf_paged::fix_scales_kernel<__nv_bfloat16>(__nv_bfloat16 const*, __nv_bfloat16 const*, float*, float*, "
    "long const*, long, int, long, long)": "kv_write",
    "void hf_paged::paged_decode_mma_kernel<__nv_bfloat16, __nv_bfloat16, 64>(hf_paged::DecodeParams)": "attention",
    "void hf_paged::paged_decode_simt_kernel<float, 64, 4>(hf_paged::DecodeParams)": "attention",
    "void hf_paged::paged_prefill_kernel<hf_paged::PrefillConfig<__nv_bfloat16, 64, 64, 64, 4> >"
    "(hf_paged::PrefillParams)": "attention",
    "void hf_paged::paged_prefill_wgmma_pipelined_kernel<hf_paged::WgmmaConfig<__nv_bfloat16, 128> >"
    "(hf_paged::PrefillParams)": "attention",
    "void hf_paged::paged_prefill_wgmma_serial_kernel<hf_paged::WgmmaConfig<__nv_bfloat16, 64> >"
    "(hf_paged::PrefillParams)": "attention",
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 64, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>"
    "(flash::Flash_fwd_params)": "attention",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
    "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<64> > > > >"
    ">(flash::FlashAttnFwdSm90<...>::Params)": "attention",
    "void hf_paged::skinny_gemm_kernel<__nv_bfloat16, 8>(hf_paged::GroupLaunch, int, int)": "gemm",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x"
    "_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
    "cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(...)": "gemm",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>"
    "(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, "
    "__nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "triton_poi_fused_add_mul_silu_0": "elementwise",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "elementwise",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_2": "elementwise",
    "void hf_paged::(anonymous namespace)::advance_decode_kernel(int*, int*, long*, long const*, int)": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, at::detail::Array<char*, 1> >"
    "(int, at::native::FillFunctor<long>, at::detail::Array<char*, 1>)": "elementwise",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<long, long, unsigned int, 1, 1, -2, true>"
    "(at::cuda::detail::TensorInfo<long, unsigned int>, ...)": "elementwise",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<8u>, "
    "unsigned int, 1, 128, 1>(...)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<...>)": "elementwise",
    "aten::rsqrt": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<c10::BFloat16>, "
    "unsigned int, long, 4, 4> >(at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<c10::BFloat16>, "
    "unsigned int, long, 4, 4>)": "sampler",
    "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)": "sampler",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "sampler",
    "aten::argmax": "sampler",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memcpy DtoH (Device -> Pinned)": "copy",
    "Memset (Device)": "copy",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "other",
    "void hf_paged::peer_sum_kernel<__nv_bfloat16>(hf_paged::PeerSumArgs)": "other",
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernels_are_classified_by_their_real_names(name):
    assert classify_kernel(name) == KERNELS[name]


def test_phase_rows_of_each_kernel_class():
    assert phase_of("gemm", "mixed", False) == "mixed GEMMs"
    assert phase_of("attention", "decode", False) == "decode attention"
    assert phase_of("elementwise", "decode", True) == "sampler"  # launched inside the sampler's range
    assert phase_of("copy", "decode", True) == "copies"
    assert phase_of("gemm", None, False) == "other"  # no step to say prefill or decode
    assert {phase_of(c, k, False) for c in ("gemm", "attention", "kv_write", "sampler", "elementwise", "copy", "other")
            for k in roofline.KINDS} == set(roofline.PHASES)


TINY = Shape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10, b=2, k=2)


def test_work_formulas_against_a_hand_count():
    """A mixed step: sequence A prefills its first 3 prompt tokens and samples, sequence B decodes its 6th token."""
    step = Step.of(computed=[0, 5], new=[3, 1], sample=[True, True], decode=[False, True])
    assert (step.kind, step.tokens, step.prefill_tokens, step.decode_tokens, step.sampled) == ("mixed", 4, 3, 1, 2)
    # A sees keys 1, 2, 3 (6 pairs), B sees 6 keys
    assert (step.causal_pairs, step.kv_read_tokens) == (12, 9)
    step = roofline._with_logit_bytes(step, 4)
    # per layer q 8*2*4 + k, v 8*1*4 each + o 2*4*8 + gate, up, down 8*16 each = 576 parameters; 2 layers
    assert TINY.linear_params == 1152
    work = step_work(TINY, step)
    assert set(work) == {"mixed GEMMs", "mixed attention", "KV write", "sampler", "norms/rotary/elementwise"}
    assert work["mixed GEMMs"] == (2 * 4 * 1152 + 2 * 2 * 10 * 8, (1152 + 10 * 8) * 2)
    # 4 FLOPs per head element per pair, 2 heads of 4, 2 layers; K and V of 1 head of 4, 2 bytes, 2 layers per key
    assert work["mixed attention"] == (4 * 2 * 4 * 2 * 12, 9 * 2 * 2 * 1 * 4 * 2)
    assert work["KV write"] == (0.0, 4 * 2 * 2 * 1 * 4 * (2 + 2))
    assert work["sampler"] == (0.0, 2 * 10 * 4)
    # per layer 8*8 + 3*16 + 2*(2+1)*4 = 136 elements, 2 layers, + 4*8 per token; 4 tokens of 2 bytes
    assert work["norms/rotary/elementwise"] == (0.0, 4 * (2 * 136 + 32) * 2)


def test_a_chunk_that_does_not_end_its_prompt_computes_no_logits():
    step = Step.of(computed=[16], new=[16], sample=[False], decode=[False])
    assert step.kind == "prefill" and step.sampled == 0
    assert step_work(TINY, step)["prefill GEMMs"] == (2 * 16 * 1152, 1152 * 2)  # no lm_head
    assert Step.of([7, 9], [1, 1], [True, True], [True, True]).kind == "decode"


def test_the_shape_of_a_llama_config():
    from transformers import LlamaConfig

    from benchmarks.e2e.workloads import LLAMA_1B

    shape = Shape.of(LlamaConfig(**LLAMA_1B), torch.bfloat16, torch.bfloat16)
    assert shape.kv_bytes_per_token == 32 * 1024  # the 32 KiB per token
    assert 2.4e9 < (shape.linear_params + shape.vocab * shape.hidden) * shape.b < 2.5e9  # ~2.5 GB of weights


def test_kernels_without_a_link_take_the_step_that_ran_them():
    ranges = [("roofline.step#0.prefill", 0, 10), ("roofline.sampler", 8, 9), ("roofline.step#1.decode", 10, 20),
              ("roofline.sampler", 18, 19)]
    kernels = [Kernel("a", 30, 31, 1, None),  # before any linked kernel on the device: the one after's step
               Kernel("b", 31, 32, 1, 2.0),  # launched in step 0
               Kernel("c", 32, 33, 1, 8.5),  # launched by step 0's sampler
               Kernel("d", 33, 40, 7, None),  # a graph's kernel: the step of the kernel before it on the device
               Kernel("e", 40, 41, 1, 12.0),
               Kernel("f", 41, 42, 1, 25.0)]  # launched outside every step: placed like "d"
    step_of, in_sampler, unplaced = place(kernels, ranges)
    assert step_of == [0, 0, 0, 0, 1, 1] and unplaced == 3
    assert in_sampler == [False, False, True, False, False, False]


def test_unlinked_kernels_take_the_device_span_of_their_step():
    """Where the profiler links no kernel to its launch (all unlinked), the device-side spans of the step and sampler
    ranges place them; a kernel outside every span takes the step of the kernel before it."""
    host = [("roofline.step#0.prefill", 0, 10), ("roofline.step#1.decode", 10, 20), ("roofline.sampler", 18, 19)]
    device = [("roofline.step#0.prefill", 30, 40), ("roofline.step#1.decode", 41, 60), ("roofline.sampler", 55, 60)]
    kernels = [Kernel("a", 30, 35, 5, None), Kernel("b", 35, 40, 5, None), Kernel("c", 40.5, 41, 0.5, None),
               Kernel("d", 41, 50, 9, None), Kernel("e", 56, 58, 2, None)]
    step_of, in_sampler, unplaced = place(kernels, host, device)
    assert step_of == [0, 0, 0, 1, 1] and unplaced == 1  # "c" falls between the spans: the step before it
    assert in_sampler == [False, False, False, False, True]
    # without the device spans nothing is placed but by order, and with no placed kernel at all, nothing
    assert place(kernels, host)[0] == [None] * 5


def _run(argv: list[str]) -> str:
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            e2e_throughput.main(argv)
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


@pytest.mark.slow
def test_roofline_smoke_gives_every_phase_summing_to_the_total(tmp_path):
    """A budget of 64 tokens makes the 4 smoke prompts take a prefill step, then mixed steps, then decode steps."""
    path = tmp_path / "roofline.json"
    out = _run(["--smoke", "--systems", "hf_paged", "--workloads", "roofline", "--max-batch-tokens", "64",
                "--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "ok" and row["tokens"] == row["expected_tokens"] == 16 == row["profiled_tokens"]
    assert [r["phase"] for r in row["phases"]] == list(roofline.PHASES)
    assert all(row["step_kinds"][kind]["steps"] >= 1 for kind in roofline.KINDS), row["step_kinds"]
    assert sum(r["gpu_ms"] for r in row["phases"]) == pytest.approx(row["total"]["gpu_ms"], rel=1e-9)
    assert sum(v["gpu_ms"] for v in row["step_kinds"].values()) == pytest.approx(row["total"]["gpu_ms"], rel=1e-9)
    assert row["total"]["gpu_ms"] > 0 and row["kernels"] > 0
    top = row["top_kernels"]
    assert top and [k["gpu_ms"] for k in top] == sorted((k["gpu_ms"] for k in top), reverse=True)
    assert {k["phase"] for k in top} <= set(roofline.PHASES)
    assert sum(k["gpu_ms"] for k in top) <= row["total"]["gpu_ms"] + 1e-9
    matrix, copy_rate = row["matmul_flops_per_s"], row["copy_bytes_per_s"]
    assert matrix > 0 and copy_rate > 0
    for r in row["phases"]:
        if r["phase"] in ("copies", "other"):
            assert r["roofline_ms"] is None and r["efficiency"] is None
            continue
        # the sum over steps of max(FLOPs / matrix rate, bytes / copy rate) lies between these
        low, high = max(r["flops"] / matrix, r["bytes"] / copy_rate), r["flops"] / matrix + r["bytes"] / copy_rate
        assert 1e3 * low * (1 - 1e-9) <= r["roofline_ms"] <= 1e3 * high * (1 + 1e-9), r
        assert r["efficiency"] == (pytest.approx(r["roofline_ms"] / r["gpu_ms"]) if r["gpu_ms"] > 0 else None)
    for phase in ("prefill GEMMs", "mixed GEMMs", "decode GEMMs", "mixed attention", "KV write", "sampler"):
        assert next(r for r in row["phases"] if r["phase"] == phase)["roofline_ms"] > 0, phase
    total = row["total"]
    assert total["roofline_ms"] == pytest.approx(sum(r["roofline_ms"] or 0 for r in row["phases"]))
    assert total["efficiency"] == pytest.approx(total["roofline_ms"] / total["gpu_ms"])
    assert 0 <= row["host_gaps"]["gpu_ms"] <= total["wall_ms"]
    assert row["host_gaps"]["gpu_ms"] == pytest.approx(total["wall_ms"] - row["host_gaps"]["device_busy_ms"], abs=1e-6)
    for phase in list(roofline.PHASES) + ["total", "host gaps", "wall (profiled)"]:
        assert any(line.startswith(phase) for line in out.splitlines()), phase
