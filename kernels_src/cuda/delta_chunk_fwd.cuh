// Chunked forward of the delta rule (chunk C = 64) for KDA (per-channel gate) and GDN (per-head gate) on tensor
// cores (mma.sync m16n8k8 tf32; 3xTF32 for fp32 inputs). Math: DESIGN.md section 3, mirrored from
// torch-ext/kda_kernels/fallback/chunk.py. Per chunk, with G the cumulative log decay from the chunk start:
//   A_kk[t,j] = sum_c k_t k_j e^{G_t - G_j} (j < t),  A_qk the same with q_t (j <= t)
//   M = I + A_kk Diag(beta);  w = M^-1 (K e^G);  u0 = M^-1 V
//   per chunk, carried state h:  U = u0 - w h;  o = scale (q e^G) h + scale A_qk Diag(beta) U;
//                                h <- Diag(e^{G_last}) h + (beta K e^{G_last - G})^T U
// Exact gates: e^{-G} is never formed. Pairs in one 16-token sub-chunk use e^{G_t - G_j} with the difference of
// double-precision prefix sums; pairs across sub-chunks factor through the token r just before t's sub-chunk:
// (x_t e^{G_t - G_r}) . (k_j e^{G_r - G_j}), both factors <= 1 for log decays <= 0, each exponent a direct sum
// of the gates between the two tokens (no cancellation whatever the gate's size).
//
// Kernel 1 (delta_chunk_prep_kernel), one block per (chunk, value head): everything that does not depend on the
// carried state, written to a workspace in mma fragment order (one float4 per lane per 16x8 tile; q~, k~^T and A~
// as bf16, one uint2, for bf16/fp16 inputs: WsLayout).
// Kernel 2 (delta_chunk_scan_kernel), one block per (sequence, value head, BV columns of V): the sequential scan
// over the sequence's chunks with h (K x BV, fp32) held in registers (and a tf32 copy in shared memory).
// Warp-specialized scan on bf16 operands (delta_chunk_scan7.cuh, delta_chunk_scan7_kernel; the default where the
// workspace is bf16, V <= 256 and the GPU sm_90+, KDA_CUDA_CHUNK_SCAN=11): recurrence warps and output warps in one
// block, each chunk's operands brought into shared memory by bulk copies two chunks ahead. (Retired in session 12:
// the bulk-prefetch scan delta_chunk_scan3_kernel, the split forward delta_chunk_scan4 / delta_chunk_out, scan5 and
// scan6, the tf32 warp-specialized scans; docs/cuda.md.)
#pragma once

#include "delta_common.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kChunk = 64;
constexpr int kSub = 16;
constexpr int kPrepThreads = 256;
constexpr int kScanThreads = 128;

struct ChunkFwdParams {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const float* h0;  // [N, HV, K, V] or nullptr
  float* ht;        // [N, HV, K, V]
  void* o;          // [B, T, HV, V]
  const int64_t* cu_seqlens;
  const int* chunk_off;  // varlen: [N + 1] first global chunk of each sequence
  const int* chunk_seq;  // varlen: [max_chunks] sequence of each global chunk, -1 past the end
  int in_dtype;
  int B, T, H, HV, K, V, N;
  int nc_per_seq;  // fixed length: chunks per sequence
  int ws_bf16;     // qg, kgT, aqk stored as bf16 (WsLayout)
  float scale;
  // workspace, one slice per (global chunk, value head); see ws_* offsets in chunk_ws_floats
  float* ws;
  int64_t ws_stride;  // floats per (chunk, head)
  int scan;           // the scan (KDA_CUDA_CHUNK_SCAN, unset -> 11): 10 / 11 scan7 where it applies, 1 the single one
};

// Workspace slice of one (chunk, head), offsets in floats: w [64 x KP], qg [64 x KP], kgT [KP x 64], aqk [64 x 64]
// (fragment order), decay [KP], u0 [64 x V] (row-major). half (ws_bf16: bf16/fp16 inputs unless
// KDA_CUDA_CHUNK_WS_BF16=0): qg, kgT and aqk are stored as bf16 (same element index, half the bytes: one uint2 per
// lane per tile); w, u0 (they meet in U = u0 - w h, which can cancel) and decay stay fp32. Every section starts
// on a multiple of 64 floats.
template <int KP>
struct WsLayout {
  int64_t w, qg, kg, aqk, decay, u;
  __host__ __device__ explicit WsLayout(bool half) {
    const int d = half ? 2 : 1;
    w = 0;
    qg = w + kChunk * KP;
    kg = qg + kChunk * KP / d;
    aqk = kg + kChunk * KP / d;
    decay = aqk + kChunk * kChunk / d;
    u = decay + KP;
  }
  int64_t floats(int V) const { return u + static_cast<int64_t>(kChunk) * V; }
};

