// state_fwd on bf16 tensor-core operands (session 13, branch sfwd13; KDA_CUDA_CHUNK_BWD_STATE_FWD=8: U plain bf16,
// =9: U as bf16 hi + lo, =10: U and K Eend as bf16 hi + lo; off by default; instantiated only in
// delta_chunk_bwd_state_fwd_bf16.cu): the chunked
// backward's recompute of the chunk-start states, state_fwd3's narrow instance (=7, delta_chunk_bwd_state_fwd3.cuh:
// the same Params, inputs wc / kendc / glc / u, outputs hs and U in fp32 with the same layout, the same grid of 16
// value columns per block, 256 threads, two blocks per SM, the same single-buffered cp.async schedule and barriers)
// with the forward scan7's products (delta_chunk_scan7.cuh): mma.sync m16n8k16 bf16 with fp32 accumulation, the state
// in fp32 registers, h_c and U in shared memory as bf16 row-pair words (s7_put_tile / s7_put_tile_hl; B fragments as
// mma_tiles16 reads them), UHL: U's low parts as a second product (scan7's =11, which kept tf32-level accuracy).
// EHL (=10, with UHL): K Eend as hi + lo too (a third product, lo x lo dropped), the correction terms in their own
// accumulators. Why: unlike the forward's o (rounded to bf16, a 2^-9 floor), hs feeds fp32 gradients, and the CPU
// emulation (tests/test_cuda_state_fwd_bf16_emu.py) puts almost all of =9's hs error (~5.6x tf32's) on K Eend's
// rounding: with K Eend hi + lo it falls below tf32's (w and h stay bf16: they only move U, by ~2-9x tf32's).
// The backward's prep writes w and K Eend in fp32 only, so they arrive in fp32 (cp.async, as state_fwd3) and are
// rounded to bf16 at the A-fragment read (two floats -> one cvt.rn.bf16x2).
//
// Row / k orders (a permutation of rows of an accumulator is free: it only decides where its values are stored;
// a permutation of the contraction index is free when A and B use the same one):
//  - an mma's accumulator row slots g, g + 8 of a 16-row tile r0 hold physical rows r0 + 2g, r0 + 2g + 1 (U's
//    tokens, S's rows), so s7_put_tile's word r0 / 2 + g is the adjacent pair (r0 + 2g, r0 + 2g + 1);
//  - k slots 2t, 2t + 1 of k-step s are physical k 16 s + 2t, + 1 and slots 2t + 8, 2t + 9 are 16 s + 8 + 2t, + 1:
//    mma_tiles16's B words 8 s + t and 8 s + 4 + t are exactly those pairs, and an A row's two k pairs are two float2
//    reads. w (rows 2g, 2g + 1 of the warp's 16 tokens, row stride KP + 4): 8-byte lane units 132 g + t, distinct mod
//    16 over a half warp; K Eend read transposed (float2 of rows 2g, 2g + 1 at token 16 s + 2t + j): 132 t + g,
//    distinct mod 16: conflict-free both.
// Emulated: tests/test_cuda_state_fwd_bf16_emu.py (fragments, banks, rounding); tested: tests/test_cuda_state_fwd_bf16.py.
#pragma once

#include "delta_chunk_bwd_state_fwd3.cuh"
#include "delta_chunk_scan7.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kSfbBV = 16;           // value columns per block (state_fwd3 narrow's)
constexpr int kSfbLdW = KP + 4;      // w rows (fp32)
constexpr int kSfbLdE = KP + 4;      // K Eend rows (fp32; read transposed as float2 of two K rows)
constexpr int kSfbLdH = kScan7LDW;   // 32-bit words per row pair of h / U (mma_tiles16's stride; 16 of 40 used)

template <bool UHL>
struct StateFwdBf16Smem {
  static constexpr size_t w_off = 0;                          // floats: [CH][kSfbLdW]
  static constexpr size_t e_off = w_off + CH * kSfbLdW;       // [CH][kSfbLdE]
  static constexpr size_t gl_off = e_off + CH * kSfbLdE;      // [KP]
  static constexpr size_t h_off = gl_off + KP;                // words: [KP / 2][kSfbLdH]
  static constexpr int us_lo = CH / 2 * kSfbLdH;              // UHL: U's low words after its high words
  static constexpr size_t u_off = h_off + KP / 2 * kSfbLdH;   // words: (UHL ? 2 : 1) x [CH / 2][kSfbLdH]
  static constexpr size_t bytes = (u_off + (UHL ? 2 : 1) * us_lo) * sizeof(float);
  static_assert(e_off % 4 == 0 && gl_off % 4 == 0 && h_off % 4 == 0 && u_off % 4 == 0, "16-byte aligned sections");
};
static_assert(StateFwdBf16Smem<true>::bytes == 88576 && StateFwdBf16Smem<false>::bytes == 83456,
              "state_fwd_bf16 shared memory changed");
