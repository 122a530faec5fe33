// state_fwd on bf16 operands (KDA_CUDA_CHUNK_BWD_STATE_FWD=8 / 9 / 10; delta_chunk_bwd_state_fwd_bf16.cuh) in its own
// translation unit, as state_bwd3_bf16: kda_chunk_bwd.cu / gdn_chunk_bwd.cu call launch_state_fwd_bf16 (declared in
// delta_chunk_bwd_host.cuh) and do not compile the kernel, so their device code -- the default kernels -- is unchanged.
#include "delta_chunk_bwd_state_fwd_bf16.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

// mode: 8 (U bf16), 9 (U hi + lo), 10 (U and K Eend hi + lo); the host passes no other value
template <bool PC>
void launch_state_fwd_bf16(const chunk_bwd::Params& p, int mode, dim3 grid, cudaStream_t st) {
  namespace cb = chunk_bwd;
  auto go = [&](auto kern, size_t bytes) {
    allow_dynamic_smem(kern, bytes, /*max_carveout=*/true);  // two blocks per SM
    kern<<<grid, cb::kSf3Threads, bytes, st>>>(p);
  };
  if (mode == 10) go(cb::state_fwd_bf16_kernel<PC, true, true>, cb::StateFwdBf16Smem<true>::bytes);
  else if (mode == 9) go(cb::state_fwd_bf16_kernel<PC, true, false>, cb::StateFwdBf16Smem<true>::bytes);
  else go(cb::state_fwd_bf16_kernel<PC, false, false>, cb::StateFwdBf16Smem<false>::bytes);
}

template void launch_state_fwd_bf16<true>(const chunk_bwd::Params&, int, dim3, cudaStream_t);
template void launch_state_fwd_bf16<false>(const chunk_bwd::Params&, int, dim3, cudaStream_t);

}  // namespace cuda
}  // namespace kda_kernels
