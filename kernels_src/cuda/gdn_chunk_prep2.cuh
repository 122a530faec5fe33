// GDN prep kernel v2 of the chunked forward (the default since session 10; the only one since session 11): the same
// workspace as v1 gdn_chunk_prep_kernel (retired in session 11, KDA_CUDA_GDN_PREP=1 refused; its phases and shared
// pieces: gdn_chunk_prep.cuh; WsLayout: w, q~, k~^T, A~, decay, u0 -- same values, the same products in the same
// order), laid out for three blocks per SM instead of two.
//
// Session 9's gdn_chunk_prep_kernel (0.30 ms at B1 T8192 H16 HV32 K=V=128 on the H200) moves about 155 KB per
// block (48 KB of q / k / v in, 107 KB of workspace out), about 0.13 ms for the whole grid at the H200's DRAM
// bandwidth. Nsight Compute (session 10): DRAM 30 %, issue slots 50 % busy with 0.96 eligible warps per
// scheduler, 34 k warp instructions per block: bound by instruction issue and latency. Its blocks run short,
// barrier-separated phases where a few warps work (the substitution of S2 on 4 half warps, the 3xTF32 products of
// S3 / S4 on 2 warps); with 88 KB of shared memory and 115 registers only two blocks (16 warps) per SM overlap
// them. Here:
//  - 69 KB of shared memory and at most 80 registers (__launch_bounds__(256, 3)): three blocks per SM. v is not
//    staged at S0: its cp.async goes into q's tile once q is done (after S2) and lands behind S3 / S4; the
//    16x16 scratch blocks of S3 / S4 live in Ab's upper triangle (never written by S1 nor read later) instead of
//    q's tile. q, k, v, Ab, T: 4 x 17 KB.
//  - S5 (w = T (K e^G), u0 = T V, tf32 m16n8k8) in pairs of 8-column jobs per warp, with far fewer conversions:
//    the old S5 spent most of its instructions on cvt.rna.tf32.f32 (3 SASS instructions each on sm_90, 6 per mma:
//    by a count of the code about 11 k of the block's 34 k warp instructions). Here T is rounded to tf32 once
//    in shared memory after S4 (prep2_round_t, one more barrier), each A fragment is read once per pair by one
//    ldmatrix.x4 (the fp32 words as b16 pairs: lane l gets word l % 4 of row l / 4, the tf32 A fragment's
//    layout) with no conversion, and each B value is rounded once (not once per row block) by the 2-instruction
//    to_tf32_fast (the same bits as cvt.rna for every non-NaN input). u0 goes out as float2 pairs where V is even
//    (one full 32-byte sector per row per instruction, half the store instructions).
//  - k~^T's stores are split between S3 and S4 (warps 2-7), so S4's 3xTF32 products on warps 0-1 no longer run
//    alone.
//  - S1's m16n8k16 fragments (the same 32-bit words) by ldmatrix.x4: 3 instead of 10 shared loads per k-step.
// The values are those of v1 gdn_chunk_prep_kernel: S0, S2-S4 are its code, S1 the same fragments and products, S5
// the same tf32 operands (rounded as cvt.rna rounds them) and accumulation order.
#pragma once

#include "gdn_chunk_prep.cuh"