static_assert(2 * (StateFwdBf16Smem<true>::bytes + 1024) <= 228 * 1024, "two state_fwd_bf16 blocks must fit per SM");

// Warp w = 4 wc + wi: U rows 16 wi .. 16 wi + 15 (tokens), S rows 32 wi .. 32 wi + 31, columns 8 wc .. 8 wc + 7 of
// the block's 16 (state_fwd3 narrow's split), in the row orders above.
// (lo, hi) as bf16 hi and lo words: x = hi + lo to ~16 mantissa bits
__device__ __forceinline__ void sfb_pack_hl(float lo, float hi, uint32_t& h, uint32_t& l) {
  const __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
  h = *reinterpret_cast<const uint32_t*>(&t);
  l = s7_pack(lo - __low2float(t), hi - __high2float(t));
}

template <bool PC, bool UHL, bool EHL>
__global__ void __launch_bounds__(kSf3Threads, 2) state_fwd_bf16_kernel(Params p) {
  static_assert(UHL || !EHL, "state_fwd_bf16: K Eend hi + lo only with U hi + lo");
  using S = StateFwdBf16Smem<UHL>;
  constexpr int LDW = kSfbLdW, LDE = kSfbLdE, BV = kSfbBV;
  constexpr int MT = 2;  // 16-row tiles of the state per warp
  extern __shared__ __align__(16) float sm[];
  const float* wsm = sm + S::w_off;
  const float* esm = sm + S::e_off;
  const float* gsm = sm + S::gl_off;
  uint32_t* hw = reinterpret_cast<uint32_t*>(sm + S::h_off);
  uint32_t* Uw = reinterpret_cast<uint32_t*>(sm + S::u_off);
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * BV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 8 * wc;  // the warp's first column in the block's tile
  const int K = p.K, V = p.V, HV = p.HV;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // the state: hacc[mt][e] is row 32 wi + 16 mt + 2 gq + (e >> 1), column cw + 2 t4 + (e & 1)
  float hacc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 32 * wi + 16 * mt + 2 * gq + (e >> 1), col = v0 + cw + 2 * t4 + (e & 1);
      hacc[mt][e] = (p.h0 != nullptr && r < K && col < V) ? p.h0[nbase + static_cast<int64_t>(r) * V + col] : 0.f;
    }
  auto put_h = [&]() {  // bf16(S) -> hw (pairs of adjacent rows)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) s7_put_tile(hw, 32 * wi + 16 * mt, cw, hacc[mt], t4, gq);
  };
  // a (row, column pair) of a [*, V] fp32 buffer: float2 when V is even (8-byte aligned), else per element
  auto st_pair = [&](float* row, int col, float x0, float x1) {
    if ((V & 1) == 0 && col + 1 < V) {
      *reinterpret_cast<float2*>(row + col) = make_float2(x0, x1);
    } else {
      if (col < V) row[col] = x0;
      if (col + 1 < V) row[col + 1] = x1;
    }
  };
  auto store_hs = [&](int cid) {
    float* dst = p.hs + (static_cast<size_t>(cid) * HV + hv) * K * V;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 32 * wi + 16 * mt + 2 * gq + hr;
        if (r < K) st_pair(dst + static_cast<int64_t>(r) * V, v0 + cw + 2 * t4, hacc[mt][2 * hr], hacc[mt][2 * hr + 1]);
      }
  };
  // u at tokens 16 wi + 2 gq + (e >> 1), columns cw + 2 t4 + (e & 1) of chunk c (zeros past the chunk and V)
  auto load_u = [&](float (&x)[4], int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = 16 * wi + 2 * gq + hr;
      const float* row = p.u + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = v0 + cw + 2 * t4 + j;
        x[2 * hr + j] = (t < cp.Cc && col < V) ? __ldg(row + col) : 0.f;
      }
    }
  };
  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  auto issue_w = [&](int c) { sf3_ktile<LDW>(sm + S::w_off, p.wc + tile(off + c)); };
  auto issue_e = [&](int c) {
    sf3_ktile<LDE>(sm + S::e_off, p.kendc + tile(off + c));
    if (tid < KP / 4) cpa16(sm + S::gl_off + 4 * tid, p.glc + (static_cast<size_t>(off + c) * HV + hv) * KP + 4 * tid);
  };

  put_h();
  if (nc > 0) issue_w(0);  // the one group in flight at the start of chunk c: w(c)
  cpa_commit();
  float ucur[4] = {}, unext[4] = {};
  if (nc > 0) load_u(ucur, 0);

  for (int c = 0; c < nc; ++c) {
    const int cid = off + c;
    cpa_wait<0>();
    __syncthreads();  // w(c) from every thread; hw complete; every warp finished chunk c - 1 (its K Eend reads)
    issue_e(c);
    cpa_commit();
    store_hs(cid);
    if (c + 1 < nc) load_u(unext, c + 1);

    {  // U = u - w S: tokens 16 wi .., columns cw .. (two chains: even / odd k-steps)
      float acc[2][1][4] = {};
      const float* w0 = wsm + (16 * wi + 2 * gq) * LDW + 2 * t4;  // A row slot g: token 16 wi + 2g; slot g + 8: + 1
#pragma unroll
      for (int s = 0; s < KP / 16; ++s) {
        const float2 x0 = *reinterpret_cast<const float2*>(w0 + 16 * s);
        const float2 x1 = *reinterpret_cast<const float2*>(w0 + LDW + 16 * s);
        const float2 x2 = *reinterpret_cast<const float2*>(w0 + 16 * s + 8);
        const float2 x3 = *reinterpret_cast<const float2*>(w0 + LDW + 16 * s + 8);
        const uint32_t a[4] = {s7_pack(x0.x, x0.y), s7_pack(x1.x, x1.y), s7_pack(x2.x, x2.y), s7_pack(x3.x, x3.y)};
        mma_tiles16<1>(acc[s & 1], a, hw + cw, s, t4, gq);
      }
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = ucur[e] - (acc[0][0][e] + acc[1][0][e]);
      if constexpr (UHL) s7_put_tile_hl(Uw, S::us_lo, 16 * wi, cw, x, t4, gq);
      else s7_put_tile(Uw, 16 * wi, cw, x, t4, gq);
      const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = 16 * wi + 2 * gq + hr;
        if (t < cp.Cc)
          st_pair(p.U + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V), v0 + cw + 2 * t4, x[2 * hr],
                  x[2 * hr + 1]);
      }
    }
    cpa_wait<0>();  // K Eend(c), Gam_last(c)
    __syncthreads();  // Uw complete; K Eend(c) from every thread; every warp finished reading w(c) and hw
    if (c + 1 < nc) issue_w(c + 1);
    cpa_commit();

    {  // S <- Diag(Gam_last) S + (K Eend)^T U
      float cor[MT][4] = {};  // EHL: E_hi U_lo + E_lo U_hi
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float2 d = *reinterpret_cast<const float2*>(gsm + 32 * wi + 16 * mt + 2 * gq);
        hacc[mt][0] *= d.x;
        hacc[mt][1] *= d.x;
        hacc[mt][2] *= d.y;
        hacc[mt][3] *= d.y;
      }
      const uint32_t* ub = Uw + cw;
      const float* er = esm + 2 * t4 * LDE + 32 * wi + 2 * gq;  // A(m, tok) = K Eend(tok, m)
