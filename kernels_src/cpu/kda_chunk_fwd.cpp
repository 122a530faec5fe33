// kda_chunk_fwd on the CPU: chunked WY forward with exact sub-chunk decays (delta_chunk.h).
#include "delta_chunk.h"

DeltaFwdResult kda_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                               const std::optional<at::Tensor>& cu_seqlens) {
  return kda_kernels::cpu::chunk_fwd_entry<true>("kda_chunk_fwd", q, k, v, g, beta, scale, initial_state, cu_seqlens);
}
