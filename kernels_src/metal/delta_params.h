// Launch parameters and launch geometry shared by the Metal kernels (MSL) and their hosts (C++/Objective-C++:
// delta_plan.h, delta_ops.mm, and the CPU emulation harness in tests/metal_emu). Plain C-compatible layout:
// only 32-bit ints and floats, so MSL and C++ agree on every offset.
#ifndef KDA_METAL_DELTA_PARAMS_H
#define KDA_METAL_DELTA_PARAMS_H

// Recurrent kernels: one 32-lane simdgroup per value row, KDA_REC_ROWS rows per threadgroup.
#define KDA_REC_ROWS 4
// Largest key dim of the recurrent kernels: each lane holds K/32 <= KDA_REC_MAX_NK state floats per row.
#define KDA_REC_MAX_NK 8
#define KDA_REC_MAX_K (32 * KDA_REC_MAX_NK)
// Chunked kernels: 16-token chunks, KDA_CHUNK_NSG simdgroups per threadgroup, each owning 8 value columns.
#define KDA_CHUNK 16
#define KDA_CHUNK_NSG 4
#define KDA_CHUNK_VB (8 * KDA_CHUNK_NSG)
#define KDA_CHUNK_MAX_K 128
// Elementwise kernels (cast): threads per threadgroup.
#define KDA_CAST_TG 256

struct DeltaParams {
  int B;        // batch (1 with cu_seqlens)
  int T;        // tokens per batch row
  int H;        // q/k heads
  int HV;       // value heads (multiple of H)
  int K;        // key dim
  int V;        // value dim
  int N;        // sequences (B, or len(cu_seqlens) - 1)
  int has_h0;   // initial_state given
  int has_cu;   // cu_seqlens given
  int has_dht;  // grad_final_state given (backward)
  int seg;      // checkpoint segment: tokens (recurrent backward) or 16-token chunks (chunked backward)
  int nslots;   // checkpoint slots per value head (backward)
  int count;    // element count (cast kernels)
  int state_v_first;  // serve: pool rows are [HV, V, K]
  int idx_cols;       // serve: 0 = ssm_state_indices is [N]; else its row length (Tmax)
  int has_nat;        // serve: num_accepted_tokens given
  float scale;  // output scale
  int pad0;
};

#endif
