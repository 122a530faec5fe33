// Recurrent backward of the gated delta rule (KDA and GDN) by checkpointed replay.
// Same layout as recurrent_fwd.metal: one simdgroup per value row v, lane l holds S[k, v] and dS[k, v] for
// k = l, l + 32, ...  Per sequence:
//   phase A: run the forward recurrence, storing the state every `seg` tokens (ckpt);
//   phase B: for each segment, last to first: restore its checkpoint, replay it forward storing the state before
//            every token (replay, private to the lane), then walk its tokens backwards carrying dS.
// Per token t (S' = Diag(e^g) S_{t-1}, p = S'^T k, delta = beta (v - p), S_t = S' + k delta^T, o = scale S_t^T q):
//   dS += scale q do^T;  dq = scale S_t do;  ddelta = dS^T k;  dv = beta ddelta;  dbeta = (v - p) . ddelta;
//   dp = -beta ddelta;  dk = dS delta + S' dp;  dS' = dS + k dp^T;  dg = rowsum(S' * dS');  dS <- Diag(e^g) dS'.
// dq, dk, dg, dbeta sum over value rows: the KDA_REC_ROWS rows of a threadgroup are reduced in threadgroup
// memory, then added atomically (fp32) to the global accumulators, which also sums GVA value heads onto their
// q/k head. dv is written directly. Grid: (ceil(V / KDA_REC_ROWS), HV, N).
#include "delta_common.h"

#define KDA_RED_STRIDE (3 * KDA_REC_MAX_K + 2)

