// Core ops the CUDA backend implements (docs/ops.md); torch_binding.cpp registers them for the CUDA key.
// The chunk ops run the recurrent kernels for now (same function, exact; no tensor-core chunked kernel yet):
// see docs/cuda.md.
#pragma once

#define KDA_BACKEND_OPS(X)                                                                              \
  X(kda_recurrent_fwd) X(kda_recurrent_bwd) X(kda_recurrent_serve) X(kda_chunk_fwd) X(kda_chunk_bwd)     \
  X(gdn_recurrent_fwd) X(gdn_recurrent_bwd) X(gdn_recurrent_serve) X(gdn_chunk_fwd) X(gdn_chunk_bwd)
