// grad3_wy2 (issue #7): the WY backward of the split grad v3 on tensor cores, replacing grad3_wy_kernel
// (KDA_CUDA_CHUNK_BWD_WY=2, the default; =1 runs grad3_wy, kept to compare; =3, this kernel with plain tf32
// products for bf16 inputs, was retired in session 11). Same inputs and outputs (see the comment above grad3_vc_kernel in
// delta_chunk_bwd.cuh), per (chunk, value head), with L = Diag(beta) A_kk (strictly lower), X = [u | w] and
// dX = [dU | dw] (64 x (V + K)):
//   dR = (I + L)^{-T} dX = T^T dX,  T = (I + L)^{-1};  dL = -dR X^T (strictly lower);
//   dv = Diag(beta) dR_u;  dbeta = dR_u . v + dL . A_kk (grad3_ch / grad3_gdn add dRg . k);
//   dR_w over dw (gdw), dA_kk = Diag(beta) dL over akk.
// grad3_wy runs the back substitution thread per column (a 2016-FMA chain per thread) and dL on CUDA cores, its
// loads not overlapped with either. Here:
//  - T by blocks of 16: the four diagonal blocks inverted by forward substitution (thread per column, 16 steps),
//    then T_ij = -T_ii sum_{j <= k < i} L_ik T_kj by block diagonals (SIMT, fp32; 6 barriers). T^T is stored as
//    rows (the A operand of T^T dX read as stored);
//  - [dU | dw] and X in slices of 64 columns (u slices, then w slices; none past V, K), double-buffered with
//    cp.async (zero-filled past the chunk's Cc rows and past V; wc is zero-padded past K by the prep), slices 0
//    and 1 issued with A_kk before T is formed, slice s + 2 as soon as slice s is consumed;
//  - per slice two products on tensor cores (mma.sync m16n8k8 tf32, fp32 accumulation, 3xTF32: about fp32):
//    dR_s = T^T dX_s (row tiles start at the diagonal: T^T is upper triangular) and dL += dR_s X_s^T (tiles wholly
//    on or above the diagonal skipped), dL accumulated in registers over the slices; dR_s goes to shared memory
//    over dX_s (the A operand of the second product) and from the accumulators straight to dv / dbeta (u slices)
//    or gdw (w slices);
//  - 8 warps: warp w owns rows 16 (w % 4) .. + 15 and columns 32 (w / 4) .. + 31 of both 64 x 64 products;
//    108 KB of shared memory, two blocks per SM.
// Needs V % 4 == 0 (16-byte rows of dU, u) and the v2 state buffers (p.wc); the host runs grad3_wy otherwise.
#pragma once

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_state_bwd3.cuh"
#include "delta_chunk_bwd_grad3_vc_tc.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kWy2S = 64;           // columns of [dU | dw] per slice
constexpr int kWy2LdB = kWy2S + 8;  // dX rows, read as the B operand [k][n]: bank 8 t + g
constexpr int kWy2LdA = 68;         // T^T, dR, X, A_kk rows, read as [row][k]: bank 4 g + t

// shared layout in floats (offsets multiples of 4: 16-byte cp.async destinations)
struct Wy2Smem {
  static constexpr int dx = 0;                     // in buffer b: dX_s [CH][kWy2LdB], then dR_s [CH][kWy2LdA]
  static constexpr int x = CH * kWy2LdB;           // in buffer b: X_s [CH][kWy2LdA]
  static constexpr int buf = x + CH * kWy2LdA;     // floats of one buffer
  static constexpr int akk = 2 * buf;              // A_kk as stored [CH][kWy2LdA]
  static constexpr int tt = akk + CH * kWy2LdA;    // T^T [CH][kWy2LdA] (row t, column m = T[m][t])
  static constexpr int ms = tt + CH * kWy2LdA;     // [3][16][16] block products of the inversion
  static constexpr int beta = ms + 3 * 256;        // [CH]
  static constexpr int dbs = beta + CH;            // [2][CH] dbeta per column half
  static constexpr int floats = dbs + 2 * CH;
  static_assert(x % 4 == 0 && buf % 4 == 0 && akk % 4 == 0 && tt % 4 == 0, "16-byte rows");
};
constexpr size_t kWy2Smem = Wy2Smem::floats * sizeof(float);
static_assert(CH == 64 && KP == 128 && VP == 128 && NT == 256, "grad3_wy2's tiling assumes CH = 64, KP = VP = 128, 256 threads");
static_assert(2 * (kWy2Smem + 1024) <= 228 * 1024, "grad3_wy2: two blocks per SM");

