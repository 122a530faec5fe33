// Recurrent (token by token) delta-rule forward, used by {kda,gdn}_recurrent_fwd and {kda,gdn}_recurrent_serve.
//
// One warp owns one (sequence, value head, V-slice of CW columns). Columns of the state are independent in the
// recurrence, so a warp never talks to another one. The warp's K x CW slice of the state lives in registers
// (NK x NV floats per lane) for the whole sequence. Per token, the two-pass step of DESIGN.md section 3:
//   pass 1: p = (Diag(e^g) S)^T k    -- reads S once, decay folded into k
//   pass 2: S = Diag(e^g) S + k (beta (v - p))^T and o = scale S^T q in the same sweep.
// The reductions over K combine registers first, then lanes with shuffles.
//
// Two register layouts, chosen by the state's memory layout so that each lane moves 16 bytes per access:
//   K-first [K, V] (VF=false): a lane holds 4 consecutive columns of NK rows; LV lanes span the slice's columns.
//   V-first [V, K] (VF=true):  a lane holds 4 consecutive rows of a column, 8 lanes span 32 rows.
// q, k and e^g of the token are staged in shared memory (double-buffered per warp, prefetched one token ahead).
#pragma once

#include "delta_common.cuh"

namespace kda_kernels {
namespace cuda {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  void* o;
  int in_dtype;
  const int64_t* cu_seqlens;  // nullptr: N == B sequences of T tokens
  int B, T, H, HV, K, V, N;
  float scale;
  int slices;  // ceil(V / CW)
  // state: s_in rows are read (nullptr: zeros), s_out rows are written
  const void* s_in;
  void* s_out;
  bool serve;                     // false: s_in/s_out indexed by sequence; true: pool rows from idx
  const int64_t* idx;             // serve: [N] or [N, idx_cols]
  int idx_cols;                   // 0 when idx is [N]
  const int64_t* num_accepted;    // serve, [N] or nullptr
  bool vec;                       // the state's contiguous axis allows aligned 4-wide accesses
};

template <bool VF, int CW, int KMAX>
struct FwdGeo {
  static constexpr int LV = VF ? 4 : CW / 4;   // lanes across the slice's columns
  static constexpr int LK = 32 / LV;           // lanes across K
  static constexpr int NK = KMAX / LK;         // rows per lane
  static constexpr int NV = VF ? CW / 4 : 4;   // columns per lane
  static_assert(LV * LK == 32, "geometry");
  static_assert(NK >= 4 && NK % 4 == 0 && NV >= 1, "geometry");
  __device__ __forceinline__ static int lane_k(int lane) { return VF ? lane % LK : lane / LV; }
  __device__ __forceinline__ static int lane_v(int lane) { return VF ? lane / LK : lane % LV; }
  __device__ __forceinline__ static int row(int kg, int i) { return VF ? 4 * kg + 4 * LK * (i / 4) + (i % 4) : kg + LK * i; }
  __device__ __forceinline__ static int col(int vg, int j) { return VF ? vg + LV * j : 4 * vg + j; }
  // sum over the lanes that share this lane's columns
  __device__ __forceinline__ static float ksum(float x) { return VF ? warp_sum_below<LK>(x) : warp_sum_from<LV>(x); }
};

constexpr int kFwdWarps = 4;

template <typename S, bool VF, int CW, int KMAX>
__device__ __forceinline__ void fwd_load_tile(float (&s)[FwdGeo<VF, CW, KMAX>::NK][FwdGeo<VF, CW, KMAX>::NV],
                                              const S* base, int K, int V, int c0, int kg, int vg, bool vec) {
  using G = FwdGeo<VF, CW, KMAX>;
  if (!VF) {
    const int c = c0 + 4 * vg;
#pragma unroll
    for (int i = 0; i < G::NK; ++i) {
      const int r = G::row(kg, i);
      const int n = r < K ? min(4, V - c) : 0;
      float4 x = load_state4(base + static_cast<int64_t>(r) * V + c, n, vec);
      s[i][0] = x.x; s[i][1] = x.y; s[i][2] = x.z; s[i][3] = x.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < G::NV; ++j) {
      const int c = c0 + G::col(vg, j);
#pragma unroll
      for (int i4 = 0; i4 < G::NK / 4; ++i4) {
        const int r = G::row(kg, 4 * i4);
        const int n = c < V ? min(4, K - r) : 0;
        float4 x = load_state4(base + static_cast<int64_t>(c) * K + r, n, vec);
        s[4 * i4][j] = x.x; s[4 * i4 + 1][j] = x.y; s[4 * i4 + 2][j] = x.z; s[4 * i4 + 3][j] = x.w;
      }
    }
  }
}

template <typename S, bool VF, int CW, int KMAX>
__device__ __forceinline__ void fwd_store_tile(const float (&s)[FwdGeo<VF, CW, KMAX>::NK][FwdGeo<VF, CW, KMAX>::NV],
                                               S* base, int K, int V, int c0, int kg, int vg, bool vec) {
  using G = FwdGeo<VF, CW, KMAX>;
  if (!VF) {
    const int c = c0 + 4 * vg;
#pragma unroll
    for (int i = 0; i < G::NK; ++i) {
      const int r = G::row(kg, i);
      const int n = r < K ? min(4, V - c) : 0;
      store_state4(base + static_cast<int64_t>(r) * V + c, make_float4(s[i][0], s[i][1], s[i][2], s[i][3]), n, vec);
    }
  } else {
#pragma unroll
    for (int j = 0; j < G::NV; ++j) {
      const int c = c0 + G::col(vg, j);
#pragma unroll
      for (int i4 = 0; i4 < G::NK / 4; ++i4) {
        const int r = G::row(kg, 4 * i4);
        const int n = c < V ? min(4, K - r) : 0;
        store_state4(base + static_cast<int64_t>(c) * K + r,
                     make_float4(s[4 * i4][j], s[4 * i4 + 1][j], s[4 * i4 + 2][j], s[4 * i4 + 3][j]), n, vec);
      }
    }
  }
}

// PC: per-channel gate (KDA) or per-head gate (GDN). S: state storage dtype.
template <bool PC, bool VF, int CW, int KMAX, typename S>
// min 4 blocks/SM caps registers at 128: more resident warps, so more state bytes in flight when decoding
__global__ void __launch_bounds__(32 * kFwdWarps, 4) delta_recurrent_fwd_kernel(const FwdParams p) {
  using G = FwdGeo<VF, CW, KMAX>;
  constexpr int NK = G::NK, NV = G::NV, KM = KMAX / 32;
  constexpr int NB = PC ? 3 : 2;  // staged vectors: q, k (, e^g)
  __shared__ float stage[kFwdWarps][2][NB][KMAX];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kFwdWarps + warp;
  if (gw >= static_cast<int64_t>(p.N) * p.HV * p.slices) return;  // whole warp; no block-wide sync below
  const int sl = static_cast<int>(gw % p.slices);
  const int64_t nh = gw / p.slices;
  const int hv = static_cast<int>(nh % p.HV);
  const int n = static_cast<int>(nh / p.HV);
  const int h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, dt = p.in_dtype;
  const int kg = G::lane_k(lane), vg = G::lane_v(lane);
  const int c0 = sl * CW;

  int64_t bos;
  int len;
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);

