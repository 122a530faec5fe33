// Core ops the CUDA backend implements (docs/ops.md); torch_binding.cpp registers them for the CUDA key.
// kda_chunk_fwd / gdn_chunk_fwd run the tensor-core chunked forward (delta_chunk_fwd.cuh); the chunk_bwd ops run
// the recurrent backward for now (same function, exact): see docs/cuda.md.
#pragma once

#define KDA_BACKEND_OPS(X)                                                                              \
  X(kda_recurrent_fwd) X(kda_recurrent_bwd) X(kda_recurrent_serve) X(kda_chunk_fwd) X(kda_chunk_bwd)     \
  X(gdn_recurrent_fwd) X(gdn_recurrent_bwd) X(gdn_recurrent_serve) X(gdn_chunk_fwd) X(gdn_chunk_bwd)