// a pair of consecutive input elements (v, dv) as loaded / stored
template <typename T>
struct Wy2Pair {
  using type = float2;
  static __device__ __forceinline__ float2 f2(type x) { return x; }
  static __device__ __forceinline__ type from(float a, float b) { return make_float2(a, b); }
};
template <>
struct Wy2Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 f2(type x) { return __bfloat1622float2(x); }
  static __device__ __forceinline__ type from(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Wy2Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 f2(type x) { return __half22float2(x); }
  static __device__ __forceinline__ type from(float a, float b) { return __floats2half2_rn(a, b); }
};

// c += a b, 3xTF32: a_lo b_hi + a_hi b_lo + a_hi b_hi
__device__ __forceinline__ void wy2_mma(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                        uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  sb3_mma(c, al, bh0, bh1);
  sb3_mma(c, ah, bl0, bl1);
  sb3_mma(c, ah, bh0, bh1);
}

template <bool PC, typename TI>
__global__ void __launch_bounds__(NT, 2) grad3_wy2_kernel(Params p) {
  using L = Wy2Smem;
  using P2 = Wy2Pair<TI>;
  ChunkPos cp;
  if (!chunk_pos(p, blockIdx.x, cp)) return;
  const int cid = blockIdx.x, hv = blockIdx.y;
  extern __shared__ __align__(16) float sm[];
  float* akks = sm + L::akk;
  float* tts = sm + L::tt;
  float* mss = sm + L::ms;
  float* bes = sm + L::beta;
  float* dbs = sm + L::dbs;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int mi = warp & 3, nh = warp >> 2;  // rows 16 mi .. + 15, columns 32 nh .. + 31
  const int K = p.K, V = p.V, HV = p.HV, Cc = cp.Cc;
  const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
  const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  auto tok = [&](int t) { return (cp.row0 + t) * HV + hv; };
  const int nsu = (V + kWy2S - 1) / kWy2S;
  const int ns = nsu + (K + kWy2S - 1) / kWy2S;

  // slice s (u slices first, then w slices) of dX and X into buffer b
  auto issue = [&](int s, int b) {
    float* dx = sm + b * L::buf + L::dx;
    float* xs = sm + b * L::buf + L::x;
#pragma unroll
    for (int r = 0; r < CH * kWy2S / 4 / NT; ++r) {
      const int i = tid + r * NT, t = i >> 4, c4 = 4 * (i & 15);
      if (s < nsu) {
        const int c = s * kWy2S + c4;
        const bool ok = t < Cc && c < V;
        const int64_t o = ok ? tok(t) * V + c : 0;
        vctc_cpa16z(dx + t * kWy2LdB + c4, p.dU + o, ok);
        vctc_cpa16z(xs + t * kWy2LdA + c4, p.u + o, ok);
      } else {
        const size_t o = tbase + static_cast<size_t>(t) * KP + (s - nsu) * kWy2S + c4;
        vctc_cpa16z(dx + t * kWy2LdB + c4, p.gdw + o, true);   // dw rows past Cc are zeros
        vctc_cpa16z(xs + t * kWy2LdA + c4, p.wc + o, t < Cc);  // wc: zeros past K
      }
    }
  };

  if (tid < CH) {
    bes[tid] = tid < Cc ? p.beta[tok(tid)] : 0.f;
    dbs[tid] = 0.f;
    dbs[CH + tid] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < CH * CH / 4 / NT; ++r) {
    const int i = tid + r * NT, t = i >> 4, c4 = 4 * (i & 15);
    vctc_cpa16z(akks + t * kWy2LdA + c4, p.akk + abase + t * CH + c4, true);
  }
  cpa_commit();
  issue(0, 0);
  cpa_commit();
  if (ns > 1) issue(1, 1);
  cpa_commit();
  cpa_wait<2>();  // A_kk
  __syncthreads();

  // ---- T = (I + L)^{-1} by blocks of 16, stored transposed: tts[t * LdA + m] = T[m][t]
  if (tid < CH) {  // the diagonal blocks: column jj of block i0 / 16 by forward substitution
    const int i0 = 16 * (tid >> 4), jj = tid & 15;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float* lr = akks + (i0 + r) * kWy2LdA + i0;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) {
        if (m & 1) s1 = fmaf(lr[m], x[m], s1);
        else s0 = fmaf(lr[m], x[m], s0);
      }
      x[r] = (r == jj ? 1.f : 0.f) - bes[i0 + r] * (s0 + s1);  // x[r] = 0 for r < jj, x[jj] = 1
    }
    float* tr = tts + (i0 + jj) * kWy2LdA + i0;
