// KDA prep kernel v2 of the chunked forward (per-channel gate), bf16/fp16 inputs: the default for KDA since
// session 7, with the 8x8 split below since session 8. The v1 kernel (KDA_CUDA_KDA_PREP=1, kda_chunk_prep.cuh,
// 0.82 ms vs 0.57) and the generic delta_chunk_prep_kernel for 16-bit inputs (=0) were retired in session 9, this
// kernel without the split (=2, 16-token diagonal blocks on CUDA cores, 0.61 ms vs 0.57) in session 11. Writes
// the workspace the scans read (WsLayout: w, q~, k~^T, A~, decay, u0; the sections,
// fragment order and bf16/fp32 choice of the generic kernel), so the scans are unchanged.
//
// Phases and thread mappings as v1 had them (S0, S1, four passes of 32 channels with build / P2 / P1, results,
// S2..S5; docs/cuda.md, "KDA prep kernel (session 4)"). Within a 16-token sub-chunk every decay factor is a
// PRODUCT of a_i = e^{g_i}; factors across sub-chunks are exponentials of float sums of whole sub-chunks' gates (no
// double arithmetic):
//   S1  a = e^g in place of the gates (one exponential per token and channel; v1 took one per pair and channel
//       in P1 and several per token in the build) and S_b = the sum of sub-chunk b's gates (float tree sum).
//   build  F_t = prod_{16a <= i <= t} a_i = e^{G_t - G_r} and R_t = prod_{t < i <= 16a + 15} a_i = e^{G_s - G_t}
//       (running products within the sub-chunk, 64 rows each), Pre_a = e^{sum_{b < a} S_b}, Suf_a =
//       e^{sum_{b > a} S_b}, the cross factors e^{G_r - G_s} = e^{S_1}, e^{S_2}, e^{S_1 + S_2}, and the decay
//       e^{S_0 + S_1 + S_2 + S_3}.
//   P2  unchanged (tf32 m16n8k8 over the factor tables).
//   W   q~ = scale q F Pre and k~^T = beta k R Suf written by a separate pass-local loop in fragment order, one
//       8-byte (bf16) / 16-byte (fp32) store per lane (v1: one 2-byte store per element).
//   P1  in-sub-chunk pairs with a running product f <- f a_j walking j down from t (v1: e^{running float sum}),
//       branch-free: rows outside the triangle keep f = 1 and their sums are dropped by the result masks.
//   S2  X = k e^{G} = k Pre_a prod_{16a <= i <= t} a_i in place of a.
// Exactness: every factor is a product of a_i <= 1 or the exponential of a direct sum of gates (<= 0 for log
// decays <= 0), so every factor is <= 1 and gates of -1e4 give 0, never inf/NaN; no gate bound is assumed. The
// products have at most 16 factors (relative error ~16 ulp at worst); the chunk decay, which compounds over the
// chunks of a sequence, is one exponential of the chunk's gate sum (a product of 64 a_i would be ~1e-6 off for
// gates near 0, where the state's memory spans hundreds of chunks).
// Shared memory ~111 KB at K = 128 (two blocks per SM), 256 threads.
//
// The 8x8 split (session 8): each 16x16 diagonal block in 8x8 quarters. The lower-left quarter (t in
// 16a+8..15, j in 16a..16a+7) on tensor cores through the token m = 16a + 7, (x_t e^{G_t - G_m}) . (k_j
// e^{G_m - G_j}), both factors running products within the half (a third 64-row table, in the A_kk region during
// the passes), one 16x8 tile per sub-chunk with the q rows on top and the k rows below (warps 0-3); P1 on CUDA
// cores only for the two 8x8 triangles (thread = sub-chunk, half, row pair {t, 7 - t}, channel group): 12 pair
// slots per channel pair instead of 24 and 24 accumulators instead of 48; the upper-right quarter of A~ is
// written as zeros.
#pragma once

#include "gdn_chunk_prep2.cuh"  // (and gdn_chunk_prep.cuh) FAST: prep2_round_t, prep2_w_u0_x, to_tf32_fast

