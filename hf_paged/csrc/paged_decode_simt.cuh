// Paged decode on CUDA cores (the float32 path; fp16/bf16 use the tensor-core kernel, paged_decode_mma.cuh).
//
// Grid (split, kv_head * head_groups + head_group, sequence); 128 threads. One CTA reads one kv head's K/V over
// one split of the context, once, for all the query heads that share that kv head (GQA). A lane group of
// `kLanesPerToken` lanes owns one token at a time; each lane holds `kDimsPerLane` dims of q and of the output
// accumulator for every head of the group, so the scores need only a short butterfly across the lane group. K/V
// rows stream through a per-lane cp.async ring in shared memory (`kStages` deep): the ring is private to each
// lane, so the main loop needs no barrier. The epilogue and the split-K combine are in decode_common.cuh.
//
// Head sizes that are not a power of two (80, 96, 112, 160, 192) run padded to the next one (`kPadded`): the lanes
// are laid out for the padded row, and the 16-byte vectors past D are zero-filled copies and zero q, so they add
// nothing to a score and are never stored. Costs idle lanes on a path that serves tests and float32 models.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "decode_common.cuh"

namespace hf_paged {
namespace decode {

constexpr int kStages = 3;
// Scores are in log2 units. The running max only moves (rescaling the accumulators) when a score beats it by
// more than this, so most tokens skip the rescale; exp2 of at most 2^8 cannot overflow fp32 sums.
constexpr float kRescaleThreshold = 8.0f;

__host__ __device__ constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

template <typename T, int D, int GT>
struct Config {
  static constexpr int kVec = Elem<T>::kVec;
  static constexpr int kPadded = next_pow2(D);  // the row the lanes are laid out for; dims >= D are zeros
  // q and the accumulator take 2 * GT * kDimsPerLane registers: keep that near 128.
  static constexpr int kDimsPerLane = cmax(kVec, cmin(kPadded / 2, 64 / GT));
  static constexpr int kLanesPerToken = kPadded / kDimsPerLane;
  static constexpr int kVecsPerLane = kDimsPerLane / kVec;
  static constexpr int kGroupsPerWarp = 32 / kLanesPerToken;
  static constexpr int kGroups = kWarps * kGroupsPerWarp;
  // Tokens per lane group per stage: ~64 bytes of K+V per lane, and at most 16 scores held at once.
  static constexpr int kUnroll = cmax(1, cmin(4 / kVecsPerLane, 16 / GT));
  static constexpr int kTile = kGroups * kUnroll;
  // Partial-output traffic per split is ~2*GT*D*4 bytes against split*2*D*sizeof(T) of KV: keep it near 3%.
  static constexpr int kMinSplit = cmax(kTile, cmin(512, 64 * GT));
  static constexpr int kStageVecs = kUnroll * 2 * kVecsPerLane;  // 16-byte vectors per lane per stage
  static constexpr int kPipeBytes = kStages * kStageVecs * 16 * kThreads;
  static constexpr int kSmemBytes = cmax(kPipeBytes, Reduce<D, GT>::kBytes);
  static_assert(kDimsPerLane % kVec == 0, "a lane owns whole 16-byte vectors");
  static_assert(kLanesPerToken <= 32 && (kLanesPerToken & (kLanesPerToken - 1)) == 0, "lane groups tile a warp");
  static_assert(kMinSplit % kTile == 0, "splits are whole tiles");
  static_assert(D % kVec == 0, "a 16-byte vector lies wholly inside or wholly past D");
  // Whether vector v of lane `sub` holds dims below D (always, when D is a power of two).
  __device__ static bool in_row(int sub, int v) {
    if constexpr (D == kPadded) return true;
    return (sub + v * kLanesPerToken) * kVec < D;
  }
};

// Per-lane softmax state for GT heads over the tokens this lane group has seen.
template <int GT, int DL>
struct State {
  float m[GT];       // running max (log2 units), -inf before the first token
  float l[GT];       // sum of exp2(score - m)
  float acc[GT][DL]; // sum of exp2(score - m) * v over this lane's dims
};

// Issue the cp.async copies of one stage: kUnroll tokens per lane group, K and V, this lane's vectors.
template <typename T, int D, int GT>
__device__ __forceinline__ void issue_stage(const DecodeParams& p, uint32_t ring, int stage, int t_first, int t_end,
                                            int blk_first, const int* table, int kvh, int group, int sub) {
  using C = Config<T, D, GT>;
  const T* k_base = static_cast<const T*>(p.k_cache);
  const T* v_base = static_cast<const T*>(p.v_cache);
#pragma unroll
  for (int u = 0; u < C::kUnroll; ++u) {
    const int t = t_first + u * C::kGroups + group;
    const bool valid = t < t_end;
    int64_t row = 0;
    if (valid) {
      const int blk = block_of(t, p);
      const int64_t phys = table[blk - blk_first];
      row = ((phys * p.block_size + (t - blk * p.block_size)) * p.num_kv_heads + kvh) * D + sub * C::kVec;
    }
#pragma unroll
    for (int v = 0; v < C::kVecsPerLane; ++v) {
      const int64_t off = row + v * C::kLanesPerToken * C::kVec;
      const uint32_t dst = ring + ((stage * C::kUnroll + u) * 2 * C::kVecsPerLane + v) * 16 * kThreads;
      const bool in = valid && C::in_row(sub, v);
      cp_async16(dst, in ? k_base + off : k_base, in);
      cp_async16(dst + C::kVecsPerLane * 16 * kThreads, in ? v_base + off : v_base, in);
    }
  }
}

// Scores of kUnroll tokens for GT heads, reduced across the lane group (every lane ends with the full dot), in
// log2 units; softcapped when cap > 0 (cap and inv_cap in log2 units too; tanhf: this path serves float32).
template <typename T, int D, int GT>
__device__ __forceinline__ void stage_scores(const unsigned char* ring, int stage, const float (&q)[GT][Config<T, D, GT>::kDimsPerLane],
                                             float cap, float inv_cap, float (&s)[Config<T, D, GT>::kUnroll][GT]) {
  using C = Config<T, D, GT>;
#pragma unroll
  for (int u = 0; u < C::kUnroll; ++u) {
#pragma unroll
    for (int g = 0; g < GT; ++g) s[u][g] = 0.f;
#pragma unroll
    for (int v = 0; v < C::kVecsPerLane; ++v) {
      const int slot = ((stage * C::kUnroll + u) * 2 * C::kVecsPerLane + v) * kThreads + threadIdx.x;
      float k[C::kVec];
      Elem<T>::unpack(reinterpret_cast<const uint4*>(ring)[slot], k);
#pragma unroll
      for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int e = 0; e < C::kVec; ++e) s[u][g] = fmaf(q[g][v * C::kVec + e], k[e], s[u][g]);
    }
#pragma unroll
    for (int g = 0; g < GT; ++g)
#pragma unroll
      for (int off = C::kLanesPerToken / 2; off > 0; off /= 2) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], off);
    if (cap > 0.f) {
#pragma unroll
      for (int g = 0; g < GT; ++g) s[u][g] = cap * tanhf(s[u][g] * inv_cap);
    }
  }
}