#pragma unroll
    for (int r = 0; r < 16; r += 4) *reinterpret_cast<float4*>(tr + r) = make_float4(x[r], x[r + 1], x[r + 2], x[r + 3]);
  }
  __syncthreads();
  {
    const int r = tid >> 4, cc = tid & 15;
#pragma unroll
    for (int d = 1; d < 4; ++d) {
      // M_b = L_ij-row sums: M[r][cc] = beta_{16i+r} sum_{j <= k < i} sum_m A_kk[16i+r][16k+m] T[16k+m][16j+cc]
#pragma unroll
      for (int b = 0; b < 4 - d; ++b) {
        const int i = b + d, j = b;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int k = j; k < i; ++k) {
          const float* lr = akks + (16 * i + r) * kWy2LdA + 16 * k;
          const float* tc = tts + (16 * j + cc) * kWy2LdA + 16 * k;
#pragma unroll
          for (int m = 0; m < 16; m += 4) {
            const float4 a = *reinterpret_cast<const float4*>(lr + m);
            const float4 t = *reinterpret_cast<const float4*>(tc + m);
            s0 = fmaf(a.x, t.x, s0);
            s1 = fmaf(a.y, t.y, s1);
            s0 = fmaf(a.z, t.z, s0);
            s1 = fmaf(a.w, t.w, s1);
          }
        }
        mss[b * 256 + tid] = bes[16 * i + r] * (s0 + s1);
      }
      __syncthreads();
      // T_ij[r][cc] = -sum_m T_ii[r][m] M[m][cc]
#pragma unroll
      for (int b = 0; b < 4 - d; ++b) {
        const int i = b + d, j = b;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int m = 0; m < 16; m += 2) {
          s0 = fmaf(tts[(16 * i + m) * kWy2LdA + 16 * i + r], mss[b * 256 + m * 16 + cc], s0);
          s1 = fmaf(tts[(16 * i + m + 1) * kWy2LdA + 16 * i + r], mss[b * 256 + (m + 1) * 16 + cc], s1);
        }
        tts[(16 * j + cc) * kWy2LdA + 16 * i + r] = -(s0 + s1);
      }
      __syncthreads();
    }
  }

  // ---- the slices
  float dl[4][4], db[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dl[nt][e] = 0.f;
  const int tr0 = 16 * mi + gq;  // the thread's first row (second: + 8)
  for (int s = 0; s < ns; ++s) {
    const int b = s & 1;
    const bool us = s < nsu;
    float* dx = sm + b * L::buf + L::dx;
    const float* xs = sm + b * L::buf + L::x;
    // v at the thread's dR positions (u slices), issued before the products
    typename P2::type vr[2][4];
    if (us) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int t = tr0 + 8 * h, c = s * kWy2S + 32 * nh + 8 * nt + 2 * t4;
          if (t < Cc && c < V) vr[h][nt] = *reinterpret_cast<const typename P2::type*>(
                                   static_cast<const TI*>(p.v) + tok(t) * V + c);
          else vr[h][nt] = P2::from(0.f, 0.f);
        }
    }
    cpa_wait<1>();  // slice s
    __syncthreads();
    // dR_s = T^T dX_s: A(t, m) = tts[t][m], B(m, c) = dX[m][c]; k-steps from the diagonal block
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < CH / 8; ++ks) {
      if (ks < 2 * mi) continue;  // T^T zero there (warp-uniform)
      const int k0 = 8 * ks + t4;
      const float* ar = tts + tr0 * kWy2LdA + k0;
      const float av[4] = {ar[0], ar[8 * kWy2LdA], ar[4], ar[8 * kWy2LdA + 4]};
      uint32_t ah[4], al[4];
      sb3_split4<true>(av, ah, al);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* br = dx + k0 * kWy2LdB + 32 * nh + 8 * nt + gq;
        uint32_t bh0, bl0, bh1, bl1;
        sb3_split<true>(br[0], bh0, bl0);
        sb3_split<true>(br[4 * kWy2LdB], bh1, bl1);
        wy2_mma(acc[nt], ah, al, bh0, bh1, bl0, bl1);
      }
    }
    __syncthreads();  // every read of dX_s done: dR_s goes over it
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int c = 32 * nh + 8 * nt + 2 * t4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = tr0 + 8 * h;
        const float r0 = acc[nt][2 * h], r1 = acc[nt][2 * h + 1];
        *reinterpret_cast<float2*>(dx + t * kWy2LdA + c) = make_float2(r0, r1);
        if (us) {
          const int col = s * kWy2S + c;
          if (t < Cc && col < V) {  // (V % 4 == 0: col + 1 < V too)
            const float bt = bes[t];
            *reinterpret_cast<typename P2::type*>(static_cast<TI*>(p.dv) + tok(t) * V + col) = P2::from(bt * r0, bt * r1);
            const float2 vv = P2::f2(vr[h][nt]);
            db[h] = fmaf(r0, vv.x, db[h]);
            db[h] = fmaf(r1, vv.y, db[h]);
          }
        } else {  // dR_w over dw
          *reinterpret_cast<float2*>(p.gdw + tbase + static_cast<size_t>(t) * KP + (s - nsu) * kWy2S + c) =
              make_float2(r0, r1);
        }
      }
    }
    __syncthreads();  // dR_s in shared memory
    // dL += dR_s X_s^T: A(t, c) = dR[t][c], B(c, j) = X[j][c]; tiles wholly on / above the diagonal skipped
