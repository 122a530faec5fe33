// state_fwd v3 of the chunked backward (issue #7, session 6): the forward-state recompute of state_fwd2_kernel
// (delta_chunk_bwd.cuh) on tensor cores, for bf16/fp16 inputs (fp32 inputs keep state_fwd2). Same inputs and
// outputs (Params of delta_chunk_bwd.cuh): per chunk c of a sequence, with S the state at the chunk's start,
//   hs[c] = S,   U = u - w S  (stored to p.U),   S <- Diag(Gam_last) S + (K Eend)^T U,
// reading wc, kendc [chunks, HV, CH, KP] (zero padded), glc [chunks, HV, KP] (written by the prep) and u
// [tokens, HV, V]. hs and U are fp32.
//
// In the style of the forward's bulk-prefetch scan (delta_chunk_scan3_kernel, delta_chunk_fwd.cuh): one block of
// 256 threads per (sequence, value head, VS = 32 columns of V), the state tile (KP x 32, fp32) in mma accumulator
// registers with a copy in shared memory for the B fragments of U = u - w S; both contractions on mma.sync
// m16n8k8 tf32 with fp32 accumulation. Warp w = 4 wc + wi: rows 16 wi .. 16 wi + 15 of U and rows 32 wi ..
// 32 wi + 31 of S, columns 16 wc .. 16 wc + 15 of the block's 32.
// The operands arrive ahead of use, double-buffered, with cp.async (16-byte pieces by every thread; padded rows,
// conflict-free fragment reads: w rows of KP + 4 floats for its row-major A fragments, K Eend rows of KP + 8 for
// the transposed ones): w of chunk c + 2 is issued once chunk c's U is formed, K Eend and Gam_last of chunk c + 1
// at the start of chunk c, so each lands about a chunk step and a half ahead; u of the next chunk goes into
// registers a step ahead. Two barriers per chunk step.
// Not PRECISE (the narrow instance below, KDA_CUDA_CHUNK_BWD_STATE_FWD=7, the default; with 32 columns, =4, the
// default until session 10, retired in session 11): one tf32 product per term (operands rounded to 10-bit
// mantissas, fp32 accumulation and state). PRECISE (=3, 32 columns): 3xTF32 (a_hi b_hi + a_hi b_lo + a_lo b_hi, the two
// correction terms in their own accumulators so that the dependent chains stay short), about fp32 accuracy.
// Measured on the H200 (session 6, B1 T8192 H16 HV32 K=V=128 bf16): tf32 0.64 ms, 3xTF32 0.82 ms, state_fwd2
// 1.29 ms. Gradients with bf16 inputs, relative RMS from state_fwd2's: tf32 dg / dbeta <= 7e-5 (DESIGN.md's bound
// against float64: 0.02), dq / dk <= 4.2e-4 (bound 0.008; their error against float64, ~1.7e-3, is the bf16
// rounding of the outputs); 3xTF32 <= 5e-7 / 3.4e-5 (benchmarks/results/h200_session6_statefwd3.log).
#pragma once

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kSf3Threads = 256;
constexpr int kSf3LdW = KP + 4;  // w rows: A fragment (row gq, column t4) on bank 4 gq + t4
constexpr int kSf3LdE = KP + 8;  // K Eend rows, read transposed: (row t4, column gq) on bank 8 t4 + gq
// State and U tiles of BV columns: rows of BV + 8 floats, B fragment (row t4, column gq) on bank (BV + 8) t4 + gq
// mod 32 -- 8 t4 + gq at BV = 32, 24 t4 + gq (0, 24, 16, 8 + gq) at BV = 16: conflict-free either way.
template <int BV>
constexpr int sf3_ldh() { return BV + 8; }

