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

#include <type_traits>

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
                                  // (decode kernel: 16-byte accesses; the launcher sets it)
  bool tvec;                      // decode kernel: q, k, g rows allow aligned 16-byte loads (K % 8 == 0)
  bool vvec;                      // decode kernel: v rows allow aligned 16-byte loads (V % 8 == 0)
  int dec_flags;                  // decode kernel with HINT = kDecHintRuntime: memory hints kDec* below
};

// decode kernel memory hints: delta_decode_kernel's template parameter HINT (a compile-time sum of the flags below,
// so the default kernels carry no flag tests per state access), or HINT = kDecHintRuntime: read from
// FwdParams::dec_flags at run time (session 7's flag tests, kept for A/B runs: KDA_CUDA_DEC_HINT, delta_host.cuh)
constexpr int kDecEvictFirstLoad = 1;  // state copies (cp.async, STAGE 1/2) with an L2 evict-first cache policy
constexpr int kDecStreamStore = 2;     // state stores st.global.cs (streaming, evict first)
constexpr int kDecPrefetch256 = 8;     // state copies (STAGE 1/2) with the L2::256B prefetch-size qualifier
constexpr int kDecHintRuntime = -1;
// the default hints per state element size: streaming stores for bf16/fp16 states, none for fp32 (measured in
// session 7, benchmarks/results/cuda_decode_session7.json)
__host__ __device__ constexpr int dec_default_hint(int esize) { return esize == 2 ? kDecStreamStore : 0; }

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


// ================================================================================================ decode kernel
// Specialisation for decoding (about one token per sequence): no token staging and no prefetch registers, every
// load (state tile, q, k, g, v, beta) is issued before any math so all of a warp's bytes are in flight at once,
// every state access moves 16 bytes per lane, and few registers per lane so that many warps are resident.
//
// A work item = (sequence, value head, slice of CW columns of V). WK warps split the item's K rows (cross-warp
// sums through shared memory and named barriers); a block holds WI = NW / WK items. A lane holds a TR x TC tile:
//   K-first [K, V]: TC = E consecutive columns (16 bytes of one row), TR consecutive rows; LV lanes span a row's
//                   CW columns (LV x 16 contiguous bytes per row), LK lanes span the warp's rows.
//   V-first [V, K]: TR = E consecutive rows (16 bytes of one column), TC consecutive columns.
// E = 16 / sizeof(state dtype): 4 fp32 values, 8 bf16/fp16 values (fp32 math, rounding on store). The kernel
// loops over a sequence's tokens, so it is exact for any length; the host picks it when sequences have ~1 token.
template <bool VF, typename S, int CW, int WK, int KMAX>
struct DecGeo {
  static constexpr int E = 16 / static_cast<int>(sizeof(S));
  static constexpr int RW = KMAX / WK;                            // rows per warp
  static constexpr int LK = VF ? RW / E : 32 / (CW / E);           // lanes across the warp's rows
  static constexpr int LV = 32 / LK;                               // lanes across the item's columns
  static constexpr int TR = VF ? E : RW / LK;                      // rows per lane (consecutive)
  static constexpr int TC = VF ? CW / LV : E;                      // columns per lane (consecutive)
  static constexpr int NW = WK > 4 ? WK : 4;                       // warps per block
  static constexpr int WI = NW / WK;                               // items per block
  static_assert(LK * LV == 32 && TR * LK == RW && TC * LV == CW && TR >= 1 && TC >= 1, "decode geometry");
  static_assert(!VF || TR == E, "decode geometry");
  static_assert(VF || TC == E, "decode geometry");
  static_assert(WK == 1 || WI <= 2, "named barriers: at most 2 items per block split K");
  // lane = VF ? vg * LK + kg : kg * LV + vg
  __device__ __forceinline__ static int lane_k(int lane) { return VF ? lane % LK : lane / LV; }
  __device__ __forceinline__ static int lane_v(int lane) { return VF ? lane / LK : lane % LV; }
  __device__ __forceinline__ static float ksum(float x) { return VF ? warp_sum_below<LK>(x) : warp_sum_from<LV>(x); }
};

