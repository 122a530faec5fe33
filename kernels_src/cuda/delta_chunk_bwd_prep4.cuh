// KDA prep v4 of the chunked backward (per-channel gate), bf16/fp16 inputs: the default (KDA_CUDA_CHUNK_BWD_PREP=4,
// with the 8x8 split of the diagonal blocks) since session 8 (=5, without the split, 0.91 vs 0.84 ms: retired in
// session 11). GDN has no v4: it runs its prep v3
// (delta_chunk_bwd_prep.cuh). Writes exactly what the SIMT prep_kernel writes (Params of delta_chunk_bwd.cuh; same
// buffers, layouts, padding), so the state and grad kernels are unchanged:
//   aqk, akk [CH][CH] row-major: A_qk (j <= t) and A_kk (j < t), no scale, no beta, zeros above;
//   u = Diag(beta) T V, w = Diag(beta) T (K Gam) (wc padded), T = (I + A_kk Diag(beta))^-1;
//   v2: qgc = Q Gam, kendc = K Eend [CH][KP] (zeros past Cc, K), glc = Gam_last [KP] (1 past K).
//
// The KDA prep v3 (prep3_kda_kernel, retired in session 9) followed the forward's v1 prep (retired too); v4 follows
// its v2 (kda_chunk_prep2.cuh, 0.82 -> 0.57 ms in the forward, session 7) with the backward's outputs:
//   S1  a = e^g in place of the gates (one exponential per token and channel; prep3 took one per token, channel
//       and pair in P1 and two per token in the build) and S_b = sub-chunk b's gate sum (float tree sum; prep3:
//       double sums).
//   build  F_t = prod_{16a <= i <= t} a_i, R_t = prod_{t < i <= 16a + 15} a_i (running products, 64-row tables),
//       Pre_a = e^{sum_{b < a} S_b}, the cross factors e^{S_1}, e^{S_2}, e^{S_1 + S_2}; on the way (v2)
//       Q Gam = q (Pre_a F_t), K Eend = k (Suf_a R_t) with Suf_a = e^{sum_{b > a} S_b}, and Gam_last =
//       e^{S_0 + S_1 + S_2 + S_3} (one exponential of the chunk's gate sum, not a 64-factor product: the state
//       stages compound it over the chunks).
//   P2  the cross-sub-chunk tiles (3xTF32 m16n8k8, as prep3) over the 64-row factor tables.
//   P1  in-sub-chunk pairs with a running product f <- f a_j walking j down from t (prep3: e^{running float sum}
//       per pair), branch-free (rows outside the triangle keep f = 1; the result masks drop their sums).
//   S2  X = K Gam = k Pre_a prod_{16a <= i <= t} a_i in place of a (prep3: e^{double prefix}).
//   S3-S5 as prep3 (blocked inverse, 3xTF32 w and u).
// The 8x8 split: each 16x16 diagonal block in 8x8 quarters as in the forward's prep: the lower-left quarter
// (t in 16a+8..15, j in 16a..16a+7) on tensor cores (3xTF32) through the token m = 16a + 7, (x_t e^{G_t - G_m}) .
// (k_j e^{G_m - G_j}), both factors running products within the half (a third 64-row table in the A_kk region
// during the passes), q rows on top and k rows below in one 16x8 tile per sub-chunk (warps 0-3); CUDA cores only
// for the two 8x8 triangles; the upper-right quarter of aqk / akk written as zeros.
// Exactness: every factor is a product of at most 16 a_i <= 1 or the exponential of a direct sum of gates (<= 0
// for log decays <= 0): never e^{-G}, every factor <= 1, gates of -1e4 give 0, never inf/NaN, no gate bound.
// One block of 256 threads per (chunk, value head); shared memory KdaPrep2Smem<128> (~111 KB): two blocks per SM.
#pragma once

#include "delta_chunk_bwd_prep.cuh"
#include "kda_chunk_prep2.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr size_t kPrep4KdaSmem = KdaPrep2Smem<KP>::bytes;
static_assert(2 * kPrep4KdaSmem <= 227 * 1024, "two prep v4 blocks per SM");

