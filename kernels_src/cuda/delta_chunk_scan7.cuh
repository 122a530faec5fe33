// Warp-specialized chunked-forward scan on bf16 tensor-core operands: delta_chunk_scan7_kernel<KP, UHL>
// (KDA_CUDA_CHUNK_SCAN=11: UHL true, the default since session 12 (0.240 ms against scan6's 0.301 at B1 T8192 H16
// HV32 on the H200, the same accuracy); 10: UHL false, opt-in (0.219 ms, but o's worst error / tolerance 0.82 against
// 0.64)). Host: delta_chunk_fwd_host.cuh (run_chunk_scan, scan7_applies). Math and workspace: delta_chunk_fwd.cuh
// (WsLayout). Since session 12 this file holds everything the kernel uses beyond delta_chunk_fwd.cuh: scan6
// (KDA_CUDA_CHUNK_SCAN=8, delta_chunk_scan6.cuh: the same structure on tf32 operands, fp32 w, h_c and U_c), from
// which it took its schedule, handoff and helpers (store_o2, rec_sync; mbar_arrive went to delta_chunk_fwd.cuh),
// was retired then (docs/cuda.md, "Retired kernels"); the move changed no instruction of scan7's SASS.
//
// Why: scan6 was bound by the SM's L1 / shared-memory data path (~80 % in Nsight Compute):
// its w operand was fp32 (256 KP bytes a chunk through the bulk copy and again through the LDS), h_c and U_c were
// fp32 (tf32-rounded) in shared memory and every B fragment was one 32-bit word per tf32 element. Here every
// product is an m16n8k16 bf16 mma with fp32 accumulation -- the precision regime of flash-linear-attention, which
// keeps w in the input dtype and casts h and v_new (U) to bf16 for its dots -- while the state itself stays fp32
// in the recurrence warps' registers (the decay and k~^T U accumulate into fp32; only the operand copy of h that the
// dots read is rounded to bf16; the final state comes from the fp32 registers):
//  - w (bf16, the prep's WB instance: gdn_chunk_prep2 / kda_chunk_prep2 via prep_w_u0) is half the bytes; q~, k~^T,
//    A~ were bf16 already. All four stay in the workspace's bf16 fragment order (ws_put_frag: per 16 x 8 tile and
//    lane one uint2 {(g, t), (g+8, t) | (g, t+4), (g+8, t+4)}); two adjacent tiles (k-columns 16 s .. 16 s + 15)
//    make one m16n8k16 A fragment by 4 byte permutes (afrag16) under the k order
//        mma slot 2t <- k 16s + t,  2t+1 <- 16s + t + 8,  2t+8 <- 16s + t + 4,  2t+9 <- 16s + t + 12.
//  - h_c and U_c live in shared memory as bf16 pairs of rows (r, r + 8) (r % 16 < 8): word (8 (r / 16) + r % 8, col)
//    of a [rows / 2 x LDW] array of 32-bit words. Under the k order above, b0 of k-step s is the word
//    (8 s + t, n0 + g) and b1 (8 s + 4 + t, n0 + g): one 32-bit load each, conflict-free with LDW = 40 (t LDW + g
//    distinct mod 32). The accumulator tile of the writer (rows g, g + 8; columns 2t, 2t + 1) is exactly two such
//    words, adjacent: one 8-byte store per tile, no shuffles (conflict-free too: 8 g + 2 t distinct per half warp).
//  - u0 stays fp32 (read a chunk ahead into registers, as scan6 did): U = u0 - w h cancels, and a CPU estimate of the
//    rounding (benchmarks/cuda/scan7_accuracy_emu.py) puts most of the error this regime adds on u0 and U, little on
//    w and h: correlated keys with slow gates over 32 chunks, o's error / 0.005 is ~0.63 with scan6's rounding,
//    ~0.89 with u0, U, w, h all bf16, ~0.81 with u0 fp32 (this kernel, UHL false), ~0.64 with u0 fp32 and U as
//    bf16 hi + lo (UHL true).
//  - UHL (11): U goes into shared memory as hi = bf16(U) and lo = bf16(U - hi) words; k~^T U and A~ U run both (twice
//    their mma and U reads: +~210 wavefronts and +~170 mma per chunk) -- U at ~16 mantissa bits, scan6's accuracy.
// Wavefronts per (block, chunk) at KP = 128 (scan6's: ~3.3 k): U 4 warps x 8 k-steps x (2 LDS.64 + 8 LDS.32) = 384
// (768), h update 8 warps x 4 x (4 LDS.64 + 4 LDS.32) = 384 (512), output h 4 x 64 + U ~4 x 20 = ~340 (768),
// h / U stores ~110 (~220), bulk copies 33 KB instead of 49 KB: ~1.5 k. Tensor instructions per chunk halve too.
// The structure is scan6's: one block per (sequence, value head, 32 value columns), 8 recurrence warps (U by warps
// 0..3, 16 rows x 32 columns each; h update by all 8 with ScanRec's ownership: rows [wi KP/4, (wi+1) KP/4), columns
// 16 wc .. 16 wc + 15) + 4 output warps (16 rows x 32 columns each); operands bulk-copied two chunks ahead; h_c / U_c
// in NB = 3 buffers handed over by full / empty mbarriers as scan6 (and scan5) did. Kept (not re-split) because the
// grid at the target shape (B1 HV32 V128: 128 blocks) is one wave on the H200's 132 SMs: two blocks per SM (which the
// ~110 KB of shared memory would allow, at <= 85 registers a thread) or 16-column blocks would not shorten a
// block's serial chain; the gain has to come from a shorter chunk step. (U on 8 warps instead of 4 would not help
// either: warps 0..3 sit on the 4 SM sub-partitions already, so their mma throughput bounds the U step.)
// Emulated: tests/test_cuda_scan7_emu.py (index math), tests/test_cuda_scan7_handoff_emu.py (the h_c / U_c buffers and
// mbarriers); tested: tests/test_cuda_scan7.py.
#pragma once

