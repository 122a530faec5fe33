// One declaration per core op, shared by every compiled backend (cpu, cuda, metal).
// Each backend's sources define these functions; torch_binding.cpp registers them for that backend's
// dispatch key. Schemas and semantics: docs/ops.md. Inputs arrive validated and contiguous.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>  // at::Tensor only: ATen/ATen.h costs ~20 s of compile per file

using DeltaFwdResult = std::tuple<at::Tensor, at::Tensor>;  // (o, final_state)
using DeltaBwdResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // dq dk dv dg dbeta dh0

#define KDA_DECLARE_FAMILY(family)                                                                   \
  DeltaFwdResult family##_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,   \
                                    const at::Tensor& g, const at::Tensor& beta, double scale,       \
                                    const std::optional<at::Tensor>& initial_state,                  \
                                    const std::optional<at::Tensor>& cu_seqlens);                    \
  DeltaBwdResult family##_chunk_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,   \
                                    const at::Tensor& g, const at::Tensor& beta, double scale,       \
                                    const std::optional<at::Tensor>& initial_state,                  \
                                    const std::optional<at::Tensor>& cu_seqlens,                     \
                                    const at::Tensor& grad_o,                                        \
                                    const std::optional<at::Tensor>& grad_final_state);              \
  DeltaFwdResult family##_recurrent_fwd(const at::Tensor& q, const at::Tensor& k,                    \
                                        const at::Tensor& v, const at::Tensor& g,                    \
                                        const at::Tensor& beta, double scale,                        \
                                        const std::optional<at::Tensor>& initial_state,              \
                                        const std::optional<at::Tensor>& cu_seqlens);                \
  DeltaBwdResult family##_recurrent_bwd(const at::Tensor& q, const at::Tensor& k,                    \
                                        const at::Tensor& v, const at::Tensor& g,                    \
                                        const at::Tensor& beta, double scale,                        \
                                        const std::optional<at::Tensor>& initial_state,              \
                                        const std::optional<at::Tensor>& cu_seqlens,                 \
                                        const at::Tensor& grad_o,                                    \
                                        const std::optional<at::Tensor>& grad_final_state);          \
  at::Tensor family##_recurrent_serve(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, \
                                      const at::Tensor& g, const at::Tensor& beta, double scale,     \
                                      at::Tensor& state_pool, const at::Tensor& ssm_state_indices,   \
                                      const std::optional<at::Tensor>& num_accepted_tokens,          \
                                      const std::optional<at::Tensor>& cu_seqlens,                   \
                                      bool state_v_first);

KDA_DECLARE_FAMILY(kda)
KDA_DECLARE_FAMILY(gdn)

// Optional staged forms of the chunked ops (context parallelism's relay, docs/context_parallel.md): the same
// kernels as family_chunk_fwd / family_chunk_bwd, launched in stages that return and take back their work
// tensors. Only backends that list them in backend_ops.h define them (CUDA).
#define KDA_DECLARE_STAGES(family)                                                                            \
  std::vector<at::Tensor> family##_chunk_fwd_stage(                                                           \
      at::TensorList work, int64_t stage, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,      \
      const at::Tensor& g, const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state, \
      const std::optional<at::Tensor>& cu_seqlens);                                                           \
  std::vector<at::Tensor> family##_chunk_bwd_stage(                                                           \
      at::TensorList work, int64_t stage, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,      \
      const at::Tensor& g, const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state, \
      const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,                                  \
      const std::optional<at::Tensor>& grad_final_state);

KDA_DECLARE_STAGES(kda)
KDA_DECLARE_STAGES(gdn)
