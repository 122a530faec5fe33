// state_bwd v3 of the chunked backward (issue #7): the chunk-end state gradients on tensor cores, for bf16/fp16
// inputs (KDA_CUDA_CHUNK_BWD_STATE_BWD=3, the default; =2 runs state_bwd2_kernel of delta_chunk_bwd.cuh, which
// fp32 inputs always run). Same inputs, outputs and layouts as state_bwd2 (Params of delta_chunk_bwd.cuh): reads
// the prep's aqk [CH][CH], kendc, qgc, wc [CH][KP] and glc [KP] per (chunk, value head), grad_o and dht; writes
// dhs (dS at each chunk end), dU and dh0, all fp32. Per chunk, backwards, with dO = scale grad_o:
//   dU  = A_qk^T dO + (K Eend) dS1
//   dS0 = Gam_last dS1 + (Q Gam)^T dO - w^T dU
// One block of 8 warps per (sequence, value head, VS = 32 columns of V), as state_bwd2, in the style of the
// forward's scan (delta_chunk_scan3_kernel):
//  - mma.sync m16n8k8 tf32 with fp32 accumulators; PRECISE (mode 3): 3xTF32 (a_hi b_hi + a_lo b_hi + a_hi b_lo),
//    about fp32 accuracy; the hi products and the correction terms go to separate fresh accumulators, added to
//    the fp32 state with ordinary adds. Raw grad_o (bf16/fp16) is exact in tf32, so its products need no b_lo;
//    `scale` multiplies their sums. Mode 4 (KDA_CUDA_CHUNK_BWD_STATE_BWD=4): plain tf32 (kept to measure);
//  - dS (128 x 32) lives in registers, each warp 32 rows x 16 columns (2 x 2 tiles), with an fp32 copy in shared
//    memory (the B operand of K Eend dS1); warp w owns dU rows 16 (w % 4) .. + 15, columns 16 (w / 4) .. + 15;
//  - operands are prefetched with cp.async into padded shared rows (conflict-free fragment reads): K Eend and w
//    double-buffered, issued two chunk steps ahead; A_qk, Q Gam, Gam_last single-buffered, issued one step ahead
//    right after their only use (the products with dO, which do not depend on the carried dS and run first in
//    each step); dO of the next chunk is loaded into registers during the step.
// Shared memory 217 KB (one block per SM); the host runs state_bwd2 where the device offers less.
#pragma once

#include "delta_chunk_bwd.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kSb3Threads = 256;
constexpr int kSb3LdKe = KP + 4;  // K Eend rows (A read as stored: bank 4 g + t)
constexpr int kSb3LdT = KP + 8;   // Q Gam, w rows (A read transposed: bank 8 t + g)
constexpr int kSb3LdA = CH + 8;   // A_qk rows (read transposed)
constexpr int kSb3LdB = VS + 8;   // dS, dO / dU rows (B operands: bank 8 t + g)

// shared layout in floats (every offset a multiple of 4: 16-byte cp.async destinations)
struct Sb3Smem {
  static constexpr int kend = 0;                         // [2][CH][kSb3LdKe]
  static constexpr int w = kend + 2 * CH * kSb3LdKe;     // [2][CH][kSb3LdT]
  static constexpr int qg = w + 2 * CH * kSb3LdT;        // [CH][kSb3LdT]
  static constexpr int aqk = qg + CH * kSb3LdT;          // [CH][kSb3LdA]
  static constexpr int gl = aqk + CH * kSb3LdA;          // [KP]
  static constexpr int ds = gl + KP;                     // [KP][kSb3LdB] fp32 copy of dS1
  static constexpr int ou = ds + KP * kSb3LdB;           // [CH][kSb3LdB] raw dO, then dU
  static constexpr int floats = ou + CH * kSb3LdB;
};
constexpr size_t kStateBwd3Smem = Sb3Smem::floats * sizeof(float);
static_assert(VS == 32 && CH == 64 && KP == 128, "state_bwd3's warp tiling assumes VS = 32, CH = 64, KP = 128");

__device__ __forceinline__ uint32_t sb3_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void sb3_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// hi = tf32(x), lo = tf32(x - hi) (lo only when PRECISE)
template <bool PRECISE>
__device__ __forceinline__ void sb3_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = sb3_tf32(x);
  if constexpr (PRECISE) lo = sb3_tf32(x - __uint_as_float(hi));
  else lo = 0u;
}

