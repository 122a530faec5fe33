// KDA prep kernel v3 of the chunked forward (per-channel gate), bf16/fp16 inputs: KDA_CUDA_KDA_PREP=4 (opt-in,
// session 10; the default stays 3, kda_chunk_prep2.cuh with SPLIT8). Writes exactly the workspace the scans read
// (WsLayout: w, q~, k~^T, A~, decay, u0), like v2. Same phases, thread maps and exactness argument as v2 with its
// 8x8 split of the diagonal blocks (every decay factor a product of at most 16 a_i = e^{g_i} <= 1 within a
// sub-chunk, or the exponential of a direct float sum of whole sub-chunks' gates; no gate bound assumed). What
// changed is where the instructions go (v2 was issue-bound: Nsight Compute of session 7, 65 % issue slots, ALU the
// busiest pipe, L1/shared 69 %):
//   build  writes the PRODUCT tables instead of the factor tables: QF_t = q_t F_t, KR_t = k_t R_t (64 rows each,
//       the region of v2's F / R tables) and KF_t = k_t F_t (rows 16..63, rounded to tf32, beside the 8x8 split's
//       table Hs in the idle A_kk region). The fp32 products are the ones v2 formed per fragment element in P2 and
//       W (same operands, same rounding), now once per (token, channel) instead of once per use.
//   P2  fragments by ldmatrix from the product tables (one ldmatrix.x4 for the 16x8 A fragment, one .x2 for the
//       8x8 B fragment: the tf32 m16n8k8 layouts are the b16 8x8 layouts read as 32-bit words), no bf16 unpacking
//       and no factor products; the cross factors e^{S_1}, e^{S_2}, e^{S_1 + S_2} still multiply B per element.
//       The tf32 conversions (cvt.rna) are those of v2's mma8: the P2 accumulators are bit-identical to v2's.
//   W   q~ = scale Pre QF, k~^T = beta Suf KR from the tables (no bf16 unpacking, fewer loads).
//   S2  X = k e^G stored rounded to tf32 (cvt.rna, as mma8 would round it in S5).
//   S4' T rounded to tf32 in place after the inverse (one more barrier), so S5 needs no conversions: w = T X and
//       u0 = T V (V's bf16 / fp16 values are tf32 numbers) with T's A fragments by ldmatrix.x4 and raw tf32 mma;
//       u0 stored as float2 where V is even. Same products and rounding as v2's S5: w and u0 are bit-identical.
// Shared memory: v2's layout (~111 KB at K = 128, two blocks per SM), 256 threads.
#pragma once

#include "kda_chunk_prep2.cuh"

