// Warp-specialized chunked-forward scan with fewer shared-memory / L1 wavefronts: delta_chunk_scan6_kernel<KP>
// (KDA_CUDA_CHUNK_SCAN=8, the default since session 11: scan 0.300 vs scan5's 0.350 ms at B1 T8192 H16 HV32 on the
// H200). Host: delta_chunk_fwd_host.cuh (run_chunk_scan). Math and workspace: delta_chunk_fwd.cuh (WsLayout).
// Since session 12 this file holds everything the kernel uses beyond delta_chunk_fwd.cuh: the scans it descends
// from -- the bulk-prefetch scan3 (=4), the split forward scan4 + out (=5 / 6) and the warp-specialized scan5 (=7),
// whose shared-memory layout, recurrence (ScanRec) and handoff scan6 kept -- were retired then (docs/cuda.md,
// "Retired kernels"); the move changed no instruction of scan6's SASS (sm_90a, both KP).
//
// Why (session 11): Nsight Compute of scan5 (h200_session10_ncu_kda_fwd_scan5_summary.txt,
// h200x2_session11_ncu_gdn_fwd_scan5_summary.txt) showed L1/TEX at 80-81 % with issue at 48 %: the SM's L1 /
// shared-memory data path (one 128-byte wavefront per cycle) is the limit, not the tensor cores. scan5's
// wavefronts per (block, chunk) at KP = 128, from its SASS: U = u0 - w h 1024 (each of 8 warps, a 16 x 16 tile,
// reads a 16 x 128 w row block, LDS.128, and all of h for its 16 columns: every w fragment read by 2 warps, h by
// 4), h update 512, output 768 shared (each of 8 output warps a 16 x 16 tile: h read 4 times) + ~384 global (the
// q~ / A~ fragments of a row block loaded by 2 warps), h / U stores ~220, operand bulk copies ~390: ~3.3k of the
// ~4.7k cycles of a chunk step (ncu clock; L1 81 %).
// The fix is larger warp tiles ((m + n) K bytes for m x n outputs), arranged so that every output element is
// accumulated exactly as scan5 did it (U: chain a0 over the even k-steps, a1 over the odd ones, u0 - (a0 + a1);
// h: the decay, then the 8 k-steps; o: the q~ h chain and the A~ U chain, summed at the end): o and the final state
// were bit-identical to scan5's (and scan3's) in session 11's tests.
// U by 4 of the 8 recurrence warps, warp wi rows 16 wi .. 16 wi + 15 and all 32 columns (each w fragment read once:
// 768 wavefronts); 4 output warps, warp wi rows 16 wi .., 32 columns (q~ / A~ fragments loaded once: ~192 global
// wavefronts; shared 768 as scan5). (A variant with the U and o chains split over warp pairs that hand partial sums
// over through shared memory and named barriers, KDA_CUDA_CHUNK_SCAN=9, measured 0.427 ms and was removed.)
// The h update keeps scan5's tiles (rows [wi KP/4, (wi+1) KP/4), columns 16 wc ..) with each U fragment loaded
// once for both row tiles.
// Block: 8 recurrence warps + 4 output warps = 384 threads (at most 168 registers each; ptxas: 146 at KP = 128, 136
// at 64, no spills); shared memory Scan6Smem (187 KB at KP = 128); one block per SM. Handoff: h_c / U_c in NB = 3
// shared buffers, full[b] (8 arrivals, lane 0 after __syncwarp: the warps that write U_c's final values after those
// writes, the others at the top of the chunk step, once their part of h_c is complete, i.e. after the named barrier
// 1 that ended the previous step) and empty[b] (4 arrivals, one per output warp after its last reads). Emulated:
// tests/test_cuda_scan6_emu.py (index math), tests/test_cuda_scan6_handoff_emu.py (buffers and mbarriers).
#pragma once

#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kScan6Threads = 384;  // 8 recurrence warps, then 4 output warps
constexpr int kScan6RecThreads = 256;
constexpr int kScan6OutWarps = (kScan6Threads - kScan6RecThreads) / 32;
constexpr int kScan6MaxV = 256;  // the V range the host sends to this kernel (and its tests cover)

