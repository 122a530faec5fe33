// Pieces of the GDN prep kernels (scalar gate per token and value head), bf16/fp16 inputs: the forward's
// gdn_chunk_prep2_kernel (gdn_chunk_prep2.cuh, the default since session 10) and the backward's prep3_gdn_kernel
// (delta_chunk_bwd_prep.cuh) follow the phases below; KDA's preps (kda_chunk_prep2.cuh, the backward's
// delta_chunk_bwd_prep4.cuh) share the staging, the blocked inverse and w / u0. The kernel these were first written
// for, the forward's v1 gdn_chunk_prep_kernel (session 4, 88 KB of shared memory, two blocks per SM: 0.297 ms
// against v2's 0.227 at B1 T8192 H16 HV32 K=V=128 on the H200), was retired in session 11 (KDA_CUDA_GDN_PREP=1,
// refused; docs/cuda.md, "Retired kernels"); its shared-memory layout GdnPrepSmem stays: prep3_gdn uses it.
// The preps write exactly the workspace delta_chunk_prep_kernel<PC=false> writes (WsLayout: w, q~, k~^T, A~, decay,
// u0; same sections, fragment order and bf16/fp32 choice), so the scans read either. fp32 inputs keep the generic
// prep kernel (3xTF32 everywhere).
//
// With a scalar gate the decay of a pair (t, j), j <= t, is the scalar e^{G_t - G_j} (G the chunk prefix of the
// gate, a double prefix sum kept as hi + lo floats, so the exponent is a direct sum of the gates in between and
// every factor is <= 1: gates of -1e4 give 0, never inf/NaN), and every product is a plain matrix product:
//   S0  cp.async of q, k (and v) into 16-bit shared tiles (gdn_stage; zero padded: rows >= L, columns >= K / V);
//       warp 0 meanwhile: gates and beta, the double prefix scan (gdn_gate_prefix), e^{G_t},
//       beta_t e^{G_last - G_t}, decay = e^{G_last}.
//  S1  Q K^T and K K^T on tensor cores (mma16: m16n8k16, bf16 or f16 in, fp32 accumulation), the 20 16x8 tiles
//       on or below the diagonal (lower_tile), both products per tile; the decay and beta_j applied per element
//       in fp32: scale A_qk Diag(beta) -> workspace (the accumulator rearranged to fragment order by shuffles,
//       acc_to_afrag), A_kk Diag(beta) (strictly lower) -> shared memory. The 12 upper tiles of A~ are zeros.
//  S2  warps 0-3: the 16x16 diagonal blocks of T = (I + A_kk Diag(beta))^-1 (prep_inverse_diag: forward
//       substitution, fp32, one column per lane); warps 4-7: q~ = scale q e^G -> workspace.
//  S3  warps 0-1: T_10 and T_32 = -T_aa A_ab T_bb (prep_inverse_sub1, 3xTF32, about fp32); the others k~^T.
//  S4  warps 0-1: the lower-left 32x32 of T = -T_D (A_L T_U) (prep_inverse_sub2, 3xTF32), one 16-column block
//       each.
//  S5  w = T (K e^G), u0 = T V on tensor cores (tf32 m16n8k8, as the generic kernel; prep_w_u0): one warp per 8
//       output columns, row block a over the k-blocks 0..a only; w rearranged to fragment order, u0 row-major.
#pragma once

#include <type_traits>

#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kGdnThreads = 256;
constexpr int kGdnVB = 128;  // columns of V per u0 pass
constexpr int kPrepLDA = kChunk + 4;  // fp32 row stride of Ab and T (conflict-free A fragments)
constexpr int kPrepLDY = 24;          // fp32 row stride of the 16x16 scratch blocks (conflict-free B fragments)
constexpr int kPrepLDV = kGdnVB + 8;  // 16-bit row stride of the staged v

