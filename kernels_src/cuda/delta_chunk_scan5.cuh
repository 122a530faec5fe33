// Warp-specialized chunked-forward scan delta_chunk_scan5_kernel (KDA_CUDA_CHUNK_SCAN=7; the default since
// session 9: scan 0.35 vs scan3's 0.48 ms at B1 T8192 H16 HV32 on the H200).
// Host: delta_chunk_fwd_host.cuh (run_chunk_scan). Math and workspace: delta_chunk_fwd.cuh (WsLayout).
//
// The bulk-prefetch scan (delta_chunk_scan3_kernel) computes, serially over a sequence's chunks, U = u0 - w h, the
// output o = q~ h + A~ U and h <- Diag(decay) h + k~^T U in one set of warps, so the output products sit on the
// recurrence's critical path (scan3 0.48 ms against the state-only scan4's 0.32 at B1 T8192 H16 HV32). Only U and
// h depend on the previous chunk: o of chunk c needs h_c (the state at its start) and U_c alone. Here one block
// (sequence, value head, 32 columns of V) runs two groups of 8 warps:
//  - recurrence warps 0..7: scan4's loop (ScanRec, delta_chunk_scan4.cuh: U and the h update, w / k~^T / decay
//    brought into two shared buffers by cp.async.bulk two chunks ahead), synchronised among themselves by the named
//    barrier 1 (256 threads). h_c and U_c live in NB = 3 shared buffers (the recurrence writes h_{c+1} into the
//    next buffer instead of overwriting h_c): buffer c % NB is handed to the output warps through the mbarrier
//    full[c % NB] (8 arrivals, one per recurrence warp: lane 0 after __syncwarp, once the warp stored its part of
//    U_c) and handed back through empty[c % NB] (8 arrivals, one per output warp after its last reads). The
//    recurrence waits on empty only before writing h_{c+1} into a buffer whose previous chunk (c + 1 - NB) the
//    output warps have not finished: they may lag it by up to NB - 1 chunk steps.
//  - output warps 8..15: o = q~ h_c + A~ U_c of each chunk, warp 8 + 4 wc + wi rows 16 wi .. 16 wi + 15 and columns
//    16 wc .. 16 wc + 15 (scan3's output split). Their q~ / A~ fragments (bf16, this warp's rows only) are loaded
//    from the workspace into registers a chunk ahead, after the previous chunk's products; o pairs of bf16 / fp16
//    go out in one 4-byte store (store_o2).
// Same products as scan3, in scan3's order (tf32 mma m16n8k8; h and U kept in shared memory already rounded to tf32,
// the operands scan3's mma8 converts them to at every use; o in two chains q~ h and A~ U summed at the end): o and
// the final state are scan3's.
// Shared memory at KP = 128: 2 x 48.5 KB operand buffers + 3 x (20 + 10) KB h_c / U_c buffers = 187 KB, one block
// per SM; 512 threads (at most 128 registers each).
#pragma once

#include "delta_chunk_scan4.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kScan5Threads = 512;  // 8 recurrence warps, then 8 output warps
constexpr int kScan5RecThreads = 256;

template <int KP>
struct Scan5Smem {
  using S4 = Scan4Smem<KP>;
  static constexpr int NB = 3;  // h_c / U_c buffers
  static constexpr int BV = S4::BV;
  static constexpr int LDH = S4::LDH;
  static constexpr uint32_t region = S4::region;  // one operand buffer: w | k~^T | decay
  static constexpr int hs_floats = KP * LDH;
  static constexpr int us_floats = kChunk * LDH;
  static constexpr size_t hs_off = 2 * static_cast<size_t>(region);
  static constexpr size_t us_off = hs_off + sizeof(float) * NB * hs_floats;
  static constexpr size_t bar_off = us_off + sizeof(float) * NB * us_floats;
  // mbarriers: operand buffers 0, 1; full[NB]; empty[NB]
  static constexpr size_t bytes = bar_off + (2 + 2 * NB) * sizeof(uint64_t);
  static_assert(bytes <= 227 * 1024, "scan5: more shared memory than one block may have");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// A plain arrival (release at CTA scope) on an mbarrier.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The recurrence warps' own barrier (named barrier 1; __syncthreads is barrier 0).
__device__ __forceinline__ void rec_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kScan5RecThreads) : "memory"); }
#endif  // __CUDA_ARCH__ >= 900