namespace kda_kernels {
namespace cuda {

// ldmatrix of 8x8 b16 matrices read as 8x4 32-bit words: lane l gets word (l % 4) of row (l / 4) of matrix i in
// register i; lanes 8 i .. 8 i + 7 give the row addresses of matrix i (16-byte aligned rows).
__device__ __forceinline__ void p3_ldsm_x4(uint32_t (&r)[4], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void p3_ldsm_x2(uint32_t (&r)[2], const void* row) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// The tf32 m16n8k8 A fragment {(g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)} of the 16x8 fp32 block at X (row
// stride ld floats, ld * 4 a multiple of 16 bytes, X 16-byte aligned): lane l addresses row (l & 7) + 8 ((l >> 3)
// & 1), column 4 (l >> 4).
__device__ __forceinline__ void ld_afrag32(uint32_t (&r)[4], const float* X, int ld, int lane) {
  p3_ldsm_x4(r, X + ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 4);
}
// The B fragment {(k = t, n = g), (k = t + 4, n = g)} of an 8x8 block stored n-major (row n, column k) at X.
__device__ __forceinline__ void ld_bfrag32(uint32_t (&r)[2], const float* X, int ld, int lane) {
  p3_ldsm_x2(r, X + (lane & 7) * ld + ((lane >> 3) & 1) * 4);
}

__device__ __forceinline__ float p3_tf32(float x) { return __uint_as_float(to_tf32(x)); }  // (scan4 has tf32_round)

// w = T X (fragment order) and u0 = T V (row-major), as prep_w_u0 (gdn_chunk_prep.cuh) but with T and X already
// tf32 (rounded in place): no conversions; T's A fragments by ldmatrix, each read once for TWO jobs (job, job + 8:
// the warp's jobs in pairs, a w job or a u0 job each), so the 20 lower fragments of T are read half as often.
// Every thread must call it (V > 128 restages v between block barriers).
template <int KP, typename T16>
__device__ __forceinline__ void prep3_w_u0(const ChunkFwdParams& p, float* ws, const WsLayout<KP>& WL, const float* Ts,
                                           const float* Xs, int ldx, uint16_t* Vs, const uint16_t* vg, int L,
                                           bool vec_v, int tid) {
  constexpr int LDA = kPrepLDA, LDV = kPrepLDV;
  constexpr int NW = kGdnThreads / 32;
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int V = p.V;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  constexpr int ntw = KP / 8;
  const bool veven = (V & 1) == 0;
  for (int v0 = 0; v0 < V; v0 += kGdnVB) {
    if (v0 > 0) {
      __syncthreads();
      gdn_stage<kGdnVB>(Vs, LDV, vg + v0, static_cast<int64_t>(p.HV) * V, L, min(V - v0, kGdnVB), vec_v, tid);
      gdn_cp_async_wait_all();
      __syncthreads();
    }
    const int ntv = (min(V - v0, kGdnVB) + 7) / 8;
    const int nw = v0 == 0 ? ntw : 0;
    const int njob = nw + ntv;
    for (int job0 = warp; job0 < njob; job0 += 2 * NW) {
      const bool has1 = job0 + NW < njob;  // warp-uniform
      uint32_t b[2][kChunk / 8][2];
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int job = job0 + x * NW;
        const bool isw = job < nw;
        const int n0 = (isw ? job : job - nw) * 8;
#pragma unroll
        for (int s = 0; s < kChunk / 8; ++s)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int t = s * 8 + t4 + 4 * hh;
            b[x][s][hh] = (x == 1 && !has1) ? 0u
                          : isw ? __float_as_uint(Xs[t * ldx + n0 + gq])
                                : __float_as_uint(f16(Vs[t * LDV + n0 + gq]));
          }
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        float acc[2][4];
#pragma unroll
        for (int x = 0; x < 2; ++x) acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = 0.f;
#pragma unroll
        for (int s = 0; s < kChunk / 8; ++s) {
          if (s < 2 * a + 2) {
            uint32_t af[4];
            ld_afrag32(af, Ts + a * kSub * LDA + s * 8, LDA, lane);
            mma_tf32_raw(acc[0], af[0], af[1], af[2], af[3], b[0][s][0], b[0][s][1]);
            if (has1) mma_tf32_raw(acc[1], af[0], af[1], af[2], af[3], b[1][s][0], b[1][s][1]);
          }
        }
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          if (x == 1 && !has1) break;
          const int job = job0 + x * NW;
          if (job < nw) {
            reinterpret_cast<float4*>(ws + WL.w)[(a * ntw + job) * 32 + lane] = acc_to_afrag(acc[x], lane);
          } else {
            const int n0 = (job - nw) * 8;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int r = a * kSub + gq + hh * 8, c = v0 + n0 + 2 * t4;
              float* dst = ws + WL.u + static_cast<int64_t>(r) * V + c;
              if (veven && c + 1 < V) {
                *reinterpret_cast<float2*>(dst) = make_float2(acc[x][2 * hh], acc[x][2 * hh + 1]);
              } else {
                if (c < V) dst[0] = acc[x][2 * hh];
                if (c + 1 < V) dst[1] = acc[x][2 * hh + 1];
              }
            }
          }
        }
      }
    }
  }
}

// Shared memory: v2's (KdaPrep2Smem) with the per-pass tables renamed: fb holds QF / KR [64][LDF] (v2: F / R),
// the A_kk region holds Hs [64][LDF] and KF [48][LDF] during the passes.
template <int KP>
struct KdaPrep3Smem : KdaPrep2Smem<KP> {
  static_assert((KdaPrep2Smem<KP>::LDF * 4) % 16 == 0 && (kPrepLDA * 4) % 16 == 0 && (KdaPrep2Smem<KP>::LDG * 4) % 16 == 0,
                "ldmatrix rows are 16-byte aligned");
  static_assert(kChunk * KdaPrep2Smem<KP>::LDF + 48 * KdaPrep2Smem<KP>::LDF <= kChunk * kPrepLDA,
                "Hs and KF fit in the A_kk region");
};

