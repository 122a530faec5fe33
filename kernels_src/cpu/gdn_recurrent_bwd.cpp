// gdn_recurrent_bwd on the CPU: checkpointed replay, dS carried backwards (delta_recurrent.h).
#include "delta_recurrent.h"

DeltaBwdResult gdn_recurrent_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                   const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                                   const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
                                   const std::optional<at::Tensor>& grad_final_state) {
  return kda_kernels::cpu::recurrent_bwd_entry<false>("gdn_recurrent_bwd", q, k, v, g, beta, scale, initial_state,
                                                     cu_seqlens, grad_o, grad_final_state);
}
