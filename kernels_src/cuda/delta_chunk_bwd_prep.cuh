// Prep of the chunked backward on tensor cores, GDN (prep v3, prep3_gdn_kernel: the default for GDN with bf16/fp16
// inputs, under KDA_CUDA_CHUNK_BWD_PREP=4 / 5 / 3 alike; KDA runs its prep v4, delta_chunk_bwd_prep4.cuh, which
// reuses prep3_zero_upper / prep3_store_tile / prep3_w_u below; KDA's prep v3 prep3_kda_kernel was retired in
// session 9, docs/cuda.md; =2 selects the fp32 SIMT prep_kernel of delta_chunk_bwd.cuh, which fp32 inputs always
// run, its fp32 products meeting the fp32 tolerance of DESIGN.md section 6). Writes exactly what prep_kernel
// writes (Params of delta_chunk_bwd.cuh), so the state and grad kernels are unchanged:
//   aqk, akk [CH][CH] row-major: A_qk (j <= t) and A_kk (j < t), no scale, no beta, zeros above;
//   u = (I + Diag(beta) A_kk)^-1 Diag(beta) V, rows < Cc, columns < V;
//   w = (I + Diag(beta) A_kk)^-1 Diag(beta) (K Gam): wc [CH][KP] padded with zeros;
//   qgc = Q Gam, kendc = K Eend [CH][KP] (zeros past Cc, K), glc = Gam_last [KP] (1 past K).
// It follows the forward's GDN prep (gdn_chunk_prep.cuh) phase by phase and reuses its pieces: bf16/f16 m16n8k16
// Q K^T and K K^T with the scalar decay per element, the same blocked inverse T = (I + A_kk Diag(beta))^-1
// (diagonal blocks by substitution in fp32, the rest 3xTF32), and (I + Diag(beta) A_kk)^-1 Diag(beta) =
// Diag(beta) T, so u = Diag(beta) T V and w = Diag(beta) T (K Gam). Differences from the forward: every tf32
// product here is 3xTF32 (about fp32; the backward's intermediates feed the gradients), and the outputs are
// row-major fp32. One block of 256 threads per (chunk, value head); shared memory GdnPrepSmem (88 KB at
// KP = 128): two blocks per SM (the SIMT prep: 193 KB, one).
#pragma once

#include "delta_chunk_bwd.cuh"
#include "gdn_chunk_prep.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

static_assert(CH == kChunk && NT == kGdnThreads && VP == kGdnVB && KP == 128, "prep v3 uses the forward's tiles");

constexpr size_t kPrep3GdnSmem = GdnPrepSmem<KP>::bytes;

// Zeros above the diagonal blocks of aqk and akk (row block a: columns >= 16 (a + 1)), float4 stores.
__device__ __forceinline__ void prep3_zero_upper(const Params& p, size_t abase, int tid) {
  for (int i = tid; i < CH * CH / 4; i += NT) {
    const int t = i / (CH / 4), j = (i % (CH / 4)) * 4;
    if (j >= kSub * (t / kSub + 1)) {
      const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
      *reinterpret_cast<float4*>(p.aqk + abase + t * CH + j) = z;
      *reinterpret_cast<float4*>(p.akk + abase + t * CH + j) = z;
    }
  }
}

// A warp's 16x8 accumulator tile (c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)) times (s0, s1) per
// column, stored row-major at D (row stride ld; D = the tile's element (0, 0)).
__device__ __forceinline__ void prep3_store_tile(float* D, int ld, const float (&c)[4], float s0, float s1, int gq,
                                                 int t4) {
  *reinterpret_cast<float2*>(D + gq * ld + 2 * t4) = make_float2(c[0] * s0, c[1] * s1);
  *reinterpret_cast<float2*>(D + (gq + 8) * ld + 2 * t4) = make_float2(c[2] * s0, c[3] * s1);
}

