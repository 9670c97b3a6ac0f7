// The float instantiations of the paged-decode kernel (one file per dtype so that ninja compiles them in parallel).
#include "paged_decode.cuh"

namespace hf_paged {

DecodeKernel decode_kernel_f32(int head_dim, int group_tile) { return decode::select_kernel<float>(head_dim, group_tile); }

}  // namespace hf_paged