// Fold kUnroll scored tokens into the softmax state and accumulate their V rows.
template <typename T, int D, int GT>
__device__ __forceinline__ void stage_accumulate(const unsigned char* ring, int stage, const bool (&valid)[Config<T, D, GT>::kUnroll],
                                                 const float (&s)[Config<T, D, GT>::kUnroll][GT],
                                                 State<GT, Config<T, D, GT>::kDimsPerLane>& st) {
  using C = Config<T, D, GT>;
  float pr[C::kUnroll][GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) mx = valid[u] ? fmaxf(mx, s[u][g]) : mx;
    if (mx > st.m[g] + kRescaleThreshold) {
      const float alpha = exp2f(st.m[g] - mx);  // 0 on the first token (m = -inf)
      st.l[g] *= alpha;
#pragma unroll
      for (int d = 0; d < C::kDimsPerLane; ++d) st.acc[g][d] *= alpha;
      st.m[g] = mx;
    }
#pragma unroll
    for (int u = 0; u < C::kUnroll; ++u) {
      pr[u][g] = valid[u] ? exp2f(s[u][g] - st.m[g]) : 0.f;
      st.l[g] += pr[u][g];
    }
  }
#pragma unroll
  for (int u = 0; u < C::kUnroll; ++u) {
#pragma unroll
    for (int v = 0; v < C::kVecsPerLane; ++v) {
      const int slot = (((stage * C::kUnroll + u) * 2 + 1) * C::kVecsPerLane + v) * kThreads + threadIdx.x;
      float x[C::kVec];
      Elem<T>::unpack(reinterpret_cast<const uint4*>(ring)[slot], x);
#pragma unroll
      for (int g = 0; g < GT; ++g)
#pragma unroll
        for (int e = 0; e < C::kVec; ++e) st.acc[g][v * C::kVec + e] = fmaf(pr[u][g], x[e], st.acc[g][v * C::kVec + e]);
    }
  }
}

}  // namespace decode
}  // namespace hf_paged

#include "paged_decode_simt_kernel.cuh"