template <int KP>
__global__ void __launch_bounds__(kScan5Threads, 1) delta_chunk_scan5_kernel(const ChunkFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan5Smem<KP>;
  using R = ScanRec<KP>;
  constexpr int NB = S::NB;
  constexpr int LDH = S::LDH;
  constexpr uint32_t RB = S::region;
  const WsLayout<KP> WL(true);
  extern __shared__ __align__(128) unsigned char smem5[];
  float* const hs0 = reinterpret_cast<float*>(smem5 + S::hs_off);  // buffer b: hs0 + b hs_floats
  float* const us0 = reinterpret_cast<float*>(smem5 + S::us_off);
  const uint32_t opbar = smem_u32(smem5 + S::bar_off);  // operand buffer b's mbarrier: opbar + 8 b
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
      mbar_init(fullbar + 8 * b, kScan5RecThreads / 32);  // one arrival per warp (lane 0 after __syncwarp)
      mbar_init(emptybar + 8 * b, (kScan5Threads - kScan5RecThreads) / 32);
    }
    mbar_init_fence();
    if (nch > 0) mbar_arrive_expect_tx(opbar, RB);
    if (nch > 1) mbar_arrive_expect_tx(opbar + 8, RB);
  }
  __syncthreads();  // mbarriers initialised

  if (tid < kScan5RecThreads) {
    // ---- recurrence warps ----
    R rec(tid);
    rec.init_h(p, sbase, v0);
    rec.store_h(hs0);  // h_0 in buffer 0 (the output warps see it through full[0])
    rec_sync();        // hs complete
    auto issue = [&](int ci) {
      scan4_issue<KP>(smem_u32(smem5 + (ci & 1) * RB), chunk_ws(ci), WL, opbar + 8 * (ci & 1));
    };
    if (tid == 0) {
      if (nch > 0) issue(0);
      if (nch > 1) issue(1);
    }
    if (nch > 0) rec.load_u0(chunk_ws(0), WL, v0, V);
    for (int ci = 0; ci < nch; ++ci) {
      const int b = ci % NB;
      const float* hs = hs0 + b * S::hs_floats;
      float* Us = us0 + b * S::us_floats;
      const unsigned char* buf = smem5 + (ci & 1) * RB;
      mbar_wait_parity(opbar + 8 * (ci & 1), (ci >> 1) & 1);
      float u[R::NT][4];
      rec.u_step(buf, hs, u);  // U = u0 - w h
      rec.store_u(Us, u);
      __syncwarp();
      if (rec.lane == 0) mbar_arrive(fullbar + 8 * b);  // h_c (written before the last rec_sync) and this warp's U_c
      if (ci + 1 < nch) rec.load_u0(chunk_ws(ci + 1), WL, v0, V);
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
    // ---- output warps: o = q~ h_c + A~ U_c (two chains, as scan3) ----
    constexpr int NT = R::NT;
    const int ot = tid - kScan5RecThreads, lane = ot & 31, w = ot >> 5, wi = w & 3;
    const int cw = (w >> 2) * R::WC;
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
      for (int ks = 0; ks < KP / 8; ++ks) mma_tiles_rounded(a0, qf[ks], hs + cw, LDH, ks * 8, t4, gq);
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks)
        if (ks < 2 * wi + 2) mma_tiles_rounded(a1, af[ks], Us + cw, LDH, ks * 8, t4, gq);
      __syncwarp();
      if (lane == 0) mbar_arrive(emptybar + 8 * b);  // this warp is done reading h_c and U_c
      if (ci + 1 < nch) load_frags(ci + 1);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = wi * 16 + gq + h * 8;
          const int c = v0 + cw + nt * 8 + 2 * t4;
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