// Store one element of a workspace section that is bf16 when half (element index i, as in fp32).
__device__ __forceinline__ void ws_put(float* sec, int i, bool half, float x) {
  if (half) reinterpret_cast<__nv_bfloat16*>(sec)[i] = __float2bfloat16_rn(x);
  else sec[i] = x;
}

// Load the A fragment (a0, a1, a2, a3) of tile-lane i of a section written in frag_index order.
__device__ __forceinline__ float4 ws_frag(const float* sec, int i, bool half) {
  if (half) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(sec) + i);  // bf16 slots 0, 1 | 2, 3 (little endian)
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
  }
  return __ldg(reinterpret_cast<const float4*>(sec) + i);
}

// Index of element (r, c) of a row-major [R x KD] A operand stored as m16n8k8 fragments: tile (r/16, c/8) is
// 32 lanes x float4 {a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)}, g = lane / 4, t = lane % 4.
template <int KD>
__device__ __forceinline__ int frag_index(int r, int c) {
  const int rr = r & 15, cc = c & 7;
  const int lane = ((rr & 7) << 2) | (cc & 3);
  const int slot = (rr >> 3) | ((cc >> 2) << 1);
  return ((((r >> 4) * (KD / 8) + (c >> 3)) << 5) + lane) * 4 + slot;
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

// A double prefix sum kept as hi + lo floats (lo = the rounding error of hi): differences of two of them in
// float arithmetic, (a.hi - b.hi) + (a.lo - b.lo), are as good as the double difference rounded to float for the
// exponents used here (the hi difference is exact when the two are within a factor 2 -- the cancelling case --
// and otherwise has a relative error of one float ulp), without the 64-bit conversion (16/clk/SM) per pair.
__device__ __forceinline__ float2 split_hi_lo(double x) {
  const float hi = static_cast<float>(x);
  return make_float2(hi, static_cast<float>(x - static_cast<double>(hi)));
}
__device__ __forceinline__ float hi_lo_diff(float2 a, float2 b) { return (a.x - b.x) + (a.y - b.y); }

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32_raw(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += a * b on one 16x8x8 tile. PRECISE: 3xTF32 (a_hi b_lo + a_lo b_hi + a_hi b_hi), about fp32 accuracy.
template <bool PRECISE>
__device__ __forceinline__ void mma8(float* c, const float4& a, float b0, float b1) {
  const uint32_t ah0 = to_tf32(a.x), ah1 = to_tf32(a.y), ah2 = to_tf32(a.z), ah3 = to_tf32(a.w);
  const uint32_t bh0 = to_tf32(b0), bh1 = to_tf32(b1);
  if constexpr (PRECISE) {
    const uint32_t al0 = to_tf32(a.x - __uint_as_float(ah0)), al1 = to_tf32(a.y - __uint_as_float(ah1));
    const uint32_t al2 = to_tf32(a.z - __uint_as_float(ah2)), al3 = to_tf32(a.w - __uint_as_float(ah3));
    const uint32_t bl0 = to_tf32(b0 - __uint_as_float(bh0)), bl1 = to_tf32(b1 - __uint_as_float(bh1));
    mma_tf32_raw(c, al0, al1, al2, al3, bh0, bh1);
    mma_tf32_raw(c, ah0, ah1, ah2, ah3, bl0, bl1);
  }
  mma_tf32_raw(c, ah0, ah1, ah2, ah3, bh0, bh1);
}

// One k-step against every 8-column tile of a row-major shared-memory tile B (row stride ld):
// acc[nt] += a * B[k0 .. k0 + 8][8 nt .. 8 nt + 8], with a the 16 x 8 A fragment of this k-step.
template <bool PRECISE, int N8>
__device__ __forceinline__ void mma_row_tiles(float (&acc)[N8][4], const float4& a, const float* B, int ld, int k0,
                                              int t4, int gq) {
#pragma unroll
  for (int nt = 0; nt < N8; ++nt)
    mma8<PRECISE>(acc[nt], a, B[(k0 + t4) * ld + nt * 8 + gq], B[(k0 + t4 + 4) * ld + nt * 8 + gq]);
}

// Global chunk -> (sequence, first token, tokens in chunk). Returns false for a slot past the last chunk.
__device__ __forceinline__ bool chunk_coords(const ChunkFwdParams& p, int cid, int64_t& tok0, int& L) {
  int n, i;
  int64_t bos;
  int len;
  if (p.cu_seqlens != nullptr) {
    n = p.chunk_seq[cid];
    if (n < 0) return false;
    i = cid - p.chunk_off[n];
  } else {
    n = cid / p.nc_per_seq;
    i = cid - n * p.nc_per_seq;
  }
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);
  tok0 = bos + static_cast<int64_t>(i) * kChunk;
  L = min(kChunk, len - i * kChunk);
  return L > 0;
}

// Varlen: chunk_off[n] (prefix of ceil(len_n / 64)) and chunk_seq[chunk]; one block of 1024 threads.
static __global__ void __launch_bounds__(1024) delta_chunk_map_kernel(const int64_t* cu, int N, int max_chunks, int* off,
                                                               int* seq) {
  __shared__ int part[1024];
  const int tid = threadIdx.x;
  const int per = (N + 1023) / 1024;
  const int n0 = min(N, tid * per), n1 = min(N, n0 + per);
  int s = 0;
  for (int n = n0; n < n1; ++n) s += static_cast<int>((cu[n + 1] - cu[n] + kChunk - 1) / kChunk);
  part[tid] = s;
  __syncthreads();
  if (tid == 0) {
    int acc = 0;
    for (int i = 0; i < 1024; ++i) {
      const int x = part[i];
      part[i] = acc;
      acc += x;
    }
    off[N] = acc;
  }
  __syncthreads();
  int acc = part[tid];
  for (int n = n0; n < n1; ++n) {
    off[n] = acc;
    const int c = static_cast<int>((cu[n + 1] - cu[n] + kChunk - 1) / kChunk);
    for (int i = 0; i < c; ++i) seq[acc + i] = n;
    acc += c;
  }
  __syncthreads();
  const int total = off[N];
  for (int i = total + tid; i < max_chunks; i += 1024) seq[i] = -1;
}

constexpr size_t cmax(size_t a, size_t b) { return a > b ? a : b; }

template <int KP>
struct PrepSmem {
  static constexpr int LD = KP + 4;  // fp32 row stride of q/k/R tiles (conflict-free fragment reads)
  static constexpr int LDA = kChunk + 4;
  static constexpr size_t qs = 0;
  static constexpr size_t ks = qs + sizeof(float) * kChunk * LD;
  static constexpr int LDX = KP + 8;  // fp32 row stride of X = K e^G (conflict-free B-fragment reads)
  static constexpr int PDS = KP + 2;  // 8-byte row stride of P (even: 16-byte aligned channel pairs)
  // P [64][PDS] (hi/lo float pairs), later float R [96][LD], later float X [64][LDX]
  static constexpr size_t pr = ks + sizeof(float) * kChunk * LD;
  static constexpr size_t pr_bytes = cmax(cmax(sizeof(float2) * kChunk * PDS, sizeof(float) * 96 * LD),
                                          sizeof(float) * kChunk * LDX);
  static constexpr size_t aq = pr + pr_bytes;
  static constexpr size_t ak = aq + sizeof(float) * kChunk * LDA;
  static constexpr size_t gs = ak + sizeof(float) * kChunk * LDA;  // gates of the chunk [64][LD]
  static constexpr size_t bs = gs + sizeof(float) * kChunk * LD;
  // KDA: ea[a][c] = e^{G_{16a-1}} (ea[0] = 1); GDN: ea[t] = e^{G_t}
  static constexpr size_t ea = bs + sizeof(float) * kChunk;
  static constexpr size_t bytes = ea + sizeof(float) * 4 * KP;
};

template <bool PC, int KP, bool PRECISE>
__global__ void __launch_bounds__(kPrepThreads, 1) delta_chunk_prep_kernel(const ChunkFwdParams p) {
  using SM = PrepSmem<KP>;
  constexpr int LD = SM::LD, LDA = SM::LDA;
  extern __shared__ __align__(16) unsigned char smem[];
  float* Qs = reinterpret_cast<float*>(smem + SM::qs);
  float* Ks = reinterpret_cast<float*>(smem + SM::ks);
  float2* Pd = reinterpret_cast<float2*>(smem + SM::pr);  // double prefix sums as hi + lo floats
  float* Rs = reinterpret_cast<float*>(smem + SM::pr);
  float* Aq = reinterpret_cast<float*>(smem + SM::aq);
  float* Ak = reinterpret_cast<float*>(smem + SM::ak);
  float* gs = reinterpret_cast<float*>(smem + SM::gs);
  float* bs = reinterpret_cast<float*>(smem + SM::bs);
  float* Ea = reinterpret_cast<float*>(smem + SM::ea);
  constexpr int PDS = SM::PDS;

  const int cid = blockIdx.x, hv = blockIdx.y;
  int64_t tok0;
  int L;
  if (!chunk_coords(p, cid, tok0, L)) return;
  const int h = hv / (p.HV / p.H);
  const int K = p.K, V = p.V, HV = p.HV, dt = p.in_dtype;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  float* ws = p.ws + (static_cast<int64_t>(cid) * HV + hv) * p.ws_stride;
  const bool half = p.ws_bf16 != 0;
  const WsLayout<KP> WL(half);

  auto gate = [&](int t, int c) -> float { return gs[t * LD + c]; };

  // ---- P0: q, k, g (zero padded), beta; clear A. Typed loads, 16 elements of each in flight per thread before
  //      any shared store (the stores would otherwise order the generic loads one element at a time).
  auto stage = [&](const auto* qp, const auto* kp) {
    constexpr int kPer = kChunk * KP / kPrepThreads, kBatch = 16;
    static_assert(kPer % kBatch == 0, "P0 batches");
#pragma unroll 1
    for (int i0 = 0; i0 < kPer; i0 += kBatch) {
      float qv[kBatch], kv[kBatch], gv[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = tid + (i0 + u) * kPrepThreads;
        const int t = i / KP, c = i % KP;
        qv[u] = kv[u] = gv[u] = 0.f;
        if (t < L && c < K) {
          const int64_t off = ((tok0 + t) * p.H + h) * K + c;
          qv[u] = to_f32(qp[off]);
          kv[u] = to_f32(kp[off]);
          const int64_t row = (tok0 + t) * HV + hv;
          gv[u] = PC ? __ldg(p.g + row * K + c) : __ldg(p.g + row);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = tid + (i0 + u) * kPrepThreads;
        const int t = i / KP, c = i % KP;
        Qs[t * LD + c] = qv[u];
        Ks[t * LD + c] = kv[u];
        gs[t * LD + c] = gv[u];
      }
    }
  };
  if (dt == kBF16)
    stage(static_cast<const __nv_bfloat16*>(p.q), static_cast<const __nv_bfloat16*>(p.k));
  else if (dt == kF16)
    stage(static_cast<const __half*>(p.q), static_cast<const __half*>(p.k));
  else
    stage(static_cast<const float*>(p.q), static_cast<const float*>(p.k));
  for (int i = tid; i < kChunk * LDA; i += kPrepThreads) {
    Aq[i] = 0.f;
    Ak[i] = 0.f;
  }
  if (tid < kChunk) bs[tid] = tid < L ? p.beta[(tok0 + tid) * HV + hv] : 0.f;
  __syncthreads();

  // ---- P0a: per channel (double prefix sums): P = prefix within the sub-chunk, qg = scale q e^G,
  //      kg = beta k e^{G_last - G} (suffix sums), decay = e^{G_last}. Threads [0, KP) run the prefix sums,
  //      threads [KP, 2 KP) the suffix sums (kPrepThreads >= 2 KP).
  static_assert(kPrepThreads >= 2 * KP, "P0a needs two threads per channel");
  static_assert(kPrepThreads == 256, "P1 maps 4 sub-chunks x 8 row pairs x 8 channel groups onto the threads");
  if (tid < KP) {
    const int c = tid;
    double G = 0.0, P = 0.0;
    for (int t = 0; t < kChunk; ++t) {
      if ((t & (kSub - 1)) == 0) P = 0.0;
      const float gt = gate(t, c);
      G += gt;
      P += gt;
      Pd[t * PDS + c] = split_hi_lo(PC ? P : G);  // GDN: the chunk prefix G_t (column 0 is used)
      const float eG = __expf(static_cast<float>(G));
      ws_put(ws + WL.qg, frag_index<KP>(t, c), half, p.scale * Qs[t * LD + c] * eG);
      if constexpr (PC) {
        if (t == 0) Ea[c] = 1.f;
        if ((t & (kSub - 1)) == kSub - 1 && t + 1 < kChunk) Ea[((t >> 4) + 1) * KP + c] = eG;
      } else {
        if (c == 0) Ea[t] = eG;
      }
    }
    ws[WL.decay + c] = __expf(static_cast<float>(G));
  } else if (tid < 2 * KP) {
    const int c = tid - KP;
    double S = 0.0;
    for (int t = kChunk - 1; t >= 0; --t) {
      ws_put(ws + WL.kg, frag_index<kChunk>(c, t), half, bs[t] * Ks[t * LD + c] * __expf(static_cast<float>(S)));
      S += gate(t, c);
    }
  }
  __syncthreads();

  if constexpr (PC) {
  // ---- P1: pairs inside one 16-token sub-chunk, exact per-channel factors on CUDA cores. Thread = (sub-chunk
  //      a, row pair rp, channel group cg): rows t1 = 16a + rp (pairs j <= t1) and t2 = 16a + 15 - rp (pairs
  //      j <= t2), 17 pairs in all, over the channel pairs c = 2 (8 ci + cg) + {0, 1}. The 16 j rows are read
  //      once per channel pair by the whole warp (the four row pairs of a warp share j: broadcast; 8 channel
  //      groups x 16 B = one 128 B wavefront), then the 8 channel groups (lane bits 0..2) are summed by xor
  //      shuffles.
  {
    constexpr int NCI = KP / 16;
    const int cg = tid & 7, rp = (tid >> 3) & 7, a = tid >> 6;
    const int j0 = a * kSub, t1 = j0 + rp, t2 = j0 + kSub - 1 - rp;
    float q1[8], k1[8], q2[kSub], k2[kSub];
#pragma unroll
    for (int jl = 0; jl < kSub; ++jl) {
      if (jl < 8) q1[jl] = k1[jl] = 0.f;
      q2[jl] = k2[jl] = 0.f;
    }
#pragma unroll 1
    for (int ci = 0; ci < NCI; ++ci) {
      const int c = 2 * (ci * 8 + cg);
      const float4 P1 = *reinterpret_cast<const float4*>(Pd + t1 * PDS + c);  // hi0, lo0, hi1, lo1
      const float4 P2 = *reinterpret_cast<const float4*>(Pd + t2 * PDS + c);
      const float2 qa = *reinterpret_cast<const float2*>(Qs + t1 * LD + c);
      const float2 ka = *reinterpret_cast<const float2*>(Ks + t1 * LD + c);
      const float2 qb = *reinterpret_cast<const float2*>(Qs + t2 * LD + c);
      const float2 kb = *reinterpret_cast<const float2*>(Ks + t2 * LD + c);
#pragma unroll
      for (int jl = 0; jl < kSub; ++jl) {
        const float4 Pj = *reinterpret_cast<const float4*>(Pd + (j0 + jl) * PDS + c);
        const float2 kj = *reinterpret_cast<const float2*>(Ks + (j0 + jl) * LD + c);
        if (jl < 8 && jl <= rp) {
          const float x0 = kj.x * __expf((P1.x - Pj.x) + (P1.y - Pj.y));
          const float x1 = kj.y * __expf((P1.z - Pj.z) + (P1.w - Pj.w));
          q1[jl] = fmaf(qa.y, x1, fmaf(qa.x, x0, q1[jl]));
          k1[jl] = fmaf(ka.y, x1, fmaf(ka.x, x0, k1[jl]));
        }
        if (jl <= kSub - 1 - rp) {
          const float x0 = kj.x * __expf((P2.x - Pj.x) + (P2.y - Pj.y));
          const float x1 = kj.y * __expf((P2.z - Pj.z) + (P2.w - Pj.w));
          q2[jl] = fmaf(qb.y, x1, fmaf(qb.x, x0, q2[jl]));
          k2[jl] = fmaf(kb.y, x1, fmaf(kb.x, x0, k2[jl]));
        }
      }
    }
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
      if (jl < 8 && jl <= rp) {
        Aq[t1 * LDA + j0 + jl] = q1[jl];
        Ak[t1 * LDA + j0 + jl] = jl < rp ? k1[jl] : 0.f;
      }
      if (jl <= kSub - 1 - rp) {
        Aq[t2 * LDA + j0 + jl] = q2[jl];
        Ak[t2 * LDA + j0 + jl] = jl < kSub - 1 - rp ? k2[jl] : 0.f;
      }
    }
  }
  __syncthreads();

  // ---- P0b: per channel: right factors R_a[j] = k_j e^{G_r - G_j} (j < 16a, r = 16a - 1; suffix sums) over
  //      P's storage, then the left factors in place (rows of sub-chunks 1..3): x_t e^{G_t - G_r}, r = the last
  //      token before t's sub-chunk (prefix sums within the sub-chunk). Thread c computes R's column c from the
  //      raw k, then scales k's column c (all four sub-chunks; sub-chunk 0 is not read by P2 but P4 uses it);
  //      thread KP + c scales q's column c.
  if (tid < KP) {
    const int c = tid;
    for (int a = 1; a < 4; ++a) {
      float* R = Rs + 8 * a * (a - 1) * LD;
      double S = 0.0;
      for (int j = a * kSub - 1; j >= 0; --j) {
        R[j * LD + c] = Ks[j * LD + c] * __expf(static_cast<float>(S));
        S += gate(j, c);
      }
    }
    double P = 0.0;
    for (int t = 0; t < kChunk; ++t) {  // sub-chunk 0 too: P4 forms K e^G from these rows
      if ((t & (kSub - 1)) == 0) P = 0.0;
      P += gate(t, c);
      Ks[t * LD + c] *= __expf(static_cast<float>(P));
    }
  } else if (tid < 2 * KP) {
    const int c = tid - KP;
    double P = 0.0;
    for (int t = kSub; t < kChunk; ++t) {
      if ((t & (kSub - 1)) == 0) P = 0.0;
      P += gate(t, c);
      Qs[t * LD + c] *= __expf(static_cast<float>(P));
    }
  }
  __syncthreads();
  }  // PC

  // ---- P2: KDA: cross-sub-chunk blocks on tensor cores, rows of sub-chunk a (q and k) x R_a^T.
  //      GDN: every block on or below the diagonal of Q K^T and K K^T (the scalar decay is applied in P3).
  {
    const int gq = lane >> 2, t4 = lane & 3;
    constexpr int kTiles = PC ? 24 : 40;
    for (int tile = warp; tile < kTiles; tile += kPrepThreads / 32) {
      int a, mat, nt;
      const float* Bs;
      if constexpr (PC) {
        a = tile < 4 ? 1 : (tile < 12 ? 2 : 3);
        const int local = tile - (a == 1 ? 0 : (a == 2 ? 4 : 12));
        mat = local / (2 * a);
        nt = local - mat * 2 * a;
        Bs = Rs + (8 * a * (a - 1) + nt * 8) * LD;
      } else {
        a = tile < 4 ? 0 : (tile < 12 ? 1 : (tile < 24 ? 2 : 3));  // 2 (2a + 2) tiles for row block a
        const int local = tile - (a == 0 ? 0 : (a == 1 ? 4 : (a == 2 ? 12 : 24)));
        mat = local / (2 * a + 2);
        nt = local - mat * (2 * a + 2);
        Bs = Ks + nt * 8 * LD;
      }
      const float* As = (mat ? Ks : Qs) + a * kSub * LD;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
      for (int ks = 0; ks < KP / 8; ++ks) {
        const int c0 = ks * 8 + t4;
        const float4 af = make_float4(As[gq * LD + c0], As[(gq + 8) * LD + c0], As[gq * LD + c0 + 4],
                                      As[(gq + 8) * LD + c0 + 4]);
        mma8<PRECISE>(acc, af, Bs[gq * LD + c0], Bs[gq * LD + c0 + 4]);
      }
      float* A = (mat ? Ak : Aq) + a * kSub * LDA + nt * 8 + 2 * t4;
      A[gq * LDA] = acc[0];
      A[gq * LDA + 1] = acc[1];
      A[(gq + 8) * LDA] = acc[2];
      A[(gq + 8) * LDA + 1] = acc[3];
    }
  }
  __syncthreads();

  // ---- P3: scale A_qk Diag(beta) -> workspace; A_kk Diag(beta) in place
  for (int i = tid; i < kChunk * kChunk; i += kPrepThreads) {
    const int t = i >> 6, j = i & 63;
    if constexpr (!PC) {  // scalar decay e^{G_t - G_j} (double prefix difference), causal mask
      const float f = j <= t ? __expf(hi_lo_diff(Pd[t * PDS], Pd[j * PDS])) : 0.f;
      Aq[t * LDA + j] *= f;
      Ak[t * LDA + j] *= (j < t ? f : 0.f);
    }
    ws_put(ws + WL.aqk, frag_index<kChunk>(t, j), half, p.scale * Aq[t * LDA + j] * bs[j]);
    Ak[t * LDA + j] *= bs[j];
  }
  __syncthreads();

  // ---- P4: T = M^-1 for M = I + A_kk Diag(beta) (unit lower triangular), then w = T (K e^G), u0 = T V.
  //      (a) X = K e^G into the P/R storage (stride LDX, conflict-free B fragments), elementwise from the staged
  //          k: KDA: row t of Ks holds k_t e^{G_t - G_r} (P0b; r = 16a - 1, the token before t's sub-chunk a),
  //          times ea[a] = e^{G_r} (two factors <= 1); GDN: raw k_t times ea[t] = e^{G_t}. Threads [0, 64)
  //          first invert the four 16x16 diagonal blocks T_aa = M_aa^-1, one column per thread (forward
  //          substitution of a unit vector, 120 FMAs), upper triangle zero; T over Aq.
  //      (b) for a = 1..3: Y = sum_{c=b}^{a-1} Ab_ac T_cb, then T_ab = -T_aa Y (b < a), fp32 on CUDA cores.
  //      (c) w and u0 on tensor cores: a warp owns 8 output columns (of w, then of u0) and all four row blocks;
  //          row block a needs only the k-blocks 0..a (T is lower triangular).
  {
    constexpr int LDX = SM::LDX;
    float* Xs = reinterpret_cast<float*>(smem + SM::pr);  // K e^G [64][LDX]
    float* Ts = Aq;                                       // T = M^-1 [64][LDA] (lower blocks only)
    float* Ys = Qs;                                       // Y [16][48]
    if (tid < 64) {
      const int a = tid >> 4, j = tid & 15;
      const float* Ab = Ak + a * kSub * LDA + a * kSub;
      float x[kSub];
#pragma unroll
      for (int i = 0; i < kSub; ++i) {
        float s = (i == j) ? 1.f : 0.f;
#pragma unroll
        for (int m = 0; m < i; ++m) s = fmaf(-Ab[i * LDA + m], x[m], s);
        x[i] = (i < j) ? 0.f : s;
      }
      float* Td = Ts + a * kSub * LDA + a * kSub + j;
#pragma unroll
      for (int i = 0; i < kSub; ++i) Td[i * LDA] = x[i];
    }
#pragma unroll 4
    for (int i = tid; i < kChunk * KP; i += kPrepThreads) {
      const int t = i / KP, c = i % KP;
      Xs[t * LDX + c] = Ks[t * LD + c] * (PC ? Ea[(t >> 4) * KP + c] : Ea[t]);
    }
    __syncthreads();
#pragma unroll 1
    for (int a = 1; a < 4; ++a) {
      const int ncol = a * kSub;  // columns [0, 16a) of block row a
      for (int idx = tid; idx < kSub * ncol; idx += kPrepThreads) {
        const int i = idx / ncol, col = idx - (idx / ncol) * ncol;
        const float* Arow = Ak + (a * kSub + i) * LDA;
        float s0 = 0.f, s1 = 0.f;
        for (int m = (col >> 4) * kSub; m < a * kSub; m += 2) {
          s0 = fmaf(Arow[m], Ts[m * LDA + col], s0);
          s1 = fmaf(Arow[m + 1], Ts[(m + 1) * LDA + col], s1);
        }
        Ys[i * 48 + col] = s0 + s1;
      }
      __syncthreads();
      for (int idx = tid; idx < kSub * ncol; idx += kPrepThreads) {
        const int i = idx / ncol, col = idx - (idx / ncol) * ncol;
        const float* Trow = Ts + (a * kSub + i) * LDA + a * kSub;
        float s = 0.f;
        for (int m = 0; m <= i; ++m) s = fmaf(Trow[m], Ys[m * 48 + col], s);
        Ts[(a * kSub + i) * LDA + col] = -s;
      }
      __syncthreads();
    }

    const int gq = lane >> 2, t4 = lane & 3;
    const int ntw = KP / 8, ntv = (V + 7) / 8;
    for (int item = warp; item < ntw + ntv; item += kPrepThreads / 32) {
      const bool isw = item < ntw;
      const int n0 = (isw ? item : item - ntw) * 8;
      float b[kChunk / 8][2];
      if (isw) {
#pragma unroll
        for (int ks = 0; ks < kChunk / 8; ++ks) {
          b[ks][0] = Xs[(ks * 8 + t4) * LDX + n0 + gq];
          b[ks][1] = Xs[(ks * 8 + t4 + 4) * LDX + n0 + gq];
        }
      } else {
        const int vc = n0 + gq;
#pragma unroll
        for (int ks = 0; ks < kChunk / 8; ++ks)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int t = ks * 8 + t4 + 4 * hh;
            b[ks][hh] = (t < L && vc < V) ? load_in(p.v, ((tok0 + t) * HV + hv) * V + vc, dt) : 0.f;
          }
      }
      float acc[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        acc[a][0] = acc[a][1] = acc[a][2] = acc[a][3] = 0.f;
        const float* Ta = Ts + (a * kSub + gq) * LDA + t4;
#pragma unroll
        for (int ks = 0; ks < kChunk / 8; ++ks) {
          if (ks < 2 * a + 2) {
            const float4 af = make_float4(Ta[ks * 8], Ta[8 * LDA + ks * 8], Ta[ks * 8 + 4], Ta[8 * LDA + ks * 8 + 4]);
            mma8<PRECISE>(acc[a], af, b[ks][0], b[ks][1]);
          }
        }
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = a * kSub + gq + (e >> 1) * 8, c = n0 + 2 * t4 + (e & 1);
          if (isw) ws[WL.w + frag_index<KP>(r, c)] = acc[a][e];
          else if (c < V) ws[WL.u + static_cast<int64_t>(r) * V + c] = acc[a][e];
        }
    }
  }
}

