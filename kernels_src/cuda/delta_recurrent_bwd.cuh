// Recurrent delta-rule backward, used by {kda,gdn}_recurrent_bwd.
//
// A block owns one (sequence, value head, group of W V-slices of CW columns); warp w owns slice w. A lane owns
// 4 consecutive K rows (rows 4*lane + e, plus 128 for the second half when K > 128) of all CW columns, so
// reductions over V (dq, dk, dg) are finished inside the lane and reductions over K (the prediction and its
// gradient) are one reduce-scatter + all-gather over the warp.
//
// Pass A (forward sweep): store a checkpoint of the state every C tokens and u_t = v_t - (Diag(e^g) S)^T k_t
// (fp32, [T, HV, V]); with u known, replaying a token needs no reduction: S <- Diag(e^g) S + k (beta u)^T.
// Pass B (backward sweep over segments, last first): bring the segment's checkpoint into shared memory; for each
// token t of the segment, last first, replay from the checkpoint up to t (at most C-1 cheap steps, registers
// only) and take the backward step carrying dS. Per-token partials of dq, dk, dg, dbeta of the W warps are
// summed in shared memory once per segment and written (SPLIT == 1) or atomically added (SPLIT > 1 blocks
// per head).
//
// Backward of one token for one column j (s = state before the token, d = e^g, s' = d s, sn = s' + k beta u_j):
//   dsn = dS + scale q do_j;  dq += scale sn do_j;  ddel_j = k . dsn;  dv_j = beta ddel_j;
//   dbeta += u_j ddel_j;  dp_j = -beta ddel_j;  dk += beta u_j dsn + s' dp_j;  ds' = dsn + k dp_j;
//   dg += s' ds';  dS = d ds'.
#pragma once

#include "delta_common.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kBwdSegment = 8;  // C: tokens between checkpoints

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const void* grad_o;
  const float* h0;        // [N, HV, K, V] or nullptr
  const float* dht;       // [N, HV, K, V] or nullptr
  int in_dtype;
  const int64_t* cu_seqlens;
  int B, T, H, HV, K, V, N;
  float scale;
  int split;              // blocks per (sequence, head)
  int slices;             // split * warps per block
  float* ckpt;            // checkpoints, lane-private tiles
  float* u;               // [B*T, HV, V]
  float* dq;              // [B*T, HV, K] fp32 (sum over the GVA group is done by the host)
  float* dk;
  float* dg;              // [B*T, HV, K] fp32 (GDN: summed over K by the host)
  float* dbeta;           // [B*T, HV]
  void* dv;               // [B*T, HV, V] in v's dtype
  float* dh0;             // [N, HV, K, V]
};

// In-place all-reduce of NVAL values over the 32 lanes: a reduce-scatter by halving, then an all-gather.
template <int NVAL>
__device__ __forceinline__ void warp_allreduce_vec(float (&x)[NVAL], int lane) {
  static_assert(NVAL >= 2 && NVAL <= 32 && (NVAL & (NVAL - 1)) == 0, "power of two");
  constexpr int SH = (NVAL == 32) ? 0 : (NVAL == 16) ? 1 : (NVAL == 8) ? 2 : (NVAL == 4) ? 3 : 4;
  float y[NVAL];
#pragma unroll
  for (int i = 0; i < NVAL; ++i) y[i] = x[i];
#pragma unroll
  for (int step = 0; (NVAL >> step) > 1; ++step) {
    const int c = NVAL >> step;
    const int m = 16 >> step;
    const bool up = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < c / 2; ++i) {
      const float send = up ? y[i] : y[i + c / 2];
      const float keep = up ? y[i + c / 2] : y[i];
      y[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
    }
  }
  float tot = y[0];
#pragma unroll
  for (int m = (1 << SH) >> 1; m >= 1; m >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, m);
#pragma unroll
  for (int j = 0; j < NVAL; ++j) x[j] = __shfl_sync(0xffffffffu, tot, j << SH);
}