template <int KP>
struct GdnPrepSmem {
  static constexpr int LDH = KP + 8;      // 16-bit row stride of q / k (LDH / 2 = 4 mod 32 words: conflict-free)
  static constexpr int LDV = kPrepLDV;
  static constexpr int LDA = kPrepLDA;
  static constexpr int LDY = kPrepLDY;
  static constexpr size_t qs = 0;
  static constexpr size_t ks = qs + 2 * kChunk * LDH;
  static constexpr size_t vs = ks + 2 * kChunk * LDH;
  static constexpr size_t ab = vs + 2 * kChunk * LDV;
  static constexpr size_t ts = ab + 4 * kChunk * LDA;
  static constexpr size_t gh = ts + 4 * kChunk * LDA;  // float2 (hi, lo) of the double prefix G_t
  static constexpr size_t ea = gh + 8 * kChunk;        // e^{G_t}
  static constexpr size_t ck = ea + 4 * kChunk;        // beta_t e^{G_last - G_t}
  static constexpr size_t bs = ck + 4 * kChunk;        // beta_t
  static constexpr size_t bytes = bs + 4 * kChunk;
  static_assert(4 * 16 * LDY * 4 <= 2 * kChunk * LDH, "the S3/S4 scratch blocks live in the q tile");
  static_assert(qs % 16 == 0 && ks % 16 == 0 && vs % 16 == 0 && ab % 16 == 0 && ts % 16 == 0 && gh % 16 == 0,
                "16-byte aligned sections");
};

__device__ __forceinline__ void gdn_cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void gdn_cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

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

// c += a * b on one 16x8x16 tile, 16-bit inputs (bf16 or f16), fp32 accumulation.
template <typename T16>
__device__ __forceinline__ void mma16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T16, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// A warp's 16x8 accumulator tile (c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1); g = lane / 4,
// t = lane % 4) as the m16n8k8 A fragment of the same tile ({(g, t), (g+8, t), (g, t+4), (g+8, t+4)}): the
// workspace's fragment order (frag_index). Element (r, c) sits in lane 4 (r & 7) + c / 2, register
// (c & 1) + 2 (r >= 8).
__device__ __forceinline__ float4 acc_to_afrag(const float (&c)[4], int lane) {
  const int s1 = (lane & ~3) | ((lane & 3) >> 1), s2 = s1 + 2;
  const bool odd = lane & 1;
  const float x0 = __shfl_sync(0xffffffffu, c[0], s1), x1 = __shfl_sync(0xffffffffu, c[1], s1);
  const float y0 = __shfl_sync(0xffffffffu, c[2], s1), y1 = __shfl_sync(0xffffffffu, c[3], s1);
  const float z0 = __shfl_sync(0xffffffffu, c[0], s2), z1 = __shfl_sync(0xffffffffu, c[1], s2);
  const float w0 = __shfl_sync(0xffffffffu, c[2], s2), w1 = __shfl_sync(0xffffffffu, c[3], s2);
  return make_float4(odd ? x1 : x0, odd ? y1 : y0, odd ? z1 : z0, odd ? w1 : w0);
}

// Store tile-lane i of a workspace section in fragment order: one uint2 of 4 bf16 (half) or one float4.
__device__ __forceinline__ void ws_put_frag(float* sec, int i, bool half, float4 a) {
  if (half) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(a.x, a.y), hi = __floats2bfloat162_rn(a.z, a.w);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t*>(&lo);
    u.y = *reinterpret_cast<const uint32_t*>(&hi);
    reinterpret_cast<uint2*>(sec)[i] = u;
  } else {
    reinterpret_cast<float4*>(sec)[i] = a;
  }
}

// Rows [0, 64) x columns [0, W) of a 16-bit shared tile (row stride ld) from src (row t at src + t * rs), zero
// outside rows < L and columns < ncol. vec: 16-byte cp.async (src 16-byte aligned, rs and ncol multiples of 8);
// otherwise element loads.
template <int W>
__device__ __forceinline__ void gdn_stage(uint16_t* dst, int ld, const uint16_t* src, int64_t rs, int L, int ncol,
                                          bool vec, int tid) {
  if (vec) {
    constexpr int CPR = W / 8;
#pragma unroll 4
    for (int i = tid; i < kChunk * CPR; i += kGdnThreads) {
      const int t = i / CPR, c = (i % CPR) * 8;
      const bool ok = t < L && c < ncol;
      gdn_cp_async16(dst + t * ld + c, ok ? src + t * rs + c : src, ok);
    }
  } else {
    for (int i = tid; i < kChunk * W; i += kGdnThreads) {
      const int t = i / W, c = i % W;
      dst[t * ld + c] = (t < L && c < ncol) ? src[t * rs + c] : static_cast<uint16_t>(0);
    }
  }
}

