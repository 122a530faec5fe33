// grad3_ch2g (issue #7, session 10): grad3_ch2 (delta_chunk_bwd_grad3_ch2.cuh) with the GVA sum of dq, dk fused
// in (KDA_CUDA_CHUNK_BWD_CH=4; off by default until measured). A block is (chunk, KEY head h, 32 channels) and runs
// grad3_ch2's per-value-head body for the G = HV / H value heads hv = h G + j of h in turn (j = 0 .. G - 1): q and
// k are loaded once per key head (shared by its value heads), dg and dbeta are written per value head as before,
// and dq, dk are summed over the G heads in fp32 in the order j = 0, 1, ... (the running sums in shared memory,
// each (t, c) entry owned by one thread) and stored once, per key head, in the inputs' dtype (round to nearest
// even) -- exactly the terms, order and rounding of grad3_ch2 + gva_reduce_kernel (delta_gva_reduce.cuh), so the
// outputs are bit-identical to the default path's. Saves: the fp32 dq, dk [tokens, HV, K] (268 MB written at B1
// T8192 HV32 K=128, and read back by gva_reduce), the gva_reduce launch (0.079 ms there), half the q / k loads.
// Only for one column block (V <= 128: the column blocks of V > 128 sum dq, dk in fp32 first; the host runs
// grad3_ch2 there). Grid (chunks x 4 channel groups, H), clusters of the 4 groups; per value head: the same
// loads, barriers and cluster barriers as grad3_ch2 (dbeta's exchange buffer alternates between two halves so
// one cluster barrier per head suffices after the first), plus 16 KB of shared memory for the dq, dk sums
// (63 KB per block: 3 per SM, as grad3_ch2's registers allow).
// p.dq / p.dk point at the outputs [tokens, H, K] in the inputs' dtype (p.in_dtype), not at fp32 per-value-head
// buffers (the host allocates them so for this kernel).
#pragma once

#include <cooperative_groups.h>

#include "delta_chunk_bwd_grad3_ch2.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

struct Ch2gSmem {
  Ch2Smem b;                                  // grad3_ch2's (dbp: the half of the current head's parity used)
  float dbp2[CH];                             // the other half of dbeta's exchange buffer (odd heads)
  float accq[CH][kCh2Cg], acck[CH][kCh2Cg];  // dq, dk summed over the value heads so far (G > 1)
};
constexpr size_t kCh2gSmem = sizeof(Ch2gSmem);

template <typename TO>
__device__ __forceinline__ void ch2g_store(void* base, int64_t o, float x) {
  StateIO<TO>::store1(static_cast<TO*>(base) + o, x);
}

// T: the inputs' dtype (q, k; dq, dk are stored in it), p.in_dtype's type. GT: G = HV / H when 1 or 2 (the head
// loop unrolled: 168 registers with 80 bytes of spills at G = 2, 40 at G = 1 -- grad3_ch2: 24 -- against 190
// for the rolled loop, whose carried address math ptxas could not keep in registers; ptxas sm_90a, nvcc 13.0), 0
// for any G (the rolled loop).
template <bool PC, typename T, int GT>
__global__ void __launch_bounds__(kCh2Threads, 3) grad3_ch2g_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const int cid = blockIdx.x / kCh2Groups, grp = blockIdx.x % kCh2Groups, h = blockIdx.y;
  ChunkPos cp;
  if (!chunk_pos(p, cid, cp)) return;  // the whole cluster (same chunk) returns
  extern __shared__ __align__(16) float sm[];
  Ch2gSmem& SG = *reinterpret_cast<Ch2gSmem*>(sm);
  Ch2Smem& S = SG.b;
  const int K = p.K, HV = p.HV, G = GT > 0 ? GT : HV / p.H;
  cg::cluster_group cl = cg::this_cluster();
  // the value heads of key head h in turn; dq, dk summed over them (registers dq, dk: this head's; SG.acc*: the
  // heads before)
