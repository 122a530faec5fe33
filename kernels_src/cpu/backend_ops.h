// The core ops the CPU backend implements (torch-ext/torch_binding.cpp registers each for DispatchKey::CPU).
#pragma once

#define KDA_BACKEND_OPS(X)                                                                     \
  X(kda_chunk_fwd) X(kda_chunk_bwd) X(kda_recurrent_fwd) X(kda_recurrent_bwd) X(kda_recurrent_serve) \
  X(gdn_chunk_fwd) X(gdn_chunk_bwd) X(gdn_recurrent_fwd) X(gdn_recurrent_bwd) X(gdn_recurrent_serve)
