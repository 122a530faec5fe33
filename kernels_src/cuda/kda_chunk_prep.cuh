// KDA-specific prep kernel of the chunked forward (per-channel gate), bf16/fp16 inputs. Writes exactly the
// workspace delta_chunk_prep_kernel<PC=true> writes (WsLayout: w, q~, k~^T, A~, decay, u0; same sections, fragment
// order and bf16/fp32 choice), so delta_chunk_scan_kernel is unchanged. fp32 inputs keep the generic prep kernel
// (3xTF32 everywhere); KDA_CUDA_KDA_PREP=0 selects the generic kernel for bf16/fp16 too (read at every call).
//
// Exact per-channel gates as in the generic kernel (no scalar approximation, no bound on the gates; every exponent
// is a direct sum of the gates between two tokens, so for log decays <= 0 every factor is <= 1 and gates of -1e4
// give 0, never inf/NaN):
//   pairs (t, j) inside one 16-token sub-chunk: e^{sum_{j<i<=t} g_i} per channel on CUDA cores, the exponent a
//     running float sum of the gates from t down to j (no prefix difference, so no cancellation);
//   pairs across sub-chunks (j in sub-chunk b < a, t in sub-chunk a): on tensor cores (tf32 m16n8k8, as the
//     generic kernel) as (x_t e^{G_t - G_r}) . (k_j e^{G_s - G_j} e^{G_r - G_s}), r = 16a - 1 the token before t's
//     sub-chunk, s = 16b + 15 the last token of j's; the three factors are tabulated per (token, channel) / per
//     (sub-chunk pair, channel) in double sums of the gates and multiplied into the fragments as they are read.
// Phases (one block of 256 threads per (chunk, value head); 104 KB of shared memory at K = 128, so two blocks
// per SM; the generic kernel: 205 KB, one):
//   S0  cp.async of q, k (16-bit tiles) and the fp32 gates, zero padded (rows >= L, columns >= K); beta.
//   S1  per channel and sub-chunk: the sub-chunk's gate total (double).
//   per pass of 32 channels (K = 128: 4 passes):
//     build: thread (channel, sub-chunk, direction): forward, the prefix within the sub-chunk (double) ->
//       e^{G_t - G_r} table, q~ = scale q e^{G_t} -> workspace, decay; backward, the suffix within the
//       sub-chunk -> e^{G_s - G_j} table, k~^T = beta k e^{G_last - G_t} -> workspace; e^{G_r - G_s} table.
//     P2: the 24 cross-sub-chunk 16x8 tiles of Q K^T and K K^T (3 per warp), accumulated over the passes.
//     P1: the in-sub-chunk pairs (thread = sub-chunk, row pair {t, 15 - t}, channel group), accumulated.
//   results: scale A_qk Diag(beta) -> workspace (P2 tiles from the accumulators in fragment order, P1 per element,
//     upper tiles zero); A_kk Diag(beta) -> shared memory.
//   S2  warps 0-3: the diagonal blocks of T (prep_inverse_diag, shared with the GDN prep); warps 4-7:
//       X = k e^{G} in place of the gates.
//   S3/S4  the off-diagonal blocks of T (prep_inverse_sub1/2, 3xTF32), v loading meanwhile (cp.async).
//   S5  w = T X, u0 = T V (prep_w_u0, tf32).
#pragma once

#include "gdn_chunk_prep.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kKdaPass = 32;  // channels per pass

