// grad3_ch2 (issue #7): the per-channel stage of the split grad v3 (grad3_ch_kernel in delta_chunk_bwd.cuh: C1
// and C2 of grad2, dRg . k into dbeta) for KDA, restructured so that several small blocks share an SM and no
// shared-memory atomics are needed (KDA_CUDA_CHUNK_BWD_CH=2, the default for the per-channel gate; =5 its F5
// instance, session 13: the same gradients bit for bit, see grad3_ch2_kernel; =1, grad3_ch_kernel,
// retired in session 9). Same inputs (gdqg, gdkend, gdw = dR_w, gdgl, aqk = dA_qk, akk = dA_kk, beta, dbeta of
// grad3_wy, q, k, g) and the same outputs (dq, dk, dg, dbeta += dRg . k), same exactness rules: fp32, every decay
// factor a running product of a_i <= 1 (no exp of a difference, no division, any gate magnitude), dg formed
// directly (no term added and later subtracted); only the fp32 summation order differs.
//
// Every quantity except dbeta is separable per channel, so a block is (chunk, value head, 32 channels): 4 warps,
// warp w owns the rows of sub-block w (t = 16 w .. 16 w + 15) and lane l channel c = 32 grp + l, each (t, c)
// output in one thread's registers. The 4 channel groups of a (chunk, head) are a cluster of 4 CTAs; their dbeta
// partials are summed through distributed shared memory in a fixed order (deterministic, no global atomics).
// Shared memory (~47 KB; 4 blocks would fit, the 168 registers of the default instance allow 3 per SM): q, k,
// a = e^g of the block's 64 x 32 tile, the 10 16 x 16 blocks on or below the diagonal of dA_qk and dA_kk
// (cp.async), and a few per-channel exchange values. Two block barriers, two cluster barriers.
// H200, B1 T8192 H16 HV32 K=V=128 bf16 (session 7): 0.93 ms against grad3_ch_kernel's 2.99 (capped for 4 blocks
// per SM: 0.99; retired).
//  C1 (per thread, its 16 rows, one exchange of the sub-block totals): with gam_t = prod of a over w's rows up to
//    t, ee_t = prod over w's rows after t, G_b the total of sub-block b, P_w = prod_{b<w} G_b, S_w = prod_{b>w}
//    G_b: Gam_t = P_w gam_t, Eend_t = ee_t S_w; dq = dQG Gam, dRg = dR_w Gam, dk = dKend Eend + beta dRg,
//    dg_t = sum_{s>=t} (q dq + k beta dRg)_s + dGam_last Gam_last + sum_{s<t} (k dKend Eend)_s, the sums over
//    other sub-blocks from their exchanged partial sums; the gate-free diagonal of A_qk.
//  C2 with E[t, j] = prod_{j<i<=t} a_i:
//    rows (warp w >= 1): dq_t, dk_t += gam_t sum_{j < 16w} dA[t, j] k_j E[16w - 1, j] (E[16w-1, j] a running
//      product over j descending; 16 x 4 register tiles of the 16 rows against 4 columns, dA read as broadcast
//      float4), and dg_i += sum_{t >= i in w} (q_t dqrow_t + k_t dkrow_t);
//    columns (warp w <= 2, b = w): dk_j += ee_j sum_{t > 16b + 15} (dA_qk[t, j] q_t + dA_kk[t, j] k_t)
//      prod_{16b+15 < i <= t} a_i (a running product over t ascending), dg_i += sum_{j in b, j < i} k_j dkcol_j,
//      and per later sub-block B the value s_{B,b} = sum_{j in b} k_j ee_j (B's part of the sum), from which
//      F_beta = sum_{b < beta < B} s_{B,b} is added to dg_i for i in sub-block beta (pairs straddling beta);
//    pairs inside sub-block w: direct (as c2_intra), accumulated into the thread's own rows.
// Rows and columns balance: warp w does 16 x 16 w row pairs and 16 x 16 (3 - w) column pairs.
#pragma once

