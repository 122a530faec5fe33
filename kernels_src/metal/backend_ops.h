// Core ops (docs/ops.md) the Metal backend implements for the MPS dispatch key (torch-ext/torch_binding.cpp).
// Ops not listed (kda_recurrent_serve, gdn_recurrent_serve) use the pure-PyTorch fallback.
// {kda,gdn}_chunk_bwd currently run the recurrent backward kernels (exact gradients; see docs/metal.md).
#pragma once

#define KDA_BACKEND_OPS(X) \
  X(kda_recurrent_fwd)     \
  X(kda_recurrent_bwd)     \
  X(kda_chunk_fwd)         \
  X(kda_chunk_bwd)         \
  X(gdn_recurrent_fwd)     \
  X(gdn_recurrent_bwd)     \
  X(gdn_chunk_fwd)         \
  X(gdn_chunk_bwd)
