// The pipelined wgmma prefill kernel, and the selection of both wgmma kernels. Included from paged_prefill_wgmma.cuh.
//
// Inside a warpgroup the softmax overlaps the tensor cores (FA3's intra-warpgroup pipelining): iteration n issues
// S(n + 1) = Q K(n + 1)^T, then O += P(n) V(n), waits for S(n + 1) only and exponentiates it while P(n) V(n) runs,
// then waits for that too and rescales O by the new maxima. So K(n + 1) must be in shared memory one iteration before
// V(n + 1): K and V have two stages each, K a tile ahead (iteration n copies K(n + 2) into K(n)'s stage and V(n + 1)
// into V(n - 1)'s, both read by products that completed before the last barrier). The slot ring holds tiles n + 1
// (for V) and n + 2 (for K) during iteration n; tile n + 1's half then takes tile n + 3's. Registers: S(n + 1), P(n)
// and O are live together, as in the serial kernel at its P V.
#pragma once

namespace hf_paged {
namespace prefill_wgmma {

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1) paged_prefill_wgmma_pipelined_kernel(const PrefillParams p) {
  using T = typename C::T;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - smem_u32(smem_raw) % 1024u) % 1024u);  // see the serial kernel
  const uint32_t q_smem = smem_u32(smem);
  const uint32_t k_smem = q_smem + C::kKOffset, v_smem = q_smem + C::kVOffset;
  int* slots = reinterpret_cast<int*>(smem + C::kSlotsOffset);  // [2][kBlockN]: tile t's in half t & 1

  const CtaTiles ct = cta_tiles<C>(p);
  if (ct.m0 >= ct.q_len) return;
  const int n_first = ct.n_first, n_tiles = ct.n_tiles, n_end = ct.n_end;
  const prefill::CtaScale sc = prefill::cta_scale<C>(p, ct.kv_head);
  const int* table = p.block_tables + static_cast<int64_t>(ct.b) * p.table_stride;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head_off = static_cast<int64_t>(ct.kv_head) * C::D + C::fixed_col(tid);
  auto stage = [](uint32_t base, int t) { return base + (t & 1) * C::kTileBytes; };
  auto issue_k = [&](int t) { issue_cache_tile<C>(p, p.k_cache, head_off, slots + (t & 1) * C::kBlockN,
                                                  stage(k_smem, t), tid); };
  auto issue_v = [&](int t) { issue_cache_tile<C>(p, p.v_cache, head_off, slots + (t & 1) * C::kBlockN,
                                                  stage(v_smem, t), tid); };
  const bool slot_thread = tid < C::kBlockN;
  int next_blk = -1;  // a slot thread's block id of its row in the next tile whose slots it writes
  auto slots_of = [&](int t) {  // tile t's slots into half t & 1; the block of tile t + 1 looked up for the next call
    if (slot_thread) {
      const int tok = t * C::kBlockN + tid;
      slots[(t & 1) * C::kBlockN + tid] = prefill::slot_of(p, tok, next_blk);
      next_blk = prefill::block_of(p, table, tok + C::kBlockN, n_end);
    }
  };

  // Prologue: Q, K(n_first) and V(n_first), K(n_first + 1) in three commit groups; then S(n_first) and its softmax.
  issue_q_tile<C>(p, q_smem, ct.head, ct.q_start, ct.q_len, ct.m0, tid);
  if (slot_thread) next_blk = prefill::block_of(p, table, n_first * C::kBlockN + tid, n_end);
  slots_of(n_first);
  slots_of(n_first + 1);
  __syncthreads();
  issue_k(n_first);
  issue_v(n_first);
  cp_async_commit();
  if (n_first + 1 < n_tiles) issue_k(n_first + 1);
  cp_async_commit();
  cp_async_wait<1>();
  wgmma::fence_proxy_async();
  __syncthreads();  // Q, K(n_first) and V(n_first) visible to all; every copy of tile n_first issued
  slots_of(n_first + 2);  // into tile n_first's half

  float o[1][C::D / 8][4];
  prefill::RowState<C> st;
  start_rows<C>(o, st);
  const int warp_row0 = warp * C::kWarpRows;
  const uint32_t q_rows = q_smem + (warp >> 2) * 64 * 128;
  const int q_pos0 = ct.prefix + ct.m0 + warp_row0 + (lane >> 2);
  // Softcap and softmax of tile t's scores in s (masked where the tile crosses the diagonal or the window's edge);
  // true when O must be scaled by corrs.
  auto scores = [&](float (&s)[1][C::kBlockN / 8][4], int t, float (&corrs)[1][2]) {
    if (sc.softcap > 0.f) prefill::softcap_tile<C>(s, sc.softcap, softcap_exp_scale(sc.softcap_inv));
    if (t >= ct.first_masked || t < ct.window_masked_end)
      return prefill::softmax_scores<C, true>(s, st, sc.scale_log2, q_pos0, p.window, t * C::kBlockN, lane, corrs);
    return prefill::softmax_scores<C, false>(s, st, sc.scale_log2, q_pos0, p.window, t * C::kBlockN, lane, corrs);
  };

  // Every wgmma below is issued unconditionally (no tile count can make one optional): ptxas serializes all of a
  // kernel's wgmmas when their pipeline crosses a data-dependent branch. With no key tile at all (n_tiles <=
  // n_first: a context shorter than its new tokens), the products run over zero-filled tiles and O stays zero.
  float s[1][C::kBlockN / 8][4];
  uint32_t p_frag[C::kBlockN / 16][4];
  {
    qk_issue<C>(s, q_rows, stage(k_smem, n_first));
    wgmma::wait<0>();
    wgmma::fence_operands(flat(s));
    float corrs[1][2];
    scores(s, n_first, corrs);  // O is still zero: nothing to rescale
    pack_p<C>(p_frag, s);
  }
  __syncthreads();  // the slots of tile n_first + 2, read by the first iteration's copies

  for (int n = n_first; n + 1 < n_tiles; ++n) {
    if (n + 2 < n_tiles) issue_k(n + 2);
    issue_v(n + 1);
    cp_async_commit();
    cp_async_wait<1>();  // all but the newest group: K(n + 1) and V(n)
    wgmma::fence_proxy_async();
    __syncthreads();

    qk_issue<C>(s, q_rows, stage(k_smem, n + 1));
    pv_issue<C>(o, p_frag, stage(v_smem, n));
    wgmma::wait<1>();  // S(n + 1) done; P(n) V(n) may still run
    wgmma::fence_operands(flat(s));
    float corrs[1][2];
    const bool rescale = scores(s, n + 1, corrs);
    wgmma::wait<0>();
    wgmma::fence_operands(flat(o));
    if (rescale) prefill::rescale_o<C>(o, corrs);
    pack_p<C>(p_frag, s);
    slots_of(n + 3);  // tile n + 1's half: V(n + 1) was its last copy
    __syncthreads();  // every product of this iteration is done: the next one refills K(n + 1)'s and V(n)'s stages
  }
  // The last tile's P V (V(n_tiles - 1) is in the newest group at most).
  cp_async_wait<0>();
  wgmma::fence_proxy_async();
  __syncthreads();
  pv_issue<C>(o, p_frag, stage(v_smem, max(n_tiles - 1, n_first)));
  wgmma::wait<0>();
  wgmma::fence_operands(flat(o));
  __syncthreads();  // every warpgroup's products are done before the epilogue overwrites the Q tile
  prefill::store_output<C>(p, o, st, reinterpret_cast<T*>(smem), warp_row0, lane, ct.m0, ct.q_len, ct.q_start,
                           ct.head, sc.out_scale);
}

template <typename T, int D>
PrefillKernel make_kernel(bool pipelined) {
  using C = Traits<T, D>;
  const void* fn = pipelined ? reinterpret_cast<const void*>(&paged_prefill_wgmma_pipelined_kernel<C>)
                             : reinterpret_cast<const void*>(&paged_prefill_wgmma_serial_kernel<C>);
  return PrefillKernel{fn, C::kThreads, C::kBlockM, C::kSmemBytes};
}

// The kernel for head_dim among Ds (pipelined, or serial); fn == nullptr for other head sizes.
template <typename T, int... Ds>
PrefillKernel select_head_dim(int head_dim, bool pipelined) {
  PrefillKernel k{};
  ((head_dim == Ds ? (void)(k = make_kernel<T, Ds>(pipelined)) : (void)0), ...);
  return k;
}

}  // namespace prefill_wgmma
}  // namespace hf_paged
