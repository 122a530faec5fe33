// kda_recurrent_serve on the CPU: in-place decode on a state pool (delta_recurrent.h, docs/ops.md).
#include "delta_recurrent.h"

at::Tensor kda_recurrent_serve(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, double scale, at::Tensor& state_pool,
                                 const at::Tensor& ssm_state_indices,
                                 const std::optional<at::Tensor>& num_accepted_tokens,
                                 const std::optional<at::Tensor>& cu_seqlens, bool state_v_first) {
  return kda_kernels::cpu::recurrent_serve_entry<true>("kda_recurrent_serve", q, k, v, g, beta, scale, state_pool,
                                                       ssm_state_indices, num_accepted_tokens, cu_seqlens,
                                                       state_v_first);
}
