// What both paged-decode kernels share: the launch shape, the CTA's work, and the CTA epilogue (merge the
// warps, write the output or this split's partial, and let the last split of a (sequence, head group) combine).
//
// Split-K (Flash-Decoding) bookkeeping: a sequence's context is cut into `split_len` pieces; each CTA leaves an
// unnormalised partial output and its (max, sum) in base-2 units. The last CTA to finish, found with an atomic
// ticket, combines them in the same launch: a separate combine kernel's launch gap costs ~10% at B=1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#include "ptx.cuh"
#include "vec.cuh"

namespace hf_paged {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ int block_of(int t, const DecodeParams& p) {
  return p.block_shift >= 0 ? (t >> p.block_shift) : t / p.block_size;
}

// Programmatic dependent launch (decode_launch.cpp launches decode with it on compute capability 9.0 on, unless the
// op's `pdl` argument is false): the grid may start while the kernel before it in the stream is still running. A CTA reads its
// sequence length and block-table slice (cta_work: written when the step was laid out, before the layers ran); the
// tensor-core kernel then starts copying the K/V of its first tiles that hold only keys older than the sequence's
// newest one; then the CTA waits for that kernel to complete and its writes to be visible before it reads the
// query, the newest key, the scales or the split workspace. The contract this rests on: the kernel right before a
// decode writes at most each sequence's newest key and value (the step's write_kv), never an older one. Near the
// end of its K/V loop (DecodeParams::pdl_lead) a CTA lets the next grid start launching. Without the launch
// attribute (or below sm_90) both are no-ops.
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Decode tracing, compiled only into the diagnostic build (HF_PAGED_DECODE_TRACE, set by HF_PAGED_KERNEL_TRACE=1 in
// kernels/_build.py; the normal build's machine code holds none of it). There, a launch with DecodeParams::trace set
// has the CTA's first thread store %globaltimer and clock64 at each point; the host-side reader is
// hf_paged/bench/_decode_trace.py.
enum TracePoint : int {
  kTraceStart = 0,      // first instruction
  kTraceWork = 1,       // sequence length and block-table slice in shared memory
  kTraceFirstTile = 2,  // warp 0's first K/V tile has arrived (tensor-core kernel only)
  kTraceLoopDone = 3,   // warp 0's K/V loop is done (its copies drained)
  kTraceTicket = 4,     // partial stored, ticket taken (or the output written: one split)
  kTraceEnd = 5,        // the CTA's last store (after the combine, for the last split)
};

#ifdef HF_PAGED_DECODE_TRACE
constexpr bool kTraceBuild = true;
#else
constexpr bool kTraceBuild = false;
#endif

__device__ __forceinline__ unsigned long long* trace_slot(const DecodeParams& p) {
  const unsigned cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  return p.trace + static_cast<unsigned long long>(cta) * kTraceWords;
}

// Record point `at` (call from one thread; nothing outside the diagnostic build).
__device__ __forceinline__ void trace_point(const DecodeParams& p, int at) {
  if (!kTraceBuild || p.trace == nullptr) return;
  unsigned long long ns, cycles = static_cast<unsigned long long>(clock64());
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  unsigned long long* slot = trace_slot(p);
  slot[at] = ns, slot[8 + at] = cycles;
  if (at == kTraceStart) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    slot[6] = sm, slot[7] = 0;
  }
}

__device__ __forceinline__ void trace_flag(const DecodeParams& p, unsigned long long flag) {
  if (kTraceBuild && p.trace != nullptr) trace_slot(p)[7] |= flag;
}

// Where this CTA works: its split of one sequence and its group of query heads (GT heads per CTA). `b` is the
// query / output row; `seq` the block-table row (the same in decode; a prefill row's sequence otherwise).
struct CtaWork {
  int b, seq, kvh, head0, valid_heads, seq_len, num_splits, split, t_begin, t_end, blk_first;
};

// Prefill rows (DecodeParams::cu_seqlens_q): the sequence of query row t and how many keys it sees.
__device__ __forceinline__ void prefill_row(const DecodeParams& p, int t, int& seq, int& seq_len) {
  int lo = 0, hi = p.num_seqs - 1;  // the last sequence starting at or before t (empty ones start there too)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.cu_seqlens_q[mid] <= t) lo = mid; else hi = mid - 1;
  }
  seq = lo;
  const int q0 = p.cu_seqlens_q[seq], q_len = p.cu_seqlens_q[seq + 1] - q0;
  const int k_len = cmin(p.seq_lens[seq], p.max_context);
  seq_len = cmin(cmax(k_len - q_len, 0) + (t - q0) + 1, k_len);
}