// P1U (KDA_CUDA_KDA_PREP=5): P1's two channel-pair iterations per pass unrolled (twice the independent work per
// warp between barriers; 128 registers, the cap, 0 spills) instead of a loop (=4: 106 registers).
template <int KP, typename T16, bool P1U>
__global__ void __launch_bounds__(kGdnThreads, 2) kda_chunk_prep3_kernel(const ChunkFwdParams p) {
  using SM = KdaPrep3Smem<KP>;
  constexpr int LDH = SM::LDH, LDG = SM::LDG, LDF = SM::LDF, LDA = kPrepLDA;
  constexpr int NP = KP / kKdaPass;
  constexpr int NB = 8, NH = 4;  // the 8x8 split (v2's SPLIT8)
  static_assert(KP % kKdaPass == 0, "passes of 32 channels");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::r1);
  float* Ts = reinterpret_cast<float*>(smem + SM::r1);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::r2);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::r2);
  float* Gx = reinterpret_cast<float*>(smem + SM::gx);
  float* QF = reinterpret_cast<float*>(smem + SM::fb);  // [64][LDF]: q_t F_t, F_t = e^{G_t - G_r}
  float* KR = QF + kChunk * LDF;                        // [64][LDF]: k_t R_t, R_t = e^{G_s - G_t}
  float* Scr = reinterpret_cast<float*>(smem + SM::fb);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Hs = Ab;                 // during the passes: [64][LDF] e^{G_t - G_m} (t upper half) / e^{G_m - G_t} (lower)
  float* KF = Ab + kChunk * LDF;  // during the passes: [48][LDF] tf32(k_t F_t), row t - 16 (t = 16..63)
  float* Tot = reinterpret_cast<float*>(smem + SM::tot);
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

  // ---- S1: a = e^g in place (padding: g = 0, a = 1); Tot_b = the float tree sum of sub-chunk b's gates (v2)
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

  // P1 mapping (v2's SPLIT8): the half (tid / 32) % 2 of sub-chunk a1 = tid / 64, rows t1 = j0 + rp and
  // t2 = j0 + 7 - rp, channel pairs c = 2 (8 ci + cg) + {0, 1} of the pass
  const int cg = lane & 7, a1 = tid >> 6;
  const int rp = lane >> 3;
  const int j0 = a1 * kSub + ((tid >> 5) & 1) * NB, t1 = j0 + rp, t2 = j0 + NB - 1 - rp;
  float q1[NH], k1[NH], q2[NB], k2[NB];
#pragma unroll
  for (int jl = 0; jl < NB; ++jl) {
    if (jl < NH) q1[jl] = k1[jl] = 0.f;
    q2[jl] = k2[jl] = 0.f;
  }
  float accq[4] = {0.f, 0.f, 0.f, 0.f};  // warps 0-3: the lower-left 8x8 quarter of sub-chunk `warp`
  float acc2[3][4];                      // P2: tiles warp, warp + 8, warp + 16
#pragma unroll
  for (int u = 0; u < 3; ++u) acc2[u][0] = acc2[u][1] = acc2[u][2] = acc2[u][3] = 0.f;
  const int bcl = tid & 31, ba = (tid >> 5) & 3, bdir = tid >> 7;