// Shared memory (the layout of scan4 / scan5, retired in session 12, kept): two operand buffers (one chunk's
// w fp32 fragments | k~^T bf16 fragments | decay, filled by cp.async.bulk two chunks ahead), NB h_c / U_c buffers
// (tf32-rounded, row stride LDH), the mbarriers. 187 KB at KP = 128, one block per SM.
template <int KP>
struct Scan6Smem {
  static constexpr int BV = 32;        // columns of V per block
  static constexpr int LDH = BV + 8;   // conflict-free B-fragment reads
  static constexpr int NB = 3;         // h_c / U_c buffers
  static constexpr uint32_t w_bytes = kChunk * KP * 4;    // fp32 fragments
  static constexpr uint32_t kg_bytes = kChunk * KP * 2;   // bf16 fragments
  static constexpr uint32_t dec_bytes = KP * 4;
  static constexpr uint32_t region = w_bytes + kg_bytes + dec_bytes;  // one operand buffer: w | k~^T | decay
  static constexpr int hs_floats = KP * LDH;
  static constexpr int us_floats = kChunk * LDH;
  static constexpr size_t hs_off = 2 * static_cast<size_t>(region);
  static constexpr size_t us_off = hs_off + sizeof(float) * NB * hs_floats;
  static constexpr size_t bar_off = us_off + sizeof(float) * NB * us_floats;
  // mbarriers: operand buffers 0, 1; full[NB]; empty[NB]
  static constexpr size_t bytes = bar_off + (2 + 2 * NB) * sizeof(uint64_t);
  static_assert(w_bytes % 16 == 0 && kg_bytes % 16 == 0 && dec_bytes % 16 == 0, "bulk copies move 16-byte multiples");
  static_assert(bytes <= 227 * 1024, "scan6: more shared memory than one block may have");
};

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

// B operands kept rounded: hs / Us hold tf32(h) / tf32(U) (tf32_round), the values mma8 would convert them to at
// every use, so the k-steps below pass their bits to the mma as they are (the same products, fewer instructions).
__device__ __forceinline__ float tf32_round(float x) { return __uint_as_float(to_tf32(x)); }

// acc[nt] += A * B[k0 .. k0 + 8][8 nt .. 8 nt + 8]: A the tf32 bits (a0..a3) of a 16 x 8 fragment, B a row-major
// shared tile of tf32-rounded values (row stride ld).
template <int N8>
__device__ __forceinline__ void mma_tiles_rounded(float (&acc)[N8][4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                  uint32_t a3, const float* B, int ld, int k0, int t4, int gq) {
#pragma unroll
  for (int nt = 0; nt < N8; ++nt)
    mma_tf32_raw(acc[nt], a0, a1, a2, a3, __float_as_uint(B[(k0 + t4) * ld + nt * 8 + gq]),
                 __float_as_uint(B[(k0 + t4 + 4) * ld + nt * 8 + gq]));
}
// The same with A an fp32 fragment (rounded here, as mma8 does) ...
template <int N8>
__device__ __forceinline__ void mma_tiles_rounded(float (&acc)[N8][4], const float4& a, const float* B, int ld,
                                                  int k0, int t4, int gq) {
  mma_tiles_rounded(acc, to_tf32(a.x), to_tf32(a.y), to_tf32(a.z), to_tf32(a.w), B, ld, k0, t4, gq);
}
// ... or a bf16 workspace fragment (exact in tf32: the bits frag_unpack gave).
template <int N8>
__device__ __forceinline__ void mma_tiles_rounded(float (&acc)[N8][4], const uint2& f, const float* B, int ld, int k0,
                                                  int t4, int gq) {
  mma_tiles_rounded(acc, f.x << 16, f.x & 0xffff0000u, f.y << 16, f.y & 0xffff0000u, B, ld, k0, t4, gq);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A plain arrival (release at CTA scope) on an mbarrier.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The recurrence warps' own barrier (named barrier 1; __syncthreads is barrier 0).
__device__ __forceinline__ void rec_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kScan6RecThreads) : "memory"); }

// The recurrence of scan6, one of its 8 recurrence warps, warp w = 4 wc + wi, of a (sequence, value head, 32
// columns) block: it holds rows [wi KP/4, (wi+1) KP/4) of h for the 16 columns cw = 16 wc .. cw + 15 of the block
// in registers (hacc); the warps 0..3 also form U for rows 16 wi .. 16 wi + 15 and all 32 columns (u0w: their u0,
// loaded a chunk ahead). The operands (w fp32 fragments | k~^T bf16 fragments | decay: Scan6Smem's region) come
// from shared memory. (The retired scan4 / scan5 ran this recurrence with U in 16-column tiles per warp, ScanRec.)
template <int KP>
struct ScanRec6 {
  static constexpr int BV = Scan6Smem<KP>::BV;
  static constexpr int LDH = Scan6Smem<KP>::LDH;
  static constexpr int WC = BV / 2;   // columns of h per warp
  static constexpr int NT = WC / 8;   // 8-column tiles of the h update (16 columns)
  static constexpr int MT = KP / 64;  // 16-row tiles of h per warp
  static constexpr int NTU = 2 * NT;  // 8-column tiles of U (32 columns)
  int lane, wi, cw, gq, t4;
  float hacc[MT][NT][4];
  float u0w[NTU][4];  // u0 of this warp's U rows, all 32 columns (warps 0..3)