template <typename T, bool KDA, typename TG>
inline void recurrent_bwd_body(device const T* q, device const T* k, device const T* v, device const float* g,
                               device const float* beta, device const float* initial_state,
                               device const long* cu_seqlens, device const T* grad_o,
                               device const float* grad_final_state, device atomic_float* dq_acc,
                               device atomic_float* dk_acc, device T* dv, device atomic_float* dg,
                               device atomic_float* dbeta, device float* dh0, device float* ckpt,
                               device float* replay, constant DeltaParams& params, uint3 tgp, uint sg, uint lane,
                               uint tid, TG red) {
  const int row = int(tgp.x) * KDA_REC_ROWS + int(sg);
  const bool active = row < params.V;  // uniform per simdgroup; inactive rows still take every barrier
  const int hv = int(tgp.y), n = int(tgp.z);
  const int K = params.K, V = params.V, HV = params.HV, H = params.H;
  const int h = hv / (HV / H);
  const int seg = params.seg;
  int bos, eos;
  kda_seq_range(params, cu_seqlens, n, bos, eos);
  const int len = eos - bos;
  const long kv = long(K) * V;
  const long sbase = (long(n) * HV + hv) * kv + row;  // S[k, row] at sbase + k * V
  // sequence n's checkpoints: slots n + bos/seg ... (fits params.nslots, see delta_plan.h)
  device float* ck = ckpt + (long(hv) * params.nslots + n + bos / seg) * kv + row;
  device float* rp = replay + ((long(n) * HV + hv) * V + row) * long(seg) * K;

  float s[KDA_REC_MAX_NK];
  // ---- phase A: forward pass, checkpoint every seg tokens
  if (active) {
    for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
      const int kk = j * 32 + int(lane);
      s[j] = (kk < K && params.has_h0) ? initial_state[sbase + long(kk) * V] : 0.0f;
    }
    for (int i = 0; i < len; ++i) {
      const long t = bos + i;
      const long qk = (t * H + h) * K;
      const long tv = t * HV + hv;
      if (i % seg == 0) {
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          if (kk < K) ck[long(i / seg) * kv + long(kk) * V] = s[j];
        }
      }
      float pred = 0.0f;
      for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
        const int kk = j * 32 + int(lane);
        if (kk < K) {
          s[j] *= kda_decay<KDA>(g, t, hv, HV, K, kk);
          pred += s[j] * float(k[qk + kk]);
        }
      }
      pred = simd_sum(pred);
      const float delta = beta[tv] * (float(v[tv * V + row]) - pred);
      for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
        const int kk = j * 32 + int(lane);
        if (kk < K) s[j] += float(k[qk + kk]) * delta;
      }
    }
  }

  // ---- phase B: backwards over segments
  float ds[KDA_REC_MAX_NK];
  for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
    const int kk = j * 32 + int(lane);
    ds[j] = (active && kk < K && params.has_dht) ? grad_final_state[sbase + long(kk) * V] : 0.0f;
  }
  const int nseg = (len + seg - 1) / seg;
  for (int si = nseg - 1; si >= 0; --si) {
    const int i0 = si * seg;
    const int i1 = min(i0 + seg, len);
    if (active) {  // replay the segment from its checkpoint, keeping the state before each token
      for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
        const int kk = j * 32 + int(lane);
        s[j] = kk < K ? ck[long(si) * kv + long(kk) * V] : 0.0f;
      }
      for (int i = i0; i < i1; ++i) {
        const long t = bos + i;
        const long qk = (t * H + h) * K;
        const long tv = t * HV + hv;
        float pred = 0.0f;
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          if (kk < K) {
            rp[long(i - i0) * K + kk] = s[j];
            s[j] *= kda_decay<KDA>(g, t, hv, HV, K, kk);
            pred += s[j] * float(k[qk + kk]);
          }
        }
        pred = simd_sum(pred);
        const float delta = beta[tv] * (float(v[tv * V + row]) - pred);
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          if (kk < K) s[j] += float(k[qk + kk]) * delta;
        }
      }
    }
    for (int i = i1 - 1; i >= i0; --i) {
      const long t = bos + i;
      const long qk = (t * H + h) * K;
      const long tv = t * HV + hv;
      float dq_c[KDA_REC_MAX_NK], dk_c[KDA_REC_MAX_NK], dg_c[KDA_REC_MAX_NK];
      float dbeta_c = 0.0f, dg_head = 0.0f;
      for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
        dq_c[j] = 0.0f;
        dk_c[j] = 0.0f;
        dg_c[j] = 0.0f;
      }
      if (active) {
        float sp[KDA_REC_MAX_NK], kr[KDA_REC_MAX_NK], dec[KDA_REC_MAX_NK];
        float pred = 0.0f;
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          sp[j] = 0.0f;
          kr[j] = 0.0f;
          dec[j] = 0.0f;
          if (kk < K) {
            dec[j] = kda_decay<KDA>(g, t, hv, HV, K, kk);
            sp[j] = rp[long(i - i0) * K + kk] * dec[j];
            kr[j] = float(k[qk + kk]);
            pred += sp[j] * kr[j];
          }
        }
        pred = simd_sum(pred);
        const float b = beta[tv];
        const float r = float(v[tv * V + row]) - pred;
        const float delta = b * r;
        const float dout = float(grad_o[tv * V + row]) * params.scale;
        float dd = 0.0f;
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          const int kk = j * 32 + int(lane);
          if (kk < K) {
            const float qv = float(q[qk + kk]);
            ds[j] += qv * dout;
            dq_c[j] = (sp[j] + kr[j] * delta) * dout;
            dd += ds[j] * kr[j];
          }
        }
        dd = simd_sum(dd);
        if (lane == 0) dv[tv * V + row] = T(b * dd);
        dbeta_c = r * dd;
        const float dp = -b * dd;
        float dgs = 0.0f;
        for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
          dk_c[j] = ds[j] * delta + sp[j] * dp;
          const float dsp = ds[j] + kr[j] * dp;
          dg_c[j] = sp[j] * dsp;
          dgs += dg_c[j];
          ds[j] = dec[j] * dsp;
        }
        if (!KDA) dg_head = simd_sum(dgs);
      }
      // reduce the rows of this threadgroup, then one atomic add per element
      for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
        const int kk = j * 32 + int(lane);
        if (kk < K) {
          red[sg * KDA_RED_STRIDE + kk] = dq_c[j];
          red[sg * KDA_RED_STRIDE + KDA_REC_MAX_K + kk] = dk_c[j];
          red[sg * KDA_RED_STRIDE + 2 * KDA_REC_MAX_K + kk] = dg_c[j];
        }
      }
      if (lane == 0) {
        red[sg * KDA_RED_STRIDE + 3 * KDA_REC_MAX_K] = dbeta_c;
        red[sg * KDA_RED_STRIDE + 3 * KDA_REC_MAX_K + 1] = dg_head;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int e = int(tid); e < 3 * K + 2; e += 32 * KDA_REC_ROWS) {
        const int which = e < 3 * K ? e / K : 3 + (e - 3 * K);  // 0 dq, 1 dk, 2 dg (KDA), 3 dbeta, 4 dg (GDN)
        if ((which == 2 && !KDA) || (which == 4 && KDA)) continue;
        const int kk = e < 3 * K ? e % K : 0;
        const int off = which < 3 ? which * KDA_REC_MAX_K + kk : 3 * KDA_REC_MAX_K + (which - 3);
        float acc = 0.0f;
        for (int r = 0; r < KDA_REC_ROWS; ++r) acc += red[r * KDA_RED_STRIDE + off];
        if (which == 0) atomic_fetch_add_explicit(&dq_acc[(t * H + h) * K + kk], acc, memory_order_relaxed);
        else if (which == 1) atomic_fetch_add_explicit(&dk_acc[(t * H + h) * K + kk], acc, memory_order_relaxed);
        else if (which == 2) atomic_fetch_add_explicit(&dg[tv * K + kk], acc, memory_order_relaxed);
        else if (which == 3) atomic_fetch_add_explicit(&dbeta[tv], acc, memory_order_relaxed);
        else atomic_fetch_add_explicit(&dg[tv], acc, memory_order_relaxed);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  if (active) {
    for (int j = 0; j < KDA_REC_MAX_NK; ++j) {
      const int kk = j * 32 + int(lane);
      if (kk < K) dh0[sbase + long(kk) * V] = ds[j];
    }
  }
}

