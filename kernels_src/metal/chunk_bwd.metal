// Chunked backward of the gated delta rule (KDA and GDN) on simdgroup matrices, 16-token chunks.
// Same threadgroup layout as chunk_fwd.metal: threadgroup = (block of KDA_CHUNK_VB value columns, value head,
// sequence), simdgroup sg owns 8 value columns and keeps its K x 8 slices of the state S and of the carried
// gradient dS in registers (K/8 simdgroup_float8x8 tiles each).
//
// Forward of one chunk (L <= 16 tokens, G_i = sum_{m<=i} g_m per channel, S the state entering the chunk):
//   A_ij = sum_k k_i k_j e^{G_i-G_j} (i > j),  M_ij = sum_k q_i k_j e^{G_i-G_j} (i >= j)   (every exponent <= 0)
//   X = V - Kg S with Kg = K . e^G;   r_j = X_j - sum_{m<j} A_jm delta_m,  delta_j = beta_j r_j   (UT/WY solve)
//   O = scale (Qg S + M delta) with Qg = Q . e^G;   S' = Diag(e^{G_L}) S + Kr^T delta with Kr = K . e^{G_L-G}
// Backward of one chunk, given dO' = scale dO and dS' (gradient of the state leaving the chunk):
//   ddelta = M^T dO' + Kr dS'
//   y_j = ddelta_j - sum_{m>j} beta_m A_mj y_m   (transposed solve, back substitution);   dX_j = beta_j y_j
//   dv = dX,  dbeta_j = y_j . r_j,  dM = dO' delta^T,  dA = -dX delta^T
//   dQg = dO' S^T,  dKg = -dX S^T,  dKr = delta dS'^T
//   dS = Diag(e^{G_L}) dS' + Qg^T dO' - Kg^T dX
//   dq_i = sum_{j<=i} dM_ij k_j e^{G_i-G_j} + dQg_i e^{G_i}
//   dk_i = sum_{j<i} dA_ij k_j e^{G_i-G_j} + sum_{m>i} dA_mi k_m e^{G_m-G_i} + sum_{m>=i} dM_mi q_m e^{G_m-G_i}
//          + dKg_i e^{G_i} + dKr_i e^{G_L-G_i}
//   dG_i = q_i dq_i + k_i (dk_i[A, i first] - dk_i[A, i second] - dk_i[M] + dk_i[Kg] - dk_i[Kr]),
//   dG_L += sum_i k_i dk_i[Kr] + e^{G_L} sum_v dS' . S;   dg_t = sum_{i>=t} dG_i (per channel; GDN sums channels)
// Again every exponent is <= 0 (G is non-increasing along the chunk), so gates down to -20 per token are safe.
//
// Per sequence: phase A runs the chunked forward, storing the state every `seg` chunks (ckpt); phase B takes the
// segments last to first: restore the checkpoint, replay the segment storing the state entering each chunk
// (replay), then walk its chunks backwards carrying dS. Products over value columns (dq, dk, dg, dbeta, dA, dM)
// are reduced over the threadgroup's simdgroups in threadgroup memory and added to global fp32 accumulators with
// atomics (value blocks and GVA heads share them). dv is written directly, dh0 is the final dS.
// Grid: (ceil(V / KDA_CHUNK_VB), HV, N); threads: 32 * KDA_CHUNK_NSG. Needs K % 8 == 0, K <= 128, V % 8 == 0.
#include "delta_common.h"

#define KDA_CB KDA_CHUNK
#define KDA_CB_NKT (KDA_CHUNK_MAX_K / 8)
#define KDA_CB_TG (32 * KDA_CHUNK_NSG)