__device__ __forceinline__ void acc_add(float* p, float x, bool atomic) {
  if (atomic)
    atomicAdd(p, x);
  else
    *p = x;
}

template <bool PC, int CW, int KMAX>
__global__ void __launch_bounds__(128) delta_recurrent_bwd_kernel(const BwdParams p) {
  constexpr int NK = KMAX / 32, C = kBwdSegment, Q4 = NK * CW / 4;
  extern __shared__ float4 smem4[];
  const int W = blockDim.x / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float4* ck = smem4 + warp * Q4 * 32;                                       // this warp's checkpoint tile
  float* red = reinterpret_cast<float*>(smem4 + W * Q4 * 32);                // [W][C][3][KMAX]
  float* redb = red + W * C * 3 * KMAX;                                      // [W][C]

  const int split = static_cast<int>(blockIdx.x % p.split);
  const int64_t nh = blockIdx.x / p.split;
  const int hv = static_cast<int>(nh % p.HV);
  const int n = static_cast<int>(nh / p.HV);
  const int h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V, HV = p.HV, H = p.H, dt = p.in_dtype;
  const int slice = split * W + warp;
  const int c0 = slice * CW;
  const bool atomic = p.split > 1;
  const bool vecu = (V % 4 == 0);

  int64_t bos;
  int len;
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);
  const int nseg = (len + C - 1) / C;
  const int64_t seg_base = bos / C + n;
  const int64_t head_off = (static_cast<int64_t>(n) * HV + hv) * K * V;

  auto row = [&](int i) { return 4 * lane + 128 * (i / 4) + (i % 4); };
  auto tile_ptr = [&](int seg) {
    return reinterpret_cast<float4*>(p.ckpt) +
           (((seg_base + seg) * HV + hv) * p.slices + slice) * static_cast<int64_t>(Q4) * 32;
  };
  // load CW consecutive fp32 values of a [*, V] row starting at column c0 (zeros past V)
  auto load_cols_f32 = [&](const float* base, float (&out)[CW]) {
    if (vecu) {
#pragma unroll
      for (int j4 = 0; j4 < CW / 4; ++j4) {
        const int c = c0 + 4 * j4;
        float4 x = c < V ? *reinterpret_cast<const float4*>(base + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        out[4 * j4] = x.x; out[4 * j4 + 1] = x.y; out[4 * j4 + 2] = x.z; out[4 * j4 + 3] = x.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < CW; ++j) out[j] = (c0 + j < V) ? base[c0 + j] : 0.f;
    }
  };
  auto load_cols_in = [&](const void* base, int64_t off, float (&out)[CW]) {
#pragma unroll
    for (int j = 0; j < CW; ++j) out[j] = (c0 + j < V) ? load_in(base, off + c0 + j, dt) : 0.f;
  };
  // the token's k rows and decay rows of this lane
  auto load_kd = [&](int64_t tok, float (&kk)[NK], float (&dd)[NK]) {
    const int64_t qb = (tok * H + h) * K;
    const float gs = PC ? 0.f : p.g[tok * HV + hv];
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int r = row(i);
      kk[i] = r < K ? load_in(p.k, qb + r, dt) : 0.f;
      dd[i] = expf(PC ? (r < K ? p.g[(tok * HV + hv) * K + r] : 0.f) : gs);
    }
  };

  float s[NK][CW];
  // ---------------- pass A: checkpoints and u
  if (p.h0 != nullptr) {
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int r = row(i);
#pragma unroll
      for (int j = 0; j < CW; ++j)
        s[i][j] = (r < K && c0 + j < V) ? p.h0[head_off + static_cast<int64_t>(r) * V + c0 + j] : 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < NK; ++i)