#pragma unroll
    for (int ks = 0; ks < kWy2S / 8; ++ks) {
      const int k0 = 8 * ks + t4;
      const float* ar = dx + tr0 * kWy2LdA + k0;
      const float av[4] = {ar[0], ar[8 * kWy2LdA], ar[4], ar[8 * kWy2LdA + 4]};
      uint32_t ah[4], al[4];
      sb3_split4<true>(av, ah, al);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        if (32 * nh + 8 * nt > 16 * mi + 15) continue;  // warp-uniform
        const float* br = xs + (32 * nh + 8 * nt + gq) * kWy2LdA + k0;
        uint32_t bh0, bl0, bh1, bl1;
        sb3_split<true>(br[0], bh0, bl0);
        sb3_split<true>(br[4], bh1, bl1);
        wy2_mma(dl[nt], ah, al, bh0, bh1, bl0, bl1);
      }
    }
    __syncthreads();  // buffer b consumed
    if (s + 2 < ns) issue(s + 2, b);
    cpa_commit();
  }

  // ---- dL = -(dR X^T) strictly lower: dA_kk = Diag(beta) dL over akk (zeros on / above the diagonal), dbeta
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int j = 32 * nh + 8 * nt + 2 * t4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = tr0 + 8 * h;
      const float l0 = j < t ? -dl[nt][2 * h] : 0.f;
      const float l1 = j + 1 < t ? -dl[nt][2 * h + 1] : 0.f;
      if (j < t) db[h] = fmaf(l0, akks[t * kWy2LdA + j], db[h]);
      if (j + 1 < t) db[h] = fmaf(l1, akks[t * kWy2LdA + j + 1], db[h]);
      const float bt = bes[t];
      *reinterpret_cast<float2*>(p.akk + abase + t * CH + j) = make_float2(bt * l0, bt * l1);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    db[h] += __shfl_xor_sync(0xffffffffu, db[h], 1);
    db[h] += __shfl_xor_sync(0xffffffffu, db[h], 2);
  }
  if (t4 == 0) {
    dbs[nh * CH + tr0] = db[0];
    dbs[nh * CH + tr0 + 8] = db[1];
  }
  __syncthreads();
  if (tid < Cc) p.dbeta[tok(tid)] = dbs[tid] + dbs[CH + tid];
}