namespace kda_kernels {
namespace cuda {

template <int KP>
struct GdnPrep2Smem {
  static constexpr int LDH = KP + 8;  // 16-bit row stride of q / k
  static constexpr int LDV = kPrepLDV;
  static constexpr int LDA = kPrepLDA;
  static constexpr size_t qv_bytes = cmax(2 * kChunk * LDH, 2 * kChunk * LDV);  // q (S0-S2), then v (S3-S5)
  static constexpr size_t qv = 0;
  static constexpr size_t ks = qv + qv_bytes;
  static constexpr size_t ab = ks + 2 * kChunk * LDH;
  static constexpr size_t ts = ab + 4 * kChunk * LDA;
  static constexpr size_t gh = ts + 4 * kChunk * LDA;  // float2 (hi, lo) of the double prefix G_t
  static constexpr size_t ea = gh + 8 * kChunk;        // e^{G_t}
  static constexpr size_t ck = ea + 4 * kChunk;        // beta_t e^{G_last - G_t}
  static constexpr size_t bs = ck + 4 * kChunk;        // beta_t
  static constexpr size_t bytes = bs + 4 * kChunk;
  static_assert(qv % 16 == 0 && ks % 16 == 0 && ab % 16 == 0 && ts % 16 == 0 && gh % 16 == 0,
                "16-byte aligned sections");
  static_assert(3 * (bytes + 1024) <= 228 * 1024, "three blocks per SM on sm_90 (228 KB, 1 KB reserved per block)");
};

// Scratch block i (16 x 16 floats, row stride kPrepLDA) of S3 / S4 in Ab's strictly upper blocks (0,1), (0,2),
// (0,3), (1,2): S1 writes only Ab's 20 tiles on or below the diagonal and S2-S4 read only those.
__device__ __forceinline__ float* prep2_scr(float* Ab, int i) {
  const int rb = i < 3 ? 0 : 1, cb = i < 3 ? i + 1 : 2;
  return Ab + rb * kSub * kPrepLDA + cb * kSub;
}

// Warps 0-1: T_10, T_32 = -T_aa Ab_ab T_bb (3xTF32), as prep_inverse_sub1 with the scratch blocks at prep2_scr(scr,
// i): v2 passes Ab (its strictly upper blocks), v3 (gdn_chunk_prep3.cuh) T's, since Ab's hold the pair's second head.
__device__ __forceinline__ void prep2_inverse_sub1(const float* Ab, float* Ts, float* scr, int warp, int gq, int t4) {
  constexpr int LDA = kPrepLDA;
  if (warp < 2) {
    const int a = warp == 0 ? 1 : 3, b = a - 1;
    float* Y = prep2_scr(scr, 2 * warp);
    float acc[2][4];
    zero_acc(acc);
    warp_mm16(acc, Ab + a * kSub * LDA + b * kSub, LDA, Ts + b * kSub * LDA + b * kSub, LDA, gq, t4);
    warp_store16(Y, LDA, acc, 1.f, gq, t4);
    __syncwarp();
    zero_acc(acc);
    warp_mm16(acc, Ts + a * kSub * LDA + a * kSub, LDA, Y, LDA, gq, t4);
    warp_store16(Ts + a * kSub * LDA + b * kSub, LDA, acc, -1.f, gq, t4);
  }
}

// Warps 0-1 (b = warp): as prep_inverse_sub2 with the scratch blocks at prep2_scr(scr, i) (see prep2_inverse_sub1).
__device__ __forceinline__ void prep2_inverse_sub2(const float* Ab, float* Ts, float* scr, int warp, int gq, int t4) {
  constexpr int LDA = kPrepLDA;
  if (warp < 2) {
    const int b = warp;
    float* Y2 = prep2_scr(scr, 2 * warp);
    float* Y3 = prep2_scr(scr, 2 * warp + 1);
    float acc2[2][4], acc3[2][4];
    zero_acc(acc2);
    zero_acc(acc3);
    for (int c = b; c < 2; ++c) {
      const float* Tcb = Ts + c * kSub * LDA + b * kSub;
      warp_mm16(acc2, Ab + 2 * kSub * LDA + c * kSub, LDA, Tcb, LDA, gq, t4);
      warp_mm16(acc3, Ab + 3 * kSub * LDA + c * kSub, LDA, Tcb, LDA, gq, t4);
    }
    warp_store16(Y2, LDA, acc2, 1.f, gq, t4);
    warp_store16(Y3, LDA, acc3, 1.f, gq, t4);
    __syncwarp();
    zero_acc(acc2);
    zero_acc(acc3);
    warp_mm16(acc2, Ts + 2 * kSub * LDA + 2 * kSub, LDA, Y2, LDA, gq, t4);
    warp_mm16(acc3, Ts + 3 * kSub * LDA + 2 * kSub, LDA, Y2, LDA, gq, t4);
    warp_mm16(acc3, Ts + 3 * kSub * LDA + 3 * kSub, LDA, Y3, LDA, gq, t4);
    warp_store16(Ts + 2 * kSub * LDA + b * kSub, LDA, acc2, -1.f, gq, t4);
    warp_store16(Ts + 3 * kSub * LDA + b * kSub, LDA, acc3, -1.f, gq, t4);
  }
}

// fp32 -> tf32 (the bits of the tf32 value in an fp32 container), round to nearest with ties away from zero: the
// result of cvt.rna.tf32.f32 for every non-NaN input (finite, subnormal, +-inf; the sign-magnitude bits round the
// magnitude up when the 13 dropped bits are >= 0x1000) in 2 instructions instead of its 3 (a NaN may come out as
// inf).
__device__ __forceinline__ uint32_t to_tf32_fast(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// Four 8x8 b16 matrices (here: 8 rows x 4 fp32 words each) from shared memory; lanes 8 i .. 8 i + 7 give the
// row addresses of matrix i, lane l receives word l % 4 of row l / 4 of each.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// k~^T items [i0, i1) (tile-lane index of the kg section) by the threads tid0.. of a group of nthr.
template <int KP, typename T16>
__device__ __forceinline__ void prep2_kg(float* ws, const WsLayout<KP>& WL, bool half, const uint16_t* Ks,
                                         const float* Ck, int i0, int i1, int gtid, int nthr) {
  constexpr int LDH = KP + 8;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  for (int it = i0 + gtid; it < i1; it += nthr) {
    const int ln = it & 31, tile = it >> 5;
    const int c0 = (tile / (kChunk / 8)) * kSub + (ln >> 2), t0 = (tile % (kChunk / 8)) * 8 + (ln & 3);
    const float d0 = Ck[t0], d1 = Ck[t0 + 4];
    ws_put_frag(ws + WL.kg, it, half,
                make_float4(d0 * f16(Ks[t0 * LDH + c0]), d0 * f16(Ks[t0 * LDH + c0 + 8]),
                            d1 * f16(Ks[(t0 + 4) * LDH + c0]), d1 * f16(Ks[(t0 + 4) * LDH + c0 + 8])));
  }
}

// T's row blocks a over the column blocks 0..a (all S5 reads) rounded to tf32 in place, once, after S4 (the 3xTF32
// products of S3 / S4 need T in fp32): the value prep_w_u0 converts T's A fragments to at every use.
// Groups of 4 columns (16-byte accesses; rows of kPrepLDA floats are 16-byte aligned, no group straddles a block).
__device__ __forceinline__ void prep2_round_t(float* Ts, int tid) {
  for (int i = tid; i < kChunk * (kChunk / 4); i += kGdnThreads) {
    const int r = i / (kChunk / 4), c = (i % (kChunk / 4)) * 4;
    if (c < (r / kSub + 1) * kSub) {
      float4* x = reinterpret_cast<float4*>(Ts + r * kPrepLDA + c);
      float4 v = *x;
      v.x = __uint_as_float(to_tf32_fast(v.x));
      v.y = __uint_as_float(to_tf32_fast(v.y));
      v.z = __uint_as_float(to_tf32_fast(v.z));
      v.w = __uint_as_float(to_tf32_fast(v.w));
      *x = v;
    }
  }
}

// S5: w = T (K e^G) (fragment order) and u0 = T V (row-major), tf32 m16n8k8, the products of prep_w_u0 (same
// operands, the same rounding to tf32 -- T's done once by prep2_round_t --, the same order) in pairs of 8-column
// jobs (j0, j0 + 1) per warp. The w jobs come first and number KP / 8 (even), so a pair never mixes w and u0; an
// odd last u0 job computes a discarded partner from staged (zero or in-bounds) columns. V > 128 restages the next
// 128 columns of v between block barriers.
// WB (scan7, KDA_CUDA_CHUNK_SCAN=10 / 11): w as bf16 in the fragment order of the bf16 sections (ws_put_frag), in the
// first half of its fp32 section (delta_chunk_scan7.cuh); u0 and the products as before.
// X[t][c] = xw(t, c) (fp32; GDN: k_t e^{G_t}, KDA's FAST instance: its X table in shared memory).
template <int KP, typename T16, bool WB = false, typename XW>
__device__ __forceinline__ void prep2_w_u0_x(const ChunkFwdParams& p, float* ws, const WsLayout<KP>& WL,
                                             const float* Ts, uint16_t* Vs, const uint16_t* vg, int L, bool vec_v,
                                             int tid, XW xw) {
  constexpr int LDA = kPrepLDA, LDV = kPrepLDV;
  constexpr int ntw = KP / 8;
  static_assert(ntw % 2 == 0, "w jobs come in pairs");
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int V = p.V;
  const bool v2 = (V & 1) == 0;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  // this lane's ldmatrix row: matrix (lane / 8) = {rows 0-7 | 8-15} x {words 0-3 | 4-7} of a 16x8 A tile
  const uint32_t ta = static_cast<uint32_t>(__cvta_generic_to_shared(
      Ts + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LDA + 4 * (lane >> 4)));
  for (int v0 = 0; v0 < V; v0 += kGdnVB) {
    if (v0 > 0) {  // V > 128: the next block of v
      __syncthreads();
      gdn_stage<kGdnVB>(Vs, LDV, vg + v0, static_cast<int64_t>(p.HV) * V, L, min(V - v0, kGdnVB), vec_v, tid);
      gdn_cp_async_wait_all();
      __syncthreads();
    }
    const int ntv = (min(V - v0, kGdnVB) + 7) / 8;
    const int nw = v0 == 0 ? ntw : 0;
    const int njob = nw + ntv;
    for (int pj = warp; 2 * pj < njob; pj += kGdnThreads / 32) {
      const int j0 = 2 * pj;
      const bool two = j0 + 1 < njob;
      const bool isw = j0 < nw;
      const int n0 = (isw ? j0 : j0 - nw) * 8;
      uint32_t b[2][kChunk / 8][2];
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int s = 0; s < kChunk / 8; ++s)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int t = s * 8 + t4 + 4 * hh, c = n0 + 8 * jj + gq;
            b[jj][s][hh] = to_tf32_fast(isw ? xw(t, c) : f16(Vs[t * LDV + c]));
          }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        float acc[2][4];
        zero_acc(acc);
#pragma unroll
        for (int s = 0; s < kChunk / 8; ++s) {
          if (s < 2 * a + 2) {
            uint32_t a0, a1, a2, a3;  // T, already rounded to tf32 (prep2_round_t)
            ldsm_x4(ta + 4u * static_cast<uint32_t>(a * kSub * LDA + s * 8), a0, a1, a2, a3);
            mma_tf32_raw(acc[0], a0, a1, a2, a3, b[0][s][0], b[0][s][1]);
            mma_tf32_raw(acc[1], a0, a1, a2, a3, b[1][s][0], b[1][s][1]);
          }
        }
        if (isw) {
          if constexpr (WB) {
            ws_put_frag(ws + WL.w, (a * ntw + j0) * 32 + lane, true, acc_to_afrag(acc[0], lane));
            ws_put_frag(ws + WL.w, (a * ntw + j0 + 1) * 32 + lane, true, acc_to_afrag(acc[1], lane));
          } else {
            float4* wf = reinterpret_cast<float4*>(ws + WL.w);
            wf[(a * ntw + j0) * 32 + lane] = acc_to_afrag(acc[0], lane);
            wf[(a * ntw + j0 + 1) * 32 + lane] = acc_to_afrag(acc[1], lane);  // ntw even: j0 + 1 < ntw
          }
        } else {
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            if (jj == 1 && !two) break;
            const int c = v0 + n0 + 8 * jj + 2 * t4;
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              float* dst = ws + WL.u + static_cast<int64_t>(a * kSub + gq + 8 * hr) * V + c;
              if (v2) {  // V even: c even, so c < V means c + 1 < V, and dst is 8-byte aligned
                if (c < V) *reinterpret_cast<float2*>(dst) = make_float2(acc[jj][2 * hr], acc[jj][2 * hr + 1]);
              } else {
                if (c < V) dst[0] = acc[jj][2 * hr];
                if (c + 1 < V) dst[1] = acc[jj][2 * hr + 1];
              }
            }
          }
        }
      }
    }
  }
}