template <int KP>
struct KdaPrepSmem {
  static constexpr int LDH = KP + 8;        // 16-bit row stride of q / k
  static constexpr int LDG = KP + 8;        // fp32 row stride of the gates / X (conflict-free B fragments in S5)
  static constexpr int LDF = kKdaPass + 4;  // fp32 row stride of the per-pass factor tables
  static constexpr size_t r1 = 0;           // q (16-bit), later T (fp32)
  static constexpr size_t r1_bytes = cmax(2 * kChunk * LDH, 4 * kChunk * kPrepLDA);
  static constexpr size_t r2 = r1 + r1_bytes;  // k (16-bit), later v's first 128 columns
  static constexpr size_t r2_bytes = cmax(2 * kChunk * LDH, 2 * kChunk * kPrepLDV);
  static constexpr size_t gx = r2 + r2_bytes;  // gates [64][LDG], later X = K e^G
  static constexpr size_t fb = gx + 4 * kChunk * LDG;  // factor tables 2 x [48][LDF], later the S3/S4 scratch
  static constexpr size_t fb_bytes = cmax(2 * 48 * LDF * 4, 4 * 16 * kPrepLDY * 4);
  static constexpr size_t ab = fb + fb_bytes;            // A_kk Diag(beta) [64][kPrepLDA]
  static constexpr size_t tot = ab + 4 * kChunk * kPrepLDA;  // double [4][KP]: gate total per sub-chunk
  static constexpr size_t ex = tot + 8 * 4 * KP;         // float [3][KP]: e^{T_1}, e^{T_2}, e^{T_1 + T_2}
  static constexpr size_t bs = ex + 4 * 3 * KP;          // beta [64]
  static constexpr size_t bytes = bs + 4 * kChunk;
  static_assert(r2 % 16 == 0 && gx % 16 == 0 && fb % 16 == 0 && ab % 16 == 0 && tot % 16 == 0,
                "16-byte aligned sections");
};

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

// Two adjacent 16-bit values (4-byte aligned) as floats.
template <typename T16>
__device__ __forceinline__ float2 ld_pair16(const uint16_t* p) {
  const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
  if constexpr (std::is_same<T16, __nv_bfloat16>::value) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}

// Cross-sub-chunk tile number (0..23) -> row block a (1..3), matrix (0: q, 1: k), 8-column tile nt (< 2a).
__device__ __forceinline__ void cross_tile(int tile, int& a, int& mat, int& nt) {
  a = tile < 4 ? 1 : (tile < 12 ? 2 : 3);
  const int local = tile - (a == 1 ? 0 : (a == 2 ? 4 : 12));
  mat = local / (2 * a);
  nt = local - mat * 2 * a;
}

template <int KP, typename T16>
__global__ void __launch_bounds__(kGdnThreads, 2) kda_chunk_prep_kernel(const ChunkFwdParams p) {
  using SM = KdaPrepSmem<KP>;
  constexpr int LDH = SM::LDH, LDG = SM::LDG, LDF = SM::LDF, LDA = kPrepLDA;
  constexpr int NP = KP / kKdaPass;
  static_assert(KP % kKdaPass == 0, "passes of 32 channels");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::r1);
  float* Ts = reinterpret_cast<float*>(smem + SM::r1);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::r2);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::r2);
  float* Gx = reinterpret_cast<float*>(smem + SM::gx);
  float* Fs = reinterpret_cast<float*>(smem + SM::fb);  // [48][LDF]: e^{G_t - G_r}, row t - 16 (t >= 16)
  float* Rf = Fs + 48 * LDF;                            // [48][LDF]: e^{G_s - G_j}, row j (j < 48)
  float* Scr = reinterpret_cast<float*>(smem + SM::fb);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  double* Tot = reinterpret_cast<double*>(smem + SM::tot);
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

  // ---- S1: gate total of each sub-chunk and channel (double)
  for (int i = tid; i < 4 * KP; i += kGdnThreads) {
    const int c = i % KP, a = i / KP;
    double s = 0.0;
#pragma unroll
    for (int u = 0; u < kSub; ++u) s += static_cast<double>(Gx[(a * kSub + u) * LDG + c]);
    Tot[a * KP + c] = s;
  }
  __syncthreads();

  // P1 mapping: sub-chunk a1, rows t1 = 16 a1 + rp (pairs j <= t1) and t2 = 16 a1 + 15 - rp (pairs j <= t2),
  // channel pairs c = 2 (8 ci + cg) + {0, 1} of the pass; the 8 channel groups (lane bits 0..2) are summed at the end.
  const int cg = lane & 7, rp = (tid >> 3) & 7, a1 = tid >> 6;
  const int j0 = a1 * kSub, t1 = j0 + rp, t2 = j0 + kSub - 1 - rp;
  float q1[8], k1[8], q2[kSub], k2[kSub];