// The block-table slice of the split starting at token t_begin (entries past the row's end are never needed).
__device__ __forceinline__ void load_table_slice(const DecodeParams& p, int t_begin, int* table, CtaWork& w) {
  w.t_begin = t_begin;
  w.blk_first = block_of(t_begin, p);
  const int n_blocks = cmin(cdiv(p.split_len, p.block_size) + 1, p.table_width - w.blk_first);
  for (int i = threadIdx.x; i < n_blocks; i += kThreads)
    table[i] = p.block_tables[static_cast<int64_t>(w.seq) * p.table_stride + w.blk_first + i];
}

// Fills `w` and copies the split's slice of the block table to `table` (so address math never waits on global
// memory). The slice a full split could need is loaded together with seq_len, not after it: one dependent round
// trip less before the first K/V copy (entries past the sequence are row padding, never used). Returns false for
// CTAs past their sequence's last split (uniformly, before the barrier it ends with). kPrefillRows: the kernel may
// be launched on prefill rows (float32 only; the tensor-core kernels leave this branch out).
template <bool kPrefillRows = false>
__device__ __forceinline__ bool cta_work(const DecodeParams& p, int gt, int* table, CtaWork& w) {
  if (threadIdx.x == 0) trace_point(p, kTraceStart);
  w.split = blockIdx.x, w.b = w.seq = blockIdx.z;
  w.kvh = blockIdx.y / p.head_groups;
  const int hg = blockIdx.y - w.kvh * p.head_groups;
  w.head0 = w.kvh * p.group_size + hg * gt;
  w.valid_heads = cmin(gt, p.group_size - hg * gt);
  int seq_len;
  if (kPrefillRows && p.cu_seqlens_q != nullptr) {
    w.b = p.first_row + w.b;
    prefill_row(p, w.b, w.seq, seq_len);
  } else {
    seq_len = p.seq_lens[w.b];
  }
  if (p.window < p.max_context) {
    // The splits cover the last `window` keys only, so the slice waits for seq_len: one round trip more, in
    // windowed launches only (nothing before the loads of the other branch reads seq_len; keep it so, the SASS
    // shows whether the compiler hoisted a use of it).
    const int k_begin = cmin(cmax(seq_len - p.window, 0), p.max_context - p.window);
    load_table_slice(p, k_begin + w.split * p.split_len, table, w);
  } else {
    load_table_slice(p, w.split * p.split_len, table, w);
  }
  w.seq_len = cmin(seq_len, p.max_context);
  const int keys = cmin(w.seq_len, p.window);  // seq_len - the window's first key
  // max_splits caps the count so that a max_seq_len below a real length cannot hang the ticket (it truncates).
  w.num_splits = cmin(cdiv(cmax(keys, 1), p.split_len), p.max_splits);
  if (w.split >= w.num_splits) {
    if (threadIdx.x == 0) trace_flag(p, kTraceNoSplit);
    return false;
  }
  w.t_end = cmin(w.seq_len, w.t_begin + p.split_len);
  __syncthreads();
  if (threadIdx.x == 0) trace_point(p, kTraceWork);
  return true;
}