  __device__ __forceinline__ ScanRec6(int tid) {
    lane = tid & 31;
    const int w = (tid >> 5) & 7;
    wi = w & 3;
    cw = (w >> 2) * WC;
    gq = lane >> 2;
    t4 = lane & 3;
  }
  // h from h0 (zeros without one); sbase: the (sequence, head) offset of h0 / ht
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
  // tf32(h) -> hs [KP x LDH]
  __device__ __forceinline__ void store_h(float* hs) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (wi * MT + mt) * 16 + gq + (e >> 1) * 8;
          hs[r * LDH + cw + nt * 8 + 2 * t4 + (e & 1)] = tf32_round(hacc[mt][nt][e]);
        }
  }
  // the final state
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
  // u0 of a chunk, 32 columns (ws: its workspace slice)
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
  // U = u0 - w h for rows 16 wi .. 16 wi + 15 and all 32 columns, stored as tf32(U) into Us (two chains per
  // element: a0 over the even k-steps, a1 over the odd ones, u0 - (a0 + a1); buf: the chunk's operand region)
  __device__ __forceinline__ void u_step_store(const unsigned char* buf, const float* hs, float* Us) const {
    const float4* sw = reinterpret_cast<const float4*>(buf) + wi * (KP / 8) * 32 + lane;  // fp32 fragments
    float a0[NTU][4], a1[NTU][4];
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ks += 2) {
      mma_tiles_rounded(a0, sw[ks * 32], hs, LDH, ks * 8, t4, gq);
      mma_tiles_rounded(a1, sw[(ks + 1) * 32], hs, LDH, (ks + 1) * 8, t4, gq);
    }
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        Us[r * LDH + nt * 8 + 2 * t4 + (e & 1)] = tf32_round(u0w[nt][e] - (a0[nt][e] + a1[nt][e]));
      }
  }
  // h <- Diag(decay) h + k~^T U (Us: the whole chunk's U); each U fragment loaded once for both row tiles
  __device__ __forceinline__ void h_step(const unsigned char* buf, const float* Us) {
    using S = Scan6Smem<KP>;
    const uint2* sk = reinterpret_cast<const uint2*>(buf + S::w_bytes) + wi * MT * (kChunk / 8) * 32 + lane;
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
    const float* ub = Us + cw;
#pragma unroll
    for (int ks = 0; ks < kChunk / 8; ++ks) {
      uint32_t b0[NT], b1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        b0[nt] = __float_as_uint(ub[(ks * 8 + t4) * LDH + nt * 8 + gq]);
        b1[nt] = __float_as_uint(ub[(ks * 8 + t4 + 4) * LDH + nt * 8 + gq]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint2 f = sk[(mt * (kChunk / 8) + ks) * 32];
        const uint32_t x0 = f.x << 16, x1 = f.x & 0xffff0000u, x2 = f.y << 16, x3 = f.y & 0xffff0000u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_tf32_raw(hacc[mt][nt], x0, x1, x2, x3, b0[nt], b1[nt]);
      }
    }
  }
};

// One thread: the recurrence's operands of a chunk (w in pieces of at most 16 KB, k~^T, decay; src its workspace
// slice) into the shared region dst, complete_tx on bar (armed by the caller with Scan6Smem::region bytes).
template <int KP>
__device__ __forceinline__ void scan6_issue(uint32_t dst, const float* ws, const WsLayout<KP>& WL, uint32_t bar) {
  using S = Scan6Smem<KP>;
  constexpr uint32_t kBulkMax = 16384;
  const char* src = reinterpret_cast<const char*>(ws);
  for (uint32_t b = 0; b < S::w_bytes; b += kBulkMax)
    bulk_copy(dst + b, src + WL.w * 4 + b, min(kBulkMax, S::w_bytes - b), bar);
  for (uint32_t b = 0; b < S::kg_bytes; b += kBulkMax)
    bulk_copy(dst + S::w_bytes + b, src + WL.kg * 4 + b, min(kBulkMax, S::kg_bytes - b), bar);
  bulk_copy(dst + S::w_bytes + S::kg_bytes, src + WL.decay * 4, S::dec_bytes, bar);
}
#endif  // __CUDA_ARCH__ >= 900