  const int64_t head_elems = static_cast<int64_t>(K) * V;
  const int64_t row_elems = head_elems * HV;

  // which state row to start from
  int64_t in_row = n;
  if (p.serve) {
    const int start_col = p.idx_cols == 0 ? 0 : (p.num_accepted ? static_cast<int>(p.num_accepted[n]) - 1 : 0);
    in_row = p.idx_cols == 0 ? p.idx[n] : p.idx[static_cast<int64_t>(n) * p.idx_cols + start_col];
    if (in_row < 0) {  // padding slot: zero outputs, no state read or written
      if (kg == 0) {
        for (int t = 0; t < len; ++t) {
          const int64_t ob = ((bos + t) * HV + hv) * V;
#pragma unroll
          for (int j = 0; j < NV; ++j) {
            const int c = c0 + G::col(vg, j);
            if (c < V) store_in(p.o, ob + c, dt, 0.f);
          }
        }
      }
      return;
    }
  }

  float s[NK][NV];
  if (p.s_in != nullptr) {
    fwd_load_tile<S, VF, CW, KMAX>(s, reinterpret_cast<const S*>(p.s_in) + in_row * row_elems + hv * head_elems, K,
                                   V, c0, kg, vg, p.vec);
  } else {
#pragma unroll
    for (int i = 0; i < NK; ++i)
#pragma unroll
      for (int j = 0; j < NV; ++j) s[i][j] = 0.f;
  }

