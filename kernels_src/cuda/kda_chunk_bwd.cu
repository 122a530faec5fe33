// kda_chunk_bwd (per-channel gate g [B, T, HV, K]): chunked (WY) backward, docs/ops.md.
// Kernels: delta_chunk_bwd.cuh; host side: delta_chunk_bwd_host.cuh.
#include "delta_chunk_bwd_host.cuh"

DeltaBwdResult kda_chunk_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                              const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
                              const std::optional<at::Tensor>& grad_final_state) {
  return kda_kernels::cuda::chunk_bwd_run<true>("kda_chunk_bwd", q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                grad_o, grad_final_state);
}

// The same backward in stages (prep, state_fwd, state_bwd, grad) for context parallelism's relay; see chunk_bwd_stage.
std::vector<at::Tensor> kda_chunk_bwd_stage(at::TensorList work, int64_t stage, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                           double scale, const std::optional<at::Tensor>& initial_state,
                                           const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
                                           const std::optional<at::Tensor>& grad_final_state) {
  return kda_kernels::cuda::chunk_bwd_stage<true>("kda_chunk_bwd_stage", work, stage, q, k, v, g, beta, scale,
                                                 initial_state, cu_seqlens, grad_o, grad_final_state);
}
