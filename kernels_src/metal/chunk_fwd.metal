// Chunked forward of the gated delta rule (KDA and GDN) on simdgroup matrices, 16-token chunks.
// Threadgroup = (block of KDA_CHUNK_VB value columns, value head, sequence); simdgroup sg owns 8 columns and
// keeps its K x 8 slice of the state in registers as K/8 simdgroup_float8x8 tiles. Per chunk of L <= 16 tokens,
// with G_i = sum_{m<=i} g_m (cumulative log-decay, per channel for KDA) and S the state entering the chunk:
//   A_ij = sum_k k_i k_j e^{G_i - G_j}          (i > j)   -- computed directly, every exponent <= 0
//   M_ij = sum_k q_i k_j e^{G_i - G_j}          (i >= j)
//   X    = V - (K . e^G) S                        (16 x K by K x 8 on simdgroup matrices)
//   delta_j = beta_j (X_j - sum_{m<j} A_jm delta_m)   (forward substitution = the UT/WY transform)
//   O    = scale ((Q . e^G) S + M delta)
//   S   <- Diag(e^{G_L}) S + (K . e^{G_L - G})^T delta
// No factorisation around a reference point, so no exponent ever overflows (gates down to -20 per token).
// Grid: (ceil(V / KDA_CHUNK_VB), HV, N); threads: 32 * KDA_CHUNK_NSG. Needs K % 8 == 0, K <= 128, V % 8 == 0.
#include "delta_common.h"

#define KDA_CK KDA_CHUNK
#define KDA_NKT (KDA_CHUNK_MAX_K / 8)

