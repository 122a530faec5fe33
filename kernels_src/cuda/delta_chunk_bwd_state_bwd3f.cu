// state_bwd3f (KDA_CUDA_CHUNK_BWD_STATE_BWD=11 / 12; state_bwd3f_kernel in delta_chunk_bwd_state_bwd3.cuh) in its
// own translation unit, as state_bwd3_bf16: kda_chunk_bwd.cu / gdn_chunk_bwd.cu call launch_state_bwd3f (declared
// in delta_chunk_bwd_host.cuh) and do not compile the kernel, so their device code is main's (in one module,
// ptxas scheduled GDN's fp32 grad3_wy2 differently).
#include "delta_chunk_bwd_state_bwd3.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

template <bool PC>
void launch_state_bwd3f(const chunk_bwd::Params& p, dim3 grid, cudaStream_t st, bool rowp) {
  namespace cb = chunk_bwd;
  constexpr size_t bytes = cb::kStateBwd3fSmem;
  // (the chunked backward checks the device for kGradSmem per block before its first stage)
  static_assert(bytes <= cb::kGradSmem, "state_bwd3f exceeds kGradSmem");
  auto kern = rowp ? cb::state_bwd3f_kernel<PC, true> : cb::state_bwd3f_kernel<PC, false>;
  allow_dynamic_smem(kern, bytes);
  kern<<<grid, cb::kSb3Threads, bytes, st>>>(p);
}

template void launch_state_bwd3f<true>(const chunk_bwd::Params&, dim3, cudaStream_t, bool);
template void launch_state_bwd3f<false>(const chunk_bwd::Params&, dim3, cudaStream_t, bool);

}  // namespace cuda
}  // namespace kda_kernels