#pragma unroll 1
  for (int pass = 0; pass < NP; ++pass) {
    const int cp0 = pass * kKdaPass;
    // ---- build: the product tables of this pass's 32 channels (thread: channel bcl, sub-chunk ba, direction)
    {
      const int c = cp0 + bcl;
      float tb[4];
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
          QF[t * LDF + bcl] = f16(Qs[t * LDH + c]) * P;
          if (ba > 0) KF[(t - kSub) * LDF + bcl] = p3_tf32(f16(Ks[t * LDH + c]) * P);
          if (i >= 8) {  // e^{G_t - G_m}, m = 16 ba + 7
            P8 *= at;
            Hs[t * LDF + bcl] = P8;
          }
        }
        if (ba == 3) ws[WL.decay + c] = __expf(spre + tb[3]);
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
          KR[t * LDF + bcl] = f16(Ks[t * LDH + c]) * S;
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

    // ---- P2: cross-sub-chunk tiles from the product tables (ldmatrix), the cross factor on B where b < a - 1
#pragma unroll
    for (int u = 0; u < 3; ++u) {
      int a, mat, nt;
      cross_tile(warp + 8 * u, a, mat, nt);
      const int b = nt >> 1;
      const float* E = b == a - 1 ? nullptr : Ex + (a == 2 ? 0 : (b == 1 ? 1 : 2)) * KP + cp0;
      const float* Xa = mat ? KF + (a - 1) * kSub * LDF : QF + a * kSub * LDF;
      const float* Xb = KR + nt * 8 * LDF;
#pragma unroll
      for (int s = 0; s < kKdaPass / 8; ++s) {
        uint32_t af[4], bf[2];
        ld_afrag32(af, Xa + s * 8, LDF, lane);
        ld_bfrag32(bf, Xb + s * 8, LDF, lane);
        if (!mat) {
#pragma unroll
          for (int e = 0; e < 4; ++e) af[e] = to_tf32(__uint_as_float(af[e]));
        }
        float b0 = __uint_as_float(bf[0]), b1 = __uint_as_float(bf[1]);
        if (E != nullptr) {
          b0 *= E[s * 8 + t4];
          b1 *= E[s * 8 + t4 + 4];
        }
        mma_tf32_raw(acc2[u], af[0], af[1], af[2], af[3], to_tf32(b0), to_tf32(b1));
      }
    }

    // ---- warps 0-3: the lower-left 8x8 quarter of sub-chunk a = warp through the token m = 16a + 7 (v2)
    if (warp < 4) {
      const int r = warp * kSub + 8 + gq, jb = warp * kSub + gq;
#pragma unroll
      for (int s = 0; s < kKdaPass / 8; ++s) {
        const int cl = s * 8 + t4, c = cp0 + cl;
        const float h0 = Hs[r * LDF + cl], h1 = Hs[r * LDF + cl + 4];
        const float4 af = make_float4(f16(Qs[r * LDH + c]) * h0, f16(Ks[r * LDH + c]) * h0,
                                      f16(Qs[r * LDH + c + 4]) * h1, f16(Ks[r * LDH + c + 4]) * h1);
        mma8<false>(accq, af, f16(Ks[jb * LDH + c]) * Hs[jb * LDF + cl], f16(Ks[jb * LDH + c + 4]) * Hs[jb * LDF + cl + 4]);
      }
    }

    // ---- W: q~ (tiles 0..15) and k~^T (tiles 16..31) of this pass in fragment order from the product tables
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int it = tid + r * kGdnThreads;
      const int ln = it & 31, z = it >> 5;  // warp-uniform
      if (z < 16) {
        const int a = z >> 2, ct = z & 3;
        const int r0 = a * kSub + (ln >> 2), cl = ct * 8 + (ln & 3), c0 = cp0 + cl;
        const float e0 = p.scale * Pre[a * KP + c0], e1 = p.scale * Pre[a * KP + c0 + 4];
        const float4 x = make_float4(e0 * QF[r0 * LDF + cl], e0 * QF[(r0 + 8) * LDF + cl],
                                     e1 * QF[r0 * LDF + cl + 4], e1 * QF[(r0 + 8) * LDF + cl + 4]);
        ws_put_frag(ws + WL.qg, (a * (KP / 8) + cp0 / 8 + ct) * 32 + ln, half, x);
      } else {
        const int zz = z - 16, rb = zz >> 3, ct = zz & 7;
        const int cl = rb * 16 + (ln >> 2), c0 = cp0 + cl, t0 = ct * 8 + (ln & 3);
        const int a = ct >> 1;
        const float s0 = Suf[a * KP + c0], s1 = Suf[a * KP + c0 + 8];
        const float d0 = Bs[t0], d1 = Bs[t0 + 4];
        const float4 x = make_float4(d0 * (KR[t0 * LDF + cl] * s0), d0 * (KR[t0 * LDF + cl + 8] * s1),
                                     d1 * (KR[(t0 + 4) * LDF + cl] * s0), d1 * (KR[(t0 + 4) * LDF + cl + 8] * s1));
        ws_put_frag(ws + WL.kg, ((cp0 / 16 + rb) * (kChunk / 8) + ct) * 32 + ln, half, x);
      }
    }

    // ---- P1: the two 8x8 triangles of each diagonal block, running products of a_i from t down to j + 1 (v2)