// ---- Prep v6 (KDA_CUDA_CHUNK_BWD_PREP=6, session 13, opt-in): prep v4 (V6 = true) with every 3xTF32 hi / lo split
// formed once per fragment and reused by the MMAs that share it, the same MMAs on the same tf32 words in the same
// order per accumulator, so the same bits as v4 (=4) in every output:
//   P2  the 24 cross tiles regrouped by row block (cross_tile6), k-steps outside the tiles: a warp forms and splits
//       each A fragment (q or k times F) once per k-step for its tiles of that row block (v4: once per tile);
//   S4  T's 20 lower A fragments split once into fragment order (prep6_split_frag; v4's S5 split each of them in
//       every one of its 16 + V/8 jobs): the 12 final after S3 by warps 2-7, idle during S4, the 8 of S4's lower-
//       left 32x32 by warps 0-1 after it;
//   S5  prep6_w_u: two jobs (the 8-column tiles job, job + 8 of v4's warp) per sweep, the k-steps outside the row
//       blocks: each B fragment split once per job (v4: once per row block), T's fragments read pre-split
//       (16-byte reads) and used by both jobs;
//   build  Q Gam / K Eend stores through a row pointer formed once per thread and pass (v4: 64-bit index math per
//       store);
//   quarter  the lower-left 8x8 quarters on warps 4-7 (v4: 0-3), whose P2 share is the lighter.
// P2's tile per warp (a, mat, nt): warps 0-3 three tiles of (3, warp / 2), warps 4-5 three of (2, warp - 4), warps
// 6-7 (2, warp - 6, 3) then (1, warp - 6, 0), (1, warp - 6, 1).
__host__ __device__ constexpr void cross_tile6(int warp, int u, int& a, int& mat, int& nt) {
  if (warp < 4) {
    a = 3, mat = warp >> 1, nt = (warp & 1) * 3 + u;
  } else if (warp < 6) {
    a = 2, mat = warp & 1, nt = u;
  } else {
    mat = warp & 1, a = u == 0 ? 2 : 1, nt = u == 0 ? 3 : u - 1;
  }
}
// Whether tile u of warp starts a new row block (a, mat): its A fragment is formed there, reused after.
__host__ __device__ constexpr bool cross_tile6_new_a(int warp, int u) { return u == 0 || (u == 1 && warp >= 6); }
// cross_tile6 covers each of the 24 cross tiles (cross_tile's numbering) once, and the tiles after a new_a share
// its (a, mat)
__host__ __device__ constexpr bool cross_tile6_ok() {
  int seen[24] = {};
  for (int w = 0; w < 8; ++w) {
    int a0 = -1, m0 = -1;
    for (int u = 0; u < 3; ++u) {
      int a = 0, mat = 0, nt = 0;
      cross_tile6(w, u, a, mat, nt);
      if (a < 1 || a > 3 || mat < 0 || mat > 1 || nt < 0 || nt >= 2 * a) return false;
      if (cross_tile6_new_a(w, u)) a0 = a, m0 = mat;
      else if (a != a0 || mat != m0) return false;
      const int tile = (a == 1 ? 0 : (a == 2 ? 4 : 12)) + mat * 2 * a + nt;  // cross_tile's inverse
      ++seen[tile];
    }
  }
  for (int t = 0; t < 24; ++t)
    if (seen[t] != 1) return false;
  return true;
}
static_assert(cross_tile6_ok(), "cross_tile6 must cover the 24 cross tiles once, row blocks shared as stated");
// The kernel's P2 calls prep6_cross_tiles<A, NT0, NTILE, U0> per warp class; tile U0 of the first warp of each
// class must be cross_tile6's (A, NT0) (the stores of acc2 use cross_tile6)
__host__ __device__ constexpr bool cross_tile6_is(int warp, int u, int a, int nt) {
  int a6 = 0, m6 = 0, n6 = 0;
  cross_tile6(warp, u, a6, m6, n6);
  return a6 == a && n6 == nt;
}
static_assert(cross_tile6_is(0, 0, 3, 0) && cross_tile6_is(2, 0, 3, 0) && cross_tile6_is(1, 0, 3, 3) &&
                  cross_tile6_is(3, 0, 3, 3) && cross_tile6_is(4, 0, 2, 0) && cross_tile6_is(5, 0, 2, 0) &&
                  cross_tile6_is(6, 0, 2, 3) && cross_tile6_is(7, 0, 2, 3) && cross_tile6_is(6, 1, 1, 0) &&
                  cross_tile6_is(7, 1, 1, 0),
              "prep6_cross_tiles' calls in prep4_kda_kernel<T16, true> follow cross_tile6");