// w = Diag(beta) T X (X(t, c) = xw(t, c), fp32) and u = Diag(beta) T V (Vs: v's columns [0, V), 16-bit, row
// stride ldv, zero padded), 3xTF32 m16n8k8 with T's lower blocks (row stride kPrepLDA): one warp per 8 output
// columns, row block a over the k-blocks 0..a only. No barrier inside.
template <typename T16, typename XW>
__device__ __forceinline__ void prep3_w_u(const Params& p, const ChunkPos& cp, int hv, size_t cbase, const float* Ts,
                                          const uint16_t* Vs, int ldv, const float* Bs, int tid, XW xw) {
  constexpr int LDA = kPrepLDA;
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  constexpr int ntw = KP / 8;
  const int ntv = (p.V + 7) / 8;
  for (int job = warp; job < ntw + ntv; job += NT / 32) {
    const bool isw = job < ntw;
    const int n0 = (isw ? job : job - ntw) * 8;
    float b[CH / 8][2];
#pragma unroll
    for (int s = 0; s < CH / 8; ++s)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = s * 8 + t4 + 4 * hh;
        b[s][hh] = isw ? xw(t, n0 + gq) : f16(Vs[t * ldv + n0 + gq]);
      }
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = 0.f;
      const float* Ta = Ts + (a * kSub + gq) * LDA + t4;
#pragma unroll
      for (int s = 0; s < CH / 8; ++s) {
        if (s < 2 * a + 2) {
          const float4 af = make_float4(Ta[s * 8], Ta[8 * LDA + s * 8], Ta[s * 8 + 4], Ta[8 * LDA + s * 8 + 4]);
          mma8<true>(acc[a], af, b[s][0], b[s][1]);
        }
      }
    }
    const int c = n0 + 2 * t4;
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = a * kSub + gq + 8 * hr;
        const float bt = Bs[r];
        const float x0 = bt * acc[a][2 * hr], x1 = bt * acc[a][2 * hr + 1];
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

