// gdn_recurrent_fwd on the CPU: token-by-token forward (delta_recurrent.h).
#include "delta_recurrent.h"

DeltaFwdResult gdn_recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                                   const std::optional<at::Tensor>& cu_seqlens) {
  return kda_kernels::cpu::recurrent_fwd_entry<false>("gdn_recurrent_fwd", q, k, v, g, beta, scale, initial_state,
                                                     cu_seqlens);
}