#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kScan7Threads = 384;  // 8 recurrence warps, then 4 output warps
constexpr int kScan7RecThreads = 256;
constexpr int kScan7OutWarps = (kScan7Threads - kScan7RecThreads) / 32;
constexpr int kScan7LDW = 40;  // 32-bit words per row pair of h_c / U_c (32 columns + 8: conflict-free)
constexpr int kScan7MaxV = 256;  // the V range the host sends to this kernel (and its tests cover)

// Two adjacent output elements o[i], o[i + 1] (the second only when has_y) in the input dtype, rounded as store_in;
// one 4-byte store for bf16 / fp16 when pair (i even: V even).
__device__ __forceinline__ void store_o2(void* o, int64_t i, int dt, bool pair, float x, float y, bool has_y) {
  if (pair && dt == kBF16) {
    reinterpret_cast<__nv_bfloat162*>(o)[i >> 1] = __floats2bfloat162_rn(x, y);
  } else if (pair && dt == kF16) {
    reinterpret_cast<__half2*>(o)[i >> 1] = __floats2half2_rn(x, y);
  } else {
    store_in(o, i, dt, x);
    if (has_y) store_in(o, i + 1, dt, y);
  }
}

template <int KP, bool UHL>
struct Scan7Smem {
  static constexpr int NB = 3;  // h_c / U_c buffers
  static constexpr int BV = 32;
  static constexpr int LDW = kScan7LDW;
  static constexpr uint32_t w_bytes = kChunk * KP * 2;   // bf16 fragments
  static constexpr uint32_t kg_bytes = kChunk * KP * 2;  // bf16 fragments
  static constexpr uint32_t dec_bytes = KP * 4;
  static constexpr uint32_t region = w_bytes + kg_bytes + dec_bytes;  // one operand buffer: w | k~^T | decay
  static constexpr int hs_words = KP / 2 * LDW;
  static constexpr int us_lo = kChunk / 2 * LDW;  // UHL: U's low words after its high words
  static constexpr int us_words = (UHL ? 2 : 1) * us_lo;
  static constexpr size_t hs_off = 2 * static_cast<size_t>(region);
  static constexpr size_t us_off = hs_off + sizeof(uint32_t) * NB * hs_words;
  static constexpr size_t bar_off = us_off + sizeof(uint32_t) * NB * us_words;
  // mbarriers: operand buffers 0, 1; full[NB]; empty[NB]
  static constexpr size_t bytes = bar_off + (2 + 2 * NB) * sizeof(uint64_t);
  static_assert(w_bytes % 16 == 0 && kg_bytes % 16 == 0 && dec_bytes % 16 == 0 && region % 16 == 0,
                "bulk copies move 16-byte multiples into 16-byte aligned buffers");
  static_assert(hs_off % 16 == 0 && us_off % 16 == 0 && bar_off % 8 == 0, "aligned sections");
  static_assert(bytes <= 227 * 1024, "scan7: more shared memory than one block may have");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The recurrence warps' own barrier (named barrier 1; __syncthreads is barrier 0).
__device__ __forceinline__ void rec_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kScan7RecThreads) : "memory"); }