#pragma unroll
    for (int ci = 0; ci < (P1U ? kKdaPass / 16 : 1); ++ci)
#pragma unroll 1
    for (int cj = 0; cj < (P1U ? 1 : kKdaPass / 16); ++cj) {
      const int c = cp0 + 2 * ((ci + cj) * 8 + cg);
      const float2 qa = ld_pair16<T16>(Qs + t1 * LDH + c), ka = ld_pair16<T16>(Ks + t1 * LDH + c);
      const float2 qb = ld_pair16<T16>(Qs + t2 * LDH + c), kb = ld_pair16<T16>(Ks + t2 * LDH + c);
      float f1x = 1.f, f1y = 1.f, f2x = 1.f, f2y = 1.f;
#pragma unroll
      for (int jl = NB - 1; jl >= 0; --jl) {
        const int j = j0 + jl;
        const float2 aj = *reinterpret_cast<const float2*>(Gx + j * LDG + c);
        const float2 kj = ld_pair16<T16>(Ks + j * LDH + c);
        {
          const float x0 = kj.x * f2x, x1 = kj.y * f2y;
          q2[jl] = fmaf(qb.y, x1, fmaf(qb.x, x0, q2[jl]));
          k2[jl] = fmaf(kb.y, x1, fmaf(kb.x, x0, k2[jl]));
          const bool on = jl <= NB - 1 - rp;
          f2x = on ? f2x * aj.x : f2x;
          f2y = on ? f2y * aj.y : f2y;
        }
        if (jl < NH) {
          const float x0 = kj.x * f1x, x1 = kj.y * f1y;
          q1[jl] = fmaf(qa.y, x1, fmaf(qa.x, x0, q1[jl]));
          k1[jl] = fmaf(ka.y, x1, fmaf(ka.x, x0, k1[jl]));
          const bool on = jl <= rp;
          f1x = on ? f1x * aj.x : f1x;
          f1y = on ? f1y * aj.y : f1y;
        }
      }
    }
    __syncthreads();
  }

  // ---- results (v2): P1 (the 8x8 triangles), the lower-left quarters, P2, zero upper tiles of A~; A_kk Diag(beta)
#pragma unroll
  for (int jl = 0; jl < NB; ++jl) {
    if (jl < NH) {
      q1[jl] = warp_sum_below<8>(q1[jl]);
      k1[jl] = warp_sum_below<8>(k1[jl]);
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
    cross_tile(warp + 8 * u, a, mat, nt);
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

  // ---- S2: warps 0-3: diagonal blocks of T; warps 4-7: X = tf32(k e^{G}) in place of a
  prep_inverse_diag(Ab, Ts, warp, lane);
  if (warp >= 4) {
    for (int i = tid - 128; i < 4 * KP; i += 128) {
      const int c = i % KP, b = i / KP;
      float e = Pre[b * KP + c];
#pragma unroll 4
      for (int u = 0; u < kSub; ++u) {
        const int t = b * kSub + u;
        e *= Gx[t * LDG + c];
        Gx[t * LDG + c] = p3_tf32(f16(Ks[t * LDH + c]) * e);
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

  // ---- S4': T rounded to tf32 in place (the blocks on and below the diagonal; S5 reads no others)
  for (int i = tid; i < kChunk * kChunk; i += kGdnThreads) {
    const int r = i >> 6, c = i & 63;
    if ((c >> 4) <= (r >> 4)) Ts[r * LDA + c] = p3_tf32(Ts[r * LDA + c]);
  }
  __syncthreads();

  // ---- S5: w = T X (fragment order), u0 = T V (row-major), raw tf32 mma, T by ldmatrix
  prep3_w_u0<KP, T16>(p, ws, WL, Ts, Gx, LDG, Vs, vsrc, L, vec_v, tid);
}

}  // namespace cuda
}  // namespace kda_kernels