// Warp 0 of a GDN prep block (forward v2, the backward's prep3_gdn): the chunk's per-head gate prefix. Lane l
// takes tokens t0 = 2l and t0 + 1 (gate and beta 0 at and past L), scans the gates in double (G_t inclusive;
// G_last = G_63, the padding adds 0), and writes Gh[t] (the prefix as hi / lo floats) and Ea[t] = e^{G_t} for both
// tokens. Returns the lane's betas and G_t0, G_t0+1, G_last for the caller's own tables.
// The double prefix scan itself, on one warp (also the backward's grad3_gdn, delta_chunk_bwd_grad3_gdn.cuh): lane
// l holds the gates g0, g1 of tokens 2l, 2l + 1 (0 at and past the chunk's end); returns G_2l, G_2l+1 (inclusive
// prefixes, summed in double in this order) and G_last = G_63 in G0, G1, Gl.
__device__ __forceinline__ void gate_prefix_warp(float g0, float g1, int lane, double& G0, double& G1, double& Gl) {
  double s = static_cast<double>(g0) + static_cast<double>(g1);
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const double o = __shfl_up_sync(0xffffffffu, s, d);
    if (lane >= d) s += o;
  }
  double ex = __shfl_up_sync(0xffffffffu, s, 1);
  if (lane == 0) ex = 0.0;
  G0 = ex + static_cast<double>(g0);
  G1 = G0 + static_cast<double>(g1);
  Gl = __shfl_sync(0xffffffffu, G1, 31);
}
struct GdnGatePrefix {
  float b0, b1;
  double G0, G1, Gl;
};
__device__ __forceinline__ GdnGatePrefix gdn_gate_prefix(const float* g, const float* beta, int64_t tok0, int L,
                                                         int HV, int hv, int lane, float2* Gh, float* Ea) {
  const int t0 = 2 * lane;
  float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f;
  if (t0 < L) {
    g0 = __ldg(g + (tok0 + t0) * HV + hv);
    b0 = __ldg(beta + (tok0 + t0) * HV + hv);
  }
  if (t0 + 1 < L) {
    g1 = __ldg(g + (tok0 + t0 + 1) * HV + hv);
    b1 = __ldg(beta + (tok0 + t0 + 1) * HV + hv);
  }
  double G0, G1, Gl;
  gate_prefix_warp(g0, g1, lane, G0, G1, Gl);
  Gh[t0] = split_hi_lo(G0);
  Gh[t0 + 1] = split_hi_lo(G1);
  Ea[t0] = __expf(static_cast<float>(G0));
  Ea[t0 + 1] = __expf(static_cast<float>(G1));
  return {b0, b1, G0, G1, Gl};
}

// acc[nt] += A (16x16, row stride lda) * B (16x16, row stride ldb) on one warp, 3xTF32 (about fp32).
__device__ __forceinline__ void warp_mm16(float (&acc)[2][4], const float* A, int lda, const float* B, int ldb,
                                          int gq, int t4) {
#pragma unroll
  for (int k0 = 0; k0 < 16; k0 += 8) {
    const float4 af = make_float4(A[gq * lda + k0 + t4], A[(gq + 8) * lda + k0 + t4], A[gq * lda + k0 + t4 + 4],
                                  A[(gq + 8) * lda + k0 + t4 + 4]);
    mma_row_tiles<true, 2>(acc, af, B, ldb, k0, t4, gq);
  }
}

// Store sign * acc (a warp's 16x16 block, two 16x8 tiles) row-major at D (row stride ld).
__device__ __forceinline__ void warp_store16(float* D, int ld, const float (&acc)[2][4], float sign, int gq, int t4) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) D[(gq + (e >> 1) * 8) * ld + nt * 8 + 2 * t4 + (e & 1)] = sign * acc[nt][e];
}

__device__ __forceinline__ void zero_acc(float (&acc)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
}