// shared memory, in floats (every offset a multiple of 4: 16-byte aligned). BV: V columns per block (32: the
// 3xTF32 instance, =3; 16: KDA_CUDA_CHUNK_BWD_STATE_FWD=7, the default); DB: w / K Eend / Gam_last double-buffered (NB = 2) or single (1).
template <int BV, bool DB>
struct StateFwd3SmemT {
  static constexpr int NB = DB ? 2 : 1;
  static constexpr int LDH = sf3_ldh<BV>();
  static constexpr size_t w_off = 0;                               // NB x [CH][kSf3LdW]
  static constexpr size_t e_off = w_off + NB * CH * kSf3LdW;       // NB x [CH][kSf3LdE]
  static constexpr size_t gl_off = e_off + NB * CH * kSf3LdE;      // NB x [KP]
  static constexpr size_t h_off = gl_off + NB * KP;                // [KP][LDH]
  static constexpr size_t u_off = h_off + KP * LDH;                // [CH][LDH]
  static constexpr size_t bytes = (u_off + CH * LDH) * sizeof(float);
};
using StateFwd3Smem = StateFwd3SmemT<VS, true>;
constexpr size_t kStateFwd3Smem = StateFwd3Smem::bytes;  // 168,960 bytes
// The narrow variant (KDA_CUDA_CHUNK_BWD_STATE_FWD=7): 16 columns per block, single buffers, 87,552 bytes, so that
// two blocks (and their 1 KB reserves) fit in the H200's 228 KB per SM; 256 threads at <= 128 registers each.
constexpr int kSf3NarrowBV = 16;
constexpr size_t kStateFwd3NarrowSmem = StateFwd3SmemT<kSf3NarrowBV, false>::bytes;
static_assert(kStateFwd3Smem == 168960 && kStateFwd3NarrowSmem == 87552, "state_fwd3 shared memory changed");
static_assert(2 * (kStateFwd3NarrowSmem + 1024) <= 228 * 1024, "two narrow state_fwd3 blocks must fit per SM");
// The wide-block instance (KDA_CUDA_CHUNK_BWD_STATE_FWD=11, session 13): 32 columns, 16 warps of the narrow one's
// warp tile, double buffers (the 32-column layout, 168,960 bytes), one block per SM.
constexpr int kSf3WideThreads = 512;

// A padded CH x KP chunk tile (global row stride KP) into shared rows of stride LD.
template <int LD, int NT = kSf3Threads>
__device__ __forceinline__ void sf3_ktile(float* dst, const float* src) {
  for (int i = threadIdx.x; i < CH * (KP / 4); i += NT) {
    const int t = i / (KP / 4), c = (i % (KP / 4)) * 4;
    cpa16(dst + t * LD + c, src + t * KP + c);
  }
}

// c += a b on one 16x8x8 tile (a: the A fragment, b0 / b1: the B fragment). PRECISE: the cross terms a_lo b_hi
// and a_hi b_lo go into e (added to c by the caller), a_hi b_hi into c.
template <bool PRECISE>
struct Sf3A {
  uint32_t h[4], l[4];
  __device__ __forceinline__ explicit Sf3A(const float4& a) {
    const float x[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      h[i] = to_tf32(x[i]);
      l[i] = PRECISE ? to_tf32(x[i] - __uint_as_float(h[i])) : 0u;
    }
  }
};

// BR: b0 / b1 are tf32 already (rounded when stored to shared memory; cvt.rna of a tf32 value is the value, so
// the mma sees the same bits as with BR false).
template <bool PRECISE, bool BR = false>
__device__ __forceinline__ void sf3_mma(float* c, float* e, const Sf3A<PRECISE>& a, float b0, float b1) {
  static_assert(!(PRECISE && BR), "sf3_mma: the 3xTF32 split needs the unrounded B");
  const uint32_t bh0 = BR ? __float_as_uint(b0) : to_tf32(b0), bh1 = BR ? __float_as_uint(b1) : to_tf32(b1);
  if constexpr (PRECISE) {
    const uint32_t bl0 = to_tf32(b0 - __uint_as_float(bh0)), bl1 = to_tf32(b1 - __uint_as_float(bh1));
    mma_tf32_raw(e, a.l[0], a.l[1], a.l[2], a.l[3], bh0, bh1);
    mma_tf32_raw(e, a.h[0], a.h[1], a.h[2], a.h[3], bl0, bl1);
  }
  mma_tf32_raw(c, a.h[0], a.h[1], a.h[2], a.h[3], bh0, bh1);
}