#include <cooperative_groups.h>
#include <type_traits>
#include <utility>

#include "delta_chunk_bwd.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kCh2Cg = 32;               // channels per block
constexpr int kCh2Groups = KP / kCh2Cg;  // channel groups = CTAs per cluster
constexpr int kCh2Threads = 128;         // 4 warps, one per 16-row sub-block
constexpr int kCh2Blk = 10;              // 16 x 16 blocks on or below the diagonal of a 64 x 64 matrix
static_assert(CH == 4 * SB && kCh2Threads == 32 * (CH / SB) && kCh2Groups == 4,
              "grad3_ch2 assumes 64-row chunks of 4 sub-blocks and 128 = 4 x 32 channels");

struct Ch2Smem {
  float dA[2][kCh2Blk][SB][SB];  // dA_qk, dA_kk: block (B, b), b <= B, at B (B + 1) / 2 + b
  float q[CH][kCh2Cg], k[CH][kCh2Cg], a[CH][kCh2Cg];
  float xg[4][kCh2Cg], xr[4][kCh2Cg], xp[4][kCh2Cg];  // per sub-block: G_b, sum of r', sum of pk'
  float f[3][kCh2Cg];                                 // s_{2,0} + s_{3,0}, s_{3,0}, s_{3,1}
  float dbp[CH];                                      // this channel group's dRg . k per row
  float beta[CH];
};
constexpr size_t kCh2Smem = sizeof(Ch2Smem);

__host__ __device__ constexpr int ch2_blk(int B, int b) { return B * (B + 1) / 2 + b; }
// f(integral_constant<int, n>) for each n, in order (compile-time n inside f)
template <class F, int... n>
__device__ __forceinline__ void ch2_each(F&& f, std::integer_sequence<int, n...>) {
  (f(std::integral_constant<int, n>{}), ...);
}
// the offset of block blk (row B, column b) in a row-major 64 x 64 dA
__host__ __device__ constexpr int ch2_src_off(int blk) {
  const int B = (blk >= 1) + (blk >= 3) + (blk >= 6);
  return SB * B * CH + SB * (blk - B * (B + 1) / 2);
}