template <int KP, typename T16, bool WB = false>
__device__ __forceinline__ void prep2_w_u0(const ChunkFwdParams& p, float* ws, const WsLayout<KP>& WL, const float* Ts,
                                           uint16_t* Vs, const uint16_t* Ks, const float* Ea, const uint16_t* vg,
                                           int L, bool vec_v, int tid) {
  constexpr int LDH = KP + 8;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  prep2_w_u0_x<KP, T16, WB>(p, ws, WL, Ts, Vs, vg, L, vec_v, tid,
                            [&](int t, int c) { return f16(Ks[t * LDH + c]) * Ea[t]; });
}

// S1 of the GDN preps v2 / v3, one lower tile (a, nt): the raw products Q K^T and K K^T (m16n8k16, fragments by
// ldmatrix: A -- q or k rows 16a..16a+15 -- one x4 per k-step, lanes 8i..8i+7 addressing rows (i & 1) * 8 +
// (lane & 7) at half offset 8 (i >> 1); B -- k rows 8nt..8nt+7 -- one x4 per two k-steps, matrix i at half offset
// 8 i). qs_a / ks_a: Qs / Ks as shared addresses; LDH their 16-bit row stride.
template <int KP, int LDH, typename T16>
__device__ __forceinline__ void gdn_s1_products(uint32_t qs_a, uint32_t ks_a, int a, int nt, int lane, float (&cq)[4],
                                                float (&ckk)[4]) {
  const uint32_t arow = static_cast<uint32_t>((((lane & 7) + 8 * ((lane >> 3) & 1)) * LDH + 8 * (lane >> 4)) * 2);
  const uint32_t brow = static_cast<uint32_t>(((lane & 7) * LDH + 8 * (lane >> 3)) * 2);
#pragma unroll
  for (int e = 0; e < 4; ++e) cq[e] = ckk[e] = 0.f;
  const uint32_t qa = qs_a + static_cast<uint32_t>(a * kSub * LDH * 2) + arow;
  const uint32_t ka = ks_a + static_cast<uint32_t>(a * kSub * LDH * 2) + arow;
  const uint32_t kb = ks_a + static_cast<uint32_t>(nt * 8 * LDH * 2) + brow;
#pragma unroll
  for (int s2 = 0; s2 < KP / 32; ++s2) {
    uint32_t b[4];
    ldsm_x4(kb + 64u * s2, b[0], b[1], b[2], b[3]);  // k-steps 2 s2 (b[0], b[1]) and 2 s2 + 1 (b[2], b[3])
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t off = 32u * (2 * s2 + h);  // 16 halfs per k-step
      uint32_t q0, q1, q2, q3, k0, k1, k2, k3;
      ldsm_x4(qa + off, q0, q1, q2, q3);
      ldsm_x4(ka + off, k0, k1, k2, k3);
      mma16<T16>(cq, q0, q1, q2, q3, b[2 * h], b[2 * h + 1]);
      mma16<T16>(ckk, k0, k1, k2, k3, b[2 * h], b[2 * h + 1]);
    }
  }
}