#pragma unroll
      for (int j = 0; j < CW; ++j) s[i][j] = 0.f;
  }
  for (int t = 0; t < len; ++t) {
    if (t % C == 0) {
      float4* tp = tile_ptr(t / C);
#pragma unroll
      for (int i = 0; i < NK; ++i)
#pragma unroll
        for (int j4 = 0; j4 < CW / 4; ++j4)
          tp[(i * (CW / 4) + j4) * 32 + lane] = make_float4(s[i][4 * j4], s[i][4 * j4 + 1], s[i][4 * j4 + 2],
                                                            s[i][4 * j4 + 3]);
    }
    const int64_t tok = bos + t;
    float kk[NK], dd[NK], vv[CW], pp[CW];
    load_kd(tok, kk, dd);
    load_cols_in(p.v, (tok * HV + hv) * V, vv);
    const float beta = p.beta[tok * HV + hv];
#pragma unroll
    for (int j = 0; j < CW; ++j) pp[j] = 0.f;
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const float kd = kk[i] * dd[i];
#pragma unroll
      for (int j = 0; j < CW; ++j) pp[j] = fmaf(s[i][j], kd, pp[j]);
    }
    warp_allreduce_vec<CW>(pp, lane);
    float bu[CW];
#pragma unroll
    for (int j = 0; j < CW; ++j) {
      const float u = vv[j] - pp[j];
      bu[j] = beta * u;
      if (lane == j && c0 + j < V) p.u[(tok * HV + hv) * V + c0 + j] = u;
    }
#pragma unroll
    for (int i = 0; i < NK; ++i)
