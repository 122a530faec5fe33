// kda_chunk_bwd on the CPU: the chunked WY forward reversed by hand, chunk by chunk (delta_chunk.h).
#include "delta_chunk.h"

DeltaBwdResult kda_chunk_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,
                               const std::optional<at::Tensor>& grad_final_state) {
  return kda_kernels::cpu::chunk_bwd_entry<true>("kda_chunk_bwd", q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                 grad_o, grad_final_state);
}