// Registers capped for 3 blocks per SM (168; nvcc 13.0 sm_90a spills 24 bytes); the shared memory would fit 4: the
// instance capped for 4 (128 registers, more spills; 0.99 ms against 0.93, KDA_CUDA_CHUNK_BWD_CH=3) was retired in
// session 11.
// F5 (KDA_CUDA_CHUNK_BWD_CH=5, session 13): the same floating-point operations on the same operands in the same
// order (every output bit for bit the default's); fewer integer and shuffle instructions: the dA copy's addresses
// from compile-time offsets, the 64-bit row addresses of the q / k / g loads and the dq / dk / dg stores formed once
// plus a per-row stride, and the 16 rows' dRg . k warp sums as one transposed butterfly (31 shuffles instead of 80;
// each level adds the same two partial sums as warp_sum, a + b == b + a bit for bit, products and sums with _rn
// intrinsics so that nothing is contracted that warp_sum left separate).
template <bool PC, bool F5 = false>
__global__ void __launch_bounds__(kCh2Threads, 3) grad3_ch2_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const int cid = blockIdx.x / kCh2Groups, grp = blockIdx.x % kCh2Groups, hv = blockIdx.y;
  ChunkPos cp;
  if (!chunk_pos(p, cid, cp)) return;  // the whole cluster (same chunk) returns
  extern __shared__ __align__(16) float sm[];
  Ch2Smem& S = *reinterpret_cast<Ch2Smem*>(sm);
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, c = grp * kCh2Cg + lane, t0 = SB * w;
  const int K = p.K, HV = p.HV;
  const bool cok = c < K;
  const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
  const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  auto tok = [&](int t) { return (cp.row0 + t) * HV + hv; };

  // ---- dA_qk, dA_kk blocks on or below the diagonal -> shared (cp.async, 16 bytes, 10 per thread)
  if constexpr (F5) {
    // i = tid + 128 n: q4, r from tid alone; (m, blk) = divmod(tid / 64 + 2 n, 10), so m = n >= 5 at compile time
    // and the source offset of block blk is one of two constants per n
    const int q4 = tid & 3, r = (tid >> 2) & 15, hi = tid >> 6;
    float* dst = &S.dA[0][0][r][4 * q4] + hi * SB * SB;
    const float* sq = p.aqk + abase + r * CH + 4 * q4;
    const float* sk = p.akk + abase + r * CH + 4 * q4;
    auto one = [&](auto nc) {
      constexpr int n = decltype(nc)::value, o0 = ch2_src_off((2 * n) % kCh2Blk);
      constexpr int o1 = ch2_src_off((2 * n + 1) % kCh2Blk);
      cpa16(dst + 2 * n * SB * SB, (2 * n >= kCh2Blk ? sk : sq) + o0 + hi * (o1 - o0));
    };
    static_assert(2 * kCh2Blk * SB * 4 / kCh2Threads == 10, "ten 16-byte copies per thread");
    ch2_each(one, std::make_integer_sequence<int, 10>{});
  } else {
#pragma unroll
    for (int n = 0; n < 2 * kCh2Blk * SB * 4 / kCh2Threads; ++n) {
      const int i = tid + n * kCh2Threads;
      const int q4 = i & 3, r = (i >> 2) & 15, blk = (i >> 6) % kCh2Blk, m = i / (64 * kCh2Blk);
      const int B = (blk >= 1) + (blk >= 3) + (blk >= 6), b = blk - B * (B + 1) / 2;
      cpa16(&S.dA[m][blk][r][4 * q4], (m ? p.akk : p.aqk) + abase + (SB * B + r) * CH + SB * b + 4 * q4);
    }
  }
  cpa_commit();

  // ---- the thread's 16 rows: q, k, g first (to shared memory), then dQG, dKend, dR_w, beta (all in flight
  // before the first use; all seven at once spilled at 128 registers)
  float gam[SB], ee[SB];
  {
    float qv[SB], kv[SB], av[SB];
    // F5: rows i < nrow are real (t < Cc and c < K); the row-t0 index and the row stride once (exact integers)
    const int nrow = cok ? min(max(cp.Cc - t0, 0), SB) : 0;
    auto ld_qk = [&](auto tag) {
      using T = decltype(tag);
      const int h = hv / (HV / p.H);
      if constexpr (F5) {
        const int64_t o0 = ((cp.row0 + t0) * p.H + h) * K + c, os = static_cast<int64_t>(p.H) * K;
        const T* qp = reinterpret_cast<const T*>(p.q) + o0;
        const T* kp = reinterpret_cast<const T*>(p.k) + o0;
#pragma unroll
        for (int i = 0; i < SB; ++i) {
          const bool ok = i < nrow;
          qv[i] = ok ? ld_elem<T>(qp, 0) : 0.f;
          kv[i] = ok ? ld_elem<T>(kp, 0) : 0.f;
          qp += os;
          kp += os;
        }
      } else {
#pragma unroll
        for (int i = 0; i < SB; ++i) {
          const int t = t0 + i;
          const bool ok = t < cp.Cc && cok;
          const int64_t o = ((cp.row0 + t) * p.H + h) * K + c;
          qv[i] = ok ? ld_elem<T>(p.q, o) : 0.f;
          kv[i] = ok ? ld_elem<T>(p.k, o) : 0.f;
        }
      }
    };
    if constexpr (F5) {
      static_assert(PC, "F5 is KDA's (per-channel gate) instance");
      const float* gp = p.g + ((cp.row0 + t0) * HV + hv) * K + c;
      const int64_t gs = static_cast<int64_t>(HV) * K;
#pragma unroll
      for (int i = 0; i < SB; ++i, gp += gs) av[i] = i < nrow ? *gp : 0.f;
    } else {
#pragma unroll
      for (int i = 0; i < SB; ++i) {
        const int t = t0 + i;
        av[i] = (t < cp.Cc && cok) ? load_gate<PC>(p, cp.row0 + t, hv, c) : 0.f;
      }
    }
    if (p.in_dtype == kBF16) ld_qk(__nv_bfloat16{});
    else if (p.in_dtype == kF16) ld_qk(__half{});
    else ld_qk(0.f);
    // C1: a, q, k to shared memory; gam, ee and the sub-block total G_w (exchanged)
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const int t = t0 + i;
      if constexpr (F5) {
        const float e = expf(av[i]);  // the same expf, no branch
        av[i] = i < nrow ? e : 1.f;
      }
      else av[i] = (t < cp.Cc && cok) ? expf(av[i]) : 1.f;
      S.q[t][lane] = qv[i];
      S.k[t][lane] = kv[i];
      S.a[t][lane] = av[i];
    }
    float gm = 1.f;
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      gm *= av[i];
      gam[i] = gm;
    }
    float e = 1.f;