// grad3_wy4 (KDA_CUDA_CHUNK_BWD_WY=4, session 13, opt-in): grad3_wy2 with fewer instructions per warp, every
// output bit for bit grad3_wy2's (the same MMAs on the same tf32 words in the same order per accumulator, the same
// fp adds / FMAs in the same order; tests/test_cuda_grad3_wy4_emu.py checks the data movement):
//  - T^T's 3xTF32 hi / lo splits formed once after the inversion, kept in shared memory in fragment order over
//    tt + ms (20 KB: the 20 (row tile, k-step) A fragments of T^T dX), two 16-byte loads per use;
//  - T^T dX by column tiles: warp w owns columns 8 w .. + 7 of all four row tiles, so each dX fragment is split
//    once per k-step (grad3_wy2: by each of up to four row-tile warps); dR_s goes to shared memory as before and
//    dbeta's dR_u . v terms are read back from there in grad3_wy2's thread mapping and order;
//  - dL += dR X^T over a table of (row tile, column tiles) per warp, three tiles for warps 0-3 and two for 4-7
//    (grad3_wy2: 2, 4, 4, 4, 0, 0, 2, 4 tiles, warps 4 and 5 splitting A fragments for none); dL goes through
//    shared memory (buffer 0, free at the end) to grad3_wy2's epilogue mapping, so the dbeta chains keep their order.
// Same 108 KB and launch as grad3_wy2.
struct Wy4Smem {
  static constexpr int tf = Wy2Smem::tt;           // [20][2][32][4] T^T fragments (hi, lo) over tt + ms
  static constexpr int frags = 20;
  // dL tiles per warp w: row tile (band >> 2 w) & 3, column tiles (col0 >> 4 w) & 15 .. + 2 (w < 4) / + 1 (w >= 4):
  // row tile 2 as 0-2 / 3-5, 3 as 0-2 / 3-5 / 6-7, 0 as 0-1, 1 as 0-1 / 2-3 (each tile with 8 J <= 16 mi + 15 once;
  // three-tile warps w and two-tile warps w + 4 share a scheduler)
  static constexpr unsigned band = 2u | 2u << 2 | 3u << 4 | 3u << 6 | 0u << 8 | 1u << 10 | 1u << 12 | 3u << 14;
  static constexpr unsigned col0 = 0u | 3u << 4 | 0u << 8 | 3u << 12 | 0u << 16 | 0u << 20 | 2u << 24 | 6u << 28;
  static_assert(Wy2Smem::beta - Wy2Smem::tt >= frags * 256, "T^T fragments fit in tt + ms");
};