#pragma unroll
      for (int j = 0; j < CW; ++j) s[i][j] = fmaf(s[i][j], dd[i], kk[i] * bu[j]);
  }
  __syncwarp();

  // ---------------- pass B
  float dS[NK][CW];
  if (p.dht != nullptr) {
#pragma unroll
    for (int i = 0; i < NK; ++i) {
      const int r = row(i);
#pragma unroll
      for (int j = 0; j < CW; ++j)
        dS[i][j] = (r < K && c0 + j < V) ? p.dht[head_off + static_cast<int64_t>(r) * V + c0 + j] : 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < NK; ++i)
#pragma unroll
      for (int j = 0; j < CW; ++j) dS[i][j] = 0.f;
  }

  for (int seg = nseg - 1; seg >= 0; --seg) {
    const int a = seg * C;
    const int nt = min(C, len - a);
    {
      const float4* tp = tile_ptr(seg);
#pragma unroll
      for (int q4 = 0; q4 < Q4; ++q4) ck[q4 * 32 + lane] = tp[q4 * 32 + lane];
    }
    __syncwarp();
    for (int tt = nt - 1; tt >= 0; --tt) {
      // state before token a + tt
#pragma unroll
      for (int i = 0; i < NK; ++i)
#pragma unroll
        for (int j4 = 0; j4 < CW / 4; ++j4) {
          const float4 x = ck[(i * (CW / 4) + j4) * 32 + lane];
          s[i][4 * j4] = x.x; s[i][4 * j4 + 1] = x.y; s[i][4 * j4 + 2] = x.z; s[i][4 * j4 + 3] = x.w;
        }
      for (int tau = 0; tau < tt; ++tau) {
        const int64_t tok = bos + a + tau;
        float kk[NK], dd[NK], bu[CW];
        load_kd(tok, kk, dd);
        load_cols_f32(p.u + (tok * HV + hv) * V, bu);
        const float beta = p.beta[tok * HV + hv];
#pragma unroll
        for (int i = 0; i < NK; ++i)
#pragma unroll
          for (int j = 0; j < CW; ++j) s[i][j] = fmaf(s[i][j], dd[i], kk[i] * (beta * bu[j]));
      }
      // backward step of token a + tt
      const int64_t tok = bos + a + tt;
      float kk[NK], dd[NK], qq[NK], uu[CW], dov[CW];
      load_kd(tok, kk, dd);
      {
        const int64_t qb = (tok * H + h) * K;
#pragma unroll
        for (int i = 0; i < NK; ++i) qq[i] = row(i) < K ? load_in(p.q, qb + row(i), dt) : 0.f;
      }
      load_cols_f32(p.u + (tok * HV + hv) * V, uu);
      load_cols_in(p.grad_o, (tok * HV + hv) * V, dov);
      const float beta = p.beta[tok * HV + hv];
      const float scale = p.scale;
      float dq[NK], ddel[CW];
#pragma unroll
      for (int j = 0; j < CW; ++j) ddel[j] = 0.f;
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        float acc = 0.f;
        const float sq = scale * qq[i];
#pragma unroll
        for (int j = 0; j < CW; ++j) {
          const float sn = fmaf(s[i][j], dd[i], kk[i] * (beta * uu[j]));
          acc = fmaf(sn, dov[j], acc);
          dS[i][j] = fmaf(sq, dov[j], dS[i][j]);  // dsn
          ddel[j] = fmaf(kk[i], dS[i][j], ddel[j]);
        }
        dq[i] = scale * acc;
      }
      warp_allreduce_vec<CW>(ddel, lane);
      float dbeta = 0.f, dp[CW];
#pragma unroll
      for (int j = 0; j < CW; ++j) {
        dbeta = fmaf(uu[j], ddel[j], dbeta);
        dp[j] = -beta * ddel[j];
        if (lane == j && c0 + j < V) store_in(p.dv, (tok * HV + hv) * V + c0 + j, dt, beta * ddel[j]);
      }
      float dk[NK], dg[NK];
#pragma unroll
      for (int i = 0; i < NK; ++i) {
        float ak = 0.f, ag = 0.f;
#pragma unroll
        for (int j = 0; j < CW; ++j) {
          const float sp = s[i][j] * dd[i];
          const float dsn = dS[i][j];
          ak = fmaf(beta * uu[j], dsn, fmaf(sp, dp[j], ak));
          const float dsp = fmaf(kk[i], dp[j], dsn);
          ag = fmaf(sp, dsp, ag);
          dS[i][j] = dd[i] * dsp;
        }
        dk[i] = ak;
        dg[i] = ag;
      }
      float* rw = red + ((warp * C + tt) * 3) * KMAX;
#pragma unroll
      for (int i4 = 0; i4 < NK / 4; ++i4) {
        const int r = row(4 * i4);
        *reinterpret_cast<float4*>(rw + r) = make_float4(dq[4 * i4], dq[4 * i4 + 1], dq[4 * i4 + 2], dq[4 * i4 + 3]);
        *reinterpret_cast<float4*>(rw + KMAX + r) =
            make_float4(dk[4 * i4], dk[4 * i4 + 1], dk[4 * i4 + 2], dk[4 * i4 + 3]);
        *reinterpret_cast<float4*>(rw + 2 * KMAX + r) =
            make_float4(dg[4 * i4], dg[4 * i4 + 1], dg[4 * i4 + 2], dg[4 * i4 + 3]);
      }
      if (lane == 0) redb[warp * C + tt] = dbeta;
    }
    __syncthreads();
    // sum the W warps' partials of this segment and write them out
    for (int e = threadIdx.x; e < nt * 3 * KMAX; e += blockDim.x) {
      const int tt = e / (3 * KMAX);
      const int which = (e / KMAX) % 3;
      const int r = e % KMAX;
      if (r >= K) continue;
      float acc = 0.f;
      for (int w = 0; w < W; ++w) acc += red[((w * C + tt) * 3 + which) * KMAX + r];
      const int64_t o = ((bos + a + tt) * HV + hv) * K + r;
      float* dst = which == 0 ? p.dq : (which == 1 ? p.dk : p.dg);
      acc_add(dst + o, acc, atomic);
    }
    for (int tt = threadIdx.x; tt < nt; tt += blockDim.x) {
      float acc = 0.f;
      for (int w = 0; w < W; ++w) acc += redb[w * C + tt];
      acc_add(p.dbeta + (bos + a + tt) * HV + hv, acc, atomic);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < NK; ++i) {
    const int r = row(i);
#pragma unroll
    for (int j = 0; j < CW; ++j)
      if (r < K && c0 + j < V) p.dh0[head_off + static_cast<int64_t>(r) * V + c0 + j] = dS[i][j];
  }
}

}  // namespace cuda
}  // namespace kda_kernels