// S1's per-element factors of one head on tile (a, nt): A~_qk = scale (Q K^T) e^{G_t - G_j} beta_j for j <= t (0
// above), A_kk Diag(beta) = (K K^T) e^{G_t - G_j} beta_j for j < t (0 on and above the diagonal).
__device__ __forceinline__ void gdn_s1_factors(const float (&cq)[4], const float (&ckk)[4], int a, int nt, int gq,
                                               int t4, const float2* Gh, const float* Bs, float scale, float (&vq)[4],
                                               float (&vk)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = a * kSub + gq + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
    const float f = j <= t ? __expf(hi_lo_diff(Gh[t], Gh[j])) : 0.f;
    const float fb = f * Bs[j];
    vq[e] = scale * (cq[e] * fb);
    vk[e] = j < t ? ckk[e] * fb : 0.f;
  }
}

template <int KP, typename T16, bool WB = false>
__global__ void __launch_bounds__(kGdnThreads, 3) gdn_chunk_prep2_kernel(const ChunkFwdParams p) {
  using SM = GdnPrep2Smem<KP>;
  constexpr int LDH = SM::LDH, LDV = SM::LDV, LDA = SM::LDA;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::qv);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::qv);  // v over q's tile from S3 on
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::ks);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Ts = reinterpret_cast<float*>(smem + SM::ts);
  float2* Gh = reinterpret_cast<float2*>(smem + SM::gh);
  float* Ea = reinterpret_cast<float*>(smem + SM::ea);
  float* Ck = reinterpret_cast<float*>(smem + SM::ck);
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

  // ---- S0: q, k -> shared memory (cp.async); gates on warp 0 (as gdn_chunk_prep_kernel)
  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + (tok0 * p.H + h) * K;
  const uint16_t* kg = static_cast<const uint16_t*>(p.k) + (tok0 * p.H + h) * K;
  const uint16_t* vg = static_cast<const uint16_t*>(p.v) + (tok0 * HV + hv) * V;
  const bool vec_qk = (K % 8) == 0 && ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k)) & 15) == 0;
  const bool vec_v = (V % 8) == 0 && (reinterpret_cast<uintptr_t>(p.v) & 15) == 0;
  gdn_stage<KP>(Qs, LDH, qg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  gdn_stage<KP>(Ks, LDH, kg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  if (warp == 0) {
    const int t0 = 2 * lane;
    const GdnGatePrefix gp = gdn_gate_prefix(p.g, p.beta, tok0, L, HV, hv, lane, Gh, Ea);
    const float b0 = gp.b0, b1 = gp.b1;
    const double G0 = gp.G0, G1 = gp.G1, Gl = gp.Gl;
    Ck[t0] = b0 * __expf(static_cast<float>(Gl - G0));
    Ck[t0 + 1] = b1 * __expf(static_cast<float>(Gl - G1));
    Bs[t0] = b0;
    Bs[t0 + 1] = b1;
    const float dec = __expf(static_cast<float>(Gl));
    for (int c = lane; c < KP; c += 32) ws[WL.decay + c] = dec;
  }
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S1: the 20 lower tiles of Q K^T and K K^T (m16n8k16, gdn_s1_products), decay and beta per element
  //      (gdn_s1_factors); upper A~ tiles = 0.
  {
    const uint32_t qs_a = static_cast<uint32_t>(__cvta_generic_to_shared(Qs));
    const uint32_t ks_a = static_cast<uint32_t>(__cvta_generic_to_shared(Ks));
    for (int job = warp; job < 20; job += kGdnThreads / 32) {
      int a, nt;
      lower_tile(job, a, nt);
      float cq[4], ckk[4], vq[4], vk[4];
      gdn_s1_products<KP, LDH, T16>(qs_a, ks_a, a, nt, lane, cq, ckk);
      gdn_s1_factors(cq, ckk, a, nt, gq, t4, Gh, Bs, p.scale, vq, vk);
      float* Ar = Ab + (a * kSub + gq) * LDA + nt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(Ar) = make_float2(vk[0], vk[1]);
      *reinterpret_cast<float2*>(Ar + 8 * LDA) = make_float2(vk[2], vk[3]);
      ws_put_frag(ws + WL.aqk, (a * (kChunk / 8) + nt) * 32 + lane, half, acc_to_afrag(vq, lane));
    }
    for (int i = tid; i < 12 * 32; i += kGdnThreads) {  // tiles (0, 2..7), (1, 4..7), (2, 6..7)
      const int z = i >> 5;
      const int a = z < 6 ? 0 : (z < 10 ? 1 : 2);
      const int nt = z < 6 ? 2 + z : (z < 10 ? z - 2 : z - 4);
      ws_put_frag(ws + WL.aqk, (a * (kChunk / 8) + nt) * 32 + (i & 31), half, make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
  __syncthreads();

  // ---- S2: warps 0-3: diagonal blocks of T (lanes 0-15, one column each); warps 4-7: q~ = scale q e^G
  prep_inverse_diag(Ab, Ts, warp, lane);
  if (warp >= 4) {
    constexpr int NQ = 4 * (KP / 8) * 32;
    for (int it = tid - 128; it < NQ; it += 128) {
      const int ln = it & 31, tile = it >> 5;
      const int r0 = (tile / (KP / 8)) * kSub + (ln >> 2), c0 = (tile % (KP / 8)) * 8 + (ln & 3);
      const float e0 = p.scale * Ea[r0], e1 = p.scale * Ea[r0 + 8];
      ws_put_frag(ws + WL.qg, it, half,
                  make_float4(e0 * f16(Qs[r0 * LDH + c0]), e1 * f16(Qs[(r0 + 8) * LDH + c0]),
                              e0 * f16(Qs[r0 * LDH + c0 + 4]), e1 * f16(Qs[(r0 + 8) * LDH + c0 + 4])));
    }
  }
  __syncthreads();

  // ---- S3: v -> q's tile (cp.async, lands behind S3 / S4); warps 0-1: T_10, T_32; warps 2-7: first half of k~^T
  gdn_stage<kGdnVB>(Vs, LDV, vg, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
  constexpr int NK = (KP / 16) * (kChunk / 8) * 32;
  prep2_inverse_sub1(Ab, Ts, Ab, warp, gq, t4);
  if (warp >= 2) prep2_kg<KP, T16>(ws, WL, half, Ks, Ck, 0, NK / 2, tid - 64, kGdnThreads - 64);
  __syncthreads();

  // ---- S4: warps 0-1: the lower-left 32x32 of T; warps 2-7: second half of k~^T
  prep2_inverse_sub2(Ab, Ts, Ab, warp, gq, t4);
  if (warp >= 2) prep2_kg<KP, T16>(ws, WL, half, Ks, Ck, NK / 2, NK, tid - 64, kGdnThreads - 64);
  gdn_cp_async_wait_all();
  __syncthreads();
  prep2_round_t(Ts, tid);
  __syncthreads();

  // ---- S5: w = T (K e^G) (fragment order), u0 = T V (row-major); V in blocks of 128 columns
  prep2_w_u0<KP, T16, WB>(p, ws, WL, Ts, Vs, Ks, Ea, vg, L, vec_v, tid);
}

}  // namespace cuda
}  // namespace kda_kernels
