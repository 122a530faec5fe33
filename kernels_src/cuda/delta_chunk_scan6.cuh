// Warp-specialized chunked-forward scan with fewer shared-memory / L1 wavefronts: delta_chunk_scan6_kernel<KP, KS>
// (opt-in since session 11: KDA_CUDA_CHUNK_SCAN=8 runs KS = false, 9 KS = true; the default stays scan5, 7).
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
//  KS = false (8): U by 4 of the 8 recurrence warps, warp wi rows 16 wi .. 16 wi + 15 and all 32 columns (each w
//   fragment read once: 768 wavefronts); 4 output warps, warp wi rows 16 wi .., 32 columns (q~ / A~ fragments
//   loaded once: ~192 global wavefronts; shared 768 as scan5).
//  KS = true (9): U by 4 recurrence warps as pairs (wr, kh): rows 32 wr .. 32 wr + 31, 32 columns, warp kh = 1
//   the odd k-steps' chain a1, stored (fp32) into U's own shared buffer at its fragment positions and handed over
//   by the named barrier 2 + wr (bar.arrive / bar.sync, 64 threads) to warp kh = 0, which runs the even chain a0 and
//   writes tf32(u0 - (a0 + a1)) over them (~512 + ~128 wavefronts); 4 output warps as pairs (wr, ch): rows 32 wr
//   .., 32 columns, ch = 0 the q~ h chain (128 mma), ch = 1 the A~ U chain, handed to ch = 0 through an 8 KB
//   scratch (named barriers 4 + wr full, 6 + wr empty) that adds them and stores o (~350 + ~128 wavefronts).
// In both, the h update keeps ScanRec's tiles (rows [wi KP/4, (wi+1) KP/4), columns 16 wc ..) with each U fragment
// loaded once for both row tiles (scan5's compiled code already shares them: no change in wavefronts).
// Block: 8 recurrence warps + 4 output warps = 384 threads (at most 168 registers each); shared memory scan5's
// (187 KB at KP = 128) + 8 KB scratch for KS; one block per SM. Handoff as scan5: h_c / U_c in NB = 3 shared
// buffers, full[b] (8 arrivals, lane 0 after __syncwarp: the warps that write U_c's final values after those
// writes, the others -- KS's kh = 1 warps too, whose partial chain only the kh = 0 warps read -- at the top of the
// chunk step, once their part of h_c is complete, i.e. after the named barrier 1 that ended the previous step) and
// empty[b] (4 arrivals, one per output warp after its last reads). Emulated: tests/test_cuda_scan6_emu.py.
#pragma once

#include "delta_chunk_scan5.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kScan6Threads = 384;  // 8 recurrence warps, then 4 output warps
constexpr int kScan6RecThreads = 256;
constexpr int kScan6OutWarps = (kScan6Threads - kScan6RecThreads) / 32;

