// kda_recurrent_bwd (per-channel gate g [B, T, HV, K]): checkpointed backward, docs/ops.md. Kernel: delta_recurrent_bwd.cuh.
// kda_chunk_bwd (the chunked backward) is in kda_chunk_bwd.cu.
#include "delta_host.cuh"

DeltaBwdResult kda_recurrent_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                                  const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
                                  const std::optional<at::Tensor>& grad_final_state) {
  return kda_kernels::cuda::recurrent_bwd<true>("kda_recurrent_bwd", q, k, v, g, beta, scale, initial_state,
                                                   cu_seqlens, grad_o, grad_final_state);
}