// The decode configurations: (CW, WK) per state layout and storage width (KDA_CUDA_DEC_CFG picks one). Configs
// 0-2 give every lane 8 chunks of 16 bytes (4 KB of state per warp; V-first bf16/fp16 config 1: 4 chunks) and
// differ in how many warps share an item; config 3 splits an item the most (small batches: more warps, shorter).
//   K-first fp32: (8,1) (16,2) (32,4) (8,4)     K-first bf16/fp16: (16,1) (32,2) (64,4) (16,4)
//   V-first fp32: (8,1) (16,2) (32,4) (4,4)     V-first bf16/fp16: (16,1) (16,2) (32,2) (4,2)
constexpr int kDecCfgs = 4;
__host__ __device__ constexpr int dec_cw(bool vf, int esize, int cfg) {
  return !vf ? (esize == 4 ? (cfg == 0 ? 8 : cfg == 1 ? 16 : cfg == 2 ? 32 : 8)
                           : (cfg == 0 ? 16 : cfg == 1 ? 32 : cfg == 2 ? 64 : 16))
             : (esize == 4 ? (cfg == 0 ? 8 : cfg == 1 ? 16 : cfg == 2 ? 32 : 4)
                           : (cfg == 0 ? 16 : cfg == 1 ? 16 : cfg == 2 ? 32 : 4));
}
__host__ __device__ constexpr int dec_wk(bool vf, int esize, int cfg) {
  return !vf ? (esize == 4 ? (cfg == 0 ? 1 : cfg == 1 ? 2 : cfg == 2 ? 4 : 4)
                           : (cfg == 0 ? 1 : cfg == 1 ? 2 : cfg == 2 ? 4 : 4))
             : (esize == 4 ? (cfg == 0 ? 1 : cfg == 1 ? 2 : cfg == 2 ? 4 : 4)
                           : (cfg == 0 ? 1 : cfg == 1 ? 2 : cfg == 2 ? 2 : 2));
}

__device__ __forceinline__ float2 unpack_half2(uint32_t w, bool bf) {
  // bf16 -> fp32 is exact bit placement: low half shifted up, high half masked (one instruction each; the
  // intrinsic __bfloat1622float2 took PRMT + shift for the high half)
  if (bf) return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}

// E consecutive state values (16 bytes when `vec` and n >= E); missing values read as 0.
template <typename S, int E>
__device__ __forceinline__ void dec_load_state(const S* p, float (&x)[E], int n, bool vec) {
  if (vec && n >= E) {
    if constexpr (sizeof(S) == 4) {
      const float4 f = *reinterpret_cast<const float4*>(p);
      x[0] = f.x; x[1] = f.y; x[2] = f.z; x[3] = f.w;
    } else {
      const uint4 r = *reinterpret_cast<const uint4*>(p);
      constexpr bool bf = std::is_same<S, __nv_bfloat16>::value;
      float2 a = unpack_half2(r.x, bf), b = unpack_half2(r.y, bf), c = unpack_half2(r.z, bf),
             d = unpack_half2(r.w, bf);
      x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y; x[4] = c.x; x[5] = c.y; x[6] = d.x; x[7] = d.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = e < n ? StateIO<S>::load1(p + e) : 0.f;
  }
}

template <typename S, int E>
__device__ __forceinline__ void dec_store_state(S* p, const float (&x)[E], int n, bool vec, bool cs = false) {
  if (vec && n >= E) {
    if constexpr (sizeof(S) == 4) {
      const float4 f = make_float4(x[0], x[1], x[2], x[3]);
      if (cs) __stcs(reinterpret_cast<float4*>(p), f);  // streaming store (evict first)
      else *reinterpret_cast<float4*>(p) = f;
    } else {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (std::is_same<S, __nv_bfloat16>::value) {
          __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
          w[e] = *reinterpret_cast<uint32_t*>(&h);
        } else {
          __half2 h = __floats2half2_rn(x[2 * e], x[2 * e + 1]);
          w[e] = *reinterpret_cast<uint32_t*>(&h);
        }
      }
      const uint4 u = make_uint4(w[0], w[1], w[2], w[3]);
      if (cs) __stcs(reinterpret_cast<uint4*>(p), u);
      else *reinterpret_cast<uint4*>(p) = u;
    }
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (e < n) StateIO<S>::store1(p + e, x[e]);
  }
}