// T's A fragment (row block a, k-step s, s < 2a + 2) as 64 uint4: tf32 hi of lane l at [l], lo at [32 + l]. The 8
// of the lower-left 32x32 (a >= 2, s < 4) at `late` (Ab's rows 0-31: S4 reads rows 32-63 only), the 12 others at
// `early` (the factor region past S3/S4's scratch).
__host__ __device__ constexpr int prep6_frag_late(int a, int s) { return a >= 2 && s < 4; }
__host__ __device__ constexpr int prep6_frag_slot(int a, int s) {
  return prep6_frag_late(a, s) ? (a - 2) * 4 + s : (a == 0 ? s : (a == 1 ? 2 + s : (a == 2 ? 2 + s : 4 + s)));
}
__host__ __device__ constexpr bool prep6_frag_ok() {
  int seen[2][12] = {};
  for (int a = 0; a < 4; ++a)
    for (int s = 0; s < 2 * a + 2; ++s) {
      const int late = prep6_frag_late(a, s), slot = prep6_frag_slot(a, s);
      if (slot < 0 || slot >= (late ? 8 : 12)) return false;
      ++seen[late][slot];
    }
  for (int i = 0; i < 12; ++i)
    if (seen[0][i] != 1 || (i < 8 && seen[1][i] != 1)) return false;
  return true;
}
static_assert(prep6_frag_ok(), "the 20 fragments of T in 12 early and 8 late slots, each once");
constexpr int kPrep6Scr = 4 * kSub * kPrepLDY;  // floats of S3/S4's scratch at the factor region's start
static_assert(kPrep6Scr * 4 + 12 * 64 * 16 <= KdaPrep2Smem<KP>::fb_bytes, "the early fragments past the scratch");
static_assert(8 * 64 * 16 <= 32 * kPrepLDA * 4, "the late fragments in Ab's rows 0-31");
// Early fragment e (0-11) -> (a, s): the inverse of prep6_frag_slot on early slots.
__device__ __forceinline__ void prep6_early_frag(int e, int& a, int& s) {
  a = e < 2 ? 0 : (e < 6 ? 1 : (e < 8 ? 2 : 3));
  s = e < 6 ? e - 2 * (a > 0) : (e < 8 ? e - 2 : e - 4);
}

__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {  // as mma8<true>
  hi = to_tf32(x);
  lo = to_tf32(x - __uint_as_float(hi));
}
// mma8<true> on split operands: the same three MMAs in the same order
__device__ __forceinline__ void mma8_split(float* c, const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                           uint32_t bh1, uint32_t bl0, uint32_t bl1) {
  mma_tf32_raw(c, al[0], al[1], al[2], al[3], bh0, bh1);
  mma_tf32_raw(c, ah[0], ah[1], ah[2], ah[3], bl0, bl1);
  mma_tf32_raw(c, ah[0], ah[1], ah[2], ah[3], bh0, bh1);
}

// P2 of prep v6 for the tiles (A, mat, NT0 + u), u < NTILE, of one row block (acc[U0 + u]): per k-step the A
// fragment (Xs = q or k of row block A, times F) formed and split once, then each tile's B fragment (k_j R_j, times
// v4's cross factor E for b < A - 1) and the three MMAs of mma8<true>. Tile and factor offsets are compile-time;
// Xs, Ks, Fs, Rf, Ex point at this lane's row gq, column t4 of the pass (cp0 added).
template <int A, int NT0, int NTILE, int U0, int LDH, int LDF, typename T16>
__device__ __forceinline__ void prep6_cross_tiles(float (&acc)[3][4], const uint16_t* Xs, const uint16_t* Ks,
                                                  const float* Fs, const float* Rf, const float* Ex) {
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  static_assert(A >= 1 && A <= 3 && NT0 >= 0 && NT0 + NTILE <= 2 * A && U0 + NTILE <= 3, "a cross tile");
  constexpr int ra = A * kSub;
#pragma unroll
  for (int s = 0; s < kKdaPass / 8; ++s) {
    const int c = s * 8;
    uint32_t ah[4], al[4];
    tf32_split(f16(Xs[ra * LDH + c]) * Fs[ra * LDF + c], ah[0], al[0]);
    tf32_split(f16(Xs[(ra + 8) * LDH + c]) * Fs[(ra + 8) * LDF + c], ah[1], al[1]);
    tf32_split(f16(Xs[ra * LDH + c + 4]) * Fs[ra * LDF + c + 4], ah[2], al[2]);
    tf32_split(f16(Xs[(ra + 8) * LDH + c + 4]) * Fs[(ra + 8) * LDF + c + 4], ah[3], al[3]);
#pragma unroll
    for (int u = 0; u < NTILE; ++u) {
      const int nt = NT0 + u, b = nt >> 1, jb = nt * 8;
      const int e = b == A - 1 ? -1 : (A == 2 ? 0 : (b == 1 ? 1 : 2));  // v4's E (e^{S_1}, e^{S_2}, e^{S_1 + S_2})
      float b0 = f16(Ks[jb * LDH + c]) * Rf[jb * LDF + c], b1 = f16(Ks[jb * LDH + c + 4]) * Rf[jb * LDF + c + 4];
      if (e >= 0) {
        b0 *= Ex[e * KP + c];
        b1 *= Ex[e * KP + c + 4];
      }
      uint32_t bh0, bl0, bh1, bl1;
      tf32_split(b0, bh0, bl0);
      tf32_split(b1, bh1, bl1);
      mma8_split(acc[U0 + u], ah, al, bh0, bh1, bl0, bl1);
    }
  }
}