#pragma unroll
    for (int i = SB - 1; i >= 0; --i) {
      ee[i] = e;
      e *= av[i];
    }
    S.xg[w][lane] = gm;
  }
  if (tid < CH) S.beta[tid] = tid < cp.Cc ? p.beta[tok(tid)] : 0.f;
  float x0[SB], x1[SB], x2[SB];
#pragma unroll
  for (int i = 0; i < SB; ++i) {
    const int t = t0 + i;
    x0[i] = p.gdqg[tbase + t * KP + c];    // dQG
    x1[i] = p.gdkend[tbase + t * KP + c];  // dKend
    x2[i] = p.gdw[tbase + t * KP + c];     // dR_w
  }
  const float dgl = p.gdgl[(static_cast<size_t>(cid) * HV + hv) * KP + c];
  __syncthreads();
  // Gam_t = P_w gam_t, Eend_t = ee_t S_w; dq, dk (C1 part), dbeta's dRg . k; r = q dq + k beta dRg (suffix sums),
  // pk = k dKend Eend (exclusive prefix sums); the sub-block sums exchanged
  float dq[SB], dk[SB], dg[SB];
  float gl;
  {
    float G[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) G[b] = S.xg[b][lane];
    const float P1 = G[0], P2 = P1 * G[1], P3 = P2 * G[2];
    gl = P3 * G[3];
    const float S2 = G[3], S1 = S2 * G[2], S0 = S1 * G[1];
    [[maybe_unused]] float pr[SB];
    const float PB = w == 0 ? 1.f : (w == 1 ? P1 : (w == 2 ? P2 : P3));
    const float SBw = w == 0 ? S0 : (w == 1 ? S1 : (w == 2 ? S2 : 1.f));
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const float Gm = PB * gam[i], dRg = x2[i] * Gm, ke = x1[i] * (ee[i] * SBw), bti = S.beta[t0 + i];
      dq[i] = x0[i] * Gm;
      dk[i] = fmaf(bti, dRg, ke);
      const float qi = S.q[t0 + i][lane], ki = S.k[t0 + i][lane];
      dg[i] = fmaf(qi, dq[i], ki * bti * dRg);  // r, then its suffix sums
      gam[i] = ki * ke;                           // pk, then its exclusive prefix sums
      if constexpr (F5) {
        pr[i] = __fmul_rn(dRg, ki);
      } else {
        const float db = warp_sum(dRg * ki);
        if (lane == 0) S.dbp[t0 + i] = db;
      }
    }
    if constexpr (F5) {
      // transposed butterfly: at level m the lane keeps the rows whose bit matches its lane bit m and receives its
      // partner's sums of them -- warp_sum's pair (own + partner) for each row; lane l ends with row
      // 8 b4 + 4 b3 + 2 b2 + b1 of its bits
      auto level = [&](auto nc) {  // n = 8, 4, 2, 1 rows kept of 2 n, partner lane ^ 2 n
        constexpr int n = decltype(nc)::value;
        const bool up = lane & (2 * n);
#pragma unroll
        for (int j = 0; j < n; ++j) {
          const float send = up ? pr[j] : pr[j + n], keep = up ? pr[j + n] : pr[j];
          pr[j] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, 2 * n));
        }
      };
      level(std::integral_constant<int, 8>{});
      level(std::integral_constant<int, 4>{});
      level(std::integral_constant<int, 2>{});
      level(std::integral_constant<int, 1>{});
      const float db = __fadd_rn(pr[0], __shfl_xor_sync(0xffffffffu, pr[0], 1));
      const int row = ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1);
      if (!(lane & 1)) S.dbp[t0 + row] = db;
    }
    float run = 0.f;