// N consecutive input values (runtime dtype dt) at element offset off; vector loads when `vec` (off is a multiple
// of N, the base 16-byte aligned) and all N exist; missing values read as `fill`.
template <int N>
__device__ __forceinline__ void dec_load_in(const void* p, int64_t off, int dt, int n, bool vec, float (&x)[N],
                                            float fill) {
  if (N % 4 == 0 && vec && n >= N) {
    if (dt == kF32) {
#pragma unroll
      for (int c = 0; c < N / 4; ++c) {
        const float4 f = reinterpret_cast<const float4*>(p)[(off >> 2) + c];
        x[4 * c] = f.x; x[4 * c + 1] = f.y; x[4 * c + 2] = f.z; x[4 * c + 3] = f.w;
      }
    } else if (N % 8 == 0) {
#pragma unroll
      for (int c = 0; c < N / 8; ++c) {
        const uint4 r = reinterpret_cast<const uint4*>(p)[(off >> 3) + c];
        const bool bf = dt == kBF16;
        float2 a = unpack_half2(r.x, bf), b = unpack_half2(r.y, bf), cc = unpack_half2(r.z, bf),
               d = unpack_half2(r.w, bf);
        x[8 * c] = a.x; x[8 * c + 1] = a.y; x[8 * c + 2] = b.x; x[8 * c + 3] = b.y;
        x[8 * c + 4] = cc.x; x[8 * c + 5] = cc.y; x[8 * c + 6] = d.x; x[8 * c + 7] = d.y;
      }
    } else {  // N == 4, 2-byte values: one 8-byte load
      const uint2 r = reinterpret_cast<const uint2*>(p)[off >> 2];
      const bool bf = dt == kBF16;
      float2 a = unpack_half2(r.x, bf), b = unpack_half2(r.y, bf);
      x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = e < n ? load_in(p, off + e, dt) : fill;
  }
}

// Named barriers of item wi (at most 2 items per block use them): ids 1 + 2 wi (sync) and 2 + 2 wi (arrive/sync).
// Immediate ids so that ptxas reserves only the barriers used.
template <int ID>
__device__ __forceinline__ void bar_sync(int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "r"(nthreads) : "memory");
}
template <int ID>
__device__ __forceinline__ void bar_arrive(int nthreads) {
  asm volatile("bar.arrive %0, %1;" ::"n"(ID), "r"(nthreads) : "memory");
}
template <int SLOT>
__device__ __forceinline__ void named_sync(int wi, int nthreads) {
  if (wi == 0) bar_sync<1 + SLOT>(nthreads);
  else bar_sync<3 + SLOT>(nthreads);
}
template <int SLOT>
__device__ __forceinline__ void named_arrive(int wi, int nthreads) {
  if (wi == 0) bar_arrive<1 + SLOT>(nthreads);
  else bar_arrive<3 + SLOT>(nthreads);
}

template <bool VF, typename S, int CW, int WK, int KMAX>
__device__ __forceinline__ void dec_tile_io(float (&s)[DecGeo<VF, S, CW, WK, KMAX>::TR][DecGeo<VF, S, CW, WK, KMAX>::TC],
                                            const S* lbase, S* sbase, int K, int V, int row0, int col0, bool vec,
                                            bool full) {
  // exactly one of lbase / sbase is non-null
  using G = DecGeo<VF, S, CW, WK, KMAX>;
  constexpr int TR = G::TR, TC = G::TC, E = G::E;
  if constexpr (!VF) {
    const int nc = full ? E : min(E, V - col0);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
      const int r = row0 + i;
      const int n = (full || r < K) ? nc : 0;
      const int64_t off = static_cast<int64_t>(r) * V + col0;
      if (lbase) dec_load_state<S, E>(lbase + off, s[i], n, vec);
      else dec_store_state<S, E>(sbase + off, s[i], n, vec);
    }
  } else {
    const int nr = full ? E : min(E, K - row0);
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      const int c = col0 + j;
      const int n = (full || c < V) ? nr : 0;
      const int64_t off = static_cast<int64_t>(c) * K + row0;
      float x[E];
      if (lbase) {
        dec_load_state<S, E>(lbase + off, x, n, vec);
#pragma unroll
        for (int i = 0; i < TR; ++i) s[i][j] = x[i];
      } else {
#pragma unroll
        for (int i = 0; i < TR; ++i) x[i] = s[i][j];
        dec_store_state<S, E>(sbase + off, x, n, vec);
      }
    }
  }
}

// STAGE: 0 = state tile in registers; 1 = state tile copied into shared memory with cp.async (no registers held
// while its bytes are in flight) and streamed from there; 2 = as 1 with two items per warp group, both items'
// copies issued up front (twice the bytes in flight per warp).
// KDA_CUDA_DEC_LEAN=2: blocks per SM of the LEAN kernels (0: as LEAN=1, 8). fp32 states 10 (at most 48 registers; the
// fp32 defaults spill 0-4 bytes there), K-first 2-byte states 9 (56 registers; cfg 1, the default, spills nothing),
// V-first 2-byte states 8 (cfg 0, the default at large batches, spills 104 bytes at 56 registers).
__host__ __device__ constexpr int dec_lean_minb(bool vf, int esize) { return esize == 4 ? 10 : vf ? 0 : 9; }

template <bool VF, typename S, int CW, int WK, int STAGE>
struct DecBounds {
  using G = DecGeo<VF, S, CW, WK, 128>;
  static constexpr int kThreads = 32 * G::NW;
  // (STAGE 2 with 4 warps: shared memory allows 7 blocks per SM, so 72 registers cost no occupancy)
  static constexpr int kRegCap = STAGE == 2 ? 72 : STAGE ? 64 : (G::TR * G::TC <= 16 ? 64 : (G::TR * G::TC <= 32 ? 80 : 128));
  static constexpr int kMinBlocks = 65536 / (kThreads * kRegCap);
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
}
// cp_async16 with the memory hints of FwdParams::dec_flags (kDecEvictFirstLoad: an L2 evict-first cache policy,
// made here rather than held in registers across the kernel; kDecPrefetch256: the L2::256B prefetch-size qualifier)
__device__ __forceinline__ void cp_async16_hint(void* smem, const void* gmem, int flags) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  uint64_t pol = 0;
  if (flags & kDecEvictFirstLoad) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  if (flags & kDecPrefetch256) {
    if (flags & kDecEvictFirstLoad)
      asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem),
                   "l"(pol) : "memory");
    else
      asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
  } else if (flags & kDecEvictFirstLoad) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "l"(pol)
                 : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem) : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// LEAN (KDA_CUDA_DEC_LEAN) helpers. Recursive-halving reduce-scatter over the LK lanes that share a lane's columns
