// gdn_recurrent_serve (per-head gate g [B, T, HV]): in-place decode / speculative decoding on a state pool
// (fp32, bf16 or fp16 storage, K-first or V-first), docs/ops.md. Kernel: delta_recurrent_fwd.cuh.
#include "delta_host.cuh"

at::Tensor gdn_recurrent_serve(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, double scale, at::Tensor& state_pool,
                                const at::Tensor& ssm_state_indices, const std::optional<at::Tensor>& num_accepted_tokens,
                                const std::optional<at::Tensor>& cu_seqlens, bool state_v_first) {
  return kda_kernels::cuda::recurrent_serve<false>("gdn_recurrent_serve", q, k, v, g, beta, scale, state_pool,
                                                     ssm_state_indices, num_accepted_tokens, cu_seqlens, state_v_first);
}