#pragma unroll
    for (int i = SB - 1; i >= 0; --i) {
      run += dg[i];
      dg[i] = run;
    }
    float pre = 0.f;
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const float x = gam[i];
      gam[i] = pre;
      pre += x;
    }
    S.xr[w][lane] = run;
    S.xp[w][lane] = pre;
  }
  cpa_wait<0>();
  __syncthreads();
  {
    float R[4], PK[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      R[b] = S.xr[b][lane];
      PK[b] = S.xp[b][lane];
    }
    const float Rs2 = R[3], Rs1 = Rs2 + R[2], Rs0 = Rs1 + R[1];
    const float Kp1 = PK[0], Kp2 = Kp1 + PK[1], Kp3 = Kp2 + PK[2];
    const float Rsuf = w == 0 ? Rs0 : (w == 1 ? Rs1 : (w == 2 ? Rs2 : 0.f));
    const float Kpre = w == 0 ? 0.f : (w == 1 ? Kp1 : (w == 2 ? Kp2 : Kp3));
    const float base = Rsuf + fmaf(dgl, gl, Kpre);
    const float* DQ = &S.dA[0][0][0][0] + ch2_blk(w, w) * SB * SB;  // diagonal block of dA_qk
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const float dd = DQ[i * SB + i];  // the gate-free diagonal of A_qk
      dq[i] = fmaf(dd, S.k[t0 + i][lane], dq[i]);
      dk[i] = fmaf(dd, S.q[t0 + i][lane], dk[i]);
      dg[i] += gam[i] + base;
    }
  }

  // ---- C2 rows: sub-block w against the earlier ones
  if (w >= 1) {
    float dqr[SB], dkr[SB];
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      dqr[i] = 0.f;
      dkr[i] = 0.f;
    }
    float e = 1.f;  // E[16 w - 1, j]
    for (int b = w - 1; b >= 0; --b) {
      const float* XQ = &S.dA[0][ch2_blk(w, b)][0][0];
      const float* XK = &S.dA[1][ch2_blk(w, b)][0][0];
#pragma unroll 1  // (the 16 rows' float4 reads of four j4 steps hoisted together spilled)
      for (int j4 = SB - 4; j4 >= 0; j4 -= 4) {
        const int j = SB * b + j4;
        float ke[4];
#pragma unroll
        for (int u = 3; u >= 0; --u) {
          ke[u] = S.k[j + u][lane] * e;
          e *= S.a[j + u][lane];
        }
#pragma unroll
        for (int i = 0; i < SB; ++i) {
          const float4 xq = *reinterpret_cast<const float4*>(XQ + i * SB + j4);
          const float4 xk = *reinterpret_cast<const float4*>(XK + i * SB + j4);
          dqr[i] = fmaf(xq.x, ke[0], fmaf(xq.y, ke[1], fmaf(xq.z, ke[2], fmaf(xq.w, ke[3], dqr[i]))));
          dkr[i] = fmaf(xk.x, ke[0], fmaf(xk.y, ke[1], fmaf(xk.z, ke[2], fmaf(xk.w, ke[3], dkr[i]))));
        }
      }
    }
    float gm = 1.f, r[SB];
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      gm *= S.a[t0 + i][lane];
      const float dqi = gm * dqr[i], dki = gm * dkr[i];
      dq[i] += dqi;
      dk[i] += dki;
      r[i] = fmaf(S.q[t0 + i][lane], dqi, S.k[t0 + i][lane] * dki);
    }
    float run = 0.f;