template <bool PC, typename TI>
__global__ void __launch_bounds__(NT, 2) grad3_wy4_kernel(Params p) {
  using L = Wy2Smem;
  using P2 = Wy2Pair<TI>;
  ChunkPos cp;
  if (!chunk_pos(p, blockIdx.x, cp)) return;
  const int cid = blockIdx.x, hv = blockIdx.y;
  extern __shared__ __align__(16) float sm[];
  float* akks = sm + L::akk;
  float* tts = sm + L::tt;
  float* mss = sm + L::ms;
  float* bes = sm + L::beta;
  float* dbs = sm + L::dbs;
  float* tfs = sm + Wy4Smem::tf;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int mi = warp & 3, nh = warp >> 2;
  const int K = p.K, V = p.V, HV = p.HV, Cc = cp.Cc;
  const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
  const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  auto tok = [&](int t) { return (cp.row0 + t) * HV + hv; };
  const int nsu = (V + kWy2S - 1) / kWy2S;
  const int ns = nsu + (K + kWy2S - 1) / kWy2S;

  auto issue = [&](int s, int b) {
    float* dx = sm + b * L::buf + L::dx;
    float* xs = sm + b * L::buf + L::x;
#pragma unroll
    for (int r = 0; r < CH * kWy2S / 4 / NT; ++r) {
      const int i = tid + r * NT, t = i >> 4, c4 = 4 * (i & 15);
      if (s < nsu) {
        const int c = s * kWy2S + c4;
        const bool ok = t < Cc && c < V;
        const int64_t o = ok ? tok(t) * V + c : 0;
        vctc_cpa16z(dx + t * kWy2LdB + c4, p.dU + o, ok);
        vctc_cpa16z(xs + t * kWy2LdA + c4, p.u + o, ok);
      } else {
        const size_t o = tbase + static_cast<size_t>(t) * KP + (s - nsu) * kWy2S + c4;
        vctc_cpa16z(dx + t * kWy2LdB + c4, p.gdw + o, true);
        vctc_cpa16z(xs + t * kWy2LdA + c4, p.wc + o, t < Cc);
      }
    }
  };

  if (tid < CH) {
    bes[tid] = tid < Cc ? p.beta[tok(tid)] : 0.f;
    dbs[tid] = 0.f;
    dbs[CH + tid] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < CH * CH / 4 / NT; ++r) {
    const int i = tid + r * NT, t = i >> 4, c4 = 4 * (i & 15);
    vctc_cpa16z(akks + t * kWy2LdA + c4, p.akk + abase + t * CH + c4, true);
  }
  cpa_commit();
  issue(0, 0);
  cpa_commit();
  if (ns > 1) issue(1, 1);
  cpa_commit();
  cpa_wait<2>();
  __syncthreads();

  // ---- T = (I + L)^{-1}, as grad3_wy2
  if (tid < CH) {
    const int i0 = 16 * (tid >> 4), jj = tid & 15;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float* lr = akks + (i0 + r) * kWy2LdA + i0;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) {
        if (m & 1) s1 = fmaf(lr[m], x[m], s1);
        else s0 = fmaf(lr[m], x[m], s0);
      }
      x[r] = (r == jj ? 1.f : 0.f) - bes[i0 + r] * (s0 + s1);
    }
    float* tr = tts + (i0 + jj) * kWy2LdA + i0;