#pragma unroll
  for (int jl = 0; jl < kSub; ++jl) {
    if (jl < 8) q1[jl] = k1[jl] = 0.f;
    q2[jl] = k2[jl] = 0.f;
  }
  float acc2[3][4];  // P2: tiles warp, warp + 8, warp + 16
#pragma unroll
  for (int u = 0; u < 3; ++u) acc2[u][0] = acc2[u][1] = acc2[u][2] = acc2[u][3] = 0.f;
  // build mapping: channel bcl of the pass, sub-chunk ba, direction bdir
  const int bcl = tid & 31, ba = (tid >> 5) & 3, bdir = tid >> 7;

#pragma unroll 1
  for (int pass = 0; pass < NP; ++pass) {
    const int cp0 = pass * kKdaPass;
    // ---- build
    {
      const int c = cp0 + bcl;
      double gb = 0.0, ga = 0.0;  // gate sums of the sub-chunks before / after ba
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const double x = Tot[b * KP + c];
        if (b < ba) gb += x;
        if (b > ba) ga += x;
      }
      if (bdir == 0) {
        double P = 0.0;
#pragma unroll 4
        for (int i = 0; i < kSub; ++i) {
          const int t = ba * kSub + i;
          P += static_cast<double>(Gx[t * LDG + c]);
          if (ba > 0) Fs[(t - kSub) * LDF + bcl] = __expf(static_cast<float>(P));
          ws_put(ws + WL.qg, frag_index<KP>(t, c), half,
                 p.scale * f16(Qs[t * LDH + c]) * __expf(static_cast<float>(gb + P)));
        }
        if (ba == 3) ws[WL.decay + c] = __expf(static_cast<float>(gb + P));
      } else {
        double S = 0.0;
#pragma unroll 4
        for (int i = kSub - 1; i >= 0; --i) {
          const int t = ba * kSub + i;
          if (ba < 3) Rf[t * LDF + bcl] = __expf(static_cast<float>(S));
          ws_put(ws + WL.kg, frag_index<kChunk>(c, t), half,
                 Bs[t] * f16(Ks[t * LDH + c]) * __expf(static_cast<float>(ga + S)));
          S += static_cast<double>(Gx[t * LDG + c]);
        }
        if (ba == 0) {
          const double T1 = Tot[KP + c], T2 = Tot[2 * KP + c];
          Ex[c] = __expf(static_cast<float>(T1));
          Ex[KP + c] = __expf(static_cast<float>(T2));
          Ex[2 * KP + c] = __expf(static_cast<float>(T1 + T2));
        }
      }
    }
    __syncthreads();

    // ---- P2: cross-sub-chunk tiles, rows of sub-chunk a (q or k, times e^{G_t - G_r}) x (k_j e^{G_s - G_j}
    //      e^{G_r - G_s}), this pass's 32 channels
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
        const float4 af = make_float4(f16(Xs[ra * LDH + c]) * Fs[(ra - kSub) * LDF + cl],
                                      f16(Xs[(ra + 8) * LDH + c]) * Fs[(ra - 8) * LDF + cl],
                                      f16(Xs[ra * LDH + c + 4]) * Fs[(ra - kSub) * LDF + cl + 4],
                                      f16(Xs[(ra + 8) * LDH + c + 4]) * Fs[(ra - 8) * LDF + cl + 4]);
        float b0 = f16(Ks[jb * LDH + c]) * Rf[jb * LDF + cl], b1 = f16(Ks[jb * LDH + c + 4]) * Rf[jb * LDF + cl + 4];
        if (E != nullptr) {
          b0 *= E[c];
          b1 *= E[c + 4];
        }
        mma8<false>(acc2[u], af, b0, b1);
      }
    }

    // ---- P1: in-sub-chunk pairs, exponent = running float sum of the gates from t down to j + 1