#pragma unroll
    for (int i = SB - 1; i >= 0; --i) {
      run += r[i];
      dg[i] += run;
    }
  }

  // ---- C2 columns: sub-block b = w against the later ones
  if (w <= 2) {
    const int b = w;
    float v[SB];
#pragma unroll
    for (int jj = 0; jj < SB; ++jj) v[jj] = 0.f;
    float gm = 1.f, s20 = 0.f, s30 = 0.f, s31 = 0.f;  // gm = prod_{16 b + 15 < i <= t} a_i
    for (int B = b + 1; B < 4; ++B) {
      const float* XQ = &S.dA[0][ch2_blk(B, b)][0][0];
      const float* XK = &S.dA[1][ch2_blk(B, b)][0][0];
      float wv[SB];
#pragma unroll
      for (int jj = 0; jj < SB; ++jj) wv[jj] = 0.f;
#pragma unroll 2
      for (int tt = 0; tt < SB; ++tt) {
        const int t = SB * B + tt;
        gm *= S.a[t][lane];
        const float qg = S.q[t][lane] * gm, kg = S.k[t][lane] * gm;
#pragma unroll
        for (int j4 = 0; j4 < SB; j4 += 4) {
          const float4 xq = *reinterpret_cast<const float4*>(XQ + tt * SB + j4);
          const float4 xk = *reinterpret_cast<const float4*>(XK + tt * SB + j4);
          wv[j4 + 0] = fmaf(xq.x, qg, fmaf(xk.x, kg, wv[j4 + 0]));
          wv[j4 + 1] = fmaf(xq.y, qg, fmaf(xk.y, kg, wv[j4 + 1]));
          wv[j4 + 2] = fmaf(xq.z, qg, fmaf(xk.z, kg, wv[j4 + 2]));
          wv[j4 + 3] = fmaf(xq.w, qg, fmaf(xk.w, kg, wv[j4 + 3]));
        }
      }
      float e = 1.f, s = 0.f;  // e = ee_j
#pragma unroll
      for (int jj = SB - 1; jj >= 0; --jj) {
        const int j = SB * b + jj;
        s = fmaf(S.k[j][lane] * e, wv[jj], s);
        e *= S.a[j][lane];
        v[jj] += wv[jj];
      }
      if (B == 2) s20 = s;
      else if (B == 3 && b == 0) s30 = s;
      else if (B == 3) s31 = s;
    }
    float dcol[SB], e = 1.f;
#pragma unroll
    for (int jj = SB - 1; jj >= 0; --jj) {
      dcol[jj] = e * v[jj];
      e *= S.a[SB * b + jj][lane];
    }
    float run = 0.f;
#pragma unroll
    for (int jj = 0; jj < SB; ++jj) {
      dk[jj] += dcol[jj];
      if (jj > 0) dg[jj] += run;
      run = fmaf(S.k[SB * b + jj][lane], dcol[jj], run);
    }
    if (b == 0) {
      S.f[0][lane] = s20 + s30;
      S.f[1][lane] = s30;
    } else if (b == 1) {
      S.f[2][lane] = s31;
    }
  }

  // ---- C2 pairs inside sub-block w (direct, as c2_intra)
  {
    float a_[SB], k_[SB];
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      a_[i] = S.a[t0 + i][lane];
      k_[i] = S.k[t0 + i][lane];
    }
    const float* XQ = &S.dA[0][0][0][0] + ch2_blk(w, w) * SB * SB;
    const float* XK = &S.dA[1][0][0][0] + ch2_blk(w, w) * SB * SB;