// ------------------------------------------------------------------------------------------------ GDN
// Phases as gdn_chunk_prep_kernel (S0 staging + the gate scan on warp 0, S1 the 20 lower tiles of Q K^T and K K^T
// on m16n8k16 with the scalar decay per element, S2-S4 the inverse with Q Gam and K Eend written meanwhile, S5).
template <typename T16>
__global__ void __launch_bounds__(NT, 2) prep3_gdn_kernel(Params p) {
  using SM = GdnPrepSmem<KP>;
  constexpr int LDH = SM::LDH, LDV = SM::LDV, LDA = SM::LDA;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::qs);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::ks);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::vs);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Ts = reinterpret_cast<float*>(smem + SM::ts);
  float2* Gh = reinterpret_cast<float2*>(smem + SM::gh);
  float* Ea = reinterpret_cast<float*>(smem + SM::ea);  // Gam_t = e^{G_t}
  float* Ee = reinterpret_cast<float*>(smem + SM::ck);  // Eend_t = e^{G_last - G_t}
  float* Bs = reinterpret_cast<float*>(smem + SM::bs);
  float* Scr = reinterpret_cast<float*>(smem + SM::qs);  // S3/S4 scratch over the q tile (q is done after S2)

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

  // ---- S0: q, k, v -> shared memory (cp.async); warp 0: gates (double prefix), Gam, Eend, Gam_last, beta
  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + (tok0 * p.H + h) * K;
  const uint16_t* kg = static_cast<const uint16_t*>(p.k) + (tok0 * p.H + h) * K;
  const uint16_t* vg = static_cast<const uint16_t*>(p.v) + (tok0 * HV + hv) * V;
  const bool vec_qk = (K % 8) == 0 && ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k)) & 15) == 0;
  const bool vec_v = (V % 8) == 0 && (reinterpret_cast<uintptr_t>(p.v) & 15) == 0;
  gdn_stage<KP>(Qs, LDH, qg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  gdn_stage<KP>(Ks, LDH, kg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  gdn_stage<kGdnVB>(Vs, LDV, vg, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
  if (warp == 0) {
    const int t0 = 2 * lane;
    const GdnGatePrefix gp = gdn_gate_prefix(p.g, p.beta, tok0, L, HV, hv, lane, Gh, Ea);
    const float b0 = gp.b0, b1 = gp.b1;
    const double G0 = gp.G0, G1 = gp.G1, Gl = gp.Gl;
    Ee[t0] = __expf(static_cast<float>(Gl - G0));
    Ee[t0 + 1] = __expf(static_cast<float>(Gl - G1));
    Bs[t0] = b0;
    Bs[t0 + 1] = b1;
    if (v2) {
      const float dec = __expf(static_cast<float>(Gl));
      for (int c = lane; c < KP; c += 32) p.glc[(static_cast<size_t>(cid) * HV + hv) * KP + c] = c < K ? dec : 1.f;
    }
  }
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S1: the 20 lower tiles of Q K^T and K K^T (m16n8k16, exact products, fp32 accumulation), the decay per
  //      element; A_qk, A_kk row-major to global, A_kk Diag(beta) to Ab; zeros above the diagonal blocks
  {
    const uint32_t* Q32 = reinterpret_cast<const uint32_t*>(Qs);
    const uint32_t* K32 = reinterpret_cast<const uint32_t*>(Ks);
    constexpr int LW = LDH / 2;
    for (int job = warp; job < 20; job += NT / 32) {
      int a, nt;
      lower_tile(job, a, nt);
      float cq[4] = {0.f, 0.f, 0.f, 0.f}, ckk[4] = {0.f, 0.f, 0.f, 0.f};
      const uint32_t* qa = Q32 + (a * kSub + gq) * LW + t4;
      const uint32_t* ka = K32 + (a * kSub + gq) * LW + t4;
      const uint32_t* kb = K32 + (nt * 8 + gq) * LW + t4;
#pragma unroll
      for (int s = 0; s < KP / 16; ++s) {
        const int o = s * 8;
        const uint32_t b0 = kb[o], b1 = kb[o + 4];
        mma16<T16>(cq, qa[o], qa[o + 8 * LW], qa[o + 4], qa[o + 8 * LW + 4], b0, b1);
        mma16<T16>(ckk, ka[o], ka[o + 8 * LW], ka[o + 4], ka[o + 8 * LW + 4], b0, b1);
      }
      float vq[4], vk[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = a * kSub + gq + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
        const float f = j <= t ? __expf(hi_lo_diff(Gh[t], Gh[j])) : 0.f;
        vq[e] = cq[e] * f;
        vk[e] = j < t ? ckk[e] * f : 0.f;
      }
      const int r0 = a * kSub, c0 = nt * 8;
      prep3_store_tile(p.aqk + abase + r0 * CH + c0, CH, vq, 1.f, 1.f, gq, t4);
      prep3_store_tile(p.akk + abase + r0 * CH + c0, CH, vk, 1.f, 1.f, gq, t4);
      prep3_store_tile(Ab + r0 * LDA + c0, LDA, vk, Bs[c0 + 2 * t4], Bs[c0 + 2 * t4 + 1], gq, t4);
    }
    prep3_zero_upper(p, abase, tid);
  }
  __syncthreads();

  // ---- S2: warps 0-3: diagonal blocks of T; warps 4-7: Q Gam (v2)
  prep_inverse_diag(Ab, Ts, warp, lane);
  if (warp >= 4 && v2) {
    for (int i = tid - 128; i < CH * KP / 2; i += 128) {
      const int t = i / (KP / 2), c = (i % (KP / 2)) * 2;
      const float2 x = ld_pair16<T16>(Qs + t * LDH + c);
      const float e = Ea[t];
      *reinterpret_cast<float2*>(p.qgc + cbase + t * KP + c) = make_float2(x.x * e, x.y * e);
    }
  }
  __syncthreads();

  // ---- S3: warps 0-1: T_10, T_32; warps 2-7: K Eend (v2)
  prep_inverse_sub1(Ab, Ts, Scr, warp, gq, t4);
  if (warp >= 2 && v2) {
    for (int i = tid - 64; i < CH * KP / 2; i += NT - 64) {
      const int t = i / (KP / 2), c = (i % (KP / 2)) * 2;
      const float2 x = ld_pair16<T16>(Ks + t * LDH + c);
      const float e = Ee[t];
      *reinterpret_cast<float2*>(p.kendc + cbase + t * KP + c) = make_float2(x.x * e, x.y * e);
    }
  }
  __syncthreads();

  // ---- S4: the lower-left 32x32 of T
  prep_inverse_sub2(Ab, Ts, Scr, warp, gq, t4);
  __syncthreads();

  // ---- S5: w = Diag(beta) T (K Gam), u = Diag(beta) T V
  prep3_w_u<T16>(p, cp, hv, cbase, Ts, Vs, LDV, Bs, tid,
                 [&](int t, int c) { return f16(Ks[t * LDH + c]) * Ea[t]; });
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