  // prefetch registers for one token
  float pq[KM], pk[KM], pg[KM], pv[NV], pb = 0.f, pgs = 0.f;
  auto load_token = [&](int t) {
    const int64_t tok = bos + t;
    const int64_t qb = (tok * H + h) * K;
#pragma unroll
    for (int m = 0; m < KM; ++m) {
      const int e = lane + 32 * m;
      pq[m] = e < K ? load_in(p.q, qb + e, dt) : 0.f;
      pk[m] = e < K ? load_in(p.k, qb + e, dt) : 0.f;
      if (PC) pg[m] = e < K ? p.g[(tok * HV + hv) * K + e] : 0.f;
    }
    if (!PC) pgs = p.g[tok * HV + hv];
    pb = p.beta[tok * HV + hv];
    const int64_t vb = (tok * HV + hv) * V;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int c = c0 + G::col(vg, j);
      pv[j] = c < V ? load_in(p.v, vb + c, dt) : 0.f;
    }
  };
  if (len > 0) load_token(0);

  for (int t = 0; t < len; ++t) {
    const int buf = t & 1;
    float(*st)[KMAX] = stage[warp][buf];
#pragma unroll
    for (int m = 0; m < KM; ++m) {
      const int e = lane + 32 * m;
      st[0][e] = pq[m];
      st[1][e] = pk[m];
      if (PC) st[2][e] = expf(pg[m]);
    }
    const float beta = pb;
    const float dscalar = PC ? 1.f : expf(pgs);
    float vv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) vv[j] = pv[j];
    __syncwarp();
    if (t + 1 < len) load_token(t + 1);

    // pass 1: p = (Diag(e^g) S)^T k
    float pr[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) pr[j] = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int r = G::row(kg, i);
      const float kd = st[1][r] * (PC ? st[2][r] : dscalar);
#pragma unroll
      for (int j = 0; j < NV; ++j) pr[j] = fmaf(s[i][j], kd, pr[j]);
    }
    float del[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) del[j] = beta * (vv[j] - G::ksum(pr[j]));
    // pass 2: S = Diag(e^g) S + k del^T, o = S^T q
    float ov[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) ov[j] = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int r = G::row(kg, i);
      const float d = PC ? st[2][r] : dscalar;
      const float kk = st[1][r], qq = st[0][r];
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        s[i][j] = fmaf(s[i][j], d, kk * del[j]);
        ov[j] = fmaf(s[i][j], qq, ov[j]);
      }
    }
    const int64_t tok = bos + t;
    const int64_t ob = (tok * HV + hv) * V;
#pragma unroll
    for (int j = 0; j < NV; ++j) ov[j] = G::ksum(ov[j]);
    if (kg == 0) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = c0 + G::col(vg, j);
        if (c < V) store_in(p.o, ob + c, dt, p.scale * ov[j]);
      }
    }
    if (p.serve && p.idx_cols > 0 && t < p.idx_cols) {
      const int64_t row = p.idx[static_cast<int64_t>(n) * p.idx_cols + t];
      if (row >= 0)
        fwd_store_tile<S, VF, CW, KMAX>(s, reinterpret_cast<S*>(p.s_out) + row * row_elems + hv * head_elems, K, V,
                                        c0, kg, vg, p.vec);
    }
  }
  if (!p.serve) {
    fwd_store_tile<S, VF, CW, KMAX>(s, reinterpret_cast<S*>(p.s_out) + static_cast<int64_t>(n) * row_elems +
                                           hv * head_elems, K, V, c0, kg, vg, p.vec);
  } else if (p.idx_cols == 0) {
    fwd_store_tile<S, VF, CW, KMAX>(s, reinterpret_cast<S*>(p.s_out) + in_row * row_elems + hv * head_elems, K, V,
                                    c0, kg, vg, p.vec);
  }
}

}  // namespace cuda
}  // namespace kda_kernels