#pragma unroll (GT > 0 ? GT : 1)
  for (int j = 0; j < G; ++j) {
    const int hv = h * G + j;
    const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
    const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
    // (the thread index and the chunk's first token through an empty asm: the per-thread index and address math is
    // recomputed per head instead of being hoisted out of the head loop into registers held across it -- that
    // spilled)
    int tid = threadIdx.x, jo = j;
    int64_t row0 = cp.row0;
    asm volatile("" : "+r"(tid), "+l"(row0), "+r"(jo));
    float* dbp = (jo & 1) ? SG.dbp2 : S.dbp;  // dbeta's exchange buffer of this head (alternating halves)
    auto tok = [&](int t) { return (row0 + t) * HV + hv; };
    const int w = tid >> 5, lane = tid & 31, c = grp * kCh2Cg + lane, t0 = SB * w;
    const bool cok = c < K;

    // ---- dA_qk, dA_kk blocks on or below the diagonal -> shared (cp.async, 16 bytes, 10 per thread)
#pragma unroll
    for (int n = 0; n < 2 * kCh2Blk * SB * 4 / kCh2Threads; ++n) {
      const int i = tid + n * kCh2Threads;
      const int q4 = i & 3, r = (i >> 2) & 15, blk = (i >> 6) % kCh2Blk, m = i / (64 * kCh2Blk);
      const int B = (blk >= 1) + (blk >= 3) + (blk >= 6), b = blk - B * (B + 1) / 2;
      cpa16(&S.dA[m][blk][r][4 * q4], (m ? p.akk : p.aqk) + abase + (SB * B + r) * CH + SB * b + 4 * q4);
    }
    cpa_commit();

    // ---- the thread's 16 rows: q, k, g first (to shared memory), then dQG, dKend, dR_w, beta (all in flight
    // before the first use; all seven at once spilled at 128 registers)
    float gam[SB], ee[SB];
    {
      float qv[SB], kv[SB], av[SB];
      auto ld_qk = [&]() {
#pragma unroll
        for (int i = 0; i < SB; ++i) {
          const int t = t0 + i;
          const bool ok = t < cp.Cc && cok;
          const int64_t o = ((row0 + t) * p.H + h) * K + c;
          qv[i] = ok ? ld_elem<T>(p.q, o) : 0.f;
          kv[i] = ok ? ld_elem<T>(p.k, o) : 0.f;
        }
      };
#pragma unroll
      for (int i = 0; i < SB; ++i) {
        const int t = t0 + i;
        av[i] = (t < cp.Cc && cok) ? load_gate<PC>(p, row0 + t, hv, c) : 0.f;
      }
      if (j == 0) ld_qk();  // q, k: once per key head (S.q, S.k stay for the later value heads)
      // C1: a, q, k to shared memory; gam, ee and the sub-block total G_w (exchanged)
#pragma unroll
      for (int i = 0; i < SB; ++i) {
        const int t = t0 + i;
        av[i] = (t < cp.Cc && cok) ? expf(av[i]) : 1.f;
        if (j == 0) {
          S.q[t][lane] = qv[i];
          S.k[t][lane] = kv[i];
        }
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
        const float db = warp_sum(dRg * ki);
        if (lane == 0) dbp[t0 + i] = db;
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
    cl.sync();  // (also this block's barrier: S.f and dbp written)
    if (w == 1 || w == 2) {
      const float F = w == 1 ? S.f[0][lane] : S.f[1][lane] + S.f[2][lane];
#pragma unroll
      for (int i = 0; i < SB; ++i) dg[i] += F;
    }
    if (cok) {
      const bool last = j == G - 1;
#pragma unroll
      for (int i = 0; i < SB; ++i) {
        const int t = t0 + i;
        if (t < cp.Cc) {
          p.dg[tok(t) * K + c] = dg[i];
          // dq, dk: this head's added to the sum of the heads before (fp32, the order of gva_reduce_kernel)
          const float sq = j == 0 ? dq[i] : SG.accq[t][lane] + dq[i];
          const float sk = j == 0 ? dk[i] : SG.acck[t][lane] + dk[i];
          if (!last) {
            SG.accq[t][lane] = sq;
            SG.acck[t][lane] = sk;
          } else {
            const int64_t o = ((row0 + t) * p.H + h) * K + c;
            ch2g_store<T>(p.dq, o, sq);
            ch2g_store<T>(p.dk, o, sk);
          }
        }
      }
    }
    if (tid < SB) {
      const int t = SB * static_cast<int>(cl.block_rank()) + tid;
      if (t < cp.Cc) {
        float s = p.dbeta[tok(t)];
#pragma unroll
        for (int r = 0; r < kCh2Groups; ++r) s += cl.map_shared_rank(dbp, r)[t];
        p.dbeta[tok(t)] = s;
      }
    }
    // The next head writes the other half of dbeta's buffer (its remote readers, two heads back, finished before
    // this head's cluster barrier) and rewrites S.a, S.dA, S.beta, S.x*, S.f at its start: a block barrier. The
    // last head waits for the whole cluster (no block leaves while another reads its dbeta buffer).
    if (j + 1 < G) __syncthreads();
  }  // value heads
  cl.sync();
#endif
}

// Launch: grid (chunks x 4 channel groups, H), clusters of the 4 groups of a chunk. p.dq, p.dk: the outputs
// [tokens, H, K] in the inputs' dtype.
template <bool PC>
void launch_grad3_ch2g(int64_t nc_max, int H, const Params& p, cudaStream_t st) {
  const int G = p.HV / H;
  auto pick = [&](auto tag) {
    using T = decltype(tag);
    return G == 1 ? grad3_ch2g_kernel<PC, T, 1> : (G == 2 ? grad3_ch2g_kernel<PC, T, 2> : grad3_ch2g_kernel<PC, T, 0>);
  };
  auto kern = p.in_dtype == kBF16 ? pick(__nv_bfloat16{}) : (p.in_dtype == kF16 ? pick(__half{}) : pick(0.f));
  allow_dynamic_smem(kern, kCh2gSmem, /*max_carveout=*/true);  // several blocks per SM
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(nc_max * kCh2Groups), static_cast<unsigned>(H));
  cfg.blockDim = dim3(kCh2Threads);
  cfg.dynamicSmemBytes = kCh2gSmem;
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