// One lane's share of T's fragment (a, s): the four values mma8's A operand takes in prep3_w_u, split.
__device__ __forceinline__ void prep6_split_frag(const float* Ts, uint4* early, uint4* late, int a, int s, int lane) {
  constexpr int LDA = kPrepLDA;
  const float* Ta = Ts + (a * kSub + (lane >> 2)) * LDA + (lane & 3) + s * 8;
  uint4 h, l;
  tf32_split(Ta[0], h.x, l.x);
  tf32_split(Ta[8 * LDA], h.y, l.y);
  tf32_split(Ta[4], h.z, l.z);
  tf32_split(Ta[8 * LDA + 4], h.w, l.w);
  uint4* f = (prep6_frag_late(a, s) ? late : early) + prep6_frag_slot(a, s) * 64;
  f[lane] = h;
  f[32 + lane] = l;
}

// prep3_w_u with T's fragments pre-split (early / late, prep6_split_frag) and two jobs per sweep: warp w takes the
// jobs w + 16 i and w + 16 i + 8 (prep3_w_u's w + 8 j), k-steps outside the row blocks. Per output tile the same
// MMAs in the same order (k-steps ascending), so the same bits. A lone last job (16 + ceil(V / 8) odd multiples
// of 8) runs as its own partner, stored once.
template <typename T16, typename XW>
__device__ __forceinline__ void prep6_w_u(const Params& p, const ChunkPos& cp, int hv, size_t cbase,
                                          const uint4* early, const uint4* late, const uint16_t* Vs, int ldv,
                                          const float* Bs, int tid, XW xw) {
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  constexpr int ntw = KP / 8, NW = NT / 32;
  static_assert(ntw % (2 * NW) == 0, "a job and its partner are both w or both u");
  const int njob = ntw + (p.V + 7) / 8;
  for (int job = warp; job < njob; job += 2 * NW) {
    const bool two = job + NW < njob;
    const bool isw = job < ntw;
    int n0[2];
    n0[0] = (isw ? job : job - ntw) * 8;
    n0[1] = two ? n0[0] + NW * 8 : n0[0];
    float acc[2][4][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int a = 0; a < 4; ++a) acc[j][a][0] = acc[j][a][1] = acc[j][a][2] = acc[j][a][3] = 0.f;
#pragma unroll
    for (int s = 0; s < CH / 8; ++s) {
      uint32_t bh[2][2], bl[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = s * 8 + t4 + 4 * hh;
          tf32_split(isw ? xw(t, n0[j] + gq) : f16(Vs[t * ldv + n0[j] + gq]), bh[j][hh], bl[j][hh]);
        }
#pragma unroll
      for (int a = s / 2; a < 4; ++a) {  // prep3_w_u's s < 2a + 2
        const uint4* f = (prep6_frag_late(a, s) ? late : early) + prep6_frag_slot(a, s) * 64;
        const uint4 h4 = f[lane], l4 = f[32 + lane];
        const uint32_t ah[4] = {h4.x, h4.y, h4.z, h4.w}, al[4] = {l4.x, l4.y, l4.z, l4.w};
#pragma unroll
        for (int j = 0; j < 2; ++j) mma8_split(acc[j][a], ah, al, bh[j][0], bh[j][1], bl[j][0], bl[j][1]);
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j == 1 && !two) break;
      const int c = n0[j] + 2 * t4;
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = a * kSub + gq + 8 * hr;
          const float bt = Bs[r];
          const float x0 = bt * acc[j][a][2 * hr], x1 = bt * acc[j][a][2 * hr + 1];
          if (isw) {
            *reinterpret_cast<float2*>(p.wc + cbase + r * KP + c) = make_float2(x0, x1);  // zeros past Cc, K
          } else if (r < cp.Cc) {
            float* d = p.u + ((cp.row0 + r) * p.HV + hv) * p.V;
            if (c < p.V) d[c] = x0;
            if (c + 1 < p.V) d[c + 1] = x1;
          }
        }
    }
  }
}