// (the kg bits of the lane index: xor masks 1 .. LK/2 for V-first, LV .. 16 for K-first): each round a lane keeps
// half of its partial sums (the upper half when its mask bit is set), sends the other half to its partner and adds
// the partner's half; once one value is left, the remaining rounds add plainly. Afterwards x[0 .. FC) hold the sums
// over all LK lanes of columns own .. own + FC - 1 (FC = max(1, TC / LK)); TC + TC/2 + ... shuffles instead of
// TC log2(LK). (Same sums, another fp32 addition order than G::ksum.)
template <int M, int CNT, int TC>
__device__ __forceinline__ void dec_rs_round(float (&x)[TC], int lane, int& own) {
  if constexpr (CNT > 1) {
    constexpr int HALF = CNT / 2;
    const bool b = (lane & M) != 0;
#pragma unroll
    for (int j = 0; j < HALF; ++j) {
      const float keep = b ? x[j + HALF] : x[j];
      const float send = b ? x[j] : x[j + HALF];
      x[j] = keep + __shfl_xor_sync(0xffffffffu, send, M);
    }
    own += b ? HALF : 0;
  } else {
    x[0] += __shfl_xor_sync(0xffffffffu, x[0], M);
  }
}
template <bool VF, int LV, int LK, int TC, int R = 0, int CNT = TC>
__device__ __forceinline__ void dec_rs_sum(float (&x)[TC], int lane, int& own) {
  if constexpr ((1 << R) < LK) {
    dec_rs_round<VF ? (1 << R) : (LV << R), CNT, TC>(x, lane, own);
    dec_rs_sum<VF, LV, LK, TC, R + 1, (CNT > 1 ? CNT / 2 : 1)>(x, lane, own);
  }
}

// One token per sequence (T == 1, no cu_seqlens; the host checks). FIX = 128: K = V = 128 and every access aligned
// (the host checks), no ragged-edge code; FIX = 0: any K <= 128 and V. The new state is stored chunk by chunk
// during the update sweep. HINT: memory hints (kDec* above, compile time; kDecHintRuntime: FwdParams::dec_flags).
// FUSE (KDA_CUDA_DEC_FUSE): o from the old state in pass 1, o = scale (S^T (d * q) + (k . q) beta (v - p)), so that
// the reductions of p and o share one round of shuffles and one barrier, and pass 2 only updates and stores S
// (mathematically the same o; fp32 rounding differs).
// LEAN (KDA_CUDA_DEC_LEAN=1; FIX = 128, STAGE 1, not FUSE): fewer instructions per item and a shorter path after the
// state arrives: 32-bit item indices with a compile-time slice count; KDA's gate exps computed once per row of the
// warp (RW / 32 per lane instead of TR, the rows' values exchanged through shared memory; bit-identical) and before
// the cp.async wait; o reduced by a reduce-scatter (dec_rs_sum) and stored by every lane of the first warp, one
// column each, instead of TC log2(LK) shuffles and TC scalar stores by the kg == 0 lanes.
// MINB: blocks per SM for __launch_bounds__ (0: DecBounds' default, 8 at stage 1; KDA_CUDA_DEC_LEAN=2 runs the LEAN
// kernels with dec_lean_minb blocks per SM).
template <bool PC, bool VF, typename S, int CW, int WK, int FIX, int STAGE, int HINT, bool FUSE, bool LEAN = false,
          int MINB = 0>
