// gdn_recurrent_fwd (per-head gate g [B, T, HV]): token-by-token forward, docs/ops.md. Kernel: delta_recurrent_fwd.cuh.
#include "delta_host.cuh"

DeltaFwdResult gdn_recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                                  const std::optional<at::Tensor>& cu_seqlens) {
  return kda_kernels::cuda::recurrent_fwd<false>("gdn_recurrent_fwd", q, k, v, g, beta, scale, initial_state,
                                                   cu_seqlens);
}