template <bool PRECISE>
__device__ __forceinline__ void sb3_split4(const float (&x)[4], uint32_t (&hi)[4], uint32_t (&lo)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) sb3_split<PRECISE>(x[e], hi[e], lo[e]);
}

// (x0, x1) into columns c, c + 1 of a row of one of our [*, V] fp32 buffers (c even), within V.
__device__ __forceinline__ void sb3_store_pair(float* row, int c, int V, float x0, float x1) {
  if ((V & 1) == 0 && c + 1 < V) {
    *reinterpret_cast<float2*>(row + c) = make_float2(x0, x1);
  } else {
    if (c < V) row[c] = x0;
    if (c + 1 < V) row[c + 1] = x1;
  }
}

template <bool PC, bool PRECISE>
__global__ void __launch_bounds__(kSb3Threads, 1) state_bwd3_kernel(Params p) {
  using L = Sb3Smem;
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS;
  extern __shared__ __align__(16) float sm[];
  float* qgs = sm + L::qg;
  float* aqs = sm + L::aqk;
  float* gls = sm + L::gl;
  float* dss = sm + L::ds;
  float* ous = sm + L::ou;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 16 * wc;        // the warp's first column in the block's VS
  const int r0 = 32 * wi + gq;   // the warp's first dS row (tile mt: + 16 mt, second half + 8)
  const int u0 = 16 * wi + gq;   // the warp's first dU row (second half + 8)
  const int K = p.K, V = p.V, HV = p.HV;
  const float scale = p.scale;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // dS: ds[mt][nt][e] at row r0 + 16 mt + 8 (e / 2), column cw + 8 nt + 2 t4 + e % 2 (+ v0 in V)
  float ds[2][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + 16 * mt + 8 * (e >> 1), c = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        ds[mt][nt][e] = (p.dht != nullptr && r < K && c < V) ? p.dht[nbase + static_cast<int64_t>(r) * V + c] : 0.f;
      }
  auto put_ds = [&]() {  // fp32 copy for the next step's B operand
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* d = dss + (r0 + 16 * mt) * kSb3LdB + cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(d) = make_float2(ds[mt][nt][0], ds[mt][nt][1]);
        *reinterpret_cast<float2*>(d + 8 * kSb3LdB) = make_float2(ds[mt][nt][2], ds[mt][nt][3]);
      }
  };
  auto store_ds = [&](float* dst) {  // a [K, V] state
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 16 * mt + 8 * h;
        if (r >= K) continue;
        float* row = dst + static_cast<int64_t>(r) * V;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
      }
  };

  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  auto issue_g1 = [&](int cid, int b) {  // K Eend and w of chunk cid into buffer b
    float* ke = sm + L::kend + b * CH * kSb3LdKe;
    float* ww = sm + L::w + b * CH * kSb3LdT;
    const float* ksrc = p.kendc + tile(cid);
    const float* wsrc = p.wc + tile(cid);
#pragma unroll 4
    for (int i = tid; i < CH * KP / 4; i += kSb3Threads) {
      const int t = i / (KP / 4), c = (i % (KP / 4)) * 4;
      cpa16(ke + t * kSb3LdKe + c, ksrc + t * KP + c);
      cpa16(ww + t * kSb3LdT + c, wsrc + t * KP + c);
    }
  };
  auto issue_g2 = [&](int cid) {  // A_qk, Q Gam, Gam_last of chunk cid
    const float* asrc = p.aqk + (static_cast<size_t>(cid) * HV + hv) * CH * CH;
    const float* qsrc = p.qgc + tile(cid);
#pragma unroll 4
    for (int i = tid; i < CH * CH / 4; i += kSb3Threads) {
      const int t = i / (CH / 4), c = (i % (CH / 4)) * 4;
      cpa16(aqs + t * kSb3LdA + c, asrc + t * CH + c);
    }
#pragma unroll 4
    for (int i = tid; i < CH * KP / 4; i += kSb3Threads) {
      const int t = i / (KP / 4), c = (i % (KP / 4)) * 4;
      cpa16(qgs + t * kSb3LdT + c, qsrc + t * KP + c);
    }
    if (tid < KP / 4) cpa16(gls + 4 * tid, p.glc + (static_cast<size_t>(cid) * HV + hv) * KP + 4 * tid);
  };
  // raw dO (no scale) of chunk c: row tid / 4, columns 8 (tid % 4) .. + 7 of the block's VS
  float dn[8];
  auto load_do = [&](int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    const int t = tid >> 2, vc = v0 + 8 * (tid & 3);
    const bool tok = t < cp.Cc;
    const int64_t base = ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V) + vc;