__global__ void __launch_bounds__(DecBounds<VF, S, CW, WK, STAGE>::kThreads,
                                  MINB ? MINB : DecBounds<VF, S, CW, WK, STAGE>::kMinBlocks)
    delta_decode_kernel(const FwdParams p) {
  constexpr int KMAX = 128;
  using G = DecGeo<VF, S, CW, WK, KMAX>;
  constexpr int TR = G::TR, TC = G::TC, E = G::E, WI = G::WI, NW = G::NW;
  constexpr int IPW = STAGE == 2 ? 2 : 1;  // items per warp group
  constexpr int NCH = VF ? TC : TR;        // 16-byte state chunks per lane: rows (K-first) or columns (V-first)
  static_assert(!LEAN || (FIX == 128 && STAGE == 1 && !FUSE && HINT != kDecHintRuntime), "LEAN variant");
  constexpr int RW = G::RW;                 // rows per warp (32, 64 or 128)
  constexpr int GPL = RW / 32;              // LEAN: gate rows per lane
  __shared__ __align__(16) float gexp[LEAN && PC ? NW : 1][LEAN && PC ? RW : 1];  // LEAN: e^g of the warp's rows
  __shared__ float red_p[IPW][WI][WK][CW];  // per item: a warp may write item 1's partials while another still
                                           // reads item 0's (the second barrier is arrive-only for warps > 0)
  __shared__ float red_o[WI][WK][CW];
  __shared__ float red_q[FUSE ? IPW : 1][FUSE ? WI : 1][FUSE ? WK : 1][FUSE ? CW + 1 : 1];  // FUSE: o's, k.q
  __shared__ uint4 stage[STAGE ? NW : 1][IPW][STAGE ? NCH : 1][32];  // [chunk][lane]: conflict-free accesses

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wi = warp / WK, wk = warp % WK;
  const int64_t total = static_cast<int64_t>(p.N) * p.HV * p.slices;
  constexpr bool full = FIX != 0;
  const int K = full ? FIX : p.K, V = full ? FIX : p.V, HV = p.HV, H = p.H, dt = p.in_dtype;
  const bool vec = full || p.vec, tvec = full || p.tvec, vvec = full || p.vvec;
  const int kg = G::lane_k(lane), vg = G::lane_v(lane);
  const int row0 = wk * G::RW + kg * TR;
  const bool out_lane = wk == 0 && kg == 0;  // stores o for this lane's columns
  const int64_t head_elems = static_cast<int64_t>(K) * V;
  const int64_t row_elems = head_elems * HV;
  const int flags = HINT == kDecHintRuntime ? p.dec_flags : HINT;  // a constant unless HINT == kDecHintRuntime
  const bool cs = (flags & kDecStreamStore) != 0;

  // item it of this warp group: (sequence n, value head hv, column slice sl); its state rows
  struct Item {
    int64_t item, in_row, out_row;
    int n, hv, col0;
  };
  auto get_item = [&](int it) {
    Item m;
    int sl;
    if constexpr (LEAN) {  // 32-bit (the host checks N * HV * slices < 2^31), slices = 128 / CW at compile time
      constexpr unsigned SL = 128 / CW;
      const unsigned it32 = blockIdx.x * static_cast<unsigned>(WI) + static_cast<unsigned>(wi);
      m.item = it32;
      const unsigned itc = m.item < total ? it32 : 0u;
      sl = static_cast<int>(itc % SL);
      const unsigned nh = itc / SL;
      const unsigned n32 = nh / static_cast<unsigned>(p.HV);
      m.n = static_cast<int>(n32);
      m.hv = static_cast<int>(nh - n32 * static_cast<unsigned>(p.HV));
    } else {
      m.item = (static_cast<int64_t>(blockIdx.x) * IPW + it) * WI + wi;
      const int64_t itc = m.item < total ? m.item : 0;
      sl = static_cast<int>(itc % p.slices);
      const int64_t nh = itc / p.slices;
      m.hv = static_cast<int>(nh % p.HV);
      m.n = static_cast<int>(nh / p.HV);
    }
    m.col0 = sl * CW + vg * TC;
    m.in_row = m.out_row = m.n;
    if (p.serve && m.item < total) {
      if (p.idx_cols == 0) {
        m.in_row = m.out_row = p.idx[m.n];
      } else {
        const int start_col = p.num_accepted ? static_cast<int>(p.num_accepted[m.n]) - 1 : 0;
        m.in_row = p.idx[static_cast<int64_t>(m.n) * p.idx_cols + start_col];
        m.out_row = p.idx[static_cast<int64_t>(m.n) * p.idx_cols];  // token 0 writes column 0 (negative: none)
      }
    }
    return m;
  };
  // chunk c of a lane: element offset in the head's state and the number of values that exist
  auto chunk_off = [&](int col0, int c) -> int64_t {
    return VF ? static_cast<int64_t>(col0 + c) * K + row0 : static_cast<int64_t>(row0 + c) * V + col0;
  };
  auto chunk_n = [&](int col0, int c) -> int {
    if (full) return E;
    return VF ? ((col0 + c) < V ? min(E, K - row0) : 0) : ((row0 + c) < K ? min(E, V - col0) : 0);
  };

  Item items[IPW];
#pragma unroll
  for (int it = 0; it < IPW; ++it) items[it] = get_item(it);
  // ---- shared-memory variants: every item's state copies are issued first
  if constexpr (STAGE != 0) {
#pragma unroll
    for (int it = 0; it < IPW; ++it) {
      const Item& m = items[it];
      const bool live = m.item < total && m.in_row >= 0 && p.s_in != nullptr;
      const S* src = reinterpret_cast<const S*>(p.s_in) + m.in_row * row_elems + m.hv * head_elems;
      if constexpr (full) {  // every chunk is whole: one test per item, not per chunk
        if (live && LEAN) {  // one 64-bit base address, constant chunk strides (K = V = FIX: immediate offsets)
          const S* s0 = src + chunk_off(m.col0, 0);
#pragma unroll
          for (int c = 0; c < NCH; ++c) cp_async16(&stage[warp][it][c][lane], s0 + c * FIX);
        } else if (live) {
#pragma unroll
          for (int c = 0; c < NCH; ++c) {
            if (flags & (kDecEvictFirstLoad | kDecPrefetch256))
              cp_async16_hint(&stage[warp][it][c][lane], src + chunk_off(m.col0, c), flags);
            else
              cp_async16(&stage[warp][it][c][lane], src + chunk_off(m.col0, c));
          }
        } else {
#pragma unroll
          for (int c = 0; c < NCH; ++c) stage[warp][it][c][lane] = make_uint4(0, 0, 0, 0);
        }
        cp_async_commit();
        continue;
      }
#pragma unroll
      for (int c = 0; c < NCH; ++c) {
        void* sp = &stage[warp][it][c][lane];
        const int nn = live ? chunk_n(m.col0, c) : 0;
        if (vec && nn >= E) {
          if (flags & (kDecEvictFirstLoad | kDecPrefetch256))
            cp_async16_hint(sp, src + chunk_off(m.col0, c), flags);
          else
            cp_async16(sp, src + chunk_off(m.col0, c));
        } else {
          S* d8 = reinterpret_cast<S*>(sp);
#pragma unroll
          for (int e = 0; e < E; ++e)
            StateIO<S>::store1(d8 + e, e < nn ? StateIO<S>::load1(src + chunk_off(m.col0, c) + e) : 0.f);
        }
      }
      cp_async_commit();
    }
  }

#pragma unroll 1  // one item at a time (the other item's bytes stay in flight)
  for (int it = 0; it < IPW; ++it) {
    const Item m = IPW == 1 ? items[0] : get_item(it);
    if (m.item >= total) break;  // uniform over the item's WK warps; later items are out of range too
    const int col0 = m.col0, hv = m.hv, h = hv / (HV / H);
    const int64_t tok = m.n;  // one token per sequence
    const int nrow = full ? TR : min(TR, K - row0), ncol = full ? TC : min(TC, V - col0);
    if (m.in_row < 0) {  // padding slot: zero outputs, no state read or written
      if (out_lane)
        for (int j = 0; j < ncol; ++j) store_in(p.o, (tok * HV + hv) * V + col0 + j, dt, 0.f);
      continue;
    }
    S* dst = m.out_row >= 0 ? reinterpret_cast<S*>(p.s_out) + m.out_row * row_elems + hv * head_elems : nullptr;
    S* dst0 = dst + chunk_off(col0, 0);  // (used only when dst != nullptr)

    float s[STAGE ? 1 : TR][STAGE ? 1 : TC];
    if constexpr (STAGE == 0) {
      if (p.s_in != nullptr) {
        dec_tile_io<VF, S, CW, WK, KMAX>(s, reinterpret_cast<const S*>(p.s_in) + m.in_row * row_elems +
                                                hv * head_elems, nullptr, K, V, row0, col0, vec, full);
      } else {
#pragma unroll
        for (int i = 0; i < TR; ++i)
#pragma unroll
          for (int j = 0; j < TC; ++j) s[i][j] = 0.f;
      }
    }
    float qv[TR], kv[TR], dv[TR], vv[TC];
    dec_load_in<TR>(p.q, (tok * H + h) * K + row0, dt, nrow, tvec, qv, 0.f);
    dec_load_in<TR>(p.k, (tok * H + h) * K + row0, dt, nrow, tvec, kv, 0.f);
    float ge[GPL];  // LEAN, KDA: this lane's GPL gate values of the warp's RW rows
    if constexpr (LEAN && PC) {
      const float* gp = p.g + (tok * HV + hv) * K + wk * RW + lane * GPL;  // one vector load per lane
      if constexpr (GPL == 4) {
        const float4 f = *reinterpret_cast<const float4*>(gp);
        ge[0] = f.x; ge[GPL > 1 ? 1 : 0] = f.y; ge[GPL > 2 ? 2 : 0] = f.z; ge[GPL > 3 ? 3 : 0] = f.w;
      } else if constexpr (GPL == 2) {
        const float2 f = *reinterpret_cast<const float2*>(gp);
        ge[0] = f.x; ge[GPL > 1 ? 1 : 0] = f.y;
      } else {
        ge[0] = *gp;
      }
    } else if (PC) {
      dec_load_in<TR>(p.g, (tok * HV + hv) * K + row0, kF32, nrow, tvec, dv, 0.f);
    } else {
      dv[0] = p.g[tok * HV + hv];
    }
    dec_load_in<TC>(p.v, (tok * HV + hv) * V + col0, dt, ncol, vvec, vv, 0.f);
    const float beta = p.beta[tok * HV + hv];
    if constexpr (LEAN) {  // the gate's exps before the state copies arrive
      if constexpr (PC) {
        float* gw = &gexp[warp][0];
        if constexpr (GPL == 4) {
          *reinterpret_cast<float4*>(gw + 4 * lane) = make_float4(expf(ge[0]), expf(ge[GPL > 1 ? 1 : 0]),
                                                                  expf(ge[GPL > 2 ? 2 : 0]), expf(ge[GPL > 3 ? 3 : 0]));
        } else if constexpr (GPL == 2) {
          *reinterpret_cast<float2*>(gw + 2 * lane) = make_float2(expf(ge[0]), expf(ge[GPL > 1 ? 1 : 0]));
        } else {
          gw[lane] = expf(ge[0]);
        }
        __syncwarp();
#pragma unroll
        for (int i4 = 0; i4 < TR / 4; ++i4) {
          const float4 f = *reinterpret_cast<const float4*>(gw + kg * TR + 4 * i4);
          dv[4 * i4] = f.x; dv[4 * i4 + 1] = f.y; dv[4 * i4 + 2] = f.z; dv[4 * i4 + 3] = f.w;
        }
        if constexpr (TR % 4 != 0) {
#pragma unroll
          for (int i = TR - TR % 4; i < TR; ++i) dv[i] = gw[kg * TR + i];
        }
      } else {
        const float d0 = expf(dv[0]);
#pragma unroll
        for (int i = 0; i < TR; ++i) dv[i] = d0;
      }
    }
    if constexpr (STAGE != 0) {  // each lane reads back only the chunks it copied itself
      if (IPW - 1 - it == 1) cp_async_wait<1>();
      else cp_async_wait<0>();
    }

    if constexpr (!LEAN) {
      if (PC) {
#pragma unroll
        for (int i = 0; i < TR; ++i) dv[i] = expf(dv[i]);
      } else {
        const float d0 = expf(dv[0]);
#pragma unroll
        for (int i = 0; i < TR; ++i) dv[i] = d0;
      }
    }
    // chunk c as fp32 values
    auto get_chunk = [&](int c, float (&x)[E]) {
      if constexpr (STAGE != 0) {
        dec_load_state<S, E>(reinterpret_cast<const S*>(&stage[warp][it][c][lane]), x, E, true);
      } else if constexpr (VF) {
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = s[e][c];
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = s[c][e];
      }
    };

    // pass 1: p = (Diag(e^g) S)^T k; FUSE: also S^T (d * q) and the lane's part of k . q (q is not needed after
    // pass 1 then: qv becomes d * q in place)
    float pr[TC], oa[TC], kq = 0.f;
    if constexpr (FUSE) {
#pragma unroll
      for (int i = 0; i < TR; ++i) {
        kq = fmaf(kv[i], qv[i], kq);
        qv[i] *= dv[i];
      }
    }
#pragma unroll
    for (int j = 0; j < TC; ++j) pr[j] = oa[j] = 0.f;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      float x[E];
      get_chunk(c, x);
      if constexpr (VF) {
#pragma unroll
        for (int i = 0; i < TR; ++i) {
          pr[c] = fmaf(x[i], kv[i] * dv[i], pr[c]);
          if (FUSE) oa[c] = fmaf(x[i], qv[i], oa[c]);
        }
      } else {
        const float kd = kv[c] * dv[c];
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          pr[j] = fmaf(x[j], kd, pr[j]);
          if (FUSE) oa[j] = fmaf(x[j], qv[c], oa[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      pr[j] = G::ksum(pr[j]);
      if (FUSE) oa[j] = G::ksum(oa[j]);
    }
    if (FUSE) kq = G::ksum(kq);
    if constexpr (WK > 1) {
      float(*rp)[CW] = red_p[it][wi];
      float(*rq)[FUSE ? CW + 1 : 1] = red_q[FUSE ? it : 0][FUSE ? wi : 0];
      if (kg == 0) {
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          rp[wk][vg * TC + j] = pr[j];
          if (FUSE) rq[wk][vg * TC + j] = oa[j];
        }
        if (FUSE && vg == 0) rq[wk][FUSE ? CW : 0] = kq;
      }
      named_sync<0>(wi, 32 * WK);
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        float acc = 0.f, acq = 0.f;
#pragma unroll
        for (int w = 0; w < WK; ++w) {
          acc += rp[w][vg * TC + j];
          if (FUSE) acq += rq[w][vg * TC + j];
        }
        pr[j] = acc;
        if (FUSE) oa[j] = acq;
      }
      if (FUSE) {
        float acq = 0.f;
#pragma unroll
        for (int w = 0; w < WK; ++w) acq += rq[w][FUSE ? CW : 0];
        kq = acq;
      }
    }
    float del[TC];
#pragma unroll
    for (int j = 0; j < TC; ++j) del[j] = beta * (vv[j] - pr[j]);
    if constexpr (FUSE) {  // o = scale (S^T (d * q) + (k . q) del), written before the update sweep
      if (out_lane) {
        const int64_t ob = (tok * HV + hv) * V + col0;
#pragma unroll
        for (int j = 0; j < TC; ++j)
          if (j < ncol) store_in(p.o, ob + j, dt, p.scale * fmaf(kq, del[j], oa[j]));
      }
    }
    // pass 2: S = Diag(e^g) S + k (beta (v - p))^T, stored chunk by chunk; o = S^T q unless FUSE. (A second copy of
    // this loop without stores for dst == nullptr, instead of the test per chunk, made ptxas spill in the one-warp
    // configurations: bf16 K-first cfg 0 116 bytes.)
    float ov[TC];
#pragma unroll
    for (int j = 0; j < TC; ++j) ov[j] = 0.f;
#pragma unroll
    for (int c = 0; c < NCH; ++c) {
      float x[E];
      get_chunk(c, x);
      if constexpr (VF) {
#pragma unroll
        for (int i = 0; i < TR; ++i) {
          x[i] = fmaf(x[i], dv[i], kv[i] * del[c]);
          if (!FUSE) ov[c] = fmaf(x[i], qv[i], ov[c]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          x[j] = fmaf(x[j], dv[c], kv[c] * del[j]);
          if (!FUSE) ov[j] = fmaf(x[j], qv[c], ov[j]);
        }
      }
      if (dst != nullptr) {
        // full 2-byte states: one base pointer and constant chunk strides (ptxas recomputed each chunk's 64-bit
        // address from the lane index for the bf16 streaming stores otherwise: 7 instructions per chunk, now 2; for
        // fp32 states the same form made the hot kernel spill, and ptxas folds the offsets there by itself)
        S* d = full && sizeof(S) == 2 ? dst0 + c * (VF ? K : V) : dst + chunk_off(col0, c);
        dec_store_state<S, E>(d, x, chunk_n(col0, c), vec, cs);
      }
    }
    if constexpr (LEAN) {
      // reduce-scatter over the warp's LK row lanes: this lane ends with FC whole-warp sums, columns own ..
      constexpr int FC = TC >= G::LK ? TC / G::LK : 1;
      int own = 0;
      dec_rs_sum<VF, G::LV, G::LK, TC>(ov, lane, own);
      if constexpr (WK > 1) {  // (lanes holding the same column write the same value)
        float(*ro)[CW] = red_o[wi];
#pragma unroll
        for (int t = 0; t < FC; ++t) ro[wk][vg * TC + own + t] = ov[t];
        if (wk == 0) {
          named_sync<1>(wi, 32 * WK);
#pragma unroll
          for (int t = 0; t < FC; ++t) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < WK; ++w) acc += ro[w][vg * TC + own + t];
            ov[t] = acc;
          }
        } else {
          named_arrive<1>(wi, 32 * WK);
        }
      }
      if (wk == 0) {  // every lane of the first warp stores its FC columns (K = V = 128: all exist)
        const int64_t ob = (tok * HV + hv) * V + col0 + own;
#pragma unroll
        for (int t = 0; t < FC; ++t) store_in(p.o, ob + t, dt, p.scale * ov[t]);
      }
    } else if constexpr (!FUSE) {
#pragma unroll
      for (int j = 0; j < TC; ++j) ov[j] = G::ksum(ov[j]);
      if constexpr (WK > 1) {
        // red_o is rewritten by the next item only after that item's first barrier, which warp 0 reaches after
        // reading this item's partials
        float(*ro)[CW] = red_o[wi];
        if (kg == 0) {
#pragma unroll
          for (int j = 0; j < TC; ++j) ro[wk][vg * TC + j] = ov[j];
        }
        if (wk == 0) {
          named_sync<1>(wi, 32 * WK);
#pragma unroll
          for (int j = 0; j < TC; ++j) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < WK; ++w) acc += ro[w][vg * TC + j];
            ov[j] = acc;
          }
        } else {
          named_arrive<1>(wi, 32 * WK);
        }
      }
      if (out_lane) {
        const int64_t ob = (tok * HV + hv) * V + col0;
#pragma unroll
        for (int j = 0; j < TC; ++j)
          if (j < ncol) store_in(p.o, ob + j, dt, p.scale * ov[j]);
      }
    }
  }
}

}  // namespace cuda
}  // namespace kda_kernels
