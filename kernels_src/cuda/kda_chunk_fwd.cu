// kda_chunk_fwd (per-channel gate g [B, T, HV, K]): chunked forward on tensor cores, docs/ops.md.
// Kernels: delta_chunk_fwd.cuh; host: delta_chunk_fwd_host.cuh (K > 128 runs the recurrent kernel).
#include "delta_chunk_fwd_host.cuh"

DeltaFwdResult kda_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                              const std::optional<at::Tensor>& cu_seqlens) {
  return kda_kernels::cuda::chunk_fwd<true>("kda_chunk_fwd", q, k, v, g, beta, scale, initial_state, cu_seqlens);
}

// The same forward in two stages (prep, scan) for context parallelism's relay; see chunk_fwd_stage.
std::vector<at::Tensor> kda_chunk_fwd_stage(at::TensorList work, int64_t stage, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                           double scale, const std::optional<at::Tensor>& initial_state,
                                           const std::optional<at::Tensor>& cu_seqlens) {
  return kda_kernels::cuda::chunk_fwd_stage<true>("kda_chunk_fwd_stage", work, stage, q, k, v, g, beta, scale,
                                                 initial_state, cu_seqlens);
}