#pragma unroll 1
    for (int ci = 0; ci < kKdaPass / 16; ++ci) {
      const int c = cp0 + 2 * (ci * 8 + cg);
      const float2 qa = ld_pair16<T16>(Qs + t1 * LDH + c), ka = ld_pair16<T16>(Ks + t1 * LDH + c);
      const float2 qb = ld_pair16<T16>(Qs + t2 * LDH + c), kb = ld_pair16<T16>(Ks + t2 * LDH + c);
      float d1x = 0.f, d1y = 0.f, d2x = 0.f, d2y = 0.f;
#pragma unroll
      for (int jl = kSub - 1; jl >= 0; --jl) {
        const int j = j0 + jl;
        const float2 gj = *reinterpret_cast<const float2*>(Gx + j * LDG + c);
        const float2 kj = ld_pair16<T16>(Ks + j * LDH + c);
        if (jl <= kSub - 1 - rp) {
          const float x0 = kj.x * __expf(d2x), x1 = kj.y * __expf(d2y);
          q2[jl] = fmaf(qb.y, x1, fmaf(qb.x, x0, q2[jl]));
          k2[jl] = fmaf(kb.y, x1, fmaf(kb.x, x0, k2[jl]));
          d2x += gj.x;
          d2y += gj.y;
        }
        if (jl < 8 && jl <= rp) {
          const float x0 = kj.x * __expf(d1x), x1 = kj.y * __expf(d1y);
          q1[jl] = fmaf(qa.y, x1, fmaf(qa.x, x0, q1[jl]));
          k1[jl] = fmaf(ka.y, x1, fmaf(ka.x, x0, k1[jl]));
          d1x += gj.x;
          d1y += gj.y;
        }
      }
    }
    __syncthreads();
  }

  // ---- results: P1 (diagonal blocks, full 16x16 incl. the zeros above the diagonal), P2 (blocks below), zero
  //      upper tiles of A~. A_kk Diag(beta) to Ab (strictly lower).
#pragma unroll
  for (int jl = 0; jl < kSub; ++jl) {
    if (jl < 8) {
      q1[jl] = warp_sum_below<8>(q1[jl]);
      k1[jl] = warp_sum_below<8>(k1[jl]);
    }
    q2[jl] = warp_sum_below<8>(q2[jl]);
    k2[jl] = warp_sum_below<8>(k2[jl]);
  }
#pragma unroll
  for (int jl = 0; jl < kSub; ++jl) {
    if ((jl & 7) != cg) continue;
    const int j = j0 + jl;
    const float bj = Bs[j];
    const float vq1 = (jl < 8 && jl <= rp) ? q1[jl & 7] : 0.f, vk1 = (jl < 8 && jl < rp) ? k1[jl & 7] : 0.f;
    const float vq2 = jl <= kSub - 1 - rp ? q2[jl] : 0.f, vk2 = jl < kSub - 1 - rp ? k2[jl] : 0.f;
    ws_put(ws + WL.aqk, frag_index<kChunk>(t1, j), half, p.scale * (vq1 * bj));
    ws_put(ws + WL.aqk, frag_index<kChunk>(t2, j), half, p.scale * (vq2 * bj));
    Ab[t1 * LDA + j] = vk1 * bj;
    Ab[t2 * LDA + j] = vk2 * bj;
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

  // ---- S2: warps 0-3: diagonal blocks of T (over q's tile); warps 4-7: X = k e^{G} in place of the gates
  prep_inverse_diag(Ab, Ts, warp, lane);
  if (warp >= 4) {
    for (int i = tid - 128; i < 4 * KP; i += 128) {
      const int c = i % KP, a = i / KP;
      double G = 0.0;
      for (int b = 0; b < a; ++b) G += Tot[b * KP + c];
#pragma unroll 4
      for (int u = 0; u < kSub; ++u) {
        const int t = a * kSub + u;
        G += static_cast<double>(Gx[t * LDG + c]);
        Gx[t * LDG + c] = f16(Ks[t * LDH + c]) * __expf(static_cast<float>(G));
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
  prep_w_u0<KP, T16>(p, ws, WL, Ts, Vs, vsrc, L, vec_v, tid, [&](int t, int c) { return Gx[t * LDG + c]; });
}

}  // namespace cuda
}  // namespace kda_kernels