// BV = 32, DB (the default launch, one block per SM): as described at the top. BV = 16, !DB (the narrow one, two
// blocks per SM): each warp owns 8 columns (NTW = 1), the grid has twice the blocks, and w, K Eend and Gam_last are
// single-buffered: w(c + 1) is issued once chunk c's U is formed (every warp past its last read of w(c)), K Eend(c)
// and Gam_last(c) at the start of chunk c (every warp past chunk c - 1's state update), so each has about half a
// chunk step to land, and the SM's other block fills the wait. Every block reads the chunk's w and K Eend tiles
// whole, so the narrow grid moves twice their L2 traffic.
// NW = 16 (the wide-block instance, KDA_CUDA_CHUNK_BWD_STATE_FWD=11; BV = 32, DB): 16 warps, w = 4 wc + wi with
// wc = 0..3, each with the narrow instance's warp tile (U rows 16 wi.., state rows 32 wi.., 8 columns 8 wc..), so
// every output element comes from the same mma chain on the same tf32 operands as under =7 (bit-identical); but
// with =3's double buffers (operands issued a step and a half ahead), half the grid (one block per SM, 128 blocks
// at B1 HV32 V128) and half the L2 -> SM traffic of =7. h and U go into shared memory rounded to tf32 once (RB),
// so their B fragments (read by the 4 warps of a column group) need no cvt.
// (The body is a device function so that the kernels of =7 / =3 keep their names and code.)
template <bool PC, bool PRECISE, int BV, bool DB, int NW>
__device__ __forceinline__ void state_fwd3_body(const Params& p) {
  static_assert((BV == 32 && DB && NW == 8) || (BV == 16 && !DB && NW == 8) || (BV == 32 && DB && NW == 16 && !PRECISE),
                "state_fwd3: BV = 32 double-buffered, BV = 16 single, or the 16-warp tf32 BV = 32");
  using S = StateFwd3SmemT<BV, DB>;
  constexpr int NT = NW * 32;
  constexpr bool RB = NW == 16;  // h, U stored tf32-rounded
  constexpr int LDW = kSf3LdW, LDE = kSf3LdE, LDH = S::LDH;
  constexpr int NTW = BV / (2 * NW);  // 8-column tiles per warp (NW = 8: BV / 2 columns; NW = 16: 8 columns)
  constexpr int MT = 2;   // 16-row tiles of the state per warp (32 rows)
  extern __shared__ __align__(16) float sm[];
  float* hsm = sm + S::h_off;
  float* Us = sm + S::u_off;
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * BV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 8 * NTW * wc;  // the warp's first column in the block's tile
  const int K = p.K, V = p.V, HV = p.HV;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // the state: hacc[mt][nt][e] is row 32 wi + 16 mt + gq + 8 (e >> 1), column cw + 8 nt + 2 t4 + (e & 1)
  float hacc[MT][NTW][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 32 * wi + 16 * mt + gq + 8 * (e >> 1), col = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        hacc[mt][nt][e] = (p.h0 != nullptr && r < K && col < V) ? p.h0[nbase + static_cast<int64_t>(r) * V + col] : 0.f;
      }
  auto put_h = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 32 * wi + 16 * mt + gq + 8 * hr;
          float x0 = hacc[mt][nt][2 * hr], x1 = hacc[mt][nt][2 * hr + 1];
          if constexpr (RB) {
            x0 = __uint_as_float(to_tf32(x0));
            x1 = __uint_as_float(to_tf32(x1));
          }
          *reinterpret_cast<float2*>(hsm + r * LDH + cw + 8 * nt + 2 * t4) = make_float2(x0, x1);
        }
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
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 32 * wi + 16 * mt + gq + 8 * hr;
          if (r < K)
            st_pair(dst + static_cast<int64_t>(r) * V, v0 + cw + 8 * nt + 2 * t4, hacc[mt][nt][2 * hr],
                       hacc[mt][nt][2 * hr + 1]);
        }
  };
  // u rows 16 wi + gq + 8 (e >> 1), columns cw + 8 nt + 2 t4 + (e & 1) of chunk c (zeros past the chunk and V)
  auto load_u = [&](float (&x)[NTW][4], int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = 16 * wi + gq + 8 * hr;
      const float* row = p.u + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = v0 + cw + 8 * nt + 2 * t4 + j;
          x[nt][2 * hr + j] = (t < cp.Cc && col < V) ? __ldg(row + col) : 0.f;
        }
    }
  };
  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  auto bsel = [](int c) { return DB ? (c & 1) : 0; };  // the buffer of chunk c
  auto issue_w = [&](int c) { sf3_ktile<LDW, NT>(sm + S::w_off + bsel(c) * CH * LDW, p.wc + tile(off + c)); };
  auto issue_e = [&](int c) {
    sf3_ktile<LDE, NT>(sm + S::e_off + bsel(c) * CH * LDE, p.kendc + tile(off + c));
    if (tid < KP / 4)
      cpa16(sm + S::gl_off + bsel(c) * KP + 4 * tid, p.glc + (static_cast<size_t>(off + c) * HV + hv) * KP + 4 * tid);
  };

  put_h();
  if constexpr (DB) {
    // groups in flight, oldest first: w(c), K Eend(c), w(c + 1) at the start of chunk c (empty groups past the end)
    if (nc > 0) issue_w(0);
    cpa_commit();
    if (nc > 0) issue_e(0);
    cpa_commit();
    if (nc > 1) issue_w(1);
    cpa_commit();
  } else {
    // the one group in flight at the start of chunk c: w(c)
    if (nc > 0) issue_w(0);
    cpa_commit();
  }
  float ucur[NTW][4] = {}, unext[NTW][4] = {};
  if (nc > 0) load_u(ucur, 0);

  for (int c = 0; c < nc; ++c) {
    const int cid = off + c;
    const float* wb = sm + S::w_off + bsel(c) * CH * LDW;
    const float* eb = sm + S::e_off + bsel(c) * CH * LDE;
    const float* gb = sm + S::gl_off + bsel(c) * KP;
    if constexpr (DB) cpa_wait<2>();  // w(c)
    else cpa_wait<0>();
    __syncthreads();  // w(c) from every thread; hsm complete; every warp finished chunk c - 1 (its K Eend buffer)
    if constexpr (DB) {
      if (c + 1 < nc) issue_e(c + 1);
    } else {
      issue_e(c);  // (the single buffer: chunk c - 1's update, its last reader, is behind the barrier above)
    }
    cpa_commit();
    store_hs(cid);
    if (c + 1 < nc) load_u(unext, c + 1);

    {  // U = u - w S: rows 16 wi .., columns cw .. (two chains: even / odd k-steps)
      float acc[2][NTW][4], cor[2][NTW][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][nt][e] = cor[i][nt][e] = 0.f;
      const float* wr = wb + (16 * wi + gq) * LDW + t4;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        const Sf3A<PRECISE> a(make_float4(wr[8 * ks], wr[8 * LDW + 8 * ks], wr[8 * ks + 4], wr[8 * LDW + 8 * ks + 4]));
        const float* hb = hsm + (8 * ks + t4) * LDH + cw + gq;
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
          sf3_mma<PRECISE, RB>(acc[ks & 1][nt], cor[ks & 1][nt], a, hb[8 * nt], hb[4 * LDH + 8 * nt]);
      }
      const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = 16 * wi + gq + 8 * hr;
        float* grow = p.U + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          float x[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int e = 2 * hr + j;
            float s = acc[0][nt][e] + acc[1][nt][e];
            if constexpr (PRECISE) s += cor[0][nt][e] + cor[1][nt][e];
            x[j] = ucur[nt][e] - s;
          }
          const int col = cw + 8 * nt + 2 * t4;
          if constexpr (RB) {
            *reinterpret_cast<float2*>(Us + t * LDH + col) =
                make_float2(__uint_as_float(to_tf32(x[0])), __uint_as_float(to_tf32(x[1])));
          } else {
            *reinterpret_cast<float2*>(Us + t * LDH + col) = make_float2(x[0], x[1]);
          }
          if (t < cp.Cc) st_pair(grow, v0 + col, x[0], x[1]);
        }
      }
    }
    if constexpr (DB) cpa_wait<2>();  // K Eend(c), Gam_last(c)
    else cpa_wait<0>();
    __syncthreads();  // Us complete; K Eend(c) from every thread; every warp finished reading w(c) and hsm
    if constexpr (DB) {
      if (c + 2 < nc) issue_w(c + 2);
    } else {
      if (c + 1 < nc) issue_w(c + 1);  // (the single buffer: w(c)'s readers are behind the barrier above)
    }
    cpa_commit();

    {  // S <- Diag(Gam_last) S + (K Eend)^T U
      float cor[MT][NTW][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float d0 = gb[32 * wi + 16 * mt + gq], d1 = gb[32 * wi + 16 * mt + gq + 8];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          hacc[mt][nt][0] *= d0;
          hacc[mt][nt][1] *= d0;
          hacc[mt][nt][2] *= d1;
          hacc[mt][nt][3] *= d1;
#pragma unroll
          for (int e = 0; e < 4; ++e) cor[mt][nt][e] = 0.f;
        }
      }
      const float* er = eb + t4 * LDE + 32 * wi + gq;  // A(m, t) = K Eend(t, m)
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        float b[NTW][2];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          b[nt][0] = Us[(8 * ks + t4) * LDH + cw + 8 * nt + gq];
          b[nt][1] = Us[(8 * ks + t4 + 4) * LDH + cw + 8 * nt + gq];
        }
        const float* ek = er + 8 * ks * LDE;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float* e0 = ek + 16 * mt;
          const Sf3A<PRECISE> a(make_float4(e0[0], e0[8], e0[4 * LDE], e0[4 * LDE + 8]));
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt) sf3_mma<PRECISE, RB>(hacc[mt][nt], cor[mt][nt], a, b[nt][0], b[nt][1]);
        }
      }
      if constexpr (PRECISE) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) hacc[mt][nt][e] += cor[mt][nt][e];
      }
    }
    put_h();  // (hsm was last read in chunk c's U, before the barrier above)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ucur[nt][e] = unext[nt][e];
  }
}

