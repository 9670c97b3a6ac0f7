// The wgmma prefill's CTA bookkeeping and its serial kernel: each warpgroup waits for S = Q K^T, exponentiates it,
// then waits for O += P V (the pipelined kernel overlaps the two). Included from paged_prefill_wgmma.cuh.
#pragma once

namespace hf_paged {
namespace prefill_wgmma {

// What one CTA covers (grid: x = query tile, y = head, z = sequence). The same arithmetic as the prologue of
// prefill::paged_prefill_kernel, which keeps its own copy (and the SASS it was measured with) until this kernel is
// verified on a GPU; then that kernel should call this.
struct CtaTiles {
  int b, head, kv_head;
  int q_start, q_len, m0;  // query rows m0 .. m0 + kBlockM - 1 of the sequence's new tokens; none when m0 >= q_len
  int prefix;              // keys before the first new token
  int n_end;               // keys the tile's last row may see
  int n_first, n_tiles;    // the key tiles read: n_first .. n_tiles - 1
  int window_masked_end;   // tiles below it start before the last row's window: masked
  int first_masked;        // tiles from here on hold keys past the first row's diagonal: masked
};

template <class C>
__device__ __forceinline__ CtaTiles cta_tiles(const PrefillParams& p) {
  CtaTiles c;
  c.b = blockIdx.z, c.head = blockIdx.y, c.kv_head = c.head / p.group_size;
  c.q_start = p.cu_seqlens_q[c.b], c.q_len = p.cu_seqlens_q[c.b + 1] - c.q_start;
  c.m0 = (gridDim.x - 1 - blockIdx.x) * C::kBlockM;  // heaviest query tiles first: the grid's tail is short CTAs
  const int k_len = min(p.seq_lens_k[c.b], p.max_context);
  c.prefix = max(k_len - c.q_len, 0);
  c.n_end = min(k_len, c.prefix + c.m0 + C::kBlockM);
  c.n_tiles = (c.n_end + C::kBlockN - 1) / C::kBlockN;
  // Sliding window: row i sees keys from i - window + 1 on. Tiles before the first row's window are skipped, tiles
  // that start before the last row's window are masked (none of either without a window: kNoWindow is INT32_MAX).
  c.n_first = max(c.prefix + c.m0 - p.window + 1, 0) / C::kBlockN;
  const int last_pos = c.prefix + min(c.m0 + C::kBlockM, c.q_len) - 1;
  c.window_masked_end = last_pos >= p.window ? (last_pos - p.window) / C::kBlockN + 1 : 0;
  c.first_masked = (c.prefix + c.m0 + 1) / C::kBlockN;
  return c;
}

// O = 0, and the running max and sum of rows that have seen no key yet.
template <class C>
__device__ __forceinline__ void start_rows(float (&o)[1][C::D / 8][4], prefill::RowState<C>& st) {
#pragma unroll
  for (int dt = 0; dt < C::D / 8; ++dt) o[0][dt][0] = o[0][dt][1] = o[0][dt][2] = o[0][dt][3] = 0.f;
  st.m[0][0] = st.m[0][1] = -INFINITY;
  st.l[0][0] = st.l[0][1] = 0.f;
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) paged_prefill_wgmma_serial_kernel(const PrefillParams p) {
  using T = typename C::T;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The 128-byte swizzle repeats every 1024 bytes of shared-memory address: the tiles start on such a boundary.
  unsigned char* smem = smem_raw + ((1024u - smem_u32(smem_raw) % 1024u) % 1024u);
  const uint32_t q_smem = smem_u32(smem);
  const uint32_t k_smem = q_smem + C::kKOffset, v_smem = q_smem + C::kVOffset;
  int* slots = reinterpret_cast<int*>(smem + C::kSlotsOffset);  // [2][kBlockN]: tile n's in half n & 1

  const CtaTiles ct = cta_tiles<C>(p);
  if (ct.m0 >= ct.q_len) return;
  const int b = ct.b, head = ct.head, kv_head = ct.kv_head, q_start = ct.q_start, q_len = ct.q_len, m0 = ct.m0;
  const int prefix = ct.prefix, n_end = ct.n_end, n_first = ct.n_first, n_tiles = ct.n_tiles;
  const prefill::CtaScale sc = prefill::cta_scale<C>(p, kv_head);
  const int* table = p.block_tables + static_cast<int64_t>(b) * p.table_stride;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t head_off = static_cast<int64_t>(kv_head) * C::D + C::fixed_col(tid);
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
  start_rows<C>(o, st);
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
    qk_issue<C>(s, q_rows, k_smem + stage * C::kTileBytes);
    wgmma::wait<0>();
    wgmma::fence_operands(flat(s));
    if (sc.softcap > 0.f) prefill::softcap_tile<C>(s, sc.softcap, softcap_exp_scale(sc.softcap_inv));
    if (n >= ct.first_masked || n < ct.window_masked_end)
      prefill::softmax_tile<C, true>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    else
      prefill::softmax_tile<C, false>(s, o, st, sc.scale_log2, q_pos0, p.window, n * C::kBlockN, lane);
    uint32_t p_frag[C::kBlockN / 16][4];
    pack_p<C>(p_frag, s);
    pv_issue<C>(o, p_frag, v_smem + stage * C::kTileBytes);
    wgmma::wait<0>();
    wgmma::fence_operands(flat(o));
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

}  // namespace prefill_wgmma
}  // namespace hf_paged
