// Shared MSL helpers of the Metal delta-rule kernels (KDA: per-channel gate, GDN: per-head gate).
// Layouts (docs/ops.md): q, k [B,T,H,K]; v, o [B,T,HV,V]; g [B,T,HV,K] (KDA) or [B,T,HV] (GDN); beta [B,T,HV];
// states [N,HV,K,V] fp32. Tokens are addressed by their flat index t in [0, B*T).
#ifndef KDA_METAL_DELTA_COMMON_H
#define KDA_METAL_DELTA_COMMON_H

#include <metal_stdlib>

#include "delta_params.h"

using namespace metal;

// Token range [bos, eos) of sequence n: cu_seqlens[n] .. cu_seqlens[n+1] (varlen, B == 1) or n*T .. n*T + T.
inline void kda_seq_range(constant DeltaParams& params, device const long* cu_seqlens, int n, thread int& bos,
                          thread int& eos) {
  if (params.has_cu) {
    bos = int(cu_seqlens[n]);
    eos = int(cu_seqlens[n + 1]);
  } else {
    bos = n * params.T;
    eos = bos + params.T;
  }
}

// Decay factor exp(g) of token t, value head hv, key channel kk. KDA reads g[t, hv, kk]; GDN reads g[t, hv].
// precise::exp: the state is multiplied by this once per token, so fast-math exp's error would accumulate.
template <bool KDA>
inline float kda_decay(device const float* g, long t, int hv, int HV, int K, int kk) {
  return KDA ? precise::exp(g[(t * HV + hv) * K + kk]) : precise::exp(g[t * HV + hv]);
}

// log-decay g of token t at channel kk (0 beyond K, so padded channels stay finite)
template <bool KDA>
inline float kda_gate(device const float* g, long t, int hv, int HV, int K, int kk) {
  return KDA ? g[(t * HV + hv) * K + kk] : g[t * HV + hv];
}

#endif
