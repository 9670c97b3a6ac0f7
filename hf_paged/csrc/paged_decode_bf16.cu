// The __nv_bfloat16 instantiations of the paged-decode kernel (one file per dtype so that ninja compiles them in parallel).
#include "paged_decode.cuh"

namespace hf_paged {

DecodeKernel decode_kernel_bf16(int head_dim, int group_tile) { return decode::select_kernel<__nv_bfloat16>(head_dim, group_tile); }

}  // namespace hf_paged