// Shared-memory layout the kernels leave their per-warp states in before `finish`.
template <int D, int GT>
struct Reduce {
  static constexpr int kBytes = kWarps * GT * (D + 2) * 4;
  __device__ static float* acc(unsigned char* smem) { return reinterpret_cast<float*>(smem); }  // [W][GT][D]
  __device__ static float* m(unsigned char* smem) { return acc(smem) + kWarps * GT * D; }       // [W][GT]
  __device__ static float* l(unsigned char* smem) { return m(smem) + kWarps * GT; }             // [W][GT]
};

// Merge the warps' (m, l, acc) of query head g, dims d .. d + 3, from shared memory (Reduce layout): the CTA's
// (max, sum, unnormalised output) over its split.
template <int D, int GT>
__device__ __forceinline__ void merge_warps(unsigned char* smem, int g, int d, float& m, float& l, float4& o) {
  using R = Reduce<D, GT>;
  const float *red_acc = R::acc(smem), *red_m = R::m(smem), *red_l = R::l(smem);
  m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kWarps; ++k) m = fmaxf(m, red_m[k * GT + g]);
  l = 0.f;
  o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kWarps; ++k) {
    const float mk = red_m[k * GT + g];
    const float f = mk == -INFINITY ? 0.f : exp2f(mk - m);  // a warp that saw no token
    const float4 a = *reinterpret_cast<const float4*>(red_acc + (k * GT + g) * D + d);
    l = fmaf(f, red_l[k * GT + g], l);
    o.x = fmaf(f, a.x, o.x), o.y = fmaf(f, a.y, o.y), o.z = fmaf(f, a.z, o.z), o.w = fmaf(f, a.w, o.w);
  }
}

// Fold kBatch splits' (max st.x, sum st.y, unnormalised output x) into the running (m, l, o) at once: one max over
// the batch, then a weight per split that no other split's weight waits on, so the dependent chain per split is a
// max and an fma (a split-by-split merge waits on an exp2 per split: ~0.4 us of a B=1 decode's tail at 16 splits).
// Splits that saw no token (st.x = -inf) weigh 0; a batch of them only leaves (m, l, o) as it was.
template <int kBatch>
__device__ __forceinline__ void merge_batch(float& m, float& l, float4& o, const float2 (&st)[kBatch],
                                            const float4 (&x)[kBatch]) {
  float mb = m;
#pragma unroll
  for (int j = 0; j < kBatch; ++j) mb = fmaxf(mb, st[j].x);
  if (mb == -INFINITY) return;
  const float a = exp2f(m - mb);  // 0 while m = -inf
  l *= a;
  o.x *= a, o.y *= a, o.z *= a, o.w *= a;
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const float c = exp2f(st[j].x - mb);
    l = fmaf(st[j].y, c, l);
    o.x = fmaf(x[j].x, c, o.x), o.y = fmaf(x[j].y, c, o.y), o.z = fmaf(x[j].z, c, o.z), o.w = fmaf(x[j].w, c, o.w);
  }
  m = mb;
}

// This split's ticket for its (sequence, head group): the counter's value before adding one, with acquire-release
// order at GPU scope. After a barrier, the release publishes the whole CTA's partial (the barrier puts the other
// threads' stores before thread 0's release); for the last split, the acquire and a barrier after it put every
// other split's partial before the combine's loads. A full __threadfence before the atomic and another after it
// did the same at two sequentially consistent fences' cost.
__device__ __forceinline__ int take_ticket(int32_t* counter) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  int32_t before;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  return before;
#else
  __threadfence();
  const int32_t before = atomicAdd(counter, 1);
  __threadfence();
  return before;
#endif
}