// Row block a and 8-column tile nt of the 20 tiles on or below the diagonal of a 64x64 matrix (row block a has
// the tiles 0 .. 2a+1; job numbers a (a+1) ..).
__device__ __forceinline__ void lower_tile(int job, int& a, int& nt) {
  a = job < 2 ? 0 : (job < 6 ? 1 : (job < 12 ? 2 : 3));
  nt = job - a * (a + 1);
}

// ---- Pieces shared by the GDN and the KDA prep kernels (kda_chunk_prep2.cuh): the blocked inverse
// T = (I + A_kk Diag(beta))^-1 from Ab = A_kk Diag(beta) (strictly lower, fp32, row stride kPrepLDA), and
// w = T X, u0 = T V. Every thread of the block calls each of them.

// Warps 0-3 (lanes 0-15, one column each): the 16x16 diagonal blocks T_aa = Ab_aa^-1 by forward substitution
// (fp32), upper triangle zero.
__device__ __forceinline__ void prep_inverse_diag(const float* Ab, float* Ts, int warp, int lane) {
  constexpr int LDA = kPrepLDA;
  if (warp < 4 && lane < kSub) {
    const int a = warp, j = lane;
    const float* Bd = Ab + a * kSub * LDA + a * kSub;
    float x[kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i) {
      float s = (i == j) ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) s = fmaf(-Bd[i * LDA + m], x[m], s);
      x[i] = (i < j) ? 0.f : s;
    }
    float* Td = Ts + a * kSub * LDA + a * kSub + j;
#pragma unroll
    for (int i = 0; i < kSub; ++i) Td[i * LDA] = x[i];
  }
}

// Warps 0-1: T_10, T_32 = -T_aa Ab_ab T_bb (3xTF32); Scr: 4 blocks of 16 x kPrepLDY floats.
__device__ __forceinline__ void prep_inverse_sub1(const float* Ab, float* Ts, float* Scr, int warp, int gq, int t4) {
  constexpr int LDA = kPrepLDA, LDY = kPrepLDY;
  if (warp < 2) {
    const int a = warp == 0 ? 1 : 3, b = a - 1;
    float* Y = Scr + warp * (2 * kSub * LDY);
    float acc[2][4];
    zero_acc(acc);
    warp_mm16(acc, Ab + a * kSub * LDA + b * kSub, LDA, Ts + b * kSub * LDA + b * kSub, LDA, gq, t4);
    warp_store16(Y, LDY, acc, 1.f, gq, t4);
    __syncwarp();
    zero_acc(acc);
    warp_mm16(acc, Ts + a * kSub * LDA + a * kSub, LDA, Y, LDY, gq, t4);
    warp_store16(Ts + a * kSub * LDA + b * kSub, LDA, acc, -1.f, gq, t4);
  }
}

// Warps 0-1 (b = warp): Y_ab = sum_{c=b}^{1} Ab_ac T_cb (a = 2, 3); T_2b = -T_22 Y_2b, T_3b = -(T_32 Y_2b +
// T_33 Y_3b) (3xTF32).
__device__ __forceinline__ void prep_inverse_sub2(const float* Ab, float* Ts, float* Scr, int warp, int gq, int t4) {
  constexpr int LDA = kPrepLDA, LDY = kPrepLDY;
  if (warp < 2) {
    const int b = warp;
    float* Y2 = Scr + warp * (2 * kSub * LDY);
    float* Y3 = Y2 + kSub * LDY;
    float acc2[2][4], acc3[2][4];
    zero_acc(acc2);
    zero_acc(acc3);
    for (int c = b; c < 2; ++c) {
      const float* Tcb = Ts + c * kSub * LDA + b * kSub;
      warp_mm16(acc2, Ab + 2 * kSub * LDA + c * kSub, LDA, Tcb, LDA, gq, t4);
      warp_mm16(acc3, Ab + 3 * kSub * LDA + c * kSub, LDA, Tcb, LDA, gq, t4);
    }
    warp_store16(Y2, LDY, acc2, 1.f, gq, t4);
    warp_store16(Y3, LDY, acc3, 1.f, gq, t4);
    __syncwarp();
    zero_acc(acc2);
    zero_acc(acc3);
    warp_mm16(acc2, Ts + 2 * kSub * LDA + 2 * kSub, LDA, Y2, LDY, gq, t4);
    warp_mm16(acc3, Ts + 3 * kSub * LDA + 2 * kSub, LDA, Y2, LDY, gq, t4);
    warp_mm16(acc3, Ts + 3 * kSub * LDA + 3 * kSub, LDA, Y3, LDY, gq, t4);
    warp_store16(Ts + 2 * kSub * LDA + b * kSub, LDA, acc2, -1.f, gq, t4);
    warp_store16(Ts + 3 * kSub * LDA + b * kSub, LDA, acc3, -1.f, gq, t4);
  }
}

