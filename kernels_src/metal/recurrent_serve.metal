// Serving op (docs/ops.md "The serving op"): recurrent forward of the gated delta rule (KDA and GDN) on a state
// pool updated in place. Same layout as recurrent_fwd.metal: one 32-lane simdgroup per value row, lane l holds
// S[k, row] for k = l, l + 32, ... in registers; KDA_REC_ROWS rows per threadgroup, grid (ceil(V/ROWS), HV, N).
// Pool rows are [HV, K, V] ([HV, V, K] with state_v_first) in fp32, fp16 or bf16; the state is fp32 in registers.
//   ssm_state_indices [N] (idx_cols == 0): sequence n starts from row idx[n] and writes its final state back there.
//   [N, idx_cols]: it starts from row idx[n, num_accepted_tokens[n] - 1] (column 0 without num_accepted_tokens)
//   and writes the state after its token i to row idx[n, i] (skipped where negative). One sequence's start row may
//   be another's write row, so those start states are first gathered (delta_serve_gather_*) into `starts`.
//   A negative start index skips the sequence: zero outputs, no row read or written.
#include "delta_common.h"

inline long serve_start_row(constant DeltaParams& params, device const long* idx, device const long* nat, int n) {
  if (params.idx_cols == 0) return idx[n];
  const int col = params.has_nat ? int(nat[n]) - 1 : 0;
  return idx[long(n) * params.idx_cols + col];
}

// offset of S[kk, row] of value head hv in pool row `prow`
inline long serve_pool_off(constant DeltaParams& params, long prow, int hv, int kk, int row) {
  const long base = (prow * params.HV + hv) * long(params.K) * params.V;
  return params.state_v_first ? base + long(row) * params.K + kk : base + long(kk) * params.V + row;
}

template <typename T, typename PT, bool KDA>
inline void recurrent_serve_body(device const T* q, device const T* k, device const T* v, device const float* g,
                                 device const float* beta, device PT* pool, device const float* starts,
                                 device const long* idx, device const long* nat, device const long* cu_seqlens,
                                 device T* o, constant DeltaParams& params, uint3 tgp, uint sg, uint lane) {
  const int row = int(tgp.x) * KDA_REC_ROWS + int(sg);
  if (row >= params.V) return;  // the whole simdgroup leaves; this kernel has no threadgroup barrier
  const int hv = int(tgp.y), n = int(tgp.z);
  const int K = params.K, V = params.V, HV = params.HV, H = params.H;
  const int h = hv / (HV / H);
  int bos, eos;
  kda_seq_range(params, cu_seqlens, n, bos, eos);
  const long start = serve_start_row(params, idx, nat, n);
  if (start < 0) {
    if (lane == 0)
      for (int t = bos; t < eos; ++t) o[(long(t) * HV + hv) * V + row] = T(0.0f);
    return;
  }
  float s[KDA_REC_MAX_NK];
  for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
    const int kk = j * 32 + int(lane);
    s[j] = 0.0f;
    if (kk < K) {
      s[j] = params.idx_cols == 0 ? float(pool[serve_pool_off(params, start, hv, kk, row)])
                                  : starts[((long(n) * HV + hv) * K + kk) * V + row];
    }
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
    if (params.idx_cols > 0) {  // speculative decoding: the state after every token goes to its own row
      const long w = idx[long(n) * params.idx_cols + (t - bos)];
      if (w >= 0)
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          if (kk < K) pool[serve_pool_off(params, w, hv, kk, row)] = PT(s[j]);
        }
    }
  }
  if (params.idx_cols == 0)
    for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
      const int kk = j * 32 + int(lane);
      if (kk < K) pool[serve_pool_off(params, start, hv, kk, row)] = PT(s[j]);
    }
}