template <int KP>
__global__ void __launch_bounds__(kScan6Threads, 1) delta_chunk_scan6_kernel(const ChunkFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan6Smem<KP>;
  using R = ScanRec6<KP>;
  constexpr int NB = S::NB;
  constexpr int LDH = S::LDH;
  constexpr uint32_t RB = S::region;
  const WsLayout<KP> WL(true);
  extern __shared__ __align__(128) unsigned char smem6[];
  float* const hs0 = reinterpret_cast<float*>(smem6 + S::hs_off);  // buffer b: hs0 + b hs_floats
  float* const us0 = reinterpret_cast<float*>(smem6 + S::us_off);
  const uint32_t opbar = smem_u32(smem6 + S::bar_off);  // operand buffer b's mbarrier: opbar + 8 b
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
      mbar_init(fullbar + 8 * b, kScan6RecThreads / 32);  // one arrival per recurrence warp (lane 0, __syncwarp)
      mbar_init(emptybar + 8 * b, kScan6OutWarps);
    }
    mbar_init_fence();
    if (nch > 0) mbar_arrive_expect_tx(opbar, RB);
    if (nch > 1) mbar_arrive_expect_tx(opbar + 8, RB);
  }
  __syncthreads();  // mbarriers initialised

  if (tid < kScan6RecThreads) {
    // ---- recurrence warps: 0..3 form U and update h, 4..7 update h ----
    R rec(tid);
    const int w = tid >> 5;
    const bool ufin = w < 4;  // forms U (arrives on full after its final values)
    rec.init_h(p, sbase, v0);
    rec.store_h(hs0);  // h_0 in buffer 0 (the output warps see it through full[0])
    rec_sync();        // hs complete
    auto issue = [&](int ci) {
      scan6_issue<KP>(smem_u32(smem6 + (ci & 1) * RB), chunk_ws(ci), WL, opbar + 8 * (ci & 1));
    };
    if (tid == 0) {
      if (nch > 0) issue(0);
      if (nch > 1) issue(1);
    }
    if (ufin && nch > 0) rec.load_u0w(chunk_ws(0), WL, v0, V);
    for (int ci = 0; ci < nch; ++ci) {
      const int b = ci % NB;
      const float* hs = hs0 + b * S::hs_floats;
      float* Us = us0 + b * S::us_floats;
      const unsigned char* buf = smem6 + (ci & 1) * RB;
      // this warp's part of h_c was written before the last rec_sync; U_c's writers arrive once it is final
      if (!ufin && rec.lane == 0) mbar_arrive(fullbar + 8 * b);
      mbar_wait_parity(opbar + 8 * (ci & 1), (ci >> 1) & 1);
      if (ufin) {
        rec.u_step_store(buf, hs, Us);
        __syncwarp();
        if (rec.lane == 0) mbar_arrive(fullbar + 8 * b);  // h_c and this warp's final U_c rows
        if (ci + 1 < nch) rec.load_u0w(chunk_ws(ci + 1), WL, v0, V);
      }
      rec_sync();  // Us complete
      rec.h_step(buf, Us);  // h <- Diag(decay) h + k~^T U
      if (ci + 1 < nch) {
        const int nb = (ci + 1) % NB;
        // buffer nb last held chunk ci + 1 - NB: wait until the output warps are done with it
        if (ci + 1 >= NB) mbar_wait_parity(emptybar + 8 * nb, ((ci + 1 - NB) / NB) & 1);
        rec.store_h(hs0 + nb * S::hs_floats);
      }
      rec_sync();  // h_{c+1} complete; every recurrence warp is done with operand buffer ci & 1
      if (tid == 0 && ci + 2 < nch) {
        mbar_arrive_expect_tx(opbar + 8 * (ci & 1), RB);
        issue(ci + 2);
      }
    }
    rec.store_ht(p, sbase, v0);
  } else {
    // ---- output warps: o = q~ h_c + A~ U_c (two chains, as scan3 / scan5), warp wi rows 16 wi .., 32 columns ----
    constexpr int NT = R::NTU;
    const int ot = tid - kScan6RecThreads, lane = ot & 31, wi = ot >> 5;
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
      const float* hs = hs0 + b * S::hs_floats;
      const float* Us = us0 + b * S::us_floats;
      const int L = min(kChunk, len - ci * kChunk);
      mbar_wait_parity(fullbar + 8 * b, (ci / NB) & 1);
      float a0[NT][4], a1[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) mma_tiles_rounded(a0, qf[ks], hs, LDH, ks * 8, t4, gq);
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks)
        if (ks < 2 * wi + 2) mma_tiles_rounded(a1, af[ks], Us, LDH, ks * 8, t4, gq);
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