// w = T X (fragment order; X[t][c] = xw(t, c), fp32) and u0 = T V (row-major), tf32 m16n8k8: one warp per 8
// output columns, row block a over the k-blocks 0..a only. Vs (row stride kPrepLDV) holds v's columns [0, 128) on
// entry; V > 128 restages the next 128 columns from vg (row t at vg + t * HV * V) between block barriers, so every
// thread must call this.
// WB (scan7, KDA_CUDA_CHUNK_SCAN=10 / 11): w as bf16 in the fragment order of the bf16 sections (ws_put_frag), in
// the first half of its fp32 section (delta_chunk_scan7.cuh); u0 and the products as before.
template <int KP, typename T16, bool WB = false, typename XW>
__device__ __forceinline__ void prep_w_u0(const ChunkFwdParams& p, float* ws, const WsLayout<KP>& WL, const float* Ts,
                                          uint16_t* Vs, const uint16_t* vg, int L, bool vec_v, int tid, XW xw) {
  constexpr int LDA = kPrepLDA, LDV = kPrepLDV;
  const int lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int V = p.V;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  constexpr int ntw = KP / 8;
  for (int v0 = 0; v0 < V; v0 += kGdnVB) {
    if (v0 > 0) {  // V > 128: the next block of v (rare: the context-parallel transition's width K + V)
      __syncthreads();
      gdn_stage<kGdnVB>(Vs, LDV, vg + v0, static_cast<int64_t>(p.HV) * V, L, min(V - v0, kGdnVB), vec_v, tid);
      gdn_cp_async_wait_all();
      __syncthreads();
    }
    const int ntv = (min(V - v0, kGdnVB) + 7) / 8;
    const int nw = v0 == 0 ? ntw : 0;
    for (int job = warp; job < nw + ntv; job += kGdnThreads / 32) {
      const bool isw = job < nw;
      const int n0 = (isw ? job : job - nw) * 8;
      float b[kChunk / 8][2];
#pragma unroll
      for (int s = 0; s < kChunk / 8; ++s)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int t = s * 8 + t4 + 4 * hh;
          b[s][hh] = isw ? xw(t, n0 + gq) : f16(Vs[t * LDV + n0 + gq]);
        }
      float acc[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = 0.f;
        const float* Ta = Ts + (a * kSub + gq) * LDA + t4;
#pragma unroll
        for (int s = 0; s < kChunk / 8; ++s) {
          if (s < 2 * a + 2) {
            const float4 af = make_float4(Ta[s * 8], Ta[8 * LDA + s * 8], Ta[s * 8 + 4], Ta[8 * LDA + s * 8 + 4]);
            mma8<false>(acc[a], af, b[s][0], b[s][1]);
          }
        }
      }
      if (isw) {
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          if constexpr (WB) ws_put_frag(ws + WL.w, (a * ntw + job) * 32 + lane, true, acc_to_afrag(acc[a], lane));
          else reinterpret_cast<float4*>(ws + WL.w)[(a * ntw + job) * 32 + lane] = acc_to_afrag(acc[a], lane);
        }
      } else {
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = a * kSub + gq + (e >> 1) * 8, c = v0 + n0 + 2 * t4 + (e & 1);
            if (c < V) ws[WL.u + static_cast<int64_t>(r) * V + c] = acc[a][e];
          }
      }
    }
  }
}

}  // namespace cuda
}  // namespace kda_kernels