#pragma unroll
    for (int r = 0; r < 16; r += 4) *reinterpret_cast<float4*>(tr + r) = make_float4(x[r], x[r + 1], x[r + 2], x[r + 3]);
  }
  __syncthreads();
  {
    const int r = tid >> 4, cc = tid & 15;
#pragma unroll
    for (int d = 1; d < 4; ++d) {
#pragma unroll
      for (int b = 0; b < 4 - d; ++b) {
        const int i = b + d, j = b;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int k = j; k < i; ++k) {
          const float* lr = akks + (16 * i + r) * kWy2LdA + 16 * k;
          const float* tc = tts + (16 * j + cc) * kWy2LdA + 16 * k;
#pragma unroll
          for (int m = 0; m < 16; m += 4) {
            const float4 a = *reinterpret_cast<const float4*>(lr + m);
            const float4 t = *reinterpret_cast<const float4*>(tc + m);
            s0 = fmaf(a.x, t.x, s0);
            s1 = fmaf(a.y, t.y, s1);
            s0 = fmaf(a.z, t.z, s0);
            s1 = fmaf(a.w, t.w, s1);
          }
        }
        mss[b * 256 + tid] = bes[16 * i + r] * (s0 + s1);
      }
      __syncthreads();
#pragma unroll
      for (int b = 0; b < 4 - d; ++b) {
        const int i = b + d, j = b;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int m = 0; m < 16; m += 2) {
          s0 = fmaf(tts[(16 * i + m) * kWy2LdA + 16 * i + r], mss[b * 256 + m * 16 + cc], s0);
          s1 = fmaf(tts[(16 * i + m + 1) * kWy2LdA + 16 * i + r], mss[b * 256 + (m + 1) * 16 + cc], s1);
        }
        tts[(16 * j + cc) * kWy2LdA + 16 * i + r] = -(s0 + s1);
      }
      __syncthreads();
    }
  }

  // ---- T^T's A fragments split once: fragment f = mi (7 - mi) + ks (row tile mi, k-step ks >= 2 mi) at
  // tfs[256 f]: hi [32 lanes][4], then lo [32][4]; warp w forms f = w, w + 8, w + 16 (read all, barrier, write)
  {
    float av[3][4];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      const int f = warp + 8 * q;
      if (f < Wy4Smem::frags) {
        const int fm = f < 8 ? 0 : (f < 14 ? 1 : (f < 18 ? 2 : 3));
        const int k0 = 8 * (f - fm * (7 - fm)) + t4;
        const float* ar = tts + (16 * fm + gq) * kWy2LdA + k0;
        av[q][0] = ar[0];
        av[q][1] = ar[8 * kWy2LdA];
        av[q][2] = ar[4];
        av[q][3] = ar[8 * kWy2LdA + 4];
      }
    }
    __syncthreads();  // every read of T^T done: the fragments go over it
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      const int f = warp + 8 * q;
      if (f < Wy4Smem::frags) {
        uint32_t ah[4], al[4];
        sb3_split4<true>(av[q], ah, al);
        *reinterpret_cast<uint4*>(tfs + 256 * f + 4 * lane) = make_uint4(ah[0], ah[1], ah[2], ah[3]);
        *reinterpret_cast<uint4*>(tfs + 256 * f + 128 + 4 * lane) = make_uint4(al[0], al[1], al[2], al[3]);
      }
    }
    // (the slice loop's first barrier orders these writes before their reads)
  }

  // ---- the slices
  float dl[3][4], db[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 3; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dl[i][e] = 0.f;
  const int tr0 = 16 * mi + gq;  // grad3_wy2's rows of this thread (v, dbeta, the epilogue)
  // dL tiles of this warp: row tile pb, column tiles pj .. pj + pn - 1 (Wy4Smem::band / col0)
  const int pb = (Wy4Smem::band >> (2 * warp)) & 3, pj = (Wy4Smem::col0 >> (4 * warp)) & 15;
  const int pn = warp < 4 ? 3 : 2;
  const int pr0 = 16 * pb + gq;
  for (int s = 0; s < ns; ++s) {
    const int b = s & 1;
    const bool us = s < nsu;
    float* dx = sm + b * L::buf + L::dx;
    const float* xs = sm + b * L::buf + L::x;
    typename P2::type vr[2][4];
    if (us) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int t = tr0 + 8 * h, c = s * kWy2S + 32 * nh + 8 * nt + 2 * t4;
          if (t < Cc && c < V) vr[h][nt] = *reinterpret_cast<const typename P2::type*>(
                                   static_cast<const TI*>(p.v) + tok(t) * V + c);
          else vr[h][nt] = P2::from(0.f, 0.f);
        }
    }
    cpa_wait<1>();
    __syncthreads();
    // dR_s = T^T dX_s: warp w the columns 8 w .. + 7 of every row tile mt (k-steps ks >= 2 mt, in order), its dX
    // fragment split once per k-step, T^T's from the pre-split fragments
    float acc[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < CH / 8; ++ks) {
      const float* br = dx + (8 * ks + t4) * kWy2LdB + 8 * warp + gq;
      uint32_t bh0, bl0, bh1, bl1;
      sb3_split<true>(br[0], bh0, bl0);
      sb3_split<true>(br[4 * kWy2LdB], bh1, bl1);
#pragma unroll
      for (int mt = 0; mt <= ks / 2; ++mt) {
        const float* fr = tfs + 256 * (mt * (7 - mt) + ks) + 4 * lane;
        const uint4 h4 = *reinterpret_cast<const uint4*>(fr);
        const uint4 l4 = *reinterpret_cast<const uint4*>(fr + 128);
        const uint32_t ah[4] = {h4.x, h4.y, h4.z, h4.w}, al[4] = {l4.x, l4.y, l4.z, l4.w};
        wy2_mma(acc[mt], ah, al, bh0, bh1, bl0, bl1);
      }
    }
    __syncthreads();  // every read of dX_s done: dR_s goes over it
    {
      const int c = 8 * warp + 2 * t4;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = 16 * mt + gq + 8 * h;
          const float r0 = acc[mt][2 * h], r1 = acc[mt][2 * h + 1];
          *reinterpret_cast<float2*>(dx + t * kWy2LdA + c) = make_float2(r0, r1);
          if (us) {
            const int col = s * kWy2S + c;
            if (t < Cc && col < V) {
              const float bt = bes[t];
              *reinterpret_cast<typename P2::type*>(static_cast<TI*>(p.dv) + tok(t) * V + col) =
                  P2::from(bt * r0, bt * r1);
            }
          } else {
            *reinterpret_cast<float2*>(p.gdw + tbase + static_cast<size_t>(t) * KP + (s - nsu) * kWy2S + c) =
                make_float2(r0, r1);
          }
        }
    }
    __syncthreads();  // dR_s in shared memory
    if (us) {  // dbeta's dR_u . v terms in grad3_wy2's thread mapping and order, dR_s read back
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int c = 32 * nh + 8 * nt + 2 * t4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int t = tr0 + 8 * h;
          if (t < Cc && s * kWy2S + c < V) {
            const float2 r = *reinterpret_cast<const float2*>(dx + t * kWy2LdA + c);
            const float2 vv = P2::f2(vr[h][nt]);
            db[h] = fmaf(r.x, vv.x, db[h]);
            db[h] = fmaf(r.y, vv.y, db[h]);
          }
        }
      }
    }
    // dL += dR_s X_s^T: this warp's tiles (pb, pj + i), i < pn