namespace kda_kernels {
namespace cuda {

// (the helpers below came from the v1 kernel's file, kda_chunk_prep.cuh, retired in session 9; the backward's
// prep v4, delta_chunk_bwd_prep4.cuh, uses them too)
constexpr int kKdaPass = 32;  // channels per pass

// Rows [0, 64) x columns [0, KP) of the fp32 gates into shared memory (row stride ld), zero outside rows < L and
// columns < ncol. vec: 16-byte cp.async (src 16-byte aligned, rs and ncol multiples of 4).
template <int KP>
__device__ __forceinline__ void kda_stage_gates(float* dst, int ld, const float* src, int64_t rs, int L, int ncol,
                                                bool vec, int tid) {
  if (vec) {
    constexpr int CPR = KP / 4;
#pragma unroll 4
    for (int i = tid; i < kChunk * CPR; i += kGdnThreads) {
      const int t = i / CPR, c = (i % CPR) * 4;
      const bool ok = t < L && c < ncol;
      gdn_cp_async16(dst + t * ld + c, ok ? src + t * rs + c : src, ok);
    }
  } else {
    for (int i = tid; i < kChunk * KP; i += kGdnThreads) {
      const int t = i / KP, c = i % KP;
      dst[t * ld + c] = (t < L && c < ncol) ? __ldg(src + t * rs + c) : 0.f;
    }
  }
}

// Cross-sub-chunk tile number (0..23) -> row block a (1..3), matrix (0: q, 1: k), 8-column tile nt (< 2a).
__device__ __forceinline__ void cross_tile(int tile, int& a, int& mat, int& nt) {
  a = tile < 4 ? 1 : (tile < 12 ? 2 : 3);
  const int local = tile - (a == 1 ? 0 : (a == 2 ? 4 : 12));
  mat = local / (2 * a);
  nt = local - mat * 2 * a;
}

// FAST's assignment of the same 24 tiles (warp, u = 0..2) so that a warp's tiles share their A operand (rows of
// sub-chunk a of q or k): warps 0-3 (a = 3; q: 0, 1, k: 2, 3) three tiles each, warps 4 / 5 (a = 2, q / k) nt 0..2,
// warps 6 / 7 (q / k) the tile (2, nt 3), then a = 1's two tiles.
__device__ __forceinline__ void cross_tile_fast(int warp, int u, int& a, int& mat, int& nt) {
  if (warp < 4) {
    a = 3, mat = warp >> 1, nt = 3 * (warp & 1) + u;
  } else if (warp < 6 || u == 0) {
    a = 2, mat = warp & 1, nt = warp < 6 ? u : 3;
  } else {
    a = 1, mat = warp & 1, nt = u - 1;
  }
}

template <int KP>
struct KdaPrep2Smem {
  static constexpr int LDH = KP + 8;        // 16-bit row stride of q / k
  static constexpr int LDG = KP + 8;        // fp32 row stride of a = e^g / X (conflict-free B fragments in S5)
  static constexpr int LDF = kKdaPass + 4;  // fp32 row stride of the per-pass factor tables
  static constexpr size_t r1 = 0;           // q (16-bit), later T (fp32)
  static constexpr size_t r1_bytes = cmax(2 * kChunk * LDH, 4 * kChunk * kPrepLDA);
  static constexpr size_t r2 = r1 + r1_bytes;  // k (16-bit), later v's first 128 columns
  static constexpr size_t r2_bytes = cmax(2 * kChunk * LDH, 2 * kChunk * kPrepLDV);
  static constexpr size_t gx = r2 + r2_bytes;  // gates [64][LDG] -> a = e^g -> X = K e^G
  static constexpr size_t fb = gx + 4 * kChunk * LDG;  // factor tables F, R: 2 x [64][LDF], later S3/S4 scratch
  static constexpr size_t fb_bytes = cmax(2 * kChunk * LDF * 4, 4 * 16 * kPrepLDY * 4);
  static constexpr size_t ab = fb + fb_bytes;                // A_kk Diag(beta) [64][kPrepLDA]
  static constexpr size_t tot = ab + 4 * kChunk * kPrepLDA;  // float [4][KP]: S_b, the gate sum of sub-chunk b
  static constexpr size_t pre = tot + 4 * 4 * KP;            // float [4][KP]: Pre_a
  static constexpr size_t suf = pre + 4 * 4 * KP;            // float [4][KP]: Suf_a
  static constexpr size_t ex = suf + 4 * 4 * KP;             // float [3][KP]: e^{S_1}, e^{S_2}, e^{S_1 + S_2}
  static constexpr size_t bs = ex + 4 * 3 * KP;              // beta [64]
  static constexpr size_t bytes = bs + 4 * kChunk;
  static_assert(r2 % 16 == 0 && gx % 16 == 0 && fb % 16 == 0 && ab % 16 == 0 && tot % 16 == 0 && pre % 16 == 0 &&
                    suf % 16 == 0 && ex % 16 == 0 && bs % 16 == 0,
                "16-byte aligned sections");
};

// c += a b on one 16x8x8 tile, tf32 operands: mma8<false>'s (cvt.rna) or, FAST, to_tf32_fast's (the same bits for
// every non-NaN input; in the SASS one IADD per conversion, cvt.rna's FSETP + IADD: the mma ignores the low bits).
template <bool FAST>
__device__ __forceinline__ void kda_mma8(float* c, const float4& a, float b0, float b1) {
  if constexpr (FAST) {
    mma_tf32_raw(c, to_tf32_fast(a.x), to_tf32_fast(a.y), to_tf32_fast(a.z), to_tf32_fast(a.w), to_tf32_fast(b0),
                 to_tf32_fast(b1));
  } else {
    mma8<false>(c, a, b0, b1);
  }
}

// Each 16x16 diagonal block in 8x8 quarters (the 8x8 split); see the end of the header comment.
// WB (scan7, KDA_CUDA_CHUNK_SCAN=10 / 11): w goes out as bf16 (prep_w_u0).
// FAST (KDA_CUDA_KDA_PREP=6, session 13, opt-in): the same values bit for bit (non-NaN inputs) with fewer
// instructions: tf32 conversions by to_tf32_fast (P2, the lower-left quarters), P2's tiles regrouped so that a
// warp's tiles share their A operand (cross_tile_fast), and S5 as gdn_chunk_prep2's (prep2_w_u0_x: T rounded to
// tf32 once in shared memory after S4, its A fragments by ldmatrix, jobs in pairs, u0 as float2); every tile the
// same tf32 operands in the same accumulation order (docs/cuda.md, "KDA prep FAST instance").
template <int KP, typename T16, bool WB = false, bool FAST = false>
__global__ void __launch_bounds__(kGdnThreads, 2) kda_chunk_prep2_kernel(const ChunkFwdParams p) {
  using SM = KdaPrep2Smem<KP>;
  constexpr int LDH = SM::LDH, LDG = SM::LDG, LDF = SM::LDF, LDA = kPrepLDA;
  constexpr int NP = KP / kKdaPass;
  static_assert(KP % kKdaPass == 0, "passes of 32 channels");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::r1);
  float* Ts = reinterpret_cast<float*>(smem + SM::r1);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::r2);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::r2);
  float* Gx = reinterpret_cast<float*>(smem + SM::gx);
  float* Fs = reinterpret_cast<float*>(smem + SM::fb);  // [64][LDF]: F_t = e^{G_t - G_r}
  float* Rf = Fs + kChunk * LDF;                        // [64][LDF]: R_t = e^{G_s - G_t}
  float* Scr = reinterpret_cast<float*>(smem + SM::fb);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Hs = Ab;  // during the passes: [64][LDF] e^{G_t - G_m} (t upper half) / e^{G_m - G_t} (lower half)
  static_assert(kChunk * LDF <= kChunk * kPrepLDA, "the half-block table fits in the A_kk region");
  float* Tot = reinterpret_cast<float*>(smem + SM::tot);  // S_b
  float* Pre = reinterpret_cast<float*>(smem + SM::pre);
  float* Suf = reinterpret_cast<float*>(smem + SM::suf);
  float* Ex = reinterpret_cast<float*>(smem + SM::ex);
  float* Bs = reinterpret_cast<float*>(smem + SM::bs);

  const int cid = blockIdx.x, hv = blockIdx.y;
  int64_t tok0;
  int L;
  if (!chunk_coords(p, cid, tok0, L)) return;
  const int h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V, HV = p.HV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, t4 = lane & 3;
  float* ws = p.ws + (static_cast<int64_t>(cid) * HV + hv) * p.ws_stride;
  const bool half = p.ws_bf16 != 0;
  const WsLayout<KP> WL(half);
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };

  // ---- S0: q, k, gates -> shared memory (cp.async, all in flight at once), beta
  const uint16_t* qsrc = static_cast<const uint16_t*>(p.q) + (tok0 * p.H + h) * K;
  const uint16_t* ksrc = static_cast<const uint16_t*>(p.k) + (tok0 * p.H + h) * K;
  const uint16_t* vsrc = static_cast<const uint16_t*>(p.v) + (tok0 * HV + hv) * V;
  const float* gsrc = p.g + (tok0 * HV + hv) * K;
  const bool vec_qk = (K % 8) == 0 && ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k)) & 15) == 0;
  const bool vec_g = (K % 4) == 0 && (reinterpret_cast<uintptr_t>(p.g) & 15) == 0;
  const bool vec_v = (V % 8) == 0 && (reinterpret_cast<uintptr_t>(p.v) & 15) == 0;
  gdn_stage<KP>(Qs, LDH, qsrc, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  gdn_stage<KP>(Ks, LDH, ksrc, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  kda_stage_gates<KP>(Gx, LDG, gsrc, static_cast<int64_t>(HV) * K, L, K, vec_g, tid);
  if (tid < kChunk) Bs[tid] = tid < L ? __ldg(p.beta + (tok0 + tid) * HV + hv) : 0.f;
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S1: a = e^g in place (padding: g = 0, a = 1); Tot_b = the sum of the gates of sub-chunk b (float, a
  //      pairwise tree: a direct sum, <= 0 for log decays <= 0)
  for (int i = tid; i < 4 * KP; i += kGdnThreads) {
    const int c = i % KP, b = i / KP;
    float* gcol = Gx + b * kSub * LDG + c;
    float x[kSub], y[kSub];
#pragma unroll
    for (int u = 0; u < kSub; ++u) x[u] = y[u] = gcol[u * LDG];
#pragma unroll
    for (int u = 0; u < kSub; ++u) gcol[u * LDG] = __expf(x[u]);
#pragma unroll
    for (int w = 1; w < kSub; w <<= 1)
#pragma unroll
      for (int u = 0; u < kSub; u += 2 * w) y[u] += y[u + w];
    Tot[b * KP + c] = y[0];
  }
  __syncthreads();

  // P1 mapping: diagonal block of NB = 8 tokens from j0 (the half (tid / 32) % 2 of sub-chunk a1 = tid / 64), rows
  // t1 = j0 + rp (pairs j <= t1) and t2 = j0 + NB - 1 - rp (pairs j <= t2), channel pairs c = 2 (8 ci + cg) + {0, 1}
  // of the pass; the 8 channel groups (lane bits 0..2) are summed at the end.
  constexpr int NB = 8, NH = NB / 2;
  const int cg = lane & 7, a1 = tid >> 6;
  const int rp = lane >> 3;
  const int j0 = a1 * kSub + ((tid >> 5) & 1) * NB, t1 = j0 + rp, t2 = j0 + NB - 1 - rp;
  float q1[NH], k1[NH], q2[NB], k2[NB];
#pragma unroll
  for (int jl = 0; jl < NB; ++jl) {
    if (jl < NH) q1[jl % NH] = k1[jl % NH] = 0.f;
    q2[jl] = k2[jl] = 0.f;
  }
  float accq[4] = {0.f, 0.f, 0.f, 0.f};  // warps 0-3: the lower-left 8x8 quarter of sub-chunk `warp`
  float acc2[3][4];  // P2: tiles warp, warp + 8, warp + 16
#pragma unroll
  for (int u = 0; u < 3; ++u) acc2[u][0] = acc2[u][1] = acc2[u][2] = acc2[u][3] = 0.f;
  // build mapping: channel bcl of the pass, sub-chunk ba, direction bdir
  const int bcl = tid & 31, ba = (tid >> 5) & 3, bdir = tid >> 7;

#pragma unroll 1
  for (int pass = 0; pass < NP; ++pass) {
    const int cp0 = pass * kKdaPass;
    // ---- build: the factor tables of this pass's 32 channels
    {
      const int c = cp0 + bcl;
      float tb[4];  // gate sums of the four sub-chunks
#pragma unroll
      for (int b = 0; b < 4; ++b) tb[b] = Tot[b * KP + c];
      if (bdir == 0) {
        float spre = 0.f;
#pragma unroll
        for (int b = 0; b < 3; ++b)
          if (b < ba) spre += tb[b];
        Pre[ba * KP + c] = __expf(spre);
        float P = 1.f, P8 = 1.f;
#pragma unroll
        for (int i = 0; i < kSub; ++i) {
          const int t = ba * kSub + i;
          const float at = Gx[t * LDG + c];
          P *= at;
          Fs[t * LDF + bcl] = P;
          if (i >= 8) {  // e^{G_t - G_m}, m = 16 ba + 7
            P8 *= at;
            Hs[t * LDF + bcl] = P8;
          }
        }
        if (ba == 3) ws[WL.decay + c] = __expf(spre + tb[3]);  // one exponential of the chunk's gate sum
      } else {
        float ssuf = 0.f;
#pragma unroll
        for (int b = 1; b < 4; ++b)
          if (b > ba) ssuf += tb[b];
        Suf[ba * KP + c] = __expf(ssuf);
        float S = 1.f, S8 = 1.f;
#pragma unroll
        for (int i = kSub - 1; i >= 0; --i) {
          const int t = ba * kSub + i;
          const float at = Gx[t * LDG + c];
          Rf[t * LDF + bcl] = S;
          S *= at;
          if (i < 8) {  // e^{G_m - G_t}, m = 16 ba + 7
            Hs[t * LDF + bcl] = S8;
            S8 *= at;
          }
        }
        if (ba == 0) {
          Ex[c] = __expf(tb[1]);
          Ex[KP + c] = __expf(tb[2]);
          Ex[2 * KP + c] = __expf(tb[1] + tb[2]);
        }
      }
    }
    __syncthreads();

    // ---- P2: cross-sub-chunk tiles, rows of sub-chunk a (q or k, times e^{G_t - G_r}) x (k_j e^{G_s - G_j}
    //      e^{G_r - G_s}), this pass's 32 channels. FAST: tiles by cross_tile_fast, k-steps outside, the A operand
    //      formed once per k-step (warps 6-7: twice); each tile's products and their order as below.
    if constexpr (FAST) {
#pragma unroll
      for (int s = 0; s < kKdaPass / 8; ++s) {
        const int cl = s * 8 + t4, c = cp0 + cl;
        float4 af = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < 3; ++u) {
          int a, mat, nt;
          cross_tile_fast(warp, u, a, mat, nt);
          if (u == 0 || (u == 1 && warp >= 6)) {
            const uint16_t* Xs = mat ? Ks : Qs;
            const int ra = a * kSub + gq;
            af = make_float4(f16(Xs[ra * LDH + c]) * Fs[ra * LDF + cl],
                             f16(Xs[(ra + 8) * LDH + c]) * Fs[(ra + 8) * LDF + cl],
                             f16(Xs[ra * LDH + c + 4]) * Fs[ra * LDF + cl + 4],
                             f16(Xs[(ra + 8) * LDH + c + 4]) * Fs[(ra + 8) * LDF + cl + 4]);
          }
          const int b = nt >> 1, jb = nt * 8 + gq;
          const float* E = b == a - 1 ? nullptr : Ex + (a == 2 ? 0 : (b == 1 ? 1 : 2)) * KP;
          float b0 = f16(Ks[jb * LDH + c]) * Rf[jb * LDF + cl];
          float b1 = f16(Ks[jb * LDH + c + 4]) * Rf[jb * LDF + cl + 4];
          if (E != nullptr) {
            b0 *= E[c];
            b1 *= E[c + 4];
          }
          kda_mma8<true>(acc2[u], af, b0, b1);
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < 3; ++u) {
        int a, mat, nt;
        cross_tile(warp + 8 * u, a, mat, nt);
        const int b = nt >> 1;
        const float* E = b == a - 1 ? nullptr : Ex + (a == 2 ? 0 : (b == 1 ? 1 : 2)) * KP;
        const uint16_t* Xs = mat ? Ks : Qs;
        const int ra = a * kSub + gq, jb = nt * 8 + gq;
#pragma unroll
        for (int s = 0; s < kKdaPass / 8; ++s) {
          const int cl = s * 8 + t4, c = cp0 + cl;
          const float4 af = make_float4(f16(Xs[ra * LDH + c]) * Fs[ra * LDF + cl],
                                        f16(Xs[(ra + 8) * LDH + c]) * Fs[(ra + 8) * LDF + cl],
                                        f16(Xs[ra * LDH + c + 4]) * Fs[ra * LDF + cl + 4],
                                        f16(Xs[(ra + 8) * LDH + c + 4]) * Fs[(ra + 8) * LDF + cl + 4]);
          float b0 = f16(Ks[jb * LDH + c]) * Rf[jb * LDF + cl], b1 = f16(Ks[jb * LDH + c + 4]) * Rf[jb * LDF + cl + 4];
          if (E != nullptr) {
            b0 *= E[c];
            b1 *= E[c + 4];
          }
          mma8<false>(acc2[u], af, b0, b1);
        }
      }
    }

    // ---- warps 0-3: the lower-left 8x8 quarter of sub-chunk a = warp on tensor cores, through the token
    //      m = 16a + 7: rows 0-7 q_t, rows 8-15 k_t (t = 16a + 8 + gq) times e^{G_t - G_m}; columns k_j e^{G_m - G_j}
    //      (j = 16a + gq): one 16x8 tile carries both products, every factor <= 1
    if (warp < 4) {
      const int r = warp * kSub + 8 + gq, jb = warp * kSub + gq;
#pragma unroll
      for (int s = 0; s < kKdaPass / 8; ++s) {
        const int cl = s * 8 + t4, c = cp0 + cl;
        const float h0 = Hs[r * LDF + cl], h1 = Hs[r * LDF + cl + 4];
        const float4 af = make_float4(f16(Qs[r * LDH + c]) * h0, f16(Ks[r * LDH + c]) * h0,
                                      f16(Qs[r * LDH + c + 4]) * h1, f16(Ks[r * LDH + c + 4]) * h1);
        kda_mma8<FAST>(accq, af, f16(Ks[jb * LDH + c]) * Hs[jb * LDF + cl],
                       f16(Ks[jb * LDH + c + 4]) * Hs[jb * LDF + cl + 4]);
      }
    }

    // ---- W: q~ (tiles 0..15: row block z / 4, column tile z % 4 of the pass) and k~^T (tiles 16..31: channel
    //      block (z - 16) / 8 of the pass, token tile (z - 16) % 8) in fragment order, one store per lane
#pragma unroll 1  // (unrolled: 16 bytes of spills beside P1's 60 accumulators)
    for (int r = 0; r < 4; ++r) {
      const int it = tid + r * kGdnThreads;
      const int ln = it & 31, z = it >> 5;  // warp-uniform
      if (z < 16) {
        const int a = z >> 2, ct = z & 3;
        const int r0 = a * kSub + (ln >> 2), cl = ct * 8 + (ln & 3), c0 = cp0 + cl;
        const float e0 = p.scale * Pre[a * KP + c0], e1 = p.scale * Pre[a * KP + c0 + 4];
        const float4 x = make_float4(e0 * (f16(Qs[r0 * LDH + c0]) * Fs[r0 * LDF + cl]),
                                     e0 * (f16(Qs[(r0 + 8) * LDH + c0]) * Fs[(r0 + 8) * LDF + cl]),
                                     e1 * (f16(Qs[r0 * LDH + c0 + 4]) * Fs[r0 * LDF + cl + 4]),
                                     e1 * (f16(Qs[(r0 + 8) * LDH + c0 + 4]) * Fs[(r0 + 8) * LDF + cl + 4]));
        ws_put_frag(ws + WL.qg, (a * (KP / 8) + cp0 / 8 + ct) * 32 + ln, half, x);
      } else {
        const int zz = z - 16, rb = zz >> 3, ct = zz & 7;
        const int cl = rb * 16 + (ln >> 2), c0 = cp0 + cl, t0 = ct * 8 + (ln & 3);
        const int a = ct >> 1;  // sub-chunk of t0 and t0 + 4
        const float s0 = Suf[a * KP + c0], s1 = Suf[a * KP + c0 + 8];
        const float d0 = Bs[t0], d1 = Bs[t0 + 4];
        const float4 x = make_float4(d0 * (f16(Ks[t0 * LDH + c0]) * (Rf[t0 * LDF + cl] * s0)),
                                     d0 * (f16(Ks[t0 * LDH + c0 + 8]) * (Rf[t0 * LDF + cl + 8] * s1)),
                                     d1 * (f16(Ks[(t0 + 4) * LDH + c0]) * (Rf[(t0 + 4) * LDF + cl] * s0)),
                                     d1 * (f16(Ks[(t0 + 4) * LDH + c0 + 8]) * (Rf[(t0 + 4) * LDF + cl + 8] * s1)));
        ws_put_frag(ws + WL.kg, ((cp0 / 16 + rb) * (kChunk / 8) + ct) * 32 + ln, half, x);
      }
    }

    // ---- P1: in-sub-chunk pairs, factor = running product of a_i from t down to j + 1
#pragma unroll 1
    for (int ci = 0; ci < kKdaPass / 16; ++ci) {
      const int c = cp0 + 2 * (ci * 8 + cg);
      const float2 qa = ld_pair16<T16>(Qs + t1 * LDH + c), ka = ld_pair16<T16>(Ks + t1 * LDH + c);
      const float2 qb = ld_pair16<T16>(Qs + t2 * LDH + c), kb = ld_pair16<T16>(Ks + t2 * LDH + c);
      float f1x = 1.f, f1y = 1.f, f2x = 1.f, f2y = 1.f;
#pragma unroll
      for (int jl = NB - 1; jl >= 0; --jl) {
        const int j = j0 + jl;
        const float2 aj = *reinterpret_cast<const float2*>(Gx + j * LDG + c);
        const float2 kj = ld_pair16<T16>(Ks + j * LDH + c);
        {  // row t2: terms with jl > NB - 1 - rp carry f = 1 and are dropped by the result mask
          const float x0 = kj.x * f2x, x1 = kj.y * f2y;
          q2[jl] = fmaf(qb.y, x1, fmaf(qb.x, x0, q2[jl]));
          k2[jl] = fmaf(kb.y, x1, fmaf(kb.x, x0, k2[jl]));
          const bool on = jl <= NB - 1 - rp;
          f2x = on ? f2x * aj.x : f2x;
          f2y = on ? f2y * aj.y : f2y;
        }
        if (jl < NH) {  // row t1 (t1 - j0 < NH): terms with jl > rp dropped likewise
          const float x0 = kj.x * f1x, x1 = kj.y * f1y;
          q1[jl % NH] = fmaf(qa.y, x1, fmaf(qa.x, x0, q1[jl % NH]));
          k1[jl % NH] = fmaf(ka.y, x1, fmaf(ka.x, x0, k1[jl % NH]));
          const bool on = jl <= rp;
          f1x = on ? f1x * aj.x : f1x;
          f1y = on ? f1y * aj.y : f1y;
        }
      }
    }
    __syncthreads();
  }

  // ---- results: P1 (diagonal blocks, full 16x16 incl. the zeros above the diagonal), P2 (blocks below), zero
  //      upper tiles of A~. A_kk Diag(beta) to Ab (strictly lower).
#pragma unroll
  for (int jl = 0; jl < NB; ++jl) {
    if (jl < NH) {
      q1[jl % NH] = warp_sum_below<8>(q1[jl % NH]);
      k1[jl % NH] = warp_sum_below<8>(k1[jl % NH]);
    }
    q2[jl] = warp_sum_below<8>(q2[jl]);
    k2[jl] = warp_sum_below<8>(k2[jl]);
  }
#pragma unroll
  for (int jl = 0; jl < NB; ++jl) {
    if ((jl & 7) != cg) continue;
    const int j = j0 + jl;
    const float bj = Bs[j];
    const float vq1 = (jl < NH && jl <= rp) ? q1[jl % NH] : 0.f, vk1 = (jl < NH && jl < rp) ? k1[jl % NH] : 0.f;
    const float vq2 = jl <= NB - 1 - rp ? q2[jl] : 0.f, vk2 = jl < NB - 1 - rp ? k2[jl] : 0.f;
    ws_put(ws + WL.aqk, frag_index<kChunk>(t1, j), half, p.scale * (vq1 * bj));
    ws_put(ws + WL.aqk, frag_index<kChunk>(t2, j), half, p.scale * (vq2 * bj));
    Ab[t1 * LDA + j] = vk1 * bj;
    Ab[t2 * LDA + j] = vk2 * bj;
  }
  {  // the upper-right 8x8 quarter of each diagonal block of A~: zero (that of A_kk is never read)
    const int a = tid >> 6, r = (tid >> 3) & 7, cc = tid & 7;
    ws_put(ws + WL.aqk, frag_index<kChunk>(a * kSub + r, a * kSub + 8 + cc), half, 0.f);
  }
  if (warp < 4) {  // the lower-left quarter from accq: rows gq (q), gq + 8 (k); columns 2 t4, 2 t4 + 1
    const int t = warp * kSub + 8 + gq, j = warp * kSub + 2 * t4;
    const float b0 = Bs[j], b1 = Bs[j + 1];
    ws_put(ws + WL.aqk, frag_index<kChunk>(t, j), half, p.scale * (accq[0] * b0));
    ws_put(ws + WL.aqk, frag_index<kChunk>(t, j + 1), half, p.scale * (accq[1] * b1));
    *reinterpret_cast<float2*>(Ab + t * LDA + j) = make_float2(accq[2] * b0, accq[3] * b1);
  }
#pragma unroll
  for (int u = 0; u < 3; ++u) {
    int a, mat, nt;
    if constexpr (FAST) cross_tile_fast(warp, u, a, mat, nt);
    else cross_tile(warp + 8 * u, a, mat, nt);
    const float b0 = Bs[nt * 8 + 2 * t4], b1 = Bs[nt * 8 + 2 * t4 + 1];
    if (mat == 0) {
      const float s = p.scale;
      const float vq[4] = {s * (acc2[u][0] * b0), s * (acc2[u][1] * b1), s * (acc2[u][2] * b0), s * (acc2[u][3] * b1)};
      ws_put_frag(ws + WL.aqk, (a * (kChunk / 8) + nt) * 32 + lane, half, acc_to_afrag(vq, lane));
    } else {
      float* Ar = Ab + (a * kSub + gq) * LDA + nt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(Ar) = make_float2(acc2[u][0] * b0, acc2[u][1] * b1);
      *reinterpret_cast<float2*>(Ar + 8 * LDA) = make_float2(acc2[u][2] * b0, acc2[u][3] * b1);
    }
  }
  for (int i = tid; i < 12 * 32; i += kGdnThreads) {  // tiles (0, 2..7), (1, 4..7), (2, 6..7)
    const int z = i >> 5;
    const int a = z < 6 ? 0 : (z < 10 ? 1 : 2);
    const int nt = z < 6 ? 2 + z : (z < 10 ? z - 2 : z - 4);
    ws_put_frag(ws + WL.aqk, (a * (kChunk / 8) + nt) * 32 + (i & 31), half, make_float4(0.f, 0.f, 0.f, 0.f));
  }
  __syncthreads();

  // ---- S2: warps 0-3: diagonal blocks of T (over q's tile); warps 4-7: X = k e^{G} in place of a
  prep_inverse_diag(Ab, Ts, warp, lane);
  if (warp >= 4) {
    for (int i = tid - 128; i < 4 * KP; i += 128) {
      const int c = i % KP, b = i / KP;
      float e = Pre[b * KP + c];
#pragma unroll 4
      for (int u = 0; u < kSub; ++u) {
        const int t = b * kSub + u;
        e *= Gx[t * LDG + c];
        Gx[t * LDG + c] = f16(Ks[t * LDH + c]) * e;
      }
    }
  }
  __syncthreads();

  // ---- S3: v's first 128 columns into k's tile (cp.async, lands during S3/S4); T_10, T_32
  gdn_stage<kGdnVB>(Vs, kPrepLDV, vsrc, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
  prep_inverse_sub1(Ab, Ts, Scr, warp, gq, t4);
  __syncthreads();

  // ---- S4: the lower-left 32x32 of T
  prep_inverse_sub2(Ab, Ts, Scr, warp, gq, t4);
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S5: w = T X (fragment order), u0 = T V (row-major)
  if constexpr (FAST) {
    prep2_round_t(Ts, tid);  // T's blocks S5 reads, to tf32 in place (S3 / S4 needed them in fp32)
    __syncthreads();
    prep2_w_u0_x<KP, T16, WB>(p, ws, WL, Ts, Vs, vsrc, L, vec_v, tid, [&](int t, int c) { return Gx[t * LDG + c]; });
  } else {
    prep_w_u0<KP, T16, WB>(p, ws, WL, Ts, Vs, vsrc, L, vec_v, tid, [&](int t, int c) { return Gx[t * LDG + c]; });
  }
}

}  // namespace cuda
}  // namespace kda_kernels
