// Recurrent (token-by-token) forward of the gated delta rule, KDA and GDN, fp32/fp16/bf16 inputs, fp32 state.
// One 32-lane simdgroup per value row v of one (sequence, value head): lane l holds the state column
// S[k, v] for k = l, l + 32, ... (K/32 floats in registers). Per token, two simd_sum reductions:
//   pred = (Diag(e^g) S)^T k,  S <- Diag(e^g) S + beta k (v - pred)^T,  o = scale S^T q.
// Grid: (ceil(V / KDA_REC_ROWS), HV, N) threadgroups of KDA_REC_ROWS simdgroups.
#include "delta_common.h"

template <typename T, bool KDA>
inline void recurrent_fwd_body(device const T* q, device const T* k, device const T* v, device const float* g,
                               device const float* beta, device const float* initial_state,
                               device const long* cu_seqlens, device T* o, device float* final_state,
                               constant DeltaParams& params, uint3 tgp, uint sg, uint lane) {
  const int row = int(tgp.x) * KDA_REC_ROWS + int(sg);
  if (row >= params.V) return;  // the whole simdgroup leaves; this kernel has no threadgroup barrier
  const int hv = int(tgp.y), n = int(tgp.z);
  const int K = params.K, V = params.V, HV = params.HV, H = params.H;
  const int h = hv / (HV / H);
  int bos, eos;
  kda_seq_range(params, cu_seqlens, n, bos, eos);

  const long sbase = (long(n) * HV + hv) * K * V + row;  // S[k, row] at sbase + k * V
  float s[KDA_REC_MAX_NK];
  for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
    const int kk = j * 32 + int(lane);
    s[j] = (kk < K && params.has_h0) ? initial_state[sbase + long(kk) * V] : 0.0f;
  }
  for (int t = bos; t < eos; ++t) {
    const long qk = (long(t) * H + h) * K;
    const long tv = long(t) * HV + hv;
    float kr[KDA_REC_MAX_NK], qr[KDA_REC_MAX_NK];
    float pred = 0.0f;
    for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
      const int kk = j * 32 + int(lane);
      kr[j] = 0.0f;
      qr[j] = 0.0f;
      if (kk < K) {
        s[j] *= kda_decay<KDA>(g, t, hv, HV, K, kk);
        kr[j] = float(k[qk + kk]);
        qr[j] = float(q[qk + kk]);
        pred += s[j] * kr[j];
      }
    }
    pred = simd_sum(pred);
    const float delta = beta[tv] * (float(v[tv * V + row]) - pred);
    float out = 0.0f;
    for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
      s[j] += kr[j] * delta;
      out += s[j] * qr[j];
    }
    out = simd_sum(out);
    if (lane == 0) o[tv * V + row] = T(out * params.scale);
  }
  for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
    const int kk = j * 32 + int(lane);
    if (kk < K) final_state[sbase + long(kk) * V] = s[j];
  }
}

#define KDA_RECURRENT_FWD_ARGS(T)                                                                             \
  device const T *q [[buffer(0)]], device const T *k [[buffer(1)]], device const T *v [[buffer(2)]],          \
      device const float *g [[buffer(3)]], device const float *beta [[buffer(4)]],                            \
      device const float *initial_state [[buffer(5)]], device const long *cu_seqlens [[buffer(6)]],           \
      device T *o [[buffer(7)]], device float *final_state [[buffer(8)]],                                     \
      constant DeltaParams &params [[buffer(9)]], uint3 tgp [[threadgroup_position_in_grid]],                 \
      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]
#define KDA_RECURRENT_FWD_PASS q, k, v, g, beta, initial_state, cu_seqlens, o, final_state, params, tgp, sg, lane

kernel void kda_recurrent_fwd_f32(KDA_RECURRENT_FWD_ARGS(float)) {
  recurrent_fwd_body<float, true>(KDA_RECURRENT_FWD_PASS);
}
kernel void kda_recurrent_fwd_f16(KDA_RECURRENT_FWD_ARGS(half)) {
  recurrent_fwd_body<half, true>(KDA_RECURRENT_FWD_PASS);
}
kernel void kda_recurrent_fwd_bf16(KDA_RECURRENT_FWD_ARGS(bfloat)) {
  recurrent_fwd_body<bfloat, true>(KDA_RECURRENT_FWD_PASS);
}
kernel void gdn_recurrent_fwd_f32(KDA_RECURRENT_FWD_ARGS(float)) {
  recurrent_fwd_body<float, false>(KDA_RECURRENT_FWD_PASS);
}
kernel void gdn_recurrent_fwd_f16(KDA_RECURRENT_FWD_ARGS(half)) {
  recurrent_fwd_body<half, false>(KDA_RECURRENT_FWD_PASS);
}
kernel void gdn_recurrent_fwd_bf16(KDA_RECURRENT_FWD_ARGS(bfloat)) {
  recurrent_fwd_body<bfloat, false>(KDA_RECURRENT_FWD_PASS);
}