template <typename T16, bool V6 = false>
__global__ void __launch_bounds__(NT, 2) prep4_kda_kernel(Params p) {
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
  float* Rf = Fs + CH * LDF;                            // [64][LDF]: R_t = e^{G_s - G_t}
  float* Scr = reinterpret_cast<float*>(smem + SM::fb);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Hs = Ab;  // during the passes: [64][LDF] e^{G_t - G_m} (t upper half) / e^{G_m - G_t} (lower half)
  static_assert(CH * LDF <= CH * kPrepLDA, "the half-block table fits in the A_kk region");
  float* Tot = reinterpret_cast<float*>(smem + SM::tot);  // S_b
  float* Pre = reinterpret_cast<float*>(smem + SM::pre);
  float* Ex = reinterpret_cast<float*>(smem + SM::ex);
  float* Bs = reinterpret_cast<float*>(smem + SM::bs);

  ChunkPos cp;
  const int hv = blockIdx.y;
  if (!chunk_pos(p, blockIdx.x, cp)) return;
  const int cid = blockIdx.x;
  const int L = cp.Cc;
  const int64_t tok0 = cp.row0;
  const int h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V, HV = p.HV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, t4 = lane & 3;
  const size_t cbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
  const bool v2 = p.qgc != nullptr;
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
  if (tid < CH) Bs[tid] = tid < L ? __ldg(p.beta + (tok0 + tid) * HV + hv) : 0.f;
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S1: a = e^g in place (padding: g = 0, a = 1); Tot_b = the sum of the gates of sub-chunk b (float, a
  //      pairwise tree: a direct sum, <= 0 for log decays <= 0)
  for (int i = tid; i < 4 * KP; i += NT) {
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
  float accq[4] = {0.f, 0.f, 0.f, 0.f};  // warps 0-3: the lower-left 8x8 quarter of sub-chunk `warp` (V6: 4-7, qa)
  const int qa = V6 ? warp - 4 : warp;
  float acc2[3][4];                      // P2: tiles warp, warp + 8, warp + 16
#pragma unroll
  for (int u = 0; u < 3; ++u) acc2[u][0] = acc2[u][1] = acc2[u][2] = acc2[u][3] = 0.f;
  // build mapping: channel bcl of the pass, sub-chunk ba, direction bdir
  const int bcl = tid & 31, ba = (tid >> 5) & 3, bdir = tid >> 7;

#pragma unroll 1
  for (int pass = 0; pass < NP; ++pass) {
    const int cp0 = pass * kKdaPass;
    // ---- build: the factor tables of this pass's 32 channels; Q Gam, K Eend, Gam_last (v2) on the way
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
        const float epre = __expf(spre);
        Pre[ba * KP + c] = epre;
        // (V6) Q Gam's column c from row 16 ba: the stores below at constant offsets
        [[maybe_unused]] float* const qrow = V6 && v2 ? p.qgc + cbase + (ba * kSub * KP + c) : nullptr;
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
          if constexpr (V6) {
            if (v2) qrow[i * KP] = f16(Qs[t * LDH + c]) * (epre * P);
          } else {
            if (v2) p.qgc[cbase + t * KP + c] = f16(Qs[t * LDH + c]) * (epre * P);  // q e^{G_t}
          }
        }
        // Gam_last: one exponential of the chunk's gate sum (padding: gates 0, so 1 past K)
        if (ba == 3 && v2) p.glc[(static_cast<size_t>(cid) * HV + hv) * KP + c] = __expf(spre + tb[3]);
      } else {
        float ssuf = 0.f;
#pragma unroll
        for (int b = 1; b < 4; ++b)
          if (b > ba) ssuf += tb[b];
        const float esuf = __expf(ssuf);
        [[maybe_unused]] float* const krow = V6 && v2 ? p.kendc + cbase + (ba * kSub * KP + c) : nullptr;
        float S = 1.f, S8 = 1.f;
#pragma unroll
        for (int i = kSub - 1; i >= 0; --i) {
          const int t = ba * kSub + i;
          const float at = Gx[t * LDG + c];
          Rf[t * LDF + bcl] = S;
          if constexpr (V6) {
            if (v2) krow[i * KP] = f16(Ks[t * LDH + c]) * (esuf * S);
          } else {
            if (v2) p.kendc[cbase + t * KP + c] = f16(Ks[t * LDH + c]) * (esuf * S);  // k e^{G_last - G_t}
          }
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

    // ---- P2: cross-sub-chunk tiles (3xTF32), rows of sub-chunk a (q or k, times e^{G_t - G_r}) x (k_j e^{G_s -
    //      G_j} e^{G_r - G_s}), this pass's 32 channels
    if constexpr (V6) {  // tiles by row block as cross_tile6: each A fragment split once per k-step
      const uint16_t* Xs = ((warp < 4 ? warp >> 1 : warp & 1) ? Ks : Qs) + gq * LDH + cp0 + t4;
      const uint16_t* Kl = Ks + gq * LDH + cp0 + t4;
      const float *Fl = Fs + gq * LDF + t4, *Rl = Rf + gq * LDF + t4, *El = Ex + cp0 + t4;
      if (warp < 4) {
        if (warp & 1) prep6_cross_tiles<3, 3, 3, 0, LDH, LDF, T16>(acc2, Xs, Kl, Fl, Rl, El);
        else prep6_cross_tiles<3, 0, 3, 0, LDH, LDF, T16>(acc2, Xs, Kl, Fl, Rl, El);
      } else if (warp < 6) {
        prep6_cross_tiles<2, 0, 3, 0, LDH, LDF, T16>(acc2, Xs, Kl, Fl, Rl, El);
      } else {
        prep6_cross_tiles<2, 3, 1, 0, LDH, LDF, T16>(acc2, Xs, Kl, Fl, Rl, El);
        prep6_cross_tiles<1, 0, 2, 1, LDH, LDF, T16>(acc2, Xs, Kl, Fl, Rl, El);
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
          mma8<true>(acc2[u], af, b0, b1);
        }
      }
    }

    // ---- warps 0-3 (V6: 4-7, the lighter ones in P2): the lower-left 8x8 quarter of sub-chunk a = qa on tensor
    //      cores (3xTF32), through the token m = 16a + 7: rows 0-7 q_t, rows 8-15 k_t (t = 16a + 8 + gq) times
    //      e^{G_t - G_m}; columns k_j e^{G_m - G_j} (j = 16a + gq): one 16x8 tile carries both products, every
    //      factor <= 1
    if (V6 ? warp >= 4 : warp < 4) {
      const int r = qa * kSub + 8 + gq, jb = qa * kSub + gq;
#pragma unroll
      for (int s = 0; s < kKdaPass / 8; ++s) {
        const int cl = s * 8 + t4, c = cp0 + cl;
        const float h0 = Hs[r * LDF + cl], h1 = Hs[r * LDF + cl + 4];
        const float4 af = make_float4(f16(Qs[r * LDH + c]) * h0, f16(Ks[r * LDH + c]) * h0,
                                      f16(Qs[r * LDH + c + 4]) * h1, f16(Ks[r * LDH + c + 4]) * h1);
        const float b0 = f16(Ks[jb * LDH + c]) * Hs[jb * LDF + cl];
        const float b1 = f16(Ks[jb * LDH + c + 4]) * Hs[jb * LDF + cl + 4];
        mma8<true>(accq, af, b0, b1);
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

  // ---- results: A_qk, A_kk row-major to global (P1: the diagonal blocks -- their 8x8 diagonal quarters
  //      -- incl. their zeros above the diagonal; P2: the blocks below; zeros above the diagonal blocks);
  //      A_kk Diag(beta) to Ab (strictly lower)
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
    p.aqk[abase + t1 * CH + j] = vq1;
    p.aqk[abase + t2 * CH + j] = vq2;
    p.akk[abase + t1 * CH + j] = vk1;
    p.akk[abase + t2 * CH + j] = vk2;
    Ab[t1 * LDA + j] = vk1 * bj;
    Ab[t2 * LDA + j] = vk2 * bj;
  }
  {  // the upper-right 8x8 quarter of each diagonal block: zeros (aqk, akk; Ab's for tidiness, never read)
    const int a = tid >> 6, r = (tid >> 3) & 7, cc = tid & 7;
    const int t = a * kSub + r, j = a * kSub + 8 + cc;
    p.aqk[abase + t * CH + j] = 0.f;
    p.akk[abase + t * CH + j] = 0.f;
    Ab[t * LDA + j] = 0.f;
  }
  if (V6 ? warp >= 4 : warp < 4) {  // the lower-left quarter from accq: rows gq (q), gq + 8 (k); columns 2 t4, 2 t4 + 1
    const int t = qa * kSub + 8 + gq, j = qa * kSub + 2 * t4;
    *reinterpret_cast<float2*>(p.aqk + abase + t * CH + j) = make_float2(accq[0], accq[1]);
    *reinterpret_cast<float2*>(p.akk + abase + t * CH + j) = make_float2(accq[2], accq[3]);
    *reinterpret_cast<float2*>(Ab + t * LDA + j) = make_float2(accq[2] * Bs[j], accq[3] * Bs[j + 1]);
  }
#pragma unroll
  for (int u = 0; u < 3; ++u) {
    int a, mat, nt;
    if constexpr (V6) cross_tile6(warp, u, a, mat, nt);
    else cross_tile(warp + 8 * u, a, mat, nt);
    const int r0 = a * kSub, c0 = nt * 8;
    prep3_store_tile((mat ? p.akk : p.aqk) + abase + r0 * CH + c0, CH, acc2[u], 1.f, 1.f, gq, t4);
    if (mat) prep3_store_tile(Ab + r0 * LDA + c0, LDA, acc2[u], Bs[c0 + 2 * t4], Bs[c0 + 2 * t4 + 1], gq, t4);
  }
  prep3_zero_upper(p, abase, tid);
  __syncthreads();

  // ---- S2: warps 0-3: diagonal blocks of T; warps 4-7: X = K Gam = k Pre_b prod a_i in place of a
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

  // ---- S3: v into k's tile (cp.async, lands during S3/S4); T_10, T_32
  gdn_stage<kGdnVB>(Vs, kPrepLDV, vsrc, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
  prep_inverse_sub1(Ab, Ts, Scr, warp, gq, t4);
  __syncthreads();

  // ---- S4: the lower-left 32x32 of T
  prep_inverse_sub2(Ab, Ts, Scr, warp, gq, t4);
  [[maybe_unused]] uint4* const Tf_early = reinterpret_cast<uint4*>(Scr + kPrep6Scr);
  [[maybe_unused]] uint4* const Tf_late = reinterpret_cast<uint4*>(Ab);
  if constexpr (V6) {  // T's fragments split: the 12 final since S3 by warps 2-7, S4's 8 by warps 0-1 (their own)
    if (warp >= 2) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        int a, s;
        prep6_early_frag(warp - 2 + 6 * r, a, s);
        prep6_split_frag(Ts, Tf_early, Tf_late, a, s, lane);
      }
    } else {
      __syncwarp();  // this warp's T_2b, T_3b (b = warp) stored by prep_inverse_sub2
#pragma unroll
      for (int i = 0; i < 4; ++i) prep6_split_frag(Ts, Tf_early, Tf_late, 2 + (i >> 1), 2 * warp + (i & 1), lane);
    }
  }
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S5: w = Diag(beta) T X, u = Diag(beta) T V
  if constexpr (V6)
    prep6_w_u<T16>(p, cp, hv, cbase, Tf_early, Tf_late, Vs, kPrepLDV, Bs, tid,
                   [&](int t, int c) { return Gx[t * LDG + c]; });
  else
    prep3_w_u<T16>(p, cp, hv, cbase, Ts, Vs, kPrepLDV, Bs, tid, [&](int t, int c) { return Gx[t * LDG + c]; });
}

// The family's prep v4 kernel (KDA; V6: prep v6, KDA_CUDA_CHUNK_BWD_PREP=6; GDN has none and runs its prep v3)
// and its shared memory.
template <bool PC, typename T16, bool V6 = false>
inline auto prep4_kernel() {
  if constexpr (PC) return prep4_kda_kernel<T16, V6>;
  else return prep3_gdn_kernel<T16>;
}
template <bool PC>
constexpr size_t prep4_smem() {
  return PC ? kPrep4KdaSmem : kPrep3GdnSmem;
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