#pragma unroll
    for (int tt = 1; tt < SB; ++tt) {
      const float qt = S.q[t0 + tt][lane], kt = k_[tt];
      float Tj[SB];
      float e = 1.f, dqa = 0.f, dka = 0.f;
#pragma unroll
      for (int jj = SB - 2; jj >= 0; --jj) {
        if (jj < tt) {  // compile-time after unrolling
          e *= a_[jj + 1];
          const float xq = XQ[tt * SB + jj], xk = XK[tt * SB + jj];
          const float ke = k_[jj] * e;
          dqa = fmaf(xq, ke, dqa);
          dka = fmaf(xk, ke, dka);
          const float mm = (xq * qt + xk * kt) * e;
          dk[jj] += mm;
          Tj[jj] = mm * k_[jj];
        }
      }
      dq[tt] += dqa;
      dk[tt] += dka;
      float run = 0.f;
#pragma unroll
      for (int i = 1; i < SB; ++i) {
        if (i <= tt) {
          run += Tj[i - 1];
          dg[i] += run;
        }
      }
    }
  }

  // ---- the pairs straddling a sub-block (F), the outputs; dbeta summed over the cluster's channel groups
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();  // (also this block's barrier: S.f and S.dbp written)
  if (w == 1 || w == 2) {
    const float F = w == 1 ? S.f[0][lane] : S.f[1][lane] + S.f[2][lane];
#pragma unroll
    for (int i = 0; i < SB; ++i) dg[i] += F;
  }
  if constexpr (F5) {
    const int nrow = cok ? min(max(cp.Cc - t0, 0), SB) : 0;
    const int64_t o0 = tok(t0) * K + c, os = static_cast<int64_t>(HV) * K;
    float *qo = p.dq + o0, *ko = p.dk + o0, *go = p.dg + o0;
#pragma unroll
    for (int i = 0; i < SB; ++i, qo += os, ko += os, go += os) {
      if (i < nrow) {
        *qo = dq[i];
        *ko = dk[i];
        *go = dg[i];
      }
    }
  } else if (cok) {
#pragma unroll
    for (int i = 0; i < SB; ++i) {
      const int t = t0 + i;
      if (t < cp.Cc) {
        const int64_t o = tok(t) * K + c;
        p.dq[o] = dq[i];
        p.dk[o] = dk[i];
        p.dg[o] = dg[i];
      }
    }
  }
  if (tid < SB) {
    const int t = SB * static_cast<int>(cl.block_rank()) + tid;
    if (t < cp.Cc) {
      float s = p.dbeta[tok(t)];
#pragma unroll
      for (int r = 0; r < kCh2Groups; ++r) s += cl.map_shared_rank(S.dbp, r)[t];
      p.dbeta[tok(t)] = s;
    }
  }
  cl.sync();  // no block leaves while another reads its S.dbp
#endif
}

// Launch: grid (chunks x 4 channel groups, HV), clusters of the 4 groups of a chunk. f5: the F5 instance (KDA).
template <bool PC>
void launch_grad3_ch2(int64_t nc_max, int HV, const Params& p, cudaStream_t st, bool f5 = false) {
  auto kern = grad3_ch2_kernel<PC, false>;
  if constexpr (PC) {
    if (f5) kern = grad3_ch2_kernel<PC, true>;
  }
  allow_dynamic_smem(kern, kCh2Smem, /*max_carveout=*/true);  // several blocks per SM
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(nc_max * kCh2Groups), static_cast<unsigned>(HV));
  cfg.blockDim = dim3(kCh2Threads);
  cfg.dynamicSmemBytes = kCh2Smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCh2Groups;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, p));
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
