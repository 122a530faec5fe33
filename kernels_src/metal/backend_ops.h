// Core ops (docs/ops.md) the Metal backend implements for the MPS dispatch key (torch-ext/torch_binding.cpp).
// Every core op is listed; {kda,gdn}_chunk_{fwd,bwd} fall back to the recurrent kernels for shapes the chunked
// kernels do not take (K % 8 != 0, K > 128, V % 8 != 0; see delta_plan.h and docs/metal.md).
#pragma once

#define KDA_BACKEND_OPS(X) \
  X(kda_recurrent_fwd)     \
  X(kda_recurrent_bwd)     \
  X(kda_chunk_fwd)         \
  X(kda_chunk_bwd)         \
  X(gdn_recurrent_fwd)     \
  X(gdn_recurrent_bwd)     \
  X(gdn_chunk_fwd)         \
  X(gdn_chunk_bwd)         \
  X(kda_recurrent_serve)   \
  X(gdn_recurrent_serve)