template <typename T, bool KDA, typename TG>
inline void chunk_fwd_body(device const T* q, device const T* k, device const T* v, device const float* g,
                           device const float* beta, device const float* initial_state,
                           device const long* cu_seqlens, device T* o, device float* final_state,
                           constant DeltaParams& params, uint3 tgp, uint sg, uint lane, uint tid, TG gbuf, TG fbuf,
                           TG amat, TG mmat, TG xbuf_all, TG obuf_all, TG dbuf) {
  const int K = params.K, V = params.V, HV = params.HV, H = params.H;
  const int hv = int(tgp.y), n = int(tgp.z);
  const int h = hv / (HV / H);
  const int c0 = int(tgp.x) * KDA_CHUNK_VB + int(sg) * 8;  // first value column of this simdgroup
  const bool active = c0 < V;                              // uniform per simdgroup
  const int nkt = K / 8;
  const int nthr = 32 * KDA_CHUNK_NSG;
  TG xbuf = xbuf_all + sg * (KDA_CK * 8);
  TG obuf = obuf_all + sg * (KDA_CK * 8);
  int bos, eos;
  kda_seq_range(params, cu_seqlens, n, bos, eos);
  const long sbase = (long(n) * HV + hv) * K * V + c0;

  simdgroup_float8x8 st[KDA_NKT];
  for (int kt = 0; kt < KDA_NKT; ++kt) {
    if (kt < nkt && active) {
      if (params.has_h0) {
        simdgroup_load(st[kt], initial_state + sbase + long(kt) * 8 * V, ulong(V));
      } else {
        st[kt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      }
    }
  }

  for (int c_t = bos; c_t < eos; c_t += KDA_CK) {
    const int L = min(KDA_CK, eos - c_t);
    // cumulative gates
    for (int kk = int(tid); kk < K; kk += nthr) {
      float acc = 0.0f;
      for (int i = 0; i < KDA_CK; ++i) {
        if (i < L) acc += kda_gate<KDA>(g, c_t + i, hv, HV, K, kk);
        gbuf[i * K + kk] = acc;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // A, M (16 x 16 each), Q . e^G, and the diagonal tiles of e^{G_last}
    for (int e = int(tid); e < 2 * KDA_CK * KDA_CK; e += nthr) {
      const int which = e / (KDA_CK * KDA_CK);
      const int i = (e / KDA_CK) % KDA_CK, j = e % KDA_CK;
      float acc = 0.0f;
      if (i < L && (which == 0 ? i > j : i >= j)) {
        const long ri = (long(c_t + i) * H + h) * K, rj = (long(c_t + j) * H + h) * K;
        for (int kk = 0; kk < K; ++kk) {
          const float a = which == 0 ? float(k[ri + kk]) : float(q[ri + kk]);
          acc += a * float(k[rj + kk]) * precise::exp(gbuf[i * K + kk] - gbuf[j * K + kk]);
        }
      }
      if (which == 0) amat[i * KDA_CK + j] = acc;
      else mmat[i * KDA_CK + j] = acc;
    }
    for (int e = int(tid); e < KDA_CK * K; e += nthr) {
      const int i = e / K, kk = e % K;
      fbuf[e] = i < L ? float(q[(long(c_t + i) * H + h) * K + kk]) * precise::exp(gbuf[e]) : 0.0f;
    }
    for (int e = int(tid); e < K * 8; e += nthr) {
      const int kt = e / 64, r = (e / 8) % 8, c = e % 8;
      dbuf[e] = r == c ? precise::exp(gbuf[(L - 1) * K + kt * 8 + r]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 oacc[2], xacc[2], dl[2], a, tmp;
    if (active) {  // inter-chunk part of the output: (Q . e^G) S
      for (int r = 0; r < 2; ++r) {
        oacc[r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int kt = 0; kt < KDA_NKT; ++kt) {
          if (kt < nkt) {
            simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K));
            simdgroup_multiply_accumulate(oacc[r], a, st[kt], oacc[r]);
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(tid); e < KDA_CK * K; e += nthr) {  // K . e^G
      const int i = e / K, kk = e % K;
      fbuf[e] = i < L ? float(k[(long(c_t + i) * H + h) * K + kk]) * precise::exp(gbuf[e]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (active) {
      for (int r = 0; r < 2; ++r) {  // (K . e^G) S, the state's prediction of v
        xacc[r] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (int kt = 0; kt < KDA_NKT; ++kt) {
          if (kt < nkt) {
            simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K));
            simdgroup_multiply_accumulate(xacc[r], a, st[kt], xacc[r]);
          }
        }
        simdgroup_store(xacc[r], xbuf + r * 64, 8);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      if (lane < 8) {  // forward substitution, one column per lane; delta overwrites X row by row
        const int c = c0 + int(lane);
        for (int j = 0; j < KDA_CK; ++j) {
          float d = 0.0f;
          if (j < L) {
            const long tv = long(c_t + j) * HV + hv;
            float acc = float(v[tv * V + c]) - xbuf[j * 8 + lane];
            for (int m = 0; m < j; ++m) acc -= amat[j * KDA_CK + m] * xbuf[m * 8 + lane];
            d = beta[tv] * acc;
          }
          xbuf[j * 8 + lane] = d;
        }
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      simdgroup_load(dl[0], xbuf, 8);
      simdgroup_load(dl[1], xbuf + 64, 8);
      for (int r = 0; r < 2; ++r) {  // intra-chunk part: M delta
        for (int r2 = 0; r2 <= r; ++r2) {
          simdgroup_load(a, mmat + r * 8 * KDA_CK + r2 * 8, ulong(KDA_CK));
          simdgroup_multiply_accumulate(oacc[r], a, dl[r2], oacc[r]);
        }
        simdgroup_store(oacc[r], obuf + r * 64, 8);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int e = int(lane); e < KDA_CK * 8; e += 32) {
        const int i = e / 8, c = e % 8;
        if (i < L) o[(long(c_t + i) * HV + hv) * V + c0 + c] = T(obuf[e] * params.scale);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(tid); e < KDA_CK * K; e += nthr) {  // K . e^{G_last - G}
      const int i = e / K, kk = e % K;
      fbuf[e] = i < L ? float(k[(long(c_t + i) * H + h) * K + kk]) * precise::exp(gbuf[(L - 1) * K + kk] - gbuf[e])
                      : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (active) {
      for (int kt = 0; kt < KDA_NKT; ++kt) {
        if (kt < nkt) {
          simdgroup_load(a, dbuf + kt * 64, 8);
          simdgroup_multiply(tmp, a, st[kt]);
          for (int r2 = 0; r2 < 2; ++r2) {
            simdgroup_load(a, fbuf + r2 * 8 * K + kt * 8, ulong(K), ulong2(0, 0), true);
            simdgroup_multiply_accumulate(tmp, a, dl[r2], tmp);
          }
          st[kt] = tmp;
        }
      }
    }
    // No barrier here: the next chunk first writes gbuf (last read before the barrier above) and writes
    // fbuf/dbuf/amat/mmat only after its first barrier, which every thread reaches after this update.
  }
  for (int kt = 0; kt < KDA_NKT; ++kt)
    if (kt < nkt && active) simdgroup_store(st[kt], final_state + sbase + long(kt) * 8 * V, ulong(V));
}

#define KDA_CHUNK_FWD_ARGS(T)                                                                                 \
  device const T *q [[buffer(0)]], device const T *k [[buffer(1)]], device const T *v [[buffer(2)]],          \
      device const float *g [[buffer(3)]], device const float *beta [[buffer(4)]],                            \
      device const float *initial_state [[buffer(5)]], device const long *cu_seqlens [[buffer(6)]],           \
      device T *o [[buffer(7)]], device float *final_state [[buffer(8)]],                                     \
      constant DeltaParams &params [[buffer(9)]], uint3 tgp [[threadgroup_position_in_grid]],                 \
      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],                    \
      uint tid [[thread_index_in_threadgroup]]
// threadgroup memory: 2 x 16 x 128 + 2 x 256 + 2 x 4 x 128 + 128 x 8 floats = 26 KiB
#define KDA_CHUNK_FWD_SHARED                                                                                  \
  threadgroup float gbuf[KDA_CK * KDA_CHUNK_MAX_K];                                                           \
  threadgroup float fbuf[KDA_CK * KDA_CHUNK_MAX_K];                                                           \
  threadgroup float amat[KDA_CK * KDA_CK];                                                                    \
  threadgroup float mmat[KDA_CK * KDA_CK];                                                                    \
  threadgroup float xbuf[KDA_CHUNK_NSG * KDA_CK * 8];                                                         \
  threadgroup float obuf[KDA_CHUNK_NSG * KDA_CK * 8];                                                         \
  threadgroup float dbuf[KDA_CHUNK_MAX_K * 8]
#define KDA_CHUNK_FWD_PASS                                                                                    \
  q, k, v, g, beta, initial_state, cu_seqlens, o, final_state, params, tgp, sg, lane, tid, gbuf, fbuf, amat, mmat, \
      xbuf, obuf, dbuf

kernel void kda_chunk_fwd_f32(KDA_CHUNK_FWD_ARGS(float)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<float, true>(KDA_CHUNK_FWD_PASS);
}
kernel void kda_chunk_fwd_f16(KDA_CHUNK_FWD_ARGS(half)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<half, true>(KDA_CHUNK_FWD_PASS);
}
kernel void kda_chunk_fwd_bf16(KDA_CHUNK_FWD_ARGS(bfloat)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<bfloat, true>(KDA_CHUNK_FWD_PASS);
}
kernel void gdn_chunk_fwd_f32(KDA_CHUNK_FWD_ARGS(float)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<float, false>(KDA_CHUNK_FWD_PASS);
}
kernel void gdn_chunk_fwd_f16(KDA_CHUNK_FWD_ARGS(half)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<half, false>(KDA_CHUNK_FWD_PASS);
}
kernel void gdn_chunk_fwd_bf16(KDA_CHUNK_FWD_ARGS(bfloat)) {
  KDA_CHUNK_FWD_SHARED;
  chunk_fwd_body<bfloat, false>(KDA_CHUNK_FWD_PASS);
}