// Scan: block = (sequence, value head, BV columns); 4 warps. Warp wi owns rows 16wi..16wi+15 of U and o, and
// rows [wi * KP/4, (wi+1) * KP/4) of h.
// HALF: the workspace's q~, k~^T, A~ are bf16 (p.ws_bf16; a template parameter here so that only one load path
// is compiled into the register-tight scan).
template <int KP, int BV, bool PRECISE, bool HALF>
__global__ void __launch_bounds__(kScanThreads) delta_chunk_scan_kernel(const ChunkFwdParams p) {
  constexpr int LDH = BV + 8;  // conflict-free B-fragment reads
  constexpr int NT = BV / 8;
  constexpr int MT = KP / 64;  // 16-row tiles of h per warp
  constexpr bool half = HALF;
  const WsLayout<KP> WL(half);
  __shared__ __align__(16) float hs[KP * LDH];
  __shared__ __align__(16) float Us[kChunk * LDH];

  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * BV;
  const int tid = threadIdx.x, lane = tid & 31, wi = tid >> 5;
  const int gq = lane >> 2, t4 = lane & 3;
  const int K = p.K, V = p.V, HV = p.HV;
  int64_t bos;
  int len;
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);
  const int nch = (len + kChunk - 1) / kChunk;
  const int c_first = p.cu_seqlens != nullptr ? p.chunk_off[n] : n * p.nc_per_seq;
  const int64_t sbase = (static_cast<int64_t>(n) * HV + hv) * K * V;

  float hacc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
        const int c = v0 + nt * 8 + 2 * t4 + (e & 1);
        hacc[mt][nt][e] = (p.h0 != nullptr && r < K && c < V) ? p.h0[sbase + static_cast<int64_t>(r) * V + c] : 0.f;
      }
  auto store_h = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
          hs[r * LDH + nt * 8 + 2 * t4 + (e & 1)] = hacc[mt][nt][e];
        }
  };
  store_h();
  __syncthreads();

  // A-operand fragments of w (and u0) are loaded one chunk ahead; qg / aqk at the top of a chunk, kg^T after U.
  auto chunk_ws = [&](int ci) { return p.ws + (static_cast<int64_t>(c_first + ci) * HV + hv) * p.ws_stride; };
  float4 wa[KP / 8];
  float u0r[NT][4];
  auto load_w = [&](int ci) {
    const float* ws = chunk_ws(ci);
    const float4* wf = reinterpret_cast<const float4*>(ws + WL.w) + wi * (KP / 8) * 32 + lane;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ++ks) wa[ks] = __ldg(wf + ks * 32);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        const int cl = nt * 8 + 2 * t4 + (e & 1);
        u0r[nt][e] = (v0 + cl < V) ? __ldg(ws + WL.u + r * V + v0 + cl) : 0.f;
      }
  };
  if (nch > 0) load_w(0);

  for (int ci = 0; ci < nch; ++ci) {
    const float* ws = chunk_ws(ci);
    const int L = min(kChunk, len - ci * kChunk);
    const int qi = wi * (KP / 8) * 32 + lane;             // tile-lane indices of this warp's fragments
    const int ai = wi * (kChunk / 8) * 32 + lane;
    const int ki = wi * MT * (kChunk / 8) * 32 + lane;
    float4 qa[KP / 8], aa[kChunk / 8];
#pragma unroll
    for (int ks = 0; ks < KP / 8; ++ks) qa[ks] = ws_frag(ws + WL.qg, qi + ks * 32, half);
#pragma unroll
    for (int ks = 0; ks < kChunk / 8; ++ks)
      aa[ks] = ks < 2 * wi + 2 ? ws_frag(ws + WL.aqk, ai + ks * 32, half) : make_float4(0.f, 0.f, 0.f, 0.f);
    float dec[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      dec[mt][0] = __ldg(ws + WL.decay + (wi * MT + mt) * 16 + gq);
      dec[mt][1] = __ldg(ws + WL.decay + (wi * MT + mt) * 16 + gq + 8);
    }

    // U = u0 - w h
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ++ks) mma_row_tiles<PRECISE>(acc, wa[ks], hs, LDH, ks * 8, t4, gq);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        Us[r * LDH + nt * 8 + 2 * t4 + (e & 1)] = u0r[nt][e] - acc[nt][e];
      }
    float4 ka[MT * (kChunk / 8)];