template <bool PC, bool PRECISE, int BV = VS, bool DB = true>
__global__ void __launch_bounds__(kSf3Threads, DB ? 1 : 2) state_fwd3_kernel(Params p) {
  state_fwd3_body<PC, PRECISE, BV, DB, 8>(p);
}

// KDA_CUDA_CHUNK_BWD_STATE_FWD=11: the wide-block instance (NW = 16 above)
template <bool PC>
__global__ void __launch_bounds__(kSf3WideThreads, 1) state_fwd3w_kernel(Params p) {
  state_fwd3_body<PC, false, VS, true, 16>(p);
}

// ---- state_fwd3 shared-operand (KDA_CUDA_CHUNK_BWD_STATE_FWD=11, session 13) ----
// One block of 16 warps per (sequence, value head, 32 columns) = two column groups of 8 warps (warps 0..7: columns
// v0 .. v0 + 15, warps 8..15: v0 + 16 .. v0 + 31), each group exactly a narrow (=7) block: its own h / U tiles
// (LDH 24), its own named barrier (1 + group) for its two barriers per chunk step, the narrow warp tiles and
// fragment reads, so every output element comes from the same mma chain on the same tf32 operands as under =7
// (bit-identical). The groups share the chunk's w, K Eend and Gam_last tiles, double-buffered: a block moves half
// the L2 -> SM bytes of two narrow blocks, and each tile is issued a whole chunk step ahead of its first read
// (=7: about half a step, exposed every step). Hand-off, per tile kind (w; K Eend with Gam_last) and buffer: a
// group gives the buffer of chunk c back once all its warps are past their last read (w: its second barrier of
// chunk c; K Eend: its first barrier of chunk c + 1) -- warp 0's lane 0 counts the release in a shared counter;
// the second group to release (odd count) then issues chunk c + 2 into the buffer with its 256 threads (16-byte
// cp.async pieces, as =7, each thread then cp.async.mbarrier.arrive.noinc on the tile's mbarrier, count 256) right
// after its next barrier (which publishes the decision to the group). Readers wait on the mbarrier's phase
// ((c >> 1) & 1) before the barrier in front of their first read. So the groups meet only there, and, as two
// narrow blocks on an SM, one can run while the other waits at its barrier. (Row-wise bulk copies, 129 per chunk
// step, were session 9's state_fwd4: slower.) h and U go into shared memory rounded to tf32 once (as the =7
// fragment reads round them: cvt.rna of a tf32 value is the value), so their B fragments need no cvt.
// 175,168 bytes of shared memory, one block per SM.
constexpr int kSf3sThreads = 512;
struct StateFwd3sSmem {
  static constexpr int LDH = sf3_ldh<kSf3NarrowBV>();
  static constexpr size_t w_off = 0;                           // 2 x [CH][kSf3LdW]
  static constexpr size_t e_off = w_off + 2 * CH * kSf3LdW;    // 2 x [CH][kSf3LdE]
  static constexpr size_t gl_off = e_off + 2 * CH * kSf3LdE;   // 2 x [KP]
  static constexpr size_t h_off = gl_off + 2 * KP;             // 2 groups x [KP][LDH]
  static constexpr size_t u_off = h_off + 2 * KP * LDH;        // 2 groups x [CH][LDH]
  // mbarriers fw[2], fe[2] (8 bytes each); int counters cw[2], ce[2]; int flags fw[group], fe[group]
  static constexpr size_t bar_off = u_off + 2 * CH * LDH;
  static constexpr size_t bytes = bar_off * sizeof(float) + 4 * 8 + 8 * 4;
};
constexpr size_t kStateFwd3sSmem = StateFwd3sSmem::bytes;
static_assert(kStateFwd3sSmem == 175168 && kStateFwd3sSmem <= 227 * 1024, "state_fwd3s shared memory changed");
static_assert((StateFwd3sSmem::bar_off * sizeof(float)) % 16 == 0 && StateFwd3sSmem::e_off % 4 == 0 &&
              StateFwd3sSmem::gl_off % 4 == 0, "16-byte aligned cp.async pieces, 8-byte aligned mbarriers");