// bf16 pair (lo: the lower 16 bits) as one 32-bit word, round to nearest even.
__device__ __forceinline__ uint32_t s7_pack(float lo, float hi) {
  const __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&t);
}

// The m16n8k16 A fragment of k-columns 16 s .. 16 s + 15 from the workspace's bf16 fragments u (8-column tile 2 s)
// and v (tile 2 s + 1) of the same lane, under scan7's k order (top of this file).
__device__ __forceinline__ void afrag16(const uint2& u, const uint2& v, uint32_t (&a)[4]) {
  a[0] = __byte_perm(u.x, v.x, 0x5410);  // (g, 16s + t), (g, 16s + t + 8)
  a[1] = __byte_perm(u.x, v.x, 0x7632);  // (g + 8, ...)
  a[2] = __byte_perm(u.y, v.y, 0x5410);  // (g, 16s + t + 4), (g, 16s + t + 12)
  a[3] = __byte_perm(u.y, v.y, 0x7632);  // (g + 8, ...)
}

__device__ __forceinline__ void mma_bf16_k16(float* c, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[nt] += A (k-step s) * B[16 s .. 16 s + 15][8 nt .. 8 nt + 7], B in row-pair words (Bw: its column 0).
template <int N8>
__device__ __forceinline__ void mma_tiles16(float (&acc)[N8][4], const uint32_t (&a)[4], const uint32_t* Bw, int s,
                                            int t4, int gq) {
  const uint32_t* b = Bw + (8 * s + t4) * kScan7LDW + gq;
#pragma unroll
  for (int nt = 0; nt < N8; ++nt) mma_bf16_k16(acc[nt], a, b[nt * 8], b[4 * kScan7LDW + nt * 8]);
}

// An accumulator tile (rows r0 + g, r0 + 8 + g; columns c0 + 2t, + 1; r0 % 16 == 0) as two adjacent row-pair words.
__device__ __forceinline__ void s7_put_tile(uint32_t* Mw, int r0, int c0, const float (&c)[4], int t4, int gq) {
  *reinterpret_cast<uint2*>(Mw + (r0 / 2 + gq) * kScan7LDW + c0 + 2 * t4) =
      make_uint2(s7_pack(c[0], c[2]), s7_pack(c[1], c[3]));
}

// The same for U with UHL: bf16(x) into Mw and bf16(x - bf16(x)) into Mw + lo (the low words).
__device__ __forceinline__ void s7_put_tile_hl(uint32_t* Mw, int lo, int r0, int c0, const float (&c)[4], int t4,
                                               int gq) {
  const __nv_bfloat162 h02 = __floats2bfloat162_rn(c[0], c[2]), h13 = __floats2bfloat162_rn(c[1], c[3]);
  const int i = (r0 / 2 + gq) * kScan7LDW + c0 + 2 * t4;
  *reinterpret_cast<uint2*>(Mw + i) =
      make_uint2(*reinterpret_cast<const uint32_t*>(&h02), *reinterpret_cast<const uint32_t*>(&h13));
  *reinterpret_cast<uint2*>(Mw + lo + i) =
      make_uint2(s7_pack(c[0] - __low2float(h02), c[2] - __high2float(h02)),
                 s7_pack(c[1] - __low2float(h13), c[3] - __high2float(h13)));
}

// The recurrence warps of scan7 (warp w = 4 wc + wi): h rows [wi KP/4, (wi+1) KP/4) x columns cw .. cw + 15 in fp32
// registers (ScanRec's ownership), U rows 16 wi .. 16 wi + 15 x all 32 columns by warps 0..3.
template <int KP, bool UHL>
struct ScanRec7 {
  static constexpr int BV = 32;
  static constexpr int WC = BV / 2;   // h columns per warp
  static constexpr int NT = WC / 8;   // 8-column tiles of the h update
  static constexpr int NTU = 2 * NT;  // 8-column tiles of U (32 columns)
  static constexpr int MT = KP / 64;  // 16-row tiles of h per warp
  int lane, wi, cw, gq, t4;
  float hacc[MT][NT][4];
  float u0w[NTU][4];     // u0 (fp32) of this warp's U rows, all 32 columns (warps 0..3)
  uint32_t kfr[MT][kChunk / 16][4];  // this chunk's k~^T A fragments of this warp's h rows (h_pre)

  __device__ __forceinline__ ScanRec7(int tid) {
    lane = tid & 31;
    const int w = (tid >> 5) & 7;
    wi = w & 3;
    cw = (w >> 2) * WC;
    gq = lane >> 2;
    t4 = lane & 3;
  }
  __device__ __forceinline__ void init_h(const ChunkFwdParams& p, int64_t sbase, int v0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
          const int c = v0 + cw + nt * 8 + 2 * t4 + (e & 1);
          hacc[mt][nt][e] =
              (p.h0 != nullptr && r < p.K && c < p.V) ? p.h0[sbase + static_cast<int64_t>(r) * p.V + c] : 0.f;
        }
  }
  // bf16(h) -> hw (row-pair words)
  __device__ __forceinline__ void store_h(uint32_t* hw) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s7_put_tile(hw, (wi * MT + mt) * 16, cw + nt * 8, hacc[mt][nt], t4, gq);
  }
  __device__ __forceinline__ void store_ht(const ChunkFwdParams& p, int64_t sbase, int v0) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
          const int c = v0 + cw + nt * 8 + 2 * t4 + (e & 1);
          if (r < p.K && c < p.V) p.ht[sbase + static_cast<int64_t>(r) * p.V + c] = hacc[mt][nt][e];
        }
  }
  // u0 of a chunk (fp32 row-major at WL.u of its workspace slice ws), 32 columns from v0 (as scan6)
  __device__ __forceinline__ void load_u0w(const float* ws, const WsLayout<KP>& WL, int v0, int V) {
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        const int c = v0 + nt * 8 + 2 * t4 + (e & 1);
        u0w[nt][e] = c < V ? __ldg(ws + WL.u + r * V + c) : 0.f;
      }
  }
  // U = u0 - w h (rows 16 wi .., all 32 columns; chains a0 / a1 over the even / odd k-steps) -> bf16 into Uw (UHL:
  // and the low parts into Uw + us_lo)
  __device__ __forceinline__ void u_step_store(const unsigned char* buf, const uint32_t* hw, uint32_t* Uw) const {
    const uint2* sw = reinterpret_cast<const uint2*>(buf) + wi * (KP / 8) * 32 + lane;  // bf16 fragments
    float a0[NTU][4], a1[NTU][4];
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
    for (int s = 0; s < KP / 16; s += 2) {
      uint32_t a[4];
      afrag16(sw[(2 * s) * 32], sw[(2 * s + 1) * 32], a);
      mma_tiles16(a0, a, hw, s, t4, gq);
      afrag16(sw[(2 * s + 2) * 32], sw[(2 * s + 3) * 32], a);
      mma_tiles16(a1, a, hw, s + 1, t4, gq);
    }
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt) {
      float u[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = u0w[nt][e] - (a0[nt][e] + a1[nt][e]);
      if constexpr (UHL) s7_put_tile_hl(Uw, Scan7Smem<KP, UHL>::us_lo, wi * 16, nt * 8, u, t4, gq);
      else s7_put_tile(Uw, wi * 16, nt * 8, u, t4, gq);
    }
  }
  // The part of the h update that does not need U, done before the barrier that completes U: h <- Diag(decay) h and
  // this warp's k~^T A fragments into kfr (buf: the chunk's operand buffer).
  __device__ __forceinline__ void h_pre(const unsigned char* buf) {
    using S = Scan7Smem<KP, UHL>;
    const uint2* sk = reinterpret_cast<const uint2*>(buf + S::w_bytes) + wi * MT * (kChunk / 8) * 32 + lane;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int s = 0; s < kChunk / 16; ++s)
        afrag16(sk[(mt * (kChunk / 8) + 2 * s) * 32], sk[(mt * (kChunk / 8) + 2 * s + 1) * 32], kfr[mt][s]);
    const float* sd = reinterpret_cast<const float*>(buf + S::w_bytes + S::kg_bytes);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float d0 = sd[(wi * MT + mt) * 16 + gq], d1 = sd[(wi * MT + mt) * 16 + gq + 8];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        hacc[mt][nt][0] *= d0;
        hacc[mt][nt][1] *= d0;
        hacc[mt][nt][2] *= d1;
        hacc[mt][nt][3] *= d1;
      }
    }
  }
  // h += k~^T U (after h_pre; Uw: the whole chunk's U; UHL: + k~^T U_lo after k~^T U_hi at every k-step); U's B
  // words loaded once for both row tiles
  __device__ __forceinline__ void h_step(const uint32_t* Uw) {
    using S = Scan7Smem<KP, UHL>;
    const uint32_t* ub = Uw + cw;
#pragma unroll
    for (int s = 0; s < kChunk / 16; ++s) {
      uint32_t b0[NT], b1[NT], l0[NT], l1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        b0[nt] = ub[(8 * s + t4) * kScan7LDW + nt * 8 + gq];
        b1[nt] = ub[(8 * s + 4 + t4) * kScan7LDW + nt * 8 + gq];
        if constexpr (UHL) {
          l0[nt] = ub[S::us_lo + (8 * s + t4) * kScan7LDW + nt * 8 + gq];
          l1[nt] = ub[S::us_lo + (8 * s + 4 + t4) * kScan7LDW + nt * 8 + gq];
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          mma_bf16_k16(hacc[mt][nt], kfr[mt][s], b0[nt], b1[nt]);
          if constexpr (UHL) mma_bf16_k16(hacc[mt][nt], kfr[mt][s], l0[nt], l1[nt]);
        }
    }
  }
};