template <int KP, bool KS>
struct Scan6Smem {
  using S5 = Scan5Smem<KP>;
  static constexpr size_t xs_off = (S5::bytes + 127) / 128 * 128;  // KS: the output pairs' scratch
  static constexpr size_t xs_bytes = KS ? 2 * 8 * 32 * sizeof(float4) : 0;
  static constexpr size_t bytes = KS ? xs_off + xs_bytes : S5::bytes;
  static_assert(bytes <= 227 * 1024, "scan6: more shared memory than one block may have");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Named barriers 2..7 of 64 threads (the pairs of KS; 0 is __syncthreads, 1 the recurrence warps' rec_sync).
__device__ __forceinline__ void pair_sync(int id) { asm volatile("bar.sync %0, 64;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pair_arrive(int id) { asm volatile("bar.arrive %0, 64;" ::"r"(id) : "memory"); }

// The recurrence of scan6: ScanRec's h ownership (hacc: rows [wi KP/4, (wi+1) KP/4), columns cw .. cw + 15) and
// init / store, U over all 32 columns by the warps 0..3, the h update with U fragments loaded once.
template <int KP, bool KS>
struct ScanRec6 : ScanRec<KP> {
  using B = ScanRec<KP>;
  static constexpr int LDH = B::LDH;
  static constexpr int MT = B::MT;
  static constexpr int NT = B::NT;    // 8-column tiles of the h update (16 columns)
  static constexpr int NTU = 2 * NT;  // 8-column tiles of U (32 columns)
  static constexpr int MU = KS ? 2 : 1;  // 16-row tiles of U per warp
  float u0w[MU][NTU][4];              // u0 of this warp's U rows, all 32 columns (warps 0..3; KS: 0, 1)

  __device__ __forceinline__ ScanRec6(int tid) : B(tid) {}
  // the first U row tile of this warp: wi (!KS), 2 wr (KS: wr = wi & 1)
  __device__ __forceinline__ int urt() const { return KS ? 2 * (this->wi & 1) : this->wi; }

  // u0 of a chunk, 32 columns (ws: its workspace slice)
  __device__ __forceinline__ void load_u0w(const float* ws, const WsLayout<KP>& WL, int v0, int V) {
#pragma unroll
    for (int mt = 0; mt < MU; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = (urt() + mt) * 16 + this->gq + (e >> 1) * 8;
          const int c = v0 + nt * 8 + 2 * this->t4 + (e & 1);
          u0w[mt][nt][e] = c < V ? __ldg(ws + WL.u + r * V + c) : 0.f;
        }
  }
  // !KS: U = u0 - w h for rows 16 wi .. 16 wi + 15 and all 32 columns, stored as tf32(U) into Us (ScanRec::u_step's
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
        Us[r * LDH + nt * 8 + 2 * this->t4 + (e & 1)] = tf32_round(u0w[0][nt][e] - (a0[nt][e] + a1[nt][e]));
      }
  }
  // KS: warp (wr, kh) = (wi & 1, wi >> 1) of the warps 0..3: rows 32 wr .. 32 wr + 31, all 32 columns, the chain
  // over the k-steps of parity kh (scan5's a0 for kh = 0, a1 for kh = 1, each in scan5's order). kh = 1 stores its
  // chain into Us (fp32, at its fragment positions) and arrives on the named barrier 2 + wr; kh = 0 waits there, reads
  // the same positions (the same lanes' fragments) and writes tf32(u0 - (a0 + a1)) over them.
  __device__ __forceinline__ void u_step_pair(const unsigned char* buf, const float* hs, float* Us) const {
    const int wr = this->wi & 1, kh = this->wi >> 1;
    const float4* sw = reinterpret_cast<const float4*>(buf) + this->lane;
    float acc[2][NTU][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
    for (int j = 0; j < KP / 16; ++j) {
      const int ks = 2 * j + kh;
      uint32_t b0[NTU], b1[NTU];
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt) {
        b0[nt] = __float_as_uint(hs[(ks * 8 + this->t4) * LDH + nt * 8 + this->gq]);
        b1[nt] = __float_as_uint(hs[(ks * 8 + this->t4 + 4) * LDH + nt * 8 + this->gq]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float4 a = sw[((2 * wr + mt) * (KP / 8) + ks) * 32];
        const uint32_t x0 = to_tf32(a.x), x1 = to_tf32(a.y), x2 = to_tf32(a.z), x3 = to_tf32(a.w);
#pragma unroll
        for (int nt = 0; nt < NTU; ++nt) mma_tf32_raw(acc[mt][nt], x0, x1, x2, x3, b0[nt], b1[nt]);
      }
    }
    if (kh == 1) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = (2 * wr + mt) * 16 + this->gq + h * 8;
            *reinterpret_cast<float2*>(Us + r * LDH + nt * 8 + 2 * this->t4) =
                make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
          }
      pair_arrive(2 + wr);
    } else {
      pair_sync(2 + wr);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = (2 * wr + mt) * 16 + this->gq + h * 8;
            float2* pu = reinterpret_cast<float2*>(Us + r * LDH + nt * 8 + 2 * this->t4);
            const float2 a1 = *pu;
            *pu = make_float2(tf32_round(u0w[mt][nt][2 * h] - (acc[mt][nt][2 * h] + a1.x)),
                              tf32_round(u0w[mt][nt][2 * h + 1] - (acc[mt][nt][2 * h + 1] + a1.y)));
          }
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

template <int KP, bool KS>
__global__ void __launch_bounds__(kScan6Threads, 1) delta_chunk_scan6_kernel(const ChunkFwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan5Smem<KP>;  // scan5's shared memory (+ Scan6Smem's scratch for KS)
  using R = ScanRec6<KP, KS>;
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
    // ---- recurrence warps: 0..3 form U (KS: 0, 1 finish it) and update h, 4..7 update h ----
    R rec(tid);
    const int w = tid >> 5;
    const bool uw = w < 4;                   // forms (part of) U
    const bool ufin = KS ? w < 2 : w < 4;    // writes U's final values (arrives on full after them)
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
      if (uw) {
        if constexpr (KS) rec.u_step_pair(buf, hs, Us);
        else rec.u_step_store(buf, hs, Us);
      }
      if (ufin) {
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
  } else if constexpr (!KS) {
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
  } else {
    // ---- KS output pairs (wr, ch): rows 32 wr .. 32 wr + 31, 32 columns; ch = 0 the chain q~ h (and the store of o),
    // ch = 1 the chain A~ U, handed to ch = 0 through the scratch xs[wr] (named barriers 4 + wr: written, 6 + wr: read)
    constexpr int NT = R::NTU;
    const int ot = tid - kScan6RecThreads, lane = ot & 31, ow = ot >> 5;
    const int wr = ow & 1, ch = ow >> 1;
    const int gq = lane >> 2, t4 = lane & 3;
    float4* const xs = reinterpret_cast<float4*>(smem6 + Scan6Smem<KP, KS>::xs_off) + wr * 8 * 32 + lane;
    const bool pair = p.in_dtype != kF32 && (V & 1) == 0;  // o pairs in one 4-byte store (store_o2)
    constexpr int NF = KP / 8 > kChunk / 8 ? KP / 8 : kChunk / 8;
    uint2 fr[2][NF];  // ch = 0: q~ fragments of row tiles 2 wr, 2 wr + 1 (KP / 8 k-steps); ch = 1: A~ (8 k-steps)
    auto load_frags = [&](int ci) {
      const float* ws = chunk_ws(ci);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int rt = 2 * wr + mt;
        if (ch == 0) {
          const uint2* sq = reinterpret_cast<const uint2*>(ws + WL.qg) + rt * (KP / 8) * 32 + lane;
#pragma unroll
          for (int ks = 0; ks < KP / 8; ++ks) fr[mt][ks] = __ldg(sq + ks * 32);
        } else {
          const uint2* sa = reinterpret_cast<const uint2*>(ws + WL.aqk) + rt * (kChunk / 8) * 32 + lane;
#pragma unroll
          for (int ks = 0; ks < kChunk / 8; ++ks)
            fr[mt][ks] = ks < 2 * rt + 2 ? __ldg(sa + ks * 32) : make_uint2(0u, 0u);
        }
      }
    };
    if (nch > 0) load_frags(0);
    for (int ci = 0; ci < nch; ++ci) {
      const int b = ci % NB;
      const float* hs = hs0 + b * S::hs_floats;
      const float* Us = us0 + b * S::us_floats;
      mbar_wait_parity(fullbar + 8 * b, (ci / NB) & 1);
      float acc[2][NT][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
      if (ch == 0) {  // q~ h_c (scan5's a0: k-steps 0 .. KP/8 - 1 in order)
#pragma unroll
        for (int ks = 0; ks < KP / 8; ++ks) {
          uint32_t b0[NT], b1[NT];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            b0[nt] = __float_as_uint(hs[(ks * 8 + t4) * LDH + nt * 8 + gq]);
            b1[nt] = __float_as_uint(hs[(ks * 8 + t4 + 4) * LDH + nt * 8 + gq]);
          }
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const uint2 f = fr[mt][ks];
            const uint32_t x0 = f.x << 16, x1 = f.x & 0xffff0000u, x2 = f.y << 16, x3 = f.y & 0xffff0000u;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_tf32_raw(acc[mt][nt], x0, x1, x2, x3, b0[nt], b1[nt]);
          }
        }
      } else {  // A~ U_c (scan5's a1: k-steps 0 .. 2 rt + 1 of row tile rt, in order)
#pragma unroll
        for (int ks = 0; ks < kChunk / 8; ++ks) {
          if (ks < 4 * wr + 4) {
            uint32_t b0[NT], b1[NT];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
              b0[nt] = __float_as_uint(Us[(ks * 8 + t4) * LDH + nt * 8 + gq]);
              b1[nt] = __float_as_uint(Us[(ks * 8 + t4 + 4) * LDH + nt * 8 + gq]);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              if (ks < 2 * (2 * wr + mt) + 2) {
                const uint2 f = fr[mt][ks];
                const uint32_t x0 = f.x << 16, x1 = f.x & 0xffff0000u, x2 = f.y << 16, x3 = f.y & 0xffff0000u;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_tf32_raw(acc[mt][nt], x0, x1, x2, x3, b0[nt], b1[nt]);
              }
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(emptybar + 8 * b);  // this warp is done reading h_c and U_c
      if (ci + 1 < nch) load_frags(ci + 1);
      if (ch == 1) {
        if (ci > 0) pair_sync(6 + wr);  // ch = 0 read the previous chunk's scratch
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            xs[(mt * NT + nt) * 32] = make_float4(acc[mt][nt][0], acc[mt][nt][1], acc[mt][nt][2], acc[mt][nt][3]);
        pair_arrive(4 + wr);
      } else {
        const int L = min(kChunk, len - ci * kChunk);
        pair_sync(4 + wr);  // the A~ U chain is in the scratch
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const float4 y = xs[(mt * NT + nt) * 32];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int r = (2 * wr + mt) * 16 + gq + h * 8;
              const int c = v0 + nt * 8 + 2 * t4;
              if (r < L && c < V)
                store_o2(p.o, ((bos + static_cast<int64_t>(ci) * kChunk + r) * HV + hv) * V + c, p.in_dtype, pair,
                         acc[mt][nt][2 * h] + (h ? y.z : y.x), acc[mt][nt][2 * h + 1] + (h ? y.w : y.y), c + 1 < V);
            }
          }
        pair_arrive(6 + wr);  // done reading the scratch
      }
    }
    if (ch == 1 && nch > 0) pair_sync(6 + wr);  // match ch = 0's last arrival
  }
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace cuda
}  // namespace kda_kernels