// Merge the warps' (m, l, acc) from shared memory: the final output, or this split's partial.
template <typename T, int D, int GT>
__device__ __forceinline__ void write_cta_result(const DecodeParams& p, unsigned char* smem, const CtaWork& w) {
  for (int idx = threadIdx.x; idx < w.valid_heads * D / 4; idx += kThreads) {
    const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
    float m, l;
    float4 o;
    merge_warps<D, GT>(smem, g, d, m, l, o);
    const int64_t row = static_cast<int64_t>(w.b) * p.num_heads + w.head0 + g;
    if (w.num_splits == 1) {
      const float r = l > 0.f ? 1.f / l : 0.f;  // l == 0 only for an empty context: write zeros
      Elem<T>::store4(static_cast<T*>(p.out) + row * D + d, make_float4(o.x * r, o.y * r, o.z * r, o.w * r));
    } else {
      const int64_t part = row * p.max_splits + w.split;
      *reinterpret_cast<float4*>(p.part_out + part * D + d) = o;
      if (d == 0) *reinterpret_cast<float2*>(p.part_stats + part * 2) = make_float2(m, l);
    }
  }
}

// Last CTA of a (sequence, head group): merge the splits' partials kBatch at a time (merge_batch), so that the
// stats and partial outputs of kBatch splits are in flight together (the tail of a B=1 decode waits on this).
template <typename T, int D>
__device__ void combine_splits(const DecodeParams& p, const CtaWork& w) {
  constexpr int kBatch = 16;
  for (int idx = threadIdx.x; idx < w.valid_heads * D / 4; idx += kThreads) {
    const int g = idx / (D / 4), d = (idx % (D / 4)) * 4;
    const int64_t row = static_cast<int64_t>(w.b) * p.num_heads + w.head0 + g;
    const float2* stats = reinterpret_cast<const float2*>(p.part_stats) + row * p.max_splits;
    const float4* src = reinterpret_cast<const float4*>(p.part_out + row * p.max_splits * D + d);
    float m = -INFINITY, l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < w.num_splits; s0 += kBatch) {
      float2 st[kBatch];
      float4 x[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {  // partials were just written: they are in L2 (__ldcg skips L1)
        const bool in = s0 + j < w.num_splits;
        st[j] = in ? __ldcg(stats + s0 + j) : make_float2(-INFINITY, 0.f);
        x[j] = in ? __ldcg(src + (s0 + j) * (D / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      merge_batch(m, l, o, st, x);
    }
    const float r = 1.f / l;
    Elem<T>::store4(static_cast<T*>(p.out) + row * D + d, make_float4(o.x * r, o.y * r, o.z * r, o.w * r));
  }
}

// After the warps' states are in shared memory (Reduce layout, behind a barrier): write this CTA's result, and
// if it is the last split of its (sequence, head group) to finish, combine all of them.
template <typename T, int D, int GT>
__device__ __forceinline__ void finish_cta(const DecodeParams& p, unsigned char* smem, const CtaWork& w) {
  __shared__ int is_last;
  write_cta_result<T, D, GT>(p, smem, w);
  if (w.num_splits == 1) {
    if (kTraceBuild && p.trace != nullptr) {  // (the point after every thread's stores)
      __syncthreads();
      if (threadIdx.x == 0) trace_point(p, kTraceTicket), trace_point(p, kTraceEnd);
    }
    return;
  }
  __syncthreads();  // every thread's partial stores come before thread 0's release (take_ticket)
  if (threadIdx.x == 0) {
    int32_t* counter = p.counters + blockIdx.z * gridDim.y + blockIdx.y;
    is_last = take_ticket(counter) == w.num_splits - 1;
    if (is_last) *counter = 0;  // every other split has taken its ticket: reset for the next launch
    trace_point(p, kTraceTicket);
    if (!is_last) trace_point(p, kTraceEnd);
  }
  __syncthreads();  // thread 0's acquire comes before every thread's loads of the other partials
  if (!is_last) return;
  combine_splits<T, D>(p, w);
  if (kTraceBuild && p.trace != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) trace_point(p, kTraceEnd), trace_flag(p, kTraceCombined);
  }
}

}  // namespace decode
}  // namespace hf_paged
