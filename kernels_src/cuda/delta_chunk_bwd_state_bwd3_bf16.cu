// state_bwd3 with bf16 operands (KDA_CUDA_CHUNK_BWD_STATE_BWD=10; delta_chunk_bwd_state_bwd3_bf16.cuh) in its own
// translation unit: kda_chunk_bwd.cu / gdn_chunk_bwd.cu call launch_state_bwd3_bf16 (declared in
// delta_chunk_bwd_host.cuh) and do not compile the kernel, so their device code -- the default kernels -- is
// unchanged (ptxas scheduled two of their kernels slightly differently when these instances shared the module).
// (=9, the variant with 4-byte fragment reads, was retired in session 12.)
#include "delta_chunk_bwd_state_bwd3_bf16.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

template <bool PC>
void launch_state_bwd3_bf16(const chunk_bwd::Params& p, dim3 grid, cudaStream_t st) {
  namespace cb = chunk_bwd;
  constexpr size_t bytes = cb::kStateBwd3Bf16Smem;
  // (the chunked backward checks the device for kGradSmem per block before its first stage)
  static_assert(bytes <= cb::kGradSmem, "state_bwd3_bf16 exceeds kGradSmem");
  auto kern = cb::state_bwd3_bf16_kernel<PC>;
  allow_dynamic_smem(kern, bytes);
  kern<<<grid, cb::kSb3Threads, bytes, st>>>(p);
}

template void launch_state_bwd3_bf16<true>(const chunk_bwd::Params&, dim3, cudaStream_t);
template void launch_state_bwd3_bf16<false>(const chunk_bwd::Params&, dim3, cudaStream_t);

}  // namespace cuda
}  // namespace kda_kernels
