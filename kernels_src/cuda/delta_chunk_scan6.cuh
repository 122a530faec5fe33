// Warp-specialized chunked-forward scan with fewer shared-memory / L1 wavefronts: delta_chunk_scan6_kernel<KP>
// (KDA_CUDA_CHUNK_SCAN=8, the default since session 11: scan 0.300 vs scan5's 0.350 ms at B1 T8192 H16 HV32 on the
// H200; scan5 is KDA_CUDA_CHUNK_SCAN=7).
// Host: delta_chunk_fwd_host.cuh (run_chunk_scan). Math and workspace: delta_chunk_fwd.cuh (WsLayout).
//
// Why: Nsight Compute of scan5 (h200_session10_ncu_kda_fwd_scan5_summary.txt, h200x2_session11_ncu_gdn_fwd_scan5_
// summary.txt) shows L1/TEX at 80-81 % with issue at 48 %: the SM's L1 / shared-memory data path (one 128-byte
// wavefront per cycle) is the limit, not the tensor cores. scan5's wavefronts per (block, chunk) at KP = 128, from
// its SASS (LDS 196, LDS.128 16, LDS.64 16, HMMA 112 per iteration of both loops): U = u0 - w h 1024 (each of 8
// warps, a 16 x 16 tile, reads a 16 x 128 w row block, LDS.128, and all of h for its 16 columns: every w fragment
// is read by 2 warps, h by 4), h update 512, output 768 shared (each of 8 warps a 16 x 16 tile: h read 4 times)
// + ~384 global (the q~ / A~ fragments of a row block loaded by 2 warps), h / U stores ~220, operand bulk copies
// ~390: ~3.3k of the ~4.7k cycles of a chunk step (ncu clock; L1 81 %).
// The fix is larger warp tiles ((m + n) K bytes for m x n outputs), arranged so that every output element is
// accumulated exactly as scan5 does it (U: chain a0 over the even k-steps, a1 over the odd ones, u0 - (a0 + a1);
// h: the decay, then the 8 k-steps; o: the q~ h chain and the A~ U chain, summed at the end): o and the final state
// are bit-identical to scan5's (and scan3's).
// U by 4 of the 8 recurrence warps, warp wi rows 16 wi .. 16 wi + 15 and all 32 columns (each w fragment read once:
// 768 wavefronts); 4 output warps, warp wi rows 16 wi .., 32 columns (q~ / A~ fragments loaded once: ~192 global
// wavefronts; shared 768 as scan5). (A variant with the U and o chains split over warp pairs that hand partial sums
// over through shared memory and named barriers, KDA_CUDA_CHUNK_SCAN=9, measured 0.427 ms and was removed.)
// The h update keeps ScanRec's tiles (rows [wi KP/4, (wi+1) KP/4), columns 16 wc ..) with each U fragment
// loaded once for both row tiles (scan5's compiled code already shares them: no change in wavefronts).
// Block: 8 recurrence warps + 4 output warps = 384 threads (at most 168 registers each); shared memory scan5's
// (187 KB at KP = 128); one block per SM. Handoff as scan5: h_c / U_c in NB = 3 shared
// buffers, full[b] (8 arrivals, lane 0 after __syncwarp: the warps that write U_c's final values after those
// writes, the others at the top of the chunk step, once their part of h_c is complete, i.e. after the named barrier 1 that ended the previous step) and
// empty[b] (4 arrivals, one per output warp after its last reads). Emulated: tests/test_cuda_scan6_emu.py.
#pragma once

#include "delta_chunk_scan5.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kScan6Threads = 384;  // 8 recurrence warps, then 4 output warps
constexpr int kScan6RecThreads = 256;
constexpr int kScan6OutWarps = (kScan6Threads - kScan6RecThreads) / 32;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The recurrence of scan6: ScanRec's h ownership (hacc: rows [wi KP/4, (wi+1) KP/4), columns cw .. cw + 15) and
// init / store, U over all 32 columns by the warps 0..3, the h update with U fragments loaded once.
template <int KP>
struct ScanRec6 : ScanRec<KP> {
  using B = ScanRec<KP>;
  static constexpr int LDH = B::LDH;
  static constexpr int MT = B::MT;
  static constexpr int NT = B::NT;    // 8-column tiles of the h update (16 columns)
  static constexpr int NTU = 2 * NT;  // 8-column tiles of U (32 columns)
  float u0w[NTU][4];                  // u0 of this warp's U rows, all 32 columns (warps 0..3)