// starts[n, hv, k, v] (fp32, K-first) <- the start row of every sequence with a non-negative start index.
template <typename PT>
inline void serve_gather_body(device const PT* pool, device const long* idx, device const long* nat,
                              device float* starts, constant DeltaParams& params, uint i) {
  const long kv = long(params.K) * params.V;
  if (long(i) >= long(params.N) * params.HV * kv) return;
  const int n = int(long(i) / (long(params.HV) * kv));
  const int hv = int((long(i) / kv) % params.HV);
  const int kk = int((long(i) % kv) / params.V), row = int(long(i) % params.V);
  const long start = serve_start_row(params, idx, nat, n);
  if (start >= 0) starts[i] = float(pool[serve_pool_off(params, start, hv, kk, row)]);
}

#define KDA_SERVE_ARGS(T, PT)                                                                                 \
  device const T *q [[buffer(0)]], device const T *k [[buffer(1)]], device const T *v [[buffer(2)]],          \
      device const float *g [[buffer(3)]], device const float *beta [[buffer(4)]],                            \
      device PT *state_pool [[buffer(5)]], device const float *starts [[buffer(6)]],                          \
      device const long *ssm_state_indices [[buffer(7)]], device const long *num_accepted_tokens [[buffer(8)]], \
      device const long *cu_seqlens [[buffer(9)]], device T *o [[buffer(10)]],                                \
      constant DeltaParams &params [[buffer(11)]], uint3 tgp [[threadgroup_position_in_grid]],                \
      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]
#define KDA_SERVE_PASS                                                                                        \
  q, k, v, g, beta, state_pool, starts, ssm_state_indices, num_accepted_tokens, cu_seqlens, o, params, tgp, sg, lane

// <family>_recurrent_serve_<q/k/v dtype>_state_<pool dtype>
#define KDA_SERVE_KERNEL(FAM, ISKDA, TN, T, PN, PT)                                                           \
  kernel void FAM##_recurrent_serve_##TN##_state_##PN(KDA_SERVE_ARGS(T, PT)) {                                \
    recurrent_serve_body<T, PT, ISKDA>(KDA_SERVE_PASS);                                                       \
  }
#define KDA_SERVE_KERNELS_POOL(PN, PT)                                                                        \
  KDA_SERVE_KERNEL(kda, true, f32, float, PN, PT)                                                             \
  KDA_SERVE_KERNEL(kda, true, f16, half, PN, PT)                                                              \
  KDA_SERVE_KERNEL(kda, true, bf16, bfloat, PN, PT)                                                           \
  KDA_SERVE_KERNEL(gdn, false, f32, float, PN, PT)                                                            \
  KDA_SERVE_KERNEL(gdn, false, f16, half, PN, PT)                                                             \
  KDA_SERVE_KERNEL(gdn, false, bf16, bfloat, PN, PT)
KDA_SERVE_KERNELS_POOL(f32, float)
KDA_SERVE_KERNELS_POOL(f16, half)
KDA_SERVE_KERNELS_POOL(bf16, bfloat)

#define KDA_SERVE_GATHER_ARGS(PT)                                                                             \
  device const PT *state_pool [[buffer(0)]], device const long *ssm_state_indices [[buffer(1)]],              \
      device const long *num_accepted_tokens [[buffer(2)]], device float *starts [[buffer(3)]],               \
      constant DeltaParams &params [[buffer(4)]], uint i [[thread_position_in_grid]]
kernel void delta_serve_gather_f32(KDA_SERVE_GATHER_ARGS(float)) {
  serve_gather_body<float>(state_pool, ssm_state_indices, num_accepted_tokens, starts, params, i);
}
kernel void delta_serve_gather_f16(KDA_SERVE_GATHER_ARGS(half)) {
  serve_gather_body<half>(state_pool, ssm_state_indices, num_accepted_tokens, starts, params, i);
}
kernel void delta_serve_gather_bf16(KDA_SERVE_GATHER_ARGS(bfloat)) {
  serve_gather_body<bfloat>(state_pool, ssm_state_indices, num_accepted_tokens, starts, params, i);
}