#pragma unroll
    for (int e = 0; e < 8; ++e) dn[e] = (tok && vc + e < V) ? load_in(p.grad_o, base + e, p.in_dtype) : 0.f;
  };
  auto put_do = [&]() {
    float* d = ous + (tid >> 2) * kSb3LdB + 8 * (tid & 3);
    *reinterpret_cast<float4*>(d) = make_float4(dn[0], dn[1], dn[2], dn[3]);
    *reinterpret_cast<float4*>(d + 4) = make_float4(dn[4], dn[5], dn[6], dn[7]);
  };

  put_ds();
  if (nc > 0) {
    issue_g1(off + nc - 1, 0);
    cpa_commit();
    issue_g2(off + nc - 1);
    cpa_commit();
    if (nc > 1) issue_g1(off + nc - 2, 1);
    cpa_commit();
    load_do(nc - 1);
    put_do();
  }

  for (int s = 0; s < nc; ++s) {
    const int c = nc - 1 - s, cid = off + c, b = s & 1;
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    store_ds(p.dhs + (static_cast<size_t>(cid) * HV + hv) * K * V);  // dS at the end of chunk c
    if (c > 0) load_do(c - 1);  // into shared memory after the step's last barrier
    cpa_wait<1>();              // K Eend, w (buffer b), A_qk, Q Gam, Gam_last of chunk c
    __syncthreads();            // (also dO of chunk c and the dS copy)

    // ---- the products with dO (independent of dS): dU = scale A_qk^T dO, dS = Gam_last dS + scale (Q Gam)^T dO
    float du[2][4];
    {
      float xm[2][4], xc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) xm[nt][e] = xc[nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        if (ks < 2 * wi) continue;  // A_qk[j, t] = 0 for j < t (rows t >= 16 wi)
        const int j0 = 8 * ks + t4;
        // A(t, j) = A_qk[j, t], zero above the diagonal (j < t) whatever the buffer holds there
        const float av[4] = {j0 >= u0 ? aqs[j0 * kSb3LdA + u0] : 0.f,
                             j0 >= u0 + 8 ? aqs[j0 * kSb3LdA + u0 + 8] : 0.f,
                             j0 + 4 >= u0 ? aqs[(j0 + 4) * kSb3LdA + u0] : 0.f,
                             j0 + 4 >= u0 + 8 ? aqs[(j0 + 4) * kSb3LdA + u0 + 8] : 0.f};
        uint32_t ah[4], al[4];
        sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t b0 = __float_as_uint(ous[j0 * kSb3LdB + cw + 8 * nt + gq]);
          const uint32_t b1 = __float_as_uint(ous[(j0 + 4) * kSb3LdB + cw + 8 * nt + gq]);
          if constexpr (PRECISE) sb3_mma(xc[nt], al, b0, b1);
          sb3_mma(xm[nt], ah, b0, b1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] = scale * (xm[nt][e] + xc[nt][e]);
    }
    {
      float ym[2][2][4], yc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ym[mt][nt][e] = yc[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        const int t0 = 8 * ks + t4;
        uint32_t bv[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          bv[nt][0] = __float_as_uint(ous[t0 * kSb3LdB + cw + 8 * nt + gq]);
          bv[nt][1] = __float_as_uint(ous[(t0 + 4) * kSb3LdB + cw + 8 * nt + gq]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int i0 = r0 + 16 * mt;  // A(i, t) = Q Gam[t, i]
          const float av[4] = {qgs[t0 * kSb3LdT + i0], qgs[t0 * kSb3LdT + i0 + 8], qgs[(t0 + 4) * kSb3LdT + i0],
                               qgs[(t0 + 4) * kSb3LdT + i0 + 8]};
          uint32_t ah[4], al[4];
          sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if constexpr (PRECISE) sb3_mma(yc[mt][nt], al, bv[nt][0], bv[nt][1]);
            sb3_mma(ym[mt][nt], ah, bv[nt][0], bv[nt][1]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float g0 = gls[r0 + 16 * mt], g1 = gls[r0 + 16 * mt + 8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ds[mt][nt][e] = fmaf(scale, ym[mt][nt][e] + yc[mt][nt][e], (e < 2 ? g0 : g1) * ds[mt][nt][e]);
      }
    }
    __syncthreads();  // A_qk, Q Gam, Gam_last and dO consumed
    if (c > 0) issue_g2(cid - 1);
    cpa_commit();

    // ---- dU += (K Eend) dS1 (B: the dS1 copy); two k-chains per tile
    {
      const float* ke = sm + L::kend + b * CH * kSb3LdKe;
      float am[2][2][4], ac[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) am[h][nt][e] = ac[h][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        const int k0 = 8 * ks + t4, h = ks & 1;
        const float av[4] = {ke[u0 * kSb3LdKe + k0], ke[(u0 + 8) * kSb3LdKe + k0], ke[u0 * kSb3LdKe + k0 + 4],
                             ke[(u0 + 8) * kSb3LdKe + k0 + 4]};
        uint32_t ah[4], al[4];
        sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t bh0, bl0, bh1, bl1;
          sb3_split<PRECISE>(dss[k0 * kSb3LdB + cw + 8 * nt + gq], bh0, bl0);
          sb3_split<PRECISE>(dss[(k0 + 4) * kSb3LdB + cw + 8 * nt + gq], bh1, bl1);
          if constexpr (PRECISE) {
            sb3_mma(ac[h][nt], al, bh0, bh1);
            sb3_mma(ac[h][nt], ah, bl0, bl1);
          }
          sb3_mma(am[h][nt], ah, bh0, bh1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] += (am[0][nt][e] + am[1][nt][e]) + (ac[0][nt][e] + ac[1][nt][e]);
      // dU into shared memory (over dO, consumed) and to p.dU (rows < Cc, columns < V)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* d = ous + u0 * kSb3LdB + cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(d) = make_float2(du[nt][0], du[nt][1]);
        *reinterpret_cast<float2*>(d + 8 * kSb3LdB) = make_float2(du[nt][2], du[nt][3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = u0 + 8 * h;
        if (t >= cp.Cc) continue;
        float* row = p.dU + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, du[nt][2 * h], du[nt][2 * h + 1]);
      }
    }
    __syncthreads();  // dU complete; the dS1 copy consumed

    // ---- dS0 = (the above) - w^T dU
    {
      const float* ww = sm + L::w + b * CH * kSb3LdT;
      float zm[2][2][4], zc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) zm[mt][nt][e] = zc[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        const int t0 = 8 * ks + t4;
        uint32_t bh[2][2], bl[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          sb3_split<PRECISE>(ous[t0 * kSb3LdB + cw + 8 * nt + gq], bh[nt][0], bl[nt][0]);
          sb3_split<PRECISE>(ous[(t0 + 4) * kSb3LdB + cw + 8 * nt + gq], bh[nt][1], bl[nt][1]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int i0 = r0 + 16 * mt;  // A(i, t) = -w[t, i]
          const float av[4] = {-ww[t0 * kSb3LdT + i0], -ww[t0 * kSb3LdT + i0 + 8], -ww[(t0 + 4) * kSb3LdT + i0],
                               -ww[(t0 + 4) * kSb3LdT + i0 + 8]};
          uint32_t ah[4], al[4];
          sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if constexpr (PRECISE) {
              sb3_mma(zc[mt][nt], al, bh[nt][0], bh[nt][1]);
              sb3_mma(zc[mt][nt], ah, bl[nt][0], bl[nt][1]);
            }
            sb3_mma(zm[mt][nt], ah, bh[nt][0], bh[nt][1]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[mt][nt][e] += zm[mt][nt][e] + zc[mt][nt][e];
      put_ds();
    }
    __syncthreads();  // dU, K Eend and w of buffer b consumed; the dS copy complete
    if (c > 1) issue_g1(cid - 2, b);
    cpa_commit();
    if (c > 0) put_do();
  }
  store_ds(p.dh0 + nbase);
}

// ---------------------------------------------------------------------------------------------------------------
// state_bwd3f (KDA_CUDA_CHUNK_BWD_STATE_BWD=11; session 13): state_bwd3<PC, false> (plain tf32) with every operand
// rounded to tf32 once, where it is written, so the mma loops only load. The same mma with the same tf32 operands
// into the same accumulators in the same order, and the same fp32 epilogues: dhs, dU and dh0 equal =4's bit for bit.
//  - A_qk, Q Gam, K Eend, w: each thread rounds in place the 16-byte pieces it copied itself (its own cp.async
//    writes are visible to it after its wait, so no extra barrier), with A_qk's upper triangle zeroed and w
//    negated there; the A operands were rounded twice per block (two warps share each fragment), now once;
//  - the dS copy and dU are stored rounded (each element once, not once per reading warp: 4x);
//  - dU has its own buffer (rows of 32 floats, XOR-swizzled: conflict-free), so phase A's barrier goes: A_qk / Q Gam
//    of the next chunk are issued after the dU barrier (they land during w^T dU); 3 barriers per chunk instead of 4;
//  - dO loaded as one 16-byte vector per thread where the 8 columns are in range and aligned.
struct Sb3fSmem {
  static constexpr int kend = 0;                         // [2][CH][kSb3LdKe] tf32(K Eend)
  static constexpr int w = kend + 2 * CH * kSb3LdKe;     // [2][CH][kSb3LdT] tf32(-w)
  static constexpr int qg = w + 2 * CH * kSb3LdT;        // [CH][kSb3LdT] tf32(Q Gam)
  static constexpr int aqk = qg + CH * kSb3LdT;          // [CH][kSb3LdA] tf32(A_qk), zero where row < column
  static constexpr int gl = aqk + CH * kSb3LdA;          // [KP] fp32
  static constexpr int ds = gl + KP;                     // [KP][kSb3LdB] tf32(dS1)
  static constexpr int od = ds + KP * kSb3LdB;           // [CH][kSb3LdB] raw dO
  static constexpr int du = od + CH * kSb3LdB;           // [CH][VS] tf32(dU), column c of row t at c ^ 8 (t & 3)
  static constexpr int floats = du + CH * VS;
};
constexpr size_t kStateBwd3fSmem = Sb3fSmem::floats * sizeof(float);

// The bits ptxas feeds the mma for sb3_tf32(x) (cvt.rna.tf32.f32): x + 2^12 in the bit pattern where x is finite,
// the low 13 bits left as they fall (the tf32 mma ignores them); stored as such, the loops pass them on unchanged.
__device__ __forceinline__ float sb3_tf32f(float x) {
  uint32_t r;
  asm("{\n .reg .pred p;\n .reg .f32 a;\n abs.f32 a, %1;\n setp.lt.f32 p, a, 0f7F800000;\n mov.b32 %0, %1;\n"
      " @p add.u32 %0, %0, 4096;\n}" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

// the 16-byte piece at d, rounded to tf32 in place (negated first when NEG)
template <bool NEG>
__device__ __forceinline__ void sb3_round16(float* d) {
  float4 x = *reinterpret_cast<const float4*>(d);
  if constexpr (NEG) x = make_float4(-x.x, -x.y, -x.z, -x.w);
  *reinterpret_cast<float4*>(d) = make_float4(sb3_tf32f(x.x), sb3_tf32f(x.y), sb3_tf32f(x.z), sb3_tf32f(x.w));
}

// The A fragments of both m tiles of a product with a transposed [CH][kSb3LdT] tile (A(i, t) = X[t, i]) at k step
// rows t4, t4 + 4 of a (a = the tile + t4 row + the lane's first dS row): ROWP: dS rows r0 + 16 mt + h, h = 0, 1,
// adjacent (LDS.64); else rows r0 + 16 mt + 8 h (=4's reads).
template <bool ROWP>
__device__ __forceinline__ void sb3f_afrag(const float* a, uint32_t (&af)[2][4]) {
  if constexpr (ROWP) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const float2 x = *reinterpret_cast<const float2*>(a + 16 * mt);
      const float2 y = *reinterpret_cast<const float2*>(a + 4 * kSb3LdT + 16 * mt);
      af[mt][0] = __float_as_uint(x.x);
      af[mt][1] = __float_as_uint(x.y);
      af[mt][2] = __float_as_uint(y.x);
      af[mt][3] = __float_as_uint(y.y);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      af[mt][0] = __float_as_uint(a[16 * mt]);
      af[mt][1] = __float_as_uint(a[16 * mt + 8]);
      af[mt][2] = __float_as_uint(a[4 * kSb3LdT + 16 * mt]);
      af[mt][3] = __float_as_uint(a[4 * kSb3LdT + 16 * mt + 8]);
    }
  }
}

// ROWP (=11): the warp's dS rows permuted -- accumulator row g + 8 h of tile mt holds dS row 32 wi + 2 g + 16 mt + h
// -- so one float2 of a Q Gam / w row holds the fragment's rows g, g + 8 (4 conflict-free LDS.64 per k step instead
// of 8 LDS, straight into the mma's register quad). Each dS element still gets the same k products in the same
// chains; only its row slot in the m16 tile moves. Without ROWP (=12) every fragment is read from =4's addresses.
template <bool PC, bool ROWP>
__global__ void __launch_bounds__(kSb3Threads, 1) state_bwd3f_kernel(Params p) {
  using L = Sb3fSmem;
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS;
  extern __shared__ __align__(16) float sm[];
  float* qgs = sm + L::qg;
  float* aqs = sm + L::aqk;
  float* gls = sm + L::gl;
  float* dss = sm + L::ds;
  float* ods = sm + L::od;
  float* dus = sm + L::du;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 16 * wc;
  const int r0 = ROWP ? 32 * wi + 2 * gq : 32 * wi + gq;
  auto drow = [&](int mt, int h) { return ROWP ? r0 + 16 * mt + h : r0 + 16 * mt + 8 * h; };  // accumulator -> dS row
  const int u0 = 16 * wi + gq;
  const int K = p.K, V = p.V, HV = p.HV;
  const float scale = p.scale;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  float ds[2][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = drow(mt, e >> 1), c = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        ds[mt][nt][e] = (p.dht != nullptr && r < K && c < V) ? p.dht[nbase + static_cast<int64_t>(r) * V + c] : 0.f;
      }
  auto put_ds = [&]() {  // tf32 copy for the next step's B operand
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* d0 = dss + drow(mt, 0) * kSb3LdB + cw + 8 * nt + 2 * t4;
        float* d1 = dss + drow(mt, 1) * kSb3LdB + cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(d0) = make_float2(sb3_tf32f(ds[mt][nt][0]), sb3_tf32f(ds[mt][nt][1]));
        *reinterpret_cast<float2*>(d1) = make_float2(sb3_tf32f(ds[mt][nt][2]), sb3_tf32f(ds[mt][nt][3]));
      }
  };
  auto store_ds = [&](float* dst) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = drow(mt, h);
        if (r >= K) continue;
        float* row = dst + static_cast<int64_t>(r) * V;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
      }
  };

  // the thread's 16-byte pieces: row tid / 32 + 8 j, column 4 (tid % 32) of the K-wide tiles (j < 8), row
  // tid / 16 + 16 j, column 4 (tid % 16) of A_qk (j < 4)
  const int kr = tid >> 5, kc = 4 * (tid & 31), ar = tid >> 4, ac = 4 * (tid & 15);
  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  auto issue_g1 = [&](int cid, int b) {  // K Eend and w of chunk cid into buffer b
    float* ke = sm + L::kend + b * CH * kSb3LdKe + kr * kSb3LdKe + kc;
    float* ww = sm + L::w + b * CH * kSb3LdT + kr * kSb3LdT + kc;
    const float* ksrc = p.kendc + tile(cid) + kr * KP + kc;
    const float* wsrc = p.wc + tile(cid) + kr * KP + kc;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      cpa16(ke + 8 * j * kSb3LdKe, ksrc + 8 * j * KP);
      cpa16(ww + 8 * j * kSb3LdT, wsrc + 8 * j * KP);
    }
  };
  auto round_g1 = [&](int b) {  // after this thread's wait for its issue_g1(., b)
    float* ke = sm + L::kend + b * CH * kSb3LdKe + kr * kSb3LdKe + kc;
    float* ww = sm + L::w + b * CH * kSb3LdT + kr * kSb3LdT + kc;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sb3_round16<false>(ke + 8 * j * kSb3LdKe);
      sb3_round16<true>(ww + 8 * j * kSb3LdT);
    }
  };
  auto issue_g2 = [&](int cid) {  // A_qk, Q Gam, Gam_last of chunk cid
    const float* asrc = p.aqk + (static_cast<size_t>(cid) * HV + hv) * CH * CH + ar * CH + ac;
    const float* qsrc = p.qgc + tile(cid) + kr * KP + kc;
#pragma unroll
    for (int j = 0; j < 4; ++j) cpa16(aqs + (ar + 16 * j) * kSb3LdA + ac, asrc + 16 * j * CH);
#pragma unroll
    for (int j = 0; j < 8; ++j) cpa16(qgs + (kr + 8 * j) * kSb3LdT + kc, qsrc + 8 * j * KP);
    if (tid < KP / 4) cpa16(gls + 4 * tid, p.glc + (static_cast<size_t>(cid) * HV + hv) * KP + 4 * tid);
  };
  auto round_g2 = [&]() {
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // A(t, j) = A_qk[j, t] = 0 for j < t: row ar + 16 j < column ac + e
      const int r = ar + 16 * j;
      float* d = aqs + r * kSb3LdA + ac;
      const float4 x = *reinterpret_cast<const float4*>(d);
      *reinterpret_cast<float4*>(d) =
          make_float4(r >= ac ? sb3_tf32f(x.x) : 0.f, r >= ac + 1 ? sb3_tf32f(x.y) : 0.f,
                      r >= ac + 2 ? sb3_tf32f(x.z) : 0.f, r >= ac + 3 ? sb3_tf32f(x.w) : 0.f);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sb3_round16<false>(qgs + (kr + 8 * j) * kSb3LdT + kc);
  };
  // raw dO (no scale) of chunk c: row tid / 4, columns 8 (tid % 4) .. + 7 of the block's VS
  float dn[8];
  const int dot = tid >> 2, dovc = v0 + 8 * (tid & 3);
  const bool dovec = p.in_dtype != kF32 && (V & 7) == 0 && dovc + 8 <= V &&  // 16 aligned bytes
                     (reinterpret_cast<uintptr_t>(p.grad_o) & 15) == 0;
  auto load_do = [&](int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    const bool tok = dot < cp.Cc;
    const int64_t base = ((cp.row0 + dot) * HV + hv) * static_cast<int64_t>(V) + dovc;
    if (dovec) {
      uint4 r = make_uint4(0u, 0u, 0u, 0u);
      if (tok) r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.grad_o) + base);
      const uint32_t w4[4] = {r.x, r.y, r.z, r.w};
      if (p.in_dtype == kBF16) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dn[2 * e] = __uint_as_float(w4[e] << 16);
          dn[2 * e + 1] = __uint_as_float(w4[e] & 0xffff0000u);
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w4[e]));
          dn[2 * e] = f.x;
          dn[2 * e + 1] = f.y;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dn[e] = (tok && dovc + e < V) ? load_in(p.grad_o, base + e, p.in_dtype) : 0.f;
    }
  };
  auto put_do = [&]() {
    float* d = ods + dot * kSb3LdB + 8 * (tid & 3);
    *reinterpret_cast<float4*>(d) = make_float4(dn[0], dn[1], dn[2], dn[3]);
    *reinterpret_cast<float4*>(d + 4) = make_float4(dn[4], dn[5], dn[6], dn[7]);
  };

  put_ds();
  if (nc > 0) {
    issue_g1(off + nc - 1, 0);
    cpa_commit();
    issue_g2(off + nc - 1);
    cpa_commit();
    if (nc > 1) issue_g1(off + nc - 2, 1);
    cpa_commit();
    load_do(nc - 1);
    put_do();
    cpa_wait<2>();  // K Eend, w of chunk nc - 1 (the loop rounds the later ones at the end of the step before)
    round_g1(0);
  }

  // the dU buffer: row t, column c at t * VS + (c ^ 8 (t & 3)); the rows this thread writes (u0, u0 + 8) and
  // reads (8 ks + t4, + 4) all have t & 3 fixed
  const int duw = (u0 & 3) << 3, dur = t4 << 3;
  for (int s = 0; s < nc; ++s) {
    const int c = nc - 1 - s, cid = off + c, b = s & 1;
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    store_ds(p.dhs + (static_cast<size_t>(cid) * HV + hv) * K * V);
    if (c > 0) load_do(c - 1);
    cpa_wait<1>();  // K Eend, w (buffer b), A_qk, Q Gam, Gam_last of chunk c (this thread's pieces)
    round_g2();
    __syncthreads();  // (also dO of chunk c and the dS copy)

    // ---- the products with dO: dU = scale A_qk^T dO, dS = Gam_last dS + scale (Q Gam)^T dO
    float du[2][4];
    {
      float xm[2][4], xc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) xm[nt][e] = xc[nt][e] = 0.f;
      const float* ab = aqs + t4 * kSb3LdA + u0;
      const float* ob = ods + t4 * kSb3LdB + cw + gq;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        if (ks < 2 * wi) continue;
        const float* a = ab + 8 * ks * kSb3LdA;
        const uint32_t ah[4] = {__float_as_uint(a[0]), __float_as_uint(a[8]), __float_as_uint(a[4 * kSb3LdA]),
                                __float_as_uint(a[4 * kSb3LdA + 8])};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* o = ob + 8 * ks * kSb3LdB + 8 * nt;
          sb3_mma(xm[nt], ah, __float_as_uint(o[0]), __float_as_uint(o[4 * kSb3LdB]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] = scale * (xm[nt][e] + xc[nt][e]);
    }
    {
      float ym[2][2][4], yc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ym[mt][nt][e] = yc[mt][nt][e] = 0.f;
      const float* qb = qgs + t4 * kSb3LdT + r0;
      const float* ob = ods + t4 * kSb3LdB + cw + gq;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        uint32_t bv[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* o = ob + 8 * ks * kSb3LdB + 8 * nt;
          bv[nt][0] = __float_as_uint(o[0]);
          bv[nt][1] = __float_as_uint(o[4 * kSb3LdB]);
        }
        uint32_t af[2][4];
        sb3f_afrag<ROWP>(qb + 8 * ks * kSb3LdT, af);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) sb3_mma(ym[mt][nt], af[mt], bv[nt][0], bv[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float g0 = gls[drow(mt, 0)], g1 = gls[drow(mt, 1)];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ds[mt][nt][e] = fmaf(scale, ym[mt][nt][e] + yc[mt][nt][e], (e < 2 ? g0 : g1) * ds[mt][nt][e]);
      }
    }

    // ---- dU += (K Eend) dS1 (B: the tf32 dS1 copy); two k-chains per tile
    {
      const float* ke = sm + L::kend + b * CH * kSb3LdKe + u0 * kSb3LdKe + t4;
      const float* sb = dss + t4 * kSb3LdB + cw + gq;
      float am[2][2][4], ac2[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) am[h][nt][e] = ac2[h][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        const int h = ks & 1;
        const float* a = ke + 8 * ks;
        const uint32_t ah[4] = {__float_as_uint(a[0]), __float_as_uint(a[8 * kSb3LdKe]), __float_as_uint(a[4]),
                                __float_as_uint(a[8 * kSb3LdKe + 4])};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* bb = sb + 8 * ks * kSb3LdB + 8 * nt;
          sb3_mma(am[h][nt], ah, __float_as_uint(bb[0]), __float_as_uint(bb[4 * kSb3LdB]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] += (am[0][nt][e] + am[1][nt][e]) + (ac2[0][nt][e] + ac2[1][nt][e]);
      // tf32(dU) into its buffer, fp32 dU to p.dU (rows < Cc, columns < V)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = (cw + 8 * nt + 2 * t4) ^ duw;
        *reinterpret_cast<float2*>(dus + u0 * VS + col) = make_float2(sb3_tf32f(du[nt][0]), sb3_tf32f(du[nt][1]));
        *reinterpret_cast<float2*>(dus + (u0 + 8) * VS + col) =
            make_float2(sb3_tf32f(du[nt][2]), sb3_tf32f(du[nt][3]));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = u0 + 8 * h;
        if (t >= cp.Cc) continue;
        float* row = p.dU + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, du[nt][2 * h], du[nt][2 * h + 1]);
      }
    }
    __syncthreads();  // dU complete; the dS copy, A_qk, Q Gam, Gam_last and dO consumed
    if (c > 0) issue_g2(cid - 1);
    cpa_commit();

    // ---- dS0 = (the above) - w^T dU (A: tf32(-w))
    {
      const float* wb = sm + L::w + b * CH * kSb3LdT + t4 * kSb3LdT + r0;
      const float* ub = dus + t4 * VS;
      float zm[2][2][4], zc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) zm[mt][nt][e] = zc[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        uint32_t bh[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* u = ub + 8 * ks * VS + ((cw + 8 * nt + gq) ^ dur);
          bh[nt][0] = __float_as_uint(u[0]);
          bh[nt][1] = __float_as_uint(u[4 * VS]);
        }
        uint32_t af[2][4];
        sb3f_afrag<ROWP>(wb + 8 * ks * kSb3LdT, af);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) sb3_mma(zm[mt][nt], af[mt], bh[nt][0], bh[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[mt][nt][e] += zm[mt][nt][e] + zc[mt][nt][e];
      put_ds();
    }
    if (c > 0) {
      cpa_wait<1>();  // K Eend, w of chunk c - 1 (buffer 1 - b; A_qk / Q Gam of c - 1 may still be in flight)
      round_g1(b ^ 1);
    }
    __syncthreads();  // dU, K Eend and w of buffer b consumed; the dS copy complete
    if (c > 1) issue_g1(cid - 2, b);
    cpa_commit();
    if (c > 0) put_do();
  }
  store_ds(p.dh0 + nbase);
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