template <bool PC>
__global__ void __launch_bounds__(kSf3sThreads, 1) state_fwd3s_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = StateFwd3sSmem;
  constexpr int LDW = kSf3LdW, LDE = kSf3LdE, LDH = S::LDH;
  constexpr int MT = 2;
  constexpr int GT = kSf3sThreads / 2;  // threads per group
  extern __shared__ __align__(16) float sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, grp = warp >> 3, wg = warp & 7, gt = tid & (GT - 1);
  const int wi = wg & 3, wc = wg >> 2, gq = lane >> 2, t4 = lane & 3;
  float* hsm = sm + S::h_off + grp * KP * LDH;
  float* Us = sm + S::u_off + grp * CH * LDH;
  const uint32_t bar0 = smem_u32(sm + S::bar_off);  // fw[b]: bar0 + 8 b, fe[b]: bar0 + 16 + 8 b
  int* cnt = reinterpret_cast<int*>(sm + S::bar_off + 8);  // cnt[0..1]: w buffers, cnt[2..3]: K Eend buffers
  int* flag = cnt + 4;  // flag[2 g]: the w chunk group g issues next, flag[2 g + 1]: the K Eend chunk
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS + kSf3NarrowBV * grp;
  const int cw = 8 * wc;
  const int V = p.V, HV = p.HV, K = p.K;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);
  auto grp_sync = [&]() {  // named barrier 1 + grp (immediate ids: ptxas then reserves 3 barriers, not 16)
    if (grp == 0) asm volatile("bar.sync 1, 256;" ::: "memory");
    else asm volatile("bar.sync 2, 256;" ::: "memory");
  };
  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  // mbar_wait_parity with a bound: a hand-off bug traps (a CUDA error) instead of hanging the GPU (2^26 polls)
  auto wait_tile = [](uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    for (uint32_t it = 0; !done; ++it) {
      asm volatile(
          "{\n\t.reg .pred P1;\n\tmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\n\tselp.u32 %0, 1, 0, P1;\n\t}"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
      if (it > (1u << 26)) __trap();
    }
  };
  auto mbar_cpa = [](uint32_t bar) {  // arrives once this thread's earlier cp.async pieces have landed
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
  };
  // a CH x KP tile of chunk c into its buffer, by one group's 256 threads (8 pieces each)
  auto issue_w = [&](int c) {
    const float* src = p.wc + tile(off + c);
    float* dst = sm + S::w_off + (c & 1) * CH * LDW;
#pragma unroll
    for (int j = 0; j < CH * KP / 4 / GT; ++j) {
      const int i = gt + GT * j, t = i >> 5, col = (i & 31) * 4;
      cpa16(dst + t * LDW + col, src + t * KP + col);
    }
    mbar_cpa(bar0 + 8 * (c & 1));
  };
  auto issue_e = [&](int c) {
    const float* src = p.kendc + tile(off + c);
    float* dst = sm + S::e_off + (c & 1) * CH * LDE;
#pragma unroll
    for (int j = 0; j < CH * KP / 4 / GT; ++j) {
      const int i = gt + GT * j, t = i >> 5, col = (i & 31) * 4;
      cpa16(dst + t * LDE + col, src + t * KP + col);
    }
    if (gt < KP / 4)
      cpa16(sm + S::gl_off + (c & 1) * KP + 4 * gt, p.glc + (static_cast<size_t>(off + c) * HV + hv) * KP + 4 * gt);
    mbar_cpa(bar0 + 16 + 8 * (c & 1));
  };
  // lane 0 of the group's warp 0, all the group's warps past their last read of chunk cr's tile of kind k (0: w,
  // 1: K Eend): the second group to get here has its threads issue chunk cr + 2 after their next barrier
  auto release = [&](int k, int cr) {
    if (cr + 2 >= nc) return;
    __threadfence_block();
    const int old = atomicAdd(cnt + 2 * k + (cr & 1), 1);  // two releases per use: odd counts are the second
    __threadfence_block();
    if (old & 1) flag[2 * grp + k] = cr + 2;
  };

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar0 + 8 * i, GT);
#pragma unroll
    for (int i = 0; i < 8; ++i) cnt[i] = i < 4 ? 0 : -1;
    mbar_init_fence();
  }
  __syncthreads();
  if (grp == 0) {  // chunks 0 and 1 by group 0
    if (nc > 0) {
      issue_w(0);
      issue_e(0);
    }
    if (nc > 1) {
      issue_w(1);
      issue_e(1);
    }
  }

  float hacc[MT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 32 * wi + 16 * mt + gq + 8 * (e >> 1), col = v0 + cw + 2 * t4 + (e & 1);
      hacc[mt][e] = (p.h0 != nullptr && r < K && col < V) ? p.h0[nbase + static_cast<int64_t>(r) * V + col] : 0.f;
    }
  auto put_h = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = 32 * wi + 16 * mt + gq + 8 * hr;
        *reinterpret_cast<float2*>(hsm + r * LDH + cw + 2 * t4) =
            make_float2(__uint_as_float(to_tf32(hacc[mt][2 * hr])), __uint_as_float(to_tf32(hacc[mt][2 * hr + 1])));
      }
  };
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
        const int r = 32 * wi + 16 * mt + gq + 8 * hr;
        if (r < K) st_pair(dst + static_cast<int64_t>(r) * V, v0 + cw + 2 * t4, hacc[mt][2 * hr], hacc[mt][2 * hr + 1]);
      }
  };
  auto load_u = [&](float (&x)[4], int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = 16 * wi + gq + 8 * hr;
      const float* row = p.u + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = v0 + cw + 2 * t4 + j;
        x[2 * hr + j] = (t < cp.Cc && col < V) ? __ldg(row + col) : 0.f;
      }
    }
  };

  put_h();
  float ucur[4] = {}, unext[4] = {};
  if (nc > 0) load_u(ucur, 0);
  for (int c = 0; c < nc; ++c) {
    const int cid = off + c, b = c & 1;
    const uint32_t par = (c >> 1) & 1;
    const float* wb = sm + S::w_off + b * CH * LDW;
    const float* eb = sm + S::e_off + b * CH * LDE;
    const float* gb = sm + S::gl_off + b * KP;
    wait_tile(bar0 + 8 * b, par);  // w(c)
    grp_sync();  // hsm complete; the group's warps all past chunk c - 1; flag[2 grp] published
    if (c + 1 < nc && flag[2 * grp] == c + 1) issue_w(c + 1);
    if (tid % GT == 0 && c > 0) release(1, c - 1);  // K Eend(c - 1), Gam_last(c - 1): read last in chunk c - 1
    store_hs(cid);
    if (c + 1 < nc) load_u(unext, c + 1);
    {  // U = u - w S (=7's chains: even / odd k-steps)
      float acc[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
      const float* wr = wb + (16 * wi + gq) * LDW + t4;
      const float* hb = hsm + t4 * LDH + cw + gq;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        const Sf3A<false> a(make_float4(wr[8 * ks], wr[8 * LDW + 8 * ks], wr[8 * ks + 4], wr[8 * LDW + 8 * ks + 4]));
        float dummy[4];
        sf3_mma<false, true>(acc[ks & 1], dummy, a, hb[8 * ks * LDH], hb[(8 * ks + 4) * LDH]);
      }
      const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = 16 * wi + gq + 8 * hr;
        float* grow = p.U + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
        float x[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = 2 * hr + j;
          x[j] = ucur[e] - (acc[0][e] + acc[1][e]);
        }
        const int col = cw + 2 * t4;
        *reinterpret_cast<float2*>(Us + t * LDH + col) =
            make_float2(__uint_as_float(to_tf32(x[0])), __uint_as_float(to_tf32(x[1])));
        if (t < cp.Cc) st_pair(grow, v0 + col, x[0], x[1]);
      }
    }
    wait_tile(bar0 + 16 + 8 * b, par);  // K Eend(c), Gam_last(c)
    grp_sync();  // Us complete; the group's reads of hsm and w(c) done; flag[2 grp + 1] published
    if (c + 1 < nc && flag[2 * grp + 1] == c + 1) issue_e(c + 1);
    if (tid % GT == 0) release(0, c);  // w(c)
    {  // S <- Diag(Gam_last) S + (K Eend)^T U
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float d0 = gb[32 * wi + 16 * mt + gq], d1 = gb[32 * wi + 16 * mt + gq + 8];
        hacc[mt][0] *= d0;
        hacc[mt][1] *= d0;
        hacc[mt][2] *= d1;
        hacc[mt][3] *= d1;
      }
      const float* er = eb + t4 * LDE + 32 * wi + gq;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        const float b0 = Us[(8 * ks + t4) * LDH + cw + gq], b1 = Us[(8 * ks + t4 + 4) * LDH + cw + gq];
        const float* ek = er + 8 * ks * LDE;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float* e0 = ek + 16 * mt;
          const Sf3A<false> a(make_float4(e0[0], e0[8], e0[4 * LDE], e0[4 * LDE + 8]));
          float dummy[4];
          sf3_mma<false, true>(hacc[mt], dummy, a, b0, b1);
        }
      }
    }
    put_h();  // (hsm was last read in chunk c's U, before the barrier above)
#pragma unroll
    for (int e = 0; e < 4; ++e) ucur[e] = unext[e];
  }
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
