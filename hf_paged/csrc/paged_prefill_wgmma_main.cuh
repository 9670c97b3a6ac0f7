// The wgmma prefill kernel's body and its per-head-size selection. Included from paged_prefill_wgmma.cuh.
#pragma once

namespace hf_paged {
namespace prefill_wgmma {

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1) paged_prefill_wgmma_kernel(const PrefillParams p) {
  using T = typename C::T;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes of shared-memory address: the tiles start on such a boundary.
  unsigned char* smem = smem_raw + ((1024u - smem_u32(smem_raw) % 1024u) % 1024u);
  const uint32_t q_smem = smem_u32(smem);
  const uint32_t k_smem = q_smem + C::kKOffset, v_smem = q_smem + C::kVOffset;
  int* slots = reinterpret_cast<int*>(smem + C::kSlotsOffset);  // [2][kBlockN]: tile n's in half n & 1

  // Which query rows and key tiles this CTA covers: as in prefill::paged_prefill_kernel.
  const int b = blockIdx.z, head = blockIdx.y;
  const int q_start = p.cu_seqlens_q[b], q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * C::kBlockM;  // heaviest query tiles first
  if (m0 >= q_len) return;
  const int k_len = min(p.seq_lens_k[b], p.max_context);
  const int prefix = max(k_len - q_len, 0);
  const int n_end = min(k_len, prefix + m0 + C::kBlockM);  // keys the tile's last row may see
  const int n_tiles = (n_end + C::kBlockN - 1) / C::kBlockN;
  const int n_first = max(prefix + m0 - p.window + 1, 0) / C::kBlockN;
  const int last_pos = prefix + min(m0 + C::kBlockM, q_len) - 1;
  const int window_masked_end = last_pos >= p.window ? (last_pos - p.window) / C::kBlockN + 1 : 0;
  const int first_masked = (prefix + m0 + 1) / C::kBlockN;  // tiles from here on cross the diagonal
  const int kv_head = head / p.group_size;
  const prefill::CtaScale sc = prefill::cta_scale<C>(p, kv_head);
  const int* table = p.block_tables + static_cast<int64_t>(b) * p.table_stride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head_off = static_cast<int64_t>(kv_head) * C::D + tid % C::kChunks * 8;
  auto issue_tile = [&](int stage) {
    prefill::issue_kv_tile<C>(p, head_off, slots + stage * C::kBlockN, k_smem + stage * C::kTileBytes,
                              v_smem + stage * C::kTileBytes, tid);
  };

  issue_q_tile<C>(p, q_smem, head, q_start, q_len, m0, tid);
  const bool slot_thread = tid < C::kBlockN;
  const int first_stage = n_first & 1;
  int next_blk = -1;
  if (slot_thread) {
    const int tok = n_first * C::kBlockN + tid;
    slots[first_stage * C::kBlockN + tid] = prefill::slot_of(p, tok, prefill::block_of(p, table, tok, n_end));
    const int tok1 = tok + C::kBlockN;
    slots[(first_stage ^ 1) * C::kBlockN + tid] = prefill::slot_of(p, tok1, prefill::block_of(p, table, tok1, n_end));
    next_blk = prefill::block_of(p, table, tok + 2 * C::kBlockN, n_end);
  }
  __syncthreads();
  issue_tile(first_stage);
  cp_async_commit();

  float o[1][C::D / 8][4];
  prefill::RowState<C> st;
#pragma unroll
  for (int dt = 0; dt < C::D / 8; ++dt) o[0][dt][0] = o[0][dt][1] = o[0][dt][2] = o[0][dt][3] = 0.f;
  st.m[0][0] = st.m[0][1] = -INFINITY;
  st.l[0][0] = st.l[0][1] = 0.f;
  const int warp_row0 = warp * C::kWarpRows;                      // warpgroup w's warp i: rows 64w + 16i ..
  const uint32_t q_rows = q_smem + (warp >> 2) * 64 * 128;         // its warpgroup's first row, panel 0
  const int q_pos0 = prefix + m0 + warp_row0 + (lane >> 2);       // absolute position of this thread's first row

  for (int n = n_first; n < n_tiles; ++n) {
    const int stage = n & 1;
    if (n + 1 < n_tiles) issue_tile(stage ^ 1);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning "tile n" (and Q)
    cp_async_wait<1>();
    wgmma::fence_proxy_async();  // this thread's cp.async writes, next read by the tensor cores
    __syncthreads();

    float s[1][C::kBlockN / 8][4];
    qk_tile<C>(s, q_rows, k_smem + stage * C::kTileBytes);
    if (sc.softcap > 0.f) prefill::softcap_tile<C>(s, sc.softcap, softcap_exp_scale(sc.softcap_inv));
    if (n >= first_masked || n < window_masked_end)
      prefill::softmax_tile<C, true>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    else
      prefill::softmax_tile<C, false>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    pv_tile<C>(o, s, v_smem + stage * C::kTileBytes);
    // Tile n's slots were used when it was issued; this half now takes tile n + 2's.
    if (slot_thread) {
      const int tok = (n + 2) * C::kBlockN + tid;
      slots[stage * C::kBlockN + tid] = prefill::slot_of(p, tok, next_blk);
      next_blk = prefill::block_of(p, table, tok + C::kBlockN, n_end);
    }
    __syncthreads();  // the next iteration refills this stage (and reads the slots just written)
  }
  // The epilogue stages O in the Q tile: no copy into it may still be in flight (a CTA with no key tile to read).
  cp_async_wait<0>();
  __syncthreads();
  prefill::store_output<C>(p, o, st, reinterpret_cast<T*>(smem), warp_row0, lane, m0, q_len, q_start, head,
                           sc.out_scale);
}

template <typename T, int D>
PrefillKernel make_kernel() {
  using C = Traits<T, D>;
  return PrefillKernel{reinterpret_cast<const void*>(&paged_prefill_wgmma_kernel<C>), C::kThreads, C::kBlockM,
                       C::kSmemBytes};
}

// The kernel for head_dim among Ds; fn == nullptr otherwise.
template <typename T, int... Ds>
PrefillKernel select_head_dim(int head_dim) {
  PrefillKernel k{};
  ((head_dim == Ds ? (void)(k = make_kernel<T, Ds>()) : (void)0), ...);
  return k;
}

}  // namespace prefill_wgmma
}  // namespace hf_paged