// Cumulative gates (gbuf), A (and M when want_m), and fbuf = K . e^G for the chunk at flat token c_t.
// The first barrier also orders the device-memory state stores (ckpt/replay) before later loads.
template <typename T, bool KDA, typename TG>
inline void cb_prepare(device const T* q, device const T* k, device const float* g, int c_t, int L, int hv, int h,
                       constant DeltaParams& params, uint tid, bool want_m, TG gbuf, TG fbuf, TG amat, TG mmat) {
  const int K = params.K, HV = params.HV, H = params.H;
  for (int kk = int(tid); kk < K; kk += KDA_CB_TG) {
    float acc = 0.0f;
    for (int i = 0; i < KDA_CB; ++i) {
      if (i < L) acc += kda_gate<KDA>(g, c_t + i, hv, HV, K, kk);
      gbuf[i * K + kk] = acc;
    }
  }
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  const int nmat = want_m ? 2 : 1;
  for (int e = int(tid); e < nmat * KDA_CB * KDA_CB; e += KDA_CB_TG) {
    const int which = e / (KDA_CB * KDA_CB);
    const int i = (e / KDA_CB) % KDA_CB, j = e % KDA_CB;
    float acc = 0.0f;
    if (i < L && (which == 0 ? i > j : i >= j)) {
      const long ri = (long(c_t + i) * H + h) * K, rj = (long(c_t + j) * H + h) * K;
      for (int kk = 0; kk < K; ++kk) {
        const float a = which == 0 ? float(k[ri + kk]) : float(q[ri + kk]);
        acc += a * float(k[rj + kk]) * precise::exp(gbuf[i * K + kk] - gbuf[j * K + kk]);
      }
    }
    if (which == 0) amat[i * KDA_CB + j] = acc;
    else mmat[i * KDA_CB + j] = acc;
  }
  for (int e = int(tid); e < KDA_CB * K; e += KDA_CB_TG) {  // K . e^G
    const int i = e / K, kk = e % K;
    fbuf[e] = i < L ? float(k[(long(c_t + i) * H + h) * K + kk]) * precise::exp(gbuf[e]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// fbuf = X . e^G (mode 0/1: X = Q or K), or K . e^{G_L - G} (mode 2, which also sets egl = e^{G_L});
// rows >= L are zero. Between two barriers.
template <typename T, typename TG>
inline void cb_fill(device const T* x, int c_t, int L, int h, constant DeltaParams& params, uint tid, int mode,
                    TG gbuf, TG fbuf, TG egl) {
  const int K = params.K, H = params.H;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < KDA_CB * K; e += KDA_CB_TG) {
    const int i = e / K, kk = e % K;
    const float ex = mode == 2 ? gbuf[(L - 1) * K + kk] - gbuf[e] : gbuf[e];
    fbuf[e] = i < L ? float(x[(long(c_t + i) * H + h) * K + kk]) * precise::exp(ex) : 0.0f;
    if (mode == 2 && i == 0) egl[kk] = precise::exp(gbuf[(L - 1) * K + kk]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// One simdgroup (active): X = V - Kg S (fbuf holds Kg), then the forward substitution, one column per lane:
// xr <- r (residuals), dl <- delta. Rows >= L are zero. Readers come after a threadgroup barrier.
template <typename T, typename TG>
inline void cb_solve(device const T* v, device const float* beta, int c_t, int L, int hv, int c0,
                     constant DeltaParams& params, uint lane, thread simdgroup_float8x8* st, TG fbuf, TG amat, TG xr,
                     TG dl) {
  const int K = params.K, V = params.V, HV = params.HV, nkt = K / 8;
  simdgroup_float8x8 acc, a;
  for (int r = 0; r < 2; ++r) {
    acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
      if (kt < nkt) {
        simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K));
        simdgroup_multiply_accumulate(acc, a, st[kt], acc);
      }
    }
    simdgroup_store(acc, xr + r * 64, 8);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  if (lane < 8) {
    for (int j = 0; j < KDA_CB; ++j) {
      float res = 0.0f, d = 0.0f;
      if (j < L) {
        const long tv = long(c_t + j) * HV + hv;
        res = float(v[tv * V + c0 + int(lane)]) - xr[j * 8 + lane];
        for (int m = 0; m < j; ++m) res -= amat[j * KDA_CB + m] * dl[m * 8 + lane];
        d = beta[tv] * res;
      }
      xr[j * 8 + lane] = res;
      dl[j * 8 + lane] = d;
    }
  }
}

// tile <- Diag(e^{G_L}) restricted to key tile kt, built by the lanes in a per-simdgroup 8x8 buffer
// (two buffers alternate, so consecutive tiles never overwrite one that a lane may still be loading).
template <typename TG>
inline void cb_decay_tile(thread simdgroup_float8x8& tile, int kt, uint lane, TG egl, TG buf) {
  for (int e = int(lane); e < 64; e += 32) {
    const int r = e / 8, c = e % 8;
    buf[e] = r == c ? egl[kt * 8 + r] : 0.0f;
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_load(tile, buf, 8);
}

// Advance the state through one chunk: S <- Diag(e^{G_L}) S + Kr^T delta (after cb_prepare and cb_solve).
template <typename T, bool KDA, typename TG>
inline void cb_advance(device const T* k, int c_t, int L, int h, bool active, constant DeltaParams& params, uint tid,
                       uint lane, thread simdgroup_float8x8* st, TG gbuf, TG fbuf, TG egl, TG dl, TG sc0, TG sc1) {
  const int nkt = params.K / 8;
  cb_fill(k, c_t, L, h, params, tid, 2, gbuf, fbuf, egl);  // Kr
  if (active) {
    simdgroup_float8x8 a, dec, tmp, dlt[2];
    simdgroup_load(dlt[0], dl, 8);
    simdgroup_load(dlt[1], dl + 64, 8);
    for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
      if (kt < nkt) {
        cb_decay_tile(dec, kt, lane, egl, (kt & 1) ? sc1 : sc0);
        simdgroup_multiply(tmp, dec, st[kt]);
        for (int r = 0; r < 2; ++r) {
          simdgroup_load(a, fbuf + r * 8 * params.K + kt * 8, ulong(params.K), ulong2(0, 0), true);
          simdgroup_multiply_accumulate(tmp, a, dlt[r], tmp);
        }
        st[kt] = tmp;
      }
    }
  }
}

template <typename T, bool KDA, typename TG>
inline void chunk_bwd_body(device const T* q, device const T* k, device const T* v, device const float* g,
                           device const float* beta, device const float* initial_state,
                           device const long* cu_seqlens, device const T* grad_o,
                           device const float* grad_final_state, device atomic_float* dq_acc,
                           device atomic_float* dk_acc, device T* dv, device atomic_float* dg,
                           device atomic_float* dbeta, device float* dh0, device float* ckpt, device float* replay,
                           constant DeltaParams& params, uint3 tgp, uint sg, uint lane, uint tid, TG gbuf, TG fbuf,
                           TG amat, TG mmat, TG dam, TG dmm, TG xr_all, TG dl_all, TG dob_all, TG ndx_all,
                           TG sc_all, TG egl) {
  const int K = params.K, V = params.V, HV = params.HV, H = params.H;
  const int hv = int(tgp.y), n = int(tgp.z);
  const int h = hv / (HV / H);
  const int cb0 = int(tgp.x) * KDA_CHUNK_VB;              // first value column of this threadgroup
  const int c0 = cb0 + int(sg) * 8;                        // first value column of this simdgroup
  const bool active = c0 < V;                              // uniform per simdgroup
  const int nkt = K / 8;
  const int seg = params.seg;                              // chunks per checkpoint segment
  const long kv = long(K) * V;
  TG xr = xr_all + sg * (KDA_CB * 8);    // r, then y . r
  TG dl = dl_all + sg * (KDA_CB * 8);    // delta
  TG dob = dob_all + sg * (KDA_CB * 8);  // scale * dO
  TG ndx = ndx_all + sg * (KDA_CB * 8);  // ddelta, then -dX
  TG sc0 = sc_all + sg * 128;
  TG sc1 = sc0 + 64;
  int bos, eos;
  kda_seq_range(params, cu_seqlens, n, bos, eos);
  const int len = eos - bos;
  const int nc = (len + KDA_CB - 1) / KDA_CB;
  const int nseg = (nc + seg - 1) / seg;
  const long sbase = (long(n) * HV + hv) * kv + c0;
  // sequence n's checkpoints: slots n + bos / (16 seg) ... (fits params.nslots, see delta_plan.h)
  device float* ck = ckpt + (long(hv) * params.nslots + n + bos / (KDA_CB * seg)) * kv + c0;
  device float* rp = replay + (long(n) * HV + hv) * long(seg) * kv + c0;

  simdgroup_float8x8 st[KDA_CB_NKT], ds[KDA_CB_NKT];
  for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
    if (kt < nkt && active) {
      if (params.has_h0) simdgroup_load(st[kt], initial_state + sbase + long(kt) * 8 * V, ulong(V));
      else st[kt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      if (params.has_dht) simdgroup_load(ds[kt], grad_final_state + sbase + long(kt) * 8 * V, ulong(V));
      else ds[kt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // ---- phase A: forward up to the start of the last segment, checkpointing every seg chunks
  for (int ci = 0; ci < (nseg - 1) * seg; ++ci) {
    const int c_t = bos + ci * KDA_CB;
    const int L = min(KDA_CB, eos - c_t);
    if (ci % seg == 0 && active)
      for (int kt = 0; kt < nkt; ++kt) simdgroup_store(st[kt], ck + long(ci / seg) * kv + kt * 8 * V, ulong(V));
    cb_prepare<T, KDA>(q, k, g, c_t, L, hv, h, params, tid, false, gbuf, fbuf, amat, mmat);
    if (active) cb_solve(v, beta, c_t, L, hv, c0, params, lane, st, fbuf, amat, xr, dl);
    cb_advance<T, KDA>(k, c_t, L, h, active, params, tid, lane, st, gbuf, fbuf, egl, dl, sc0, sc1);
  }

  // ---- phase B: segments last to first
  for (int si = nseg - 1; si >= 0; --si) {
    const int i0 = si * seg, i1 = min(i0 + seg, nc);
    if (si < nseg - 1 && active)  // the last segment's start state is still in registers
      for (int kt = 0; kt < nkt; ++kt) simdgroup_load(st[kt], ck + long(si) * kv + kt * 8 * V, ulong(V));
    for (int ci = i0; ci < i1 - 1; ++ci) {  // replay, keeping the state entering each chunk but the last
      const int c_t = bos + ci * KDA_CB;
      const int L = min(KDA_CB, eos - c_t);
      if (active)
        for (int kt = 0; kt < nkt; ++kt) simdgroup_store(st[kt], rp + long(ci - i0) * kv + kt * 8 * V, ulong(V));
      cb_prepare<T, KDA>(q, k, g, c_t, L, hv, h, params, tid, false, gbuf, fbuf, amat, mmat);
      if (active) cb_solve(v, beta, c_t, L, hv, c0, params, lane, st, fbuf, amat, xr, dl);
      cb_advance<T, KDA>(k, c_t, L, h, active, params, tid, lane, st, gbuf, fbuf, egl, dl, sc0, sc1);
    }
    for (int ci = i1 - 1; ci >= i0; --ci) {
      const int c_t = bos + ci * KDA_CB;
      const int L = min(KDA_CB, eos - c_t);
      if (ci < i1 - 1 && active)
        for (int kt = 0; kt < nkt; ++kt) simdgroup_load(st[kt], rp + long(ci - i0) * kv + kt * 8 * V, ulong(V));
      // P1-P3: recompute the chunk's forward quantities; dO' into dob
      cb_prepare<T, KDA>(q, k, g, c_t, L, hv, h, params, tid, true, gbuf, fbuf, amat, mmat);
      if (active) {
        cb_solve(v, beta, c_t, L, hv, c0, params, lane, st, fbuf, amat, xr, dl);
        for (int e = int(lane); e < KDA_CB * 8; e += 32) {
          const int i = e / 8, c = e % 8;
          dob[e] = i < L ? float(grad_o[(long(c_t + i) * HV + hv) * V + c0 + c]) * params.scale : 0.0f;
        }
      }
      cb_fill(k, c_t, L, h, params, tid, 2, gbuf, fbuf, egl);  // Kr, e^{G_L}
      // P4: ddelta = M^T dO' + Kr dS', then the transposed solve
      if (active) {
        simdgroup_float8x8 acc, a, b;
        for (int r = 0; r < 2; ++r) {
          acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
          for (int r2 = r; r2 < 2; ++r2) {
            simdgroup_load(a, mmat + r2 * 8 * KDA_CB + r * 8, ulong(KDA_CB), ulong2(0, 0), true);
            simdgroup_load(b, dob + r2 * 64, 8);
            simdgroup_multiply_accumulate(acc, a, b, acc);
          }
          for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
            if (kt < nkt) {
              simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K));
              simdgroup_multiply_accumulate(acc, a, ds[kt], acc);
            }
          }
          simdgroup_store(acc, ndx + r * 64, 8);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        if (lane < 8) {
          for (int j = KDA_CB - 1; j >= 0; --j) {
            float nd = 0.0f, yr = 0.0f;
            if (j < L) {
              float y = ndx[j * 8 + lane];
              for (int m = j + 1; m < L; ++m) y += amat[m * KDA_CB + j] * ndx[m * 8 + lane];  // ndx_m = -dX_m
              const long tv = long(c_t + j) * HV + hv;
              const float dx = beta[tv] * y;
              dv[tv * V + c0 + int(lane)] = T(dx);
              nd = -dx;
              yr = y * xr[j * 8 + lane];
            }
            ndx[j * 8 + lane] = nd;
            xr[j * 8 + lane] = yr;
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // P5: dM = dO' delta^T, dA = -dX delta^T (lower tiles), summed over the simdgroups; dbeta
      for (int w = int(sg); w < 6; w += KDA_CHUNK_NSG) {
        const int which = w / 3, ti = w % 3;
        const int ri = ti == 0 ? 0 : 1, rj = ti == 2 ? 1 : 0;
        simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f), a, b;
        for (int s = 0; s < KDA_CHUNK_NSG; ++s) {
          if (cb0 + s * 8 < V) {
            simdgroup_load(a, (which ? ndx_all : dob_all) + s * (KDA_CB * 8) + ri * 64, 8);
            simdgroup_load(b, dl_all + s * (KDA_CB * 8) + rj * 64, 8, ulong2(0, 0), true);
            simdgroup_multiply_accumulate(acc, a, b, acc);
          }
        }
        simdgroup_store(acc, (which ? dam : dmm) + ri * 8 * KDA_CB + rj * 8, ulong(KDA_CB));
      }
      if (int(tid) < L) {
        float acc = 0.0f;
        for (int s = 0; s < KDA_CHUNK_NSG; ++s)
          if (cb0 + s * 8 < V)
            for (int c = 0; c < 8; ++c) acc += xr_all[s * (KDA_CB * 8) + int(tid) * 8 + c];
        atomic_fetch_add_explicit(&dbeta[long(c_t + int(tid)) * HV + hv], acc, memory_order_relaxed);
      }
      // (no barrier: P6 writes only fbuf, last read before the barrier above, and reads dam/dmm after its own)
      // P6: per key tile, the products over value columns (dQg, dKg, dKr; S . dS' for dG_L), reduced over the
      // simdgroups in fbuf (free now), then dq, dk, dG of the 16 x 8 (token, key) block and the reverse cumsum.
      TG red = fbuf;                          // [sg][3][2 row blocks][8 k][8 i]
      TG gacc = fbuf + KDA_CHUNK_NSG * 384;   // [16 i][8 k]: dG without the G_L terms
      TG gkr = gacc + 128;                    // [16 i][8 k]: k_i dKr_i e^{G_L - G_i}
      TG gsd = gkr + 128;                     // [8 k]: e^{G_L} sum_v S dS'
      for (int kt = 0; kt < nkt; ++kt) {
        if (active) {
          simdgroup_float8x8 t, b;
          for (int r = 0; r < 2; ++r) {
            simdgroup_load(b, dob + r * 64, 8, ulong2(0, 0), true);
            simdgroup_multiply(t, st[kt], b);
            simdgroup_store(t, red + (sg * 3 + 0) * 128 + r * 64, 8);
            simdgroup_load(b, ndx + r * 64, 8, ulong2(0, 0), true);
            simdgroup_multiply(t, st[kt], b);
            simdgroup_store(t, red + (sg * 3 + 1) * 128 + r * 64, 8);
            simdgroup_load(b, dl + r * 64, 8, ulong2(0, 0), true);
            simdgroup_multiply(t, ds[kt], b);
            simdgroup_store(t, red + (sg * 3 + 2) * 128 + r * 64, 8);
          }
          simdgroup_store(st[kt], sc0, 8);
          simdgroup_store(ds[kt], sc1, 8);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        {
          const int i = int(tid) / 8, c = int(tid) % 8, kk = kt * 8 + c;
          const float gl = gbuf[(L - 1) * K + kk];
          if (i == 0) {
            float sd = 0.0f;
            for (int s = 0; s < KDA_CHUNK_NSG; ++s)
              if (cb0 + s * 8 < V)
                for (int u = 0; u < 8; ++u)
                  sd += sc_all[s * 128 + c * 8 + u] * sc_all[s * 128 + 64 + c * 8 + u];
            gsd[c] = precise::exp(gl) * sd;
          }
          if (i < L) {
            const int o = (i / 8) * 64 + c * 8 + (i % 8);
            float dqg = 0.0f, dkg = 0.0f, dkr = 0.0f;
            for (int s = 0; s < KDA_CHUNK_NSG; ++s) {
              if (cb0 + s * 8 < V) {
                dqg += red[(s * 3 + 0) * 128 + o];
                dkg += red[(s * 3 + 1) * 128 + o];
                dkr += red[(s * 3 + 2) * 128 + o];
              }
            }
            const float gi = gbuf[i * K + kk];
            const long t = c_t + i;
            const float qi = float(q[(t * H + h) * K + kk]), ki = float(k[(t * H + h) * K + kk]);
            float dq_in = 0.0f, dk_af = 0.0f, dk_as = 0.0f, dk_ms = 0.0f;
            for (int j = 0; j < L; ++j) {
              const long tj = (long(c_t + j) * H + h) * K + kk;
              const float gj = gbuf[j * K + kk];
              if (j <= i) {
                const float kd = float(k[tj]) * precise::exp(gi - gj);
                dq_in += dmm[i * KDA_CB + j] * kd;
                if (j < i) dk_af += dam[i * KDA_CB + j] * kd;
              }
              if (j >= i) {
                const float e = precise::exp(gj - gi);
                dk_ms += dmm[j * KDA_CB + i] * float(q[tj]) * e;
                if (j > i) dk_as += dam[j * KDA_CB + i] * float(k[tj]) * e;
              }
            }
            const float egi = precise::exp(gi);
            const float dq = dq_in + dqg * egi;
            const float dk_kg = dkg * egi, dk_kr = dkr * precise::exp(gl - gi);
            atomic_fetch_add_explicit(&dq_acc[(t * H + h) * K + kk], dq, memory_order_relaxed);
            atomic_fetch_add_explicit(&dk_acc[(t * H + h) * K + kk], dk_af + dk_as + dk_ms + dk_kg + dk_kr,
                                      memory_order_relaxed);
            gacc[i * 8 + c] = qi * dq + ki * (dk_af - dk_as - dk_ms + dk_kg - dk_kr);
            gkr[i * 8 + c] = ki * dk_kr;
          }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (KDA ? int(tid) < 8 : tid == 0) {
          const int c_lo = KDA ? int(tid) : 0, c_hi = KDA ? int(tid) + 1 : 8;
          float run = 0.0f;
          for (int c = c_lo; c < c_hi; ++c) {
            run += gsd[c];
            for (int i = 0; i < L; ++i) run += gkr[i * 8 + c];
          }
          for (int i = L - 1; i >= 0; --i) {
            for (int c = c_lo; c < c_hi; ++c) run += gacc[i * 8 + c];
            const long tv = long(c_t + i) * HV + hv;
            if (KDA) atomic_fetch_add_explicit(&dg[tv * K + kt * 8 + c_lo], run, memory_order_relaxed);
            else atomic_fetch_add_explicit(&dg[tv], run, memory_order_relaxed);
          }
        }
      }
      // P7: dS <- Diag(e^{G_L}) dS' + Qg^T dO' - Kg^T dX
      cb_fill(q, c_t, L, h, params, tid, 0, gbuf, fbuf, egl);  // Qg
      if (active) {
        simdgroup_float8x8 a, dec, tmp, b[2];
        simdgroup_load(b[0], dob, 8);
        simdgroup_load(b[1], dob + 64, 8);
        for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
          if (kt < nkt) {
            cb_decay_tile(dec, kt, lane, egl, (kt & 1) ? sc1 : sc0);
            simdgroup_multiply(tmp, dec, ds[kt]);
            for (int r = 0; r < 2; ++r) {
              simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K), ulong2(0, 0), true);
              simdgroup_multiply_accumulate(tmp, a, b[r], tmp);
            }
            ds[kt] = tmp;
          }
        }
      }
      cb_fill(k, c_t, L, h, params, tid, 1, gbuf, fbuf, egl);  // Kg
      if (active) {
        simdgroup_float8x8 a, b[2];
        simdgroup_load(b[0], ndx, 8);
        simdgroup_load(b[1], ndx + 64, 8);
        for (int kt = 0; kt < KDA_CB_NKT; ++kt) {
          if (kt < nkt) {
            for (int r = 0; r < 2; ++r) {
              simdgroup_load(a, fbuf + r * 8 * K + kt * 8, ulong(K), ulong2(0, 0), true);
              simdgroup_multiply_accumulate(ds[kt], a, b[r], ds[kt]);
            }
          }
        }
      }
      // No barrier here: the next chunk's cb_prepare writes gbuf (last read before cb_fill's final barrier)
      // and fbuf/amat/mmat only after its first barrier.
    }
  }
  for (int kt = 0; kt < KDA_CB_NKT; ++kt)
    if (kt < nkt && active) simdgroup_store(ds[kt], dh0 + sbase + long(kt) * 8 * V, ulong(V));
}

#define KDA_CHUNK_BWD_ARGS(T)                                                                                 \
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
// threadgroup memory: 2 x 16 x 128 + 4 x 256 + 4 x 4 x 128 + 4 x 128 + 128 floats = 30.5 KiB
#define KDA_CHUNK_BWD_SHARED                                                                                  \
  threadgroup float gbuf[KDA_CB * KDA_CHUNK_MAX_K];                                                           \
  threadgroup float fbuf[KDA_CB * KDA_CHUNK_MAX_K];                                                           \
  threadgroup float amat[KDA_CB * KDA_CB];                                                                    \
  threadgroup float mmat[KDA_CB * KDA_CB];                                                                    \
  threadgroup float dam[KDA_CB * KDA_CB];                                                                     \
  threadgroup float dmm[KDA_CB * KDA_CB];                                                                     \
  threadgroup float xr[KDA_CHUNK_NSG * KDA_CB * 8];                                                           \
  threadgroup float dl[KDA_CHUNK_NSG * KDA_CB * 8];                                                           \
  threadgroup float dob[KDA_CHUNK_NSG * KDA_CB * 8];                                                          \
  threadgroup float ndx[KDA_CHUNK_NSG * KDA_CB * 8];                                                          \
  threadgroup float sc[KDA_CHUNK_NSG * 128];                                                                  \
  threadgroup float egl[KDA_CHUNK_MAX_K]
#define KDA_CHUNK_BWD_PASS                                                                                    \
  q, k, v, g, beta, initial_state, cu_seqlens, grad_o, grad_final_state, dq_acc, dk_acc, dv, dg, dbeta, dh0,  \
      ckpt, replay, params, tgp, sg, lane, tid, gbuf, fbuf, amat, mmat, dam, dmm, xr, dl, dob, ndx, sc, egl

kernel void kda_chunk_bwd_f32(KDA_CHUNK_BWD_ARGS(float)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<float, true>(KDA_CHUNK_BWD_PASS);
}
kernel void kda_chunk_bwd_f16(KDA_CHUNK_BWD_ARGS(half)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<half, true>(KDA_CHUNK_BWD_PASS);
}
kernel void kda_chunk_bwd_bf16(KDA_CHUNK_BWD_ARGS(bfloat)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<bfloat, true>(KDA_CHUNK_BWD_PASS);
}
kernel void gdn_chunk_bwd_f32(KDA_CHUNK_BWD_ARGS(float)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<float, false>(KDA_CHUNK_BWD_PASS);
}
kernel void gdn_chunk_bwd_f16(KDA_CHUNK_BWD_ARGS(half)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<half, false>(KDA_CHUNK_BWD_PASS);
}
kernel void gdn_chunk_bwd_bf16(KDA_CHUNK_BWD_ARGS(bfloat)) {
  KDA_CHUNK_BWD_SHARED;
  chunk_bwd_body<bfloat, false>(KDA_CHUNK_BWD_PASS);
}