#pragma unroll
      for (int s = 0; s < CH / 16; ++s) {
        const uint32_t b0 = ub[(8 * s + t4) * kSfbLdH + gq], b1 = ub[(8 * s + 4 + t4) * kSfbLdH + gq];
        uint32_t l0 = 0, l1 = 0;
        if constexpr (UHL) {
          l0 = ub[S::us_lo + (8 * s + t4) * kSfbLdH + gq];
          l1 = ub[S::us_lo + (8 * s + 4 + t4) * kSfbLdH + gq];
        }
        const float* ek = er + 16 * s * LDE;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          // tokens 16 s + 2t, + 1 (k slots 2t, 2t + 1) and 16 s + 8 + 2t, + 1 (2t + 8, 2t + 9); .x: row slot g
          const float2 x0 = *reinterpret_cast<const float2*>(ek + 16 * mt);
          const float2 x1 = *reinterpret_cast<const float2*>(ek + LDE + 16 * mt);
          const float2 x2 = *reinterpret_cast<const float2*>(ek + 8 * LDE + 16 * mt);
          const float2 x3 = *reinterpret_cast<const float2*>(ek + 9 * LDE + 16 * mt);
          if constexpr (EHL) {
            uint32_t a[4], al[4];
            sfb_pack_hl(x0.x, x1.x, a[0], al[0]);
            sfb_pack_hl(x0.y, x1.y, a[1], al[1]);
            sfb_pack_hl(x2.x, x3.x, a[2], al[2]);
            sfb_pack_hl(x2.y, x3.y, a[3], al[3]);
            mma_bf16_k16(hacc[mt], a, b0, b1);
            mma_bf16_k16(cor[mt], a, l0, l1);
            mma_bf16_k16(cor[mt], al, b0, b1);
          } else {
            const uint32_t a[4] = {s7_pack(x0.x, x1.x), s7_pack(x0.y, x1.y), s7_pack(x2.x, x3.x),
                                   s7_pack(x2.y, x3.y)};
            mma_bf16_k16(hacc[mt], a, b0, b1);
            if constexpr (UHL) mma_bf16_k16(hacc[mt], a, l0, l1);
          }
        }
      }
      if constexpr (EHL) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) hacc[mt][e] += cor[mt][e];
      }
    }
    put_h();  // (hw was last read in chunk c's U, before the barrier above)
#pragma unroll
    for (int e = 0; e < 4; ++e) ucur[e] = unext[e];
  }
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