// One thread: the recurrence's operands of a chunk (w bf16, k~^T bf16, decay fp32; src its workspace slice) into
// the shared region dst, complete_tx on bar (armed by the caller with Scan7Smem::region bytes).
template <int KP, bool UHL>
__device__ __forceinline__ void scan7_issue(uint32_t dst, const float* ws, const WsLayout<KP>& WL, uint32_t bar) {
  using S = Scan7Smem<KP, UHL>;
  constexpr uint32_t kBulkMax = 16384;
  const char* src = reinterpret_cast<const char*>(ws);
  for (uint32_t b = 0; b < S::w_bytes; b += kBulkMax)
    bulk_copy(dst + b, src + WL.w * 4 + b, min(kBulkMax, S::w_bytes - b), bar);
  for (uint32_t b = 0; b < S::kg_bytes; b += kBulkMax)
    bulk_copy(dst + S::w_bytes + b, src + WL.kg * 4 + b, min(kBulkMax, S::kg_bytes - b), bar);
  bulk_copy(dst + S::w_bytes + S::kg_bytes, src + WL.decay * 4, S::dec_bytes, bar);
}
#endif  // __CUDA_ARCH__ >= 900

template <int KP, bool UHL>
__global__ void __launch_bounds__(kScan7Threads, 1) delta_chunk_scan7_kernel(const ChunkFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan7Smem<KP, UHL>;
  using R = ScanRec7<KP, UHL>;
  constexpr int NB = S::NB;
  constexpr uint32_t RB = S::region;
  const WsLayout<KP> WL(true);
  extern __shared__ __align__(128) unsigned char smem7[];
  uint32_t* const hw0 = reinterpret_cast<uint32_t*>(smem7 + S::hs_off);  // buffer b: hw0 + b hs_words
  uint32_t* const uw0 = reinterpret_cast<uint32_t*>(smem7 + S::us_off);
  const uint32_t opbar = smem_u32(smem7 + S::bar_off);  // operand buffer b's mbarrier: opbar + 8 b
  const uint32_t fullbar = opbar + 16;                  // full[b]: fullbar + 8 b
  const uint32_t emptybar = fullbar + 8 * NB;           // empty[b]: emptybar + 8 b

  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * S::BV;
  const int tid = threadIdx.x;
  const int HV = p.HV, V = p.V;
  int64_t bos;
  int len;
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);
  const int nch = (len + kChunk - 1) / kChunk;
  const int c_first = p.cu_seqlens != nullptr ? p.chunk_off[n] : n * p.nc_per_seq;
  const int64_t sbase = (static_cast<int64_t>(n) * HV + hv) * p.K * V;
  auto chunk_ws = [&](int ci) { return p.ws + (static_cast<int64_t>(c_first + ci) * HV + hv) * p.ws_stride; };

  if (tid == 0) {
    mbar_init(opbar, 1);
    mbar_init(opbar + 8, 1);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      mbar_init(fullbar + 8 * b, kScan7RecThreads / 32);  // one arrival per recurrence warp (lane 0, __syncwarp)
      mbar_init(emptybar + 8 * b, kScan7OutWarps);
    }
    mbar_init_fence();
    if (nch > 0) mbar_arrive_expect_tx(opbar, RB);
    if (nch > 1) mbar_arrive_expect_tx(opbar + 8, RB);
  }
  __syncthreads();  // mbarriers initialised

  if (tid < kScan7RecThreads) {
    // ---- recurrence warps: 0..3 form U and update h, 4..7 update h (scan6's schedule) ----
    R rec(tid);
    const int w = tid >> 5;
    const bool ufin = w < 4;  // forms U (arrives on full after its final values)
    rec.init_h(p, sbase, v0);
    rec.store_h(hw0);  // h_0 in buffer 0 (the output warps see it through full[0])
    rec_sync();        // hw complete
    auto issue = [&](int ci) {
      scan7_issue<KP, UHL>(smem_u32(smem7 + (ci & 1) * RB), chunk_ws(ci), WL, opbar + 8 * (ci & 1));
    };
    if (tid == 0) {
      if (nch > 0) issue(0);
      if (nch > 1) issue(1);
    }
    if (ufin && nch > 0) rec.load_u0w(chunk_ws(0), WL, v0, V);
    for (int ci = 0; ci < nch; ++ci) {
      const int b = ci % NB;
      const uint32_t* hw = hw0 + b * S::hs_words;
      uint32_t* Uw = uw0 + b * S::us_words;
      const unsigned char* buf = smem7 + (ci & 1) * RB;
      // this warp's part of h_c was written before the last rec_sync; U_c's writers arrive once it is final
      if (!ufin && rec.lane == 0) mbar_arrive(fullbar + 8 * b);
      mbar_wait_parity(opbar + 8 * (ci & 1), (ci >> 1) & 1);
      rec.h_pre(buf);  // decay and k~^T fragments: warps 4..7 meanwhile warps 0..3 form U
      if (ufin) {
        rec.u_step_store(buf, hw, Uw);
        __syncwarp();
        if (rec.lane == 0) mbar_arrive(fullbar + 8 * b);  // h_c and this warp's final U_c rows
        if (ci + 1 < nch) rec.load_u0w(chunk_ws(ci + 1), WL, v0, V);
      }
      rec_sync();  // Uw complete
      rec.h_step(Uw);  // h += k~^T U
      if (ci + 1 < nch) {
        const int nb = (ci + 1) % NB;
        // buffer nb last held chunk ci + 1 - NB: wait until the output warps are done with it
        if (ci + 1 >= NB) mbar_wait_parity(emptybar + 8 * nb, ((ci + 1 - NB) / NB) & 1);
        rec.store_h(hw0 + nb * S::hs_words);
      }
      rec_sync();  // h_{c+1} complete; every recurrence warp is done with operand buffer ci & 1
      if (tid == 0 && ci + 2 < nch) {
        mbar_arrive_expect_tx(opbar + 8 * (ci & 1), RB);
        issue(ci + 2);
      }
    }
    rec.store_ht(p, sbase, v0);
  } else {
    // ---- output warps: o = q~ h_c + A~ U_c (two chains), warp wi rows 16 wi .., 32 columns ----
    constexpr int NT = R::NTU;
    const int ot = tid - kScan7RecThreads, lane = ot & 31, wi = ot >> 5;
    const int gq = lane >> 2, t4 = lane & 3;
    const bool pair = p.in_dtype != kF32 && (V & 1) == 0;  // o pairs in one 4-byte store (store_o2)
    uint2 qf[KP / 8], af[kChunk / 8];
    auto load_frags = [&](int ci) {  // this warp's rows of q~ and A~ (bf16 fragments, uint2 per tile-lane)
      const float* ws = chunk_ws(ci);
      const uint2* sq = reinterpret_cast<const uint2*>(ws + WL.qg) + wi * (KP / 8) * 32 + lane;
      const uint2* sa = reinterpret_cast<const uint2*>(ws + WL.aqk) + wi * (kChunk / 8) * 32 + lane;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) qf[ks] = __ldg(sq + ks * 32);
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks) af[ks] = ks < 2 * wi + 2 ? __ldg(sa + ks * 32) : make_uint2(0u, 0u);
    };
    if (nch > 0) load_frags(0);
    for (int ci = 0; ci < nch; ++ci) {
      const int b = ci % NB;
      const uint32_t* hw = hw0 + b * S::hs_words;
      const uint32_t* Uw = uw0 + b * S::us_words;
      const int L = min(kChunk, len - ci * kChunk);
      mbar_wait_parity(fullbar + 8 * b, (ci / NB) & 1);
      float a0[NT][4], a1[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
      for (int s = 0; s < KP / 16; ++s) {
        uint32_t a[4];
        afrag16(qf[2 * s], qf[2 * s + 1], a);
        mma_tiles16(a0, a, hw, s, t4, gq);
      }
#pragma unroll
      for (int s = 0; s < kChunk / 16; ++s)
        if (s <= wi) {  // A~ is lower triangular: k-steps past the diagonal block are zero
          uint32_t a[4];
          afrag16(af[2 * s], af[2 * s + 1], a);
          mma_tiles16(a1, a, Uw, s, t4, gq);
          if constexpr (UHL) mma_tiles16(a1, a, Uw + S::us_lo, s, t4, gq);
        }
      __syncwarp();
      if (lane == 0) mbar_arrive(emptybar + 8 * b);  // this warp is done reading h_c and U_c
      if (ci + 1 < nch) load_frags(ci + 1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wi * 16 + gq + h * 8;
          const int c = v0 + nt * 8 + 2 * t4;
          if (r < L && c < V)
            store_o2(p.o, ((bos + static_cast<int64_t>(ci) * kChunk + r) * HV + hv) * V + c, p.in_dtype, pair,
                     a0[nt][2 * h] + a1[nt][2 * h], a0[nt][2 * h + 1] + a1[nt][2 * h + 1], c + 1 < V);
        }
    }
  }
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace cuda
}  // namespace kda_kernels
