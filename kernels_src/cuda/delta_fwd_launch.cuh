// Launcher of the recurrent forward kernel for one (gate kind, state layout, state dtype); explicitly
// instantiated per state dtype in delta_fwd_launch_{f32,bf16,f16}.cu.
#pragma once

#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

template <bool PC, bool VF, int CW, int KMAX, typename S>
void launch_fwd_one(const FwdParams& p, cudaStream_t st) {
  const int64_t warps = static_cast<int64_t>(p.N) * p.HV * p.slices;
  if (warps == 0) return;
  const int64_t blocks = (warps + kFwdWarps - 1) / kFwdWarps;
  delta_recurrent_fwd_kernel<PC, VF, CW, KMAX, S><<<static_cast<unsigned>(blocks), 32 * kFwdWarps, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool PC, bool VF, typename S>
void launch_fwd(FwdParams& p, int kmax, cudaStream_t st) {
  const int cw = choose_fwd_cw(p.N, p.HV, p.V, kmax, VF);
  p.slices = (p.V + cw - 1) / cw;
  if (kmax > 128) return launch_fwd_one<PC, VF, 4, 256, S>(p, st);
  if (cw == 16) return launch_fwd_one<PC, VF, 16, 128, S>(p, st);
  return launch_fwd_one<PC, VF, 4, 128, S>(p, st);
}

}  // namespace cuda
}  // namespace kda_kernels

#define KDA_INSTANTIATE_LAUNCH_FWD(S)                                                                      \
  namespace kda_kernels {                                                                                  \
  namespace cuda {                                                                                         \
  template void launch_fwd<true, false, S>(FwdParams&, int, cudaStream_t);                                \
  template void launch_fwd<true, true, S>(FwdParams&, int, cudaStream_t);                                 \
  template void launch_fwd<false, false, S>(FwdParams&, int, cudaStream_t);                               \
  template void launch_fwd<false, true, S>(FwdParams&, int, cudaStream_t);                                 \
  }                                                                                                        \
  }