  __device__ __forceinline__ ScanRec6(int tid) : B(tid) {}
  // u0 of a chunk, 32 columns (ws: its workspace slice)
  __device__ __forceinline__ void load_u0w(const float* ws, const WsLayout<KP>& WL, int v0, int V) {
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = this->wi * 16 + this->gq + (e >> 1) * 8;
        const int c = v0 + nt * 8 + 2 * this->t4 + (e & 1);
        u0w[nt][e] = c < V ? __ldg(ws + WL.u + r * V + c) : 0.f;
      }
  }
  // U = u0 - w h for rows 16 wi .. 16 wi + 15 and all 32 columns, stored as tf32(U) into Us (ScanRec::u_step's
  // chains per element: a0 over the even k-steps, a1 over the odd ones, u0 - (a0 + a1))
  __device__ __forceinline__ void u_step_store(const unsigned char* buf, const float* hs, float* Us) const {
    const float4* sw = reinterpret_cast<const float4*>(buf) + this->wi * (KP / 8) * 32 + this->lane;
    float a0[NTU][4], a1[NTU][4];
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ks += 2) {
      mma_tiles_rounded(a0, sw[ks * 32], hs, LDH, ks * 8, this->t4, this->gq);
      mma_tiles_rounded(a1, sw[(ks + 1) * 32], hs, LDH, (ks + 1) * 8, this->t4, this->gq);
    }
#pragma unroll
    for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = this->wi * 16 + this->gq + (e >> 1) * 8;
        Us[r * LDH + nt * 8 + 2 * this->t4 + (e & 1)] = tf32_round(u0w[nt][e] - (a0[nt][e] + a1[nt][e]));
      }
  }
  // h <- Diag(decay) h + k~^T U (Us: the whole chunk's U); each U fragment loaded once for both row tiles
  __device__ __forceinline__ void h_step(const unsigned char* buf, const float* Us) {
    using S = Scan4Smem<KP>;
    const uint2* sk = reinterpret_cast<const uint2*>(buf + S::w_bytes) + this->wi * MT * (kChunk / 8) * 32 + this->lane;
    const float* sd = reinterpret_cast<const float*>(buf + S::w_bytes + S::kg_bytes);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float d0 = sd[(this->wi * MT + mt) * 16 + this->gq], d1 = sd[(this->wi * MT + mt) * 16 + this->gq + 8];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        this->hacc[mt][nt][0] *= d0;
        this->hacc[mt][nt][1] *= d0;
        this->hacc[mt][nt][2] *= d1;
        this->hacc[mt][nt][3] *= d1;
      }
    }
    const float* ub = Us + this->cw;
#pragma unroll
    for (int ks = 0; ks < kChunk / 8; ++ks) {
      uint32_t b0[NT], b1[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        b0[nt] = __float_as_uint(ub[(ks * 8 + this->t4) * LDH + nt * 8 + this->gq]);
        b1[nt] = __float_as_uint(ub[(ks * 8 + this->t4 + 4) * LDH + nt * 8 + this->gq]);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint2 f = sk[(mt * (kChunk / 8) + ks) * 32];
        const uint32_t x0 = f.x << 16, x1 = f.x & 0xffff0000u, x2 = f.y << 16, x3 = f.y & 0xffff0000u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_tf32_raw(this->hacc[mt][nt], x0, x1, x2, x3, b0[nt], b1[nt]);
      }
    }
  }
};
#endif  // __CUDA_ARCH__ >= 900

template <int KP>
__global__ void __launch_bounds__(kScan6Threads, 1) delta_chunk_scan6_kernel(const ChunkFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan5Smem<KP>;  // scan5's shared memory
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
      scan4_issue<KP>(smem_u32(smem6 + (ci & 1) * RB), chunk_ws(ci), WL, opbar + 8 * (ci & 1));
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
