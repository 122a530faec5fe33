// Core ops the CUDA backend implements (docs/ops.md); torch_binding.cpp registers them for the CUDA key.
// kda_chunk_fwd / gdn_chunk_fwd: tensor-core chunked forward (delta_chunk_fwd.cuh); kda_chunk_bwd / gdn_chunk_bwd:
// chunked backward (delta_chunk_bwd.cuh); *_stage: both in stages for context parallelism's relay. See docs/cuda.md.
#pragma once

#define KDA_BACKEND_OPS(X)                                                                              \
  X(kda_recurrent_fwd) X(kda_recurrent_bwd) X(kda_recurrent_serve) X(kda_chunk_fwd) X(kda_chunk_bwd)     \
  X(gdn_recurrent_fwd) X(gdn_recurrent_bwd) X(gdn_recurrent_serve) X(gdn_chunk_fwd) X(gdn_chunk_bwd)     \
  X(kda_chunk_fwd_stage) X(kda_chunk_bwd_stage) X(gdn_chunk_fwd_stage) X(gdn_chunk_bwd_stage)