#pragma unroll
    for (int i = 0; i < MT * (kChunk / 8); ++i) ka[i] = ws_frag(ws + WL.kg, ki + i * 32, half);
    __syncthreads();

    // o = qg h + aqk U
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ++ks) mma_row_tiles<PRECISE>(acc, qa[ks], hs, LDH, ks * 8, t4, gq);
#pragma unroll
    for (int ks = 0; ks < kChunk / 8; ++ks) {
      if (ks < 2 * wi + 2) mma_row_tiles<PRECISE>(acc, aa[ks], Us, LDH, ks * 8, t4, gq);
    }
    if (ci + 1 < nch) load_w(ci + 1);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        const int c = v0 + nt * 8 + 2 * t4 + (e & 1);
        if (r < L && c < V) store_in(p.o, ((bos + ci * kChunk + r) * HV + hv) * V + c, p.in_dtype, acc[nt][e]);
      }

    // h <- Diag(decay) h + kg^T U
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float d0 = dec[mt][0], d1 = dec[mt][1];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        hacc[mt][nt][0] *= d0;
        hacc[mt][nt][1] *= d0;
        hacc[mt][nt][2] *= d1;
        hacc[mt][nt][3] *= d1;
      }
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks)
        mma_row_tiles<PRECISE>(hacc[mt], ka[mt * (kChunk / 8) + ks], Us, LDH, ks * 8, t4, gq);
    }
    __syncthreads();
    store_h();
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
        const int c = v0 + nt * 8 + 2 * t4 + (e & 1);
        if (r < K && c < V) p.ht[sbase + static_cast<int64_t>(r) * V + c] = hacc[mt][nt][e];
      }
}

// ---- Shared-memory bulk copies and mbarriers (sm_90+; the scan delta_chunk_scan7_kernel) ----
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // sm_90+ PTX (bulk copies); the host checks
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also raises the phase's expected transaction bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred P1;\n\tmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\n\tselp.u32 %0, 1, 0, P1;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// A plain arrival (release at CTA scope) on an mbarrier.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Global -> this CTA's shared memory; complete_tx on its mbarrier bar.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace cuda
}  // namespace kda_kernels