#pragma unroll
    for (int ks = 0; ks < kWy2S / 8; ++ks) {
      const int k0 = 8 * ks + t4;
      const float* ar = dx + pr0 * kWy2LdA + k0;
      const float av[4] = {ar[0], ar[8 * kWy2LdA], ar[4], ar[8 * kWy2LdA + 4]};
      uint32_t ah[4], al[4];
      sb3_split4<true>(av, ah, al);
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        if (i >= pn) continue;  // warp-uniform
        const float* br = xs + (8 * (pj + i) + gq) * kWy2LdA + k0;
        uint32_t bh0, bl0, bh1, bl1;
        sb3_split<true>(br[0], bh0, bl0);
        sb3_split<true>(br[4], bh1, bl1);
        wy2_mma(dl[i], ah, al, bh0, bh1, bl0, bl1);
      }
    }
    __syncthreads();
    if (s + 2 < ns) issue(s + 2, b);
    cpa_commit();
  }

  // ---- dL tiles to shared memory (buffer 0's dX area, [CH][kWy2LdA]), then grad3_wy2's epilogue mapping
  float* dls = sm + L::dx;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    if (i >= pn) continue;
    const int j = 8 * (pj + i) + 2 * t4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(dls + (pr0 + 8 * h) * kWy2LdA + j) = make_float2(dl[i][2 * h], dl[i][2 * h + 1]);
  }
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int j = 32 * nh + 8 * nt + 2 * t4;
    const bool done = 4 * nh + nt <= 2 * mi + 1;  // tile computed (else j >= t: zeros, as grad3_wy2)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = tr0 + 8 * h;
      const float2 d = done ? *reinterpret_cast<const float2*>(dls + t * kWy2LdA + j) : make_float2(0.f, 0.f);
      const float l0 = j < t ? -d.x : 0.f;
      const float l1 = j + 1 < t ? -d.y : 0.f;
      if (j < t) db[h] = fmaf(l0, akks[t * kWy2LdA + j], db[h]);
      if (j + 1 < t) db[h] = fmaf(l1, akks[t * kWy2LdA + j + 1], db[h]);
      const float bt = bes[t];
      *reinterpret_cast<float2*>(p.akk + abase + t * CH + j) = make_float2(bt * l0, bt * l1);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    db[h] += __shfl_xor_sync(0xffffffffu, db[h], 1);
    db[h] += __shfl_xor_sync(0xffffffffu, db[h], 2);
  }
  if (t4 == 0) {
    dbs[nh * CH + tr0] = db[0];
    dbs[nh * CH + tr0 + 8] = db[1];
  }
  __syncthreads();
  if (tid < Cc) p.dbeta[tok(tid)] = dbs[tid] + dbs[CH + tid];
}

template <bool PC>
auto grad3_wy4(int in_dtype) {
  return in_dtype == kF32 ? grad3_wy4_kernel<PC, float>
                          : (in_dtype == kF16 ? grad3_wy4_kernel<PC, __half> : grad3_wy4_kernel<PC, __nv_bfloat16>);
}

// The kernel for the inputs' dtype.
template <bool PC>
auto grad3_wy2(int in_dtype) {
  return in_dtype == kF32 ? grad3_wy2_kernel<PC, float>
                          : (in_dtype == kF16 ? grad3_wy2_kernel<PC, __half> : grad3_wy2_kernel<PC, __nv_bfloat16>);
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