#define KDA_RECURRENT_BWD_ARGS(T)                                                                             \
  device const T *q [[buffer(0)]], device const T *k [[buffer(1)]], device const T *v [[buffer(2)]],          \
      device const float *g [[buffer(3)]], device const float *beta [[buffer(4)]],                            \
      device const float *initial_state [[buffer(5)]], device const long *cu_seqlens [[buffer(6)]],           \
      device const T *grad_o [[buffer(7)]], device const float *grad_final_state [[buffer(8)]],               \
      device atomic_float *dq_acc [[buffer(9)]], device atomic_float *dk_acc [[buffer(10)]],                  \
      device T *dv [[buffer(11)]], device atomic_float *dg [[buffer(12)]],                                    \
      device atomic_float *dbeta [[buffer(13)]], device float *dh0 [[buffer(14)]],                            \
      device float *ckpt [[buffer(15)]], device float *replay [[buffer(16)]],                                 \
      constant DeltaParams &params [[buffer(17)]], uint3 tgp [[threadgroup_position_in_grid]],                \
      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],                    \
      uint tid [[thread_index_in_threadgroup]]
#define KDA_RECURRENT_BWD_PASS                                                                                \
  q, k, v, g, beta, initial_state, cu_seqlens, grad_o, grad_final_state, dq_acc, dk_acc, dv, dg, dbeta, dh0,  \
      ckpt, replay, params, tgp, sg, lane, tid, red

kernel void kda_recurrent_bwd_f32(KDA_RECURRENT_BWD_ARGS(float)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<float, true>(KDA_RECURRENT_BWD_PASS);
}
kernel void kda_recurrent_bwd_f16(KDA_RECURRENT_BWD_ARGS(half)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<half, true>(KDA_RECURRENT_BWD_PASS);
}
kernel void kda_recurrent_bwd_bf16(KDA_RECURRENT_BWD_ARGS(bfloat)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<bfloat, true>(KDA_RECURRENT_BWD_PASS);
}
kernel void gdn_recurrent_bwd_f32(KDA_RECURRENT_BWD_ARGS(float)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<float, false>(KDA_RECURRENT_BWD_PASS);
}
kernel void gdn_recurrent_bwd_f16(KDA_RECURRENT_BWD_ARGS(half)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<half, false>(KDA_RECURRENT_BWD_PASS);
}
kernel void gdn_recurrent_bwd_bf16(KDA_RECURRENT_BWD_ARGS(bfloat)) {
  threadgroup float red[KDA_REC_ROWS * KDA_RED_STRIDE];
  recurrent_bwd_body<bfloat, false>(KDA_RECURRENT_BWD_PASS);
}
