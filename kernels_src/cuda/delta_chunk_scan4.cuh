// Split chunked forward, part 1 (KDA_CUDA_CHUNK_SCAN=5 / 6, off by default): the state-only scan
// delta_chunk_scan4_kernel. Part 2, the parallel output kernel, is delta_chunk_out.cuh; host:
// delta_chunk_fwd_host.cuh (chunk_scan_run). Math and workspace: delta_chunk_fwd.cuh (WsLayout).
//
// The bulk-prefetch scan (delta_chunk_scan3_kernel) computes, serially over a sequence's chunks, U = u0 - w h, the
// output o = q~ h + A~ U and h <- Diag(decay) h + k~^T U. Only U and h depend on the previous chunk; o of chunk c
// needs h_c (the state at the start of chunk c) and U_c alone. So this kernel runs only the recurrence and stores,
// per (chunk, value head), h_c [KP x vp] and U_c [64 x vp] (row-major, vp = V rounded up to 8; fp32, or bf16 with
// HB), and delta_chunk_out_kernel computes every chunk's o in parallel afterwards.
// Per chunk step the loop reads w (fp32 fragments, 256 KP bytes), k~^T (bf16 fragments, 128 KP bytes) and the
// decay (4 KP bytes): 48.5 KB at KP = 128 instead of scan3's 72.5 KB (no q~, no A~), with two barriers instead of
// three (nothing reads h after U is formed, so h is rewritten right after the first barrier).
// Same products as scan3 (tf32 mma m16n8k8, w and u0 fp32, h and U fp32 in shared memory): the final state is
// scan3's up to fp32 summation order; the output path sees tf32(h_c), tf32(U_c) as scan3 does (fp32 storage) or
// their bf16 roundings (HB).
// Block (sequence, value head, 32 columns of V), 8 warps: warp w = 4 wc + wi computes rows 16 wi .. 16 wi + 15 of
// U and rows [wi KP/4, (wi+1) KP/4) of h for the 16 columns 16 wc .. 16 wc + 15 of the block's 32. Two shared
// buffers of the per-chunk operands, filled by cp.async.bulk (mbarrier complete_tx) two chunks ahead.
#pragma once

#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {

// Where the split forward keeps h_c and U_c (allocated per call by the host).
struct ChunkSplitWs {
  void* hc;  // [chunk slot, HV, KP, vp]: the state at the start of each chunk (fp32, or bf16 when HB)
  void* uc;  // [chunk slot, HV, 64, vp]: U = u0 - w h of each chunk
  int vp;    // row length: V rounded up to a multiple of 8 (columns >= V hold zeros)
};

constexpr int kScan4Threads = 256;

template <int KP>
struct Scan4Smem {
  static constexpr int BV = 32;
  static constexpr int LDH = BV + 8;  // conflict-free B-fragment reads
  static constexpr uint32_t w_bytes = kChunk * KP * 4;    // fp32 fragments
  static constexpr uint32_t kg_bytes = kChunk * KP * 2;   // bf16 fragments
  static constexpr uint32_t dec_bytes = KP * 4;
  static constexpr uint32_t region = w_bytes + kg_bytes + dec_bytes;  // one buffer: w | k~^T | decay
  static constexpr size_t hs_off = 2 * static_cast<size_t>(region);
  static constexpr size_t us_off = hs_off + sizeof(float) * KP * LDH;
  static constexpr size_t bar_off = us_off + sizeof(float) * kChunk * LDH;
  static constexpr size_t bytes = bar_off + 2 * sizeof(uint64_t);
  static_assert(w_bytes % 16 == 0 && kg_bytes % 16 == 0 && dec_bytes % 16 == 0, "bulk copies move 16-byte multiples");
};

// Two adjacent elements (i even) of an h_c / U_c row: fp32 or bf16.
template <bool HB>
__device__ __forceinline__ void split_put2(void* base, int64_t i, float x, float y) {
  if constexpr (HB) reinterpret_cast<__nv_bfloat162*>(base)[i >> 1] = __floats2bfloat162_rn(x, y);
  else reinterpret_cast<float2*>(base)[i >> 1] = make_float2(x, y);
}

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
// ... or a bf16 workspace fragment (exact in tf32: frag_unpack's bits).
template <int N8>
__device__ __forceinline__ void mma_tiles_rounded(float (&acc)[N8][4], const uint2& f, const float* B, int ld, int k0,
                                                  int t4, int gq) {
  mma_tiles_rounded(acc, f.x << 16, f.x & 0xffff0000u, f.y << 16, f.y & 0xffff0000u, B, ld, k0, t4, gq);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The recurrence shared by the state-only scan (scan4) and the warp-specialized scan (delta_chunk_scan5.cuh): one
// of 8 warps, warp w = 4 wc + wi, of a (sequence, value head, 32 columns) block. It holds rows
// [wi KP/4, (wi+1) KP/4) of h for the 16 columns 16 wc .. 16 wc + 15 of the block in registers (hacc) and this
// chunk's u0 rows 16 wi .. 16 wi + 15 (u0r, loaded a chunk ahead); the operands (w fp32 fragments | k~^T bf16
// fragments | decay: Scan4Smem's region) come from shared memory.
template <int KP>
struct ScanRec {
  static constexpr int BV = Scan4Smem<KP>::BV;
  static constexpr int LDH = Scan4Smem<KP>::LDH;
  static constexpr int WC = BV / 2;   // columns per warp
  static constexpr int NT = WC / 8;   // 8-column tiles per warp
  static constexpr int MT = KP / 64;  // 16-row tiles of h per warp
  int lane, wi, cw, gq, t4;
  float hacc[MT][NT][4];
  float u0r[NT][4];

  __device__ __forceinline__ ScanRec(int tid) {
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
  // u0 of a chunk (ws: its workspace slice)
  __device__ __forceinline__ void load_u0(const float* ws, const WsLayout<KP>& WL, int v0, int V) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        const int c = v0 + cw + nt * 8 + 2 * t4 + (e & 1);
        u0r[nt][e] = c < V ? __ldg(ws + WL.u + r * V + c) : 0.f;
      }
  }
  // u = u0 - w h for this warp's 16 rows and 16 columns (two chains: even / odd k-steps); buf: the chunk's region
  __device__ __forceinline__ void u_step(const unsigned char* buf, const float* hs, float (&u)[NT][4]) const {
    const float4* sw = reinterpret_cast<const float4*>(buf) + wi * (KP / 8) * 32 + lane;  // fp32 fragments
    float a0[NT][4], a1[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KP / 8; ks += 2) {
      mma_tiles_rounded(a0, sw[ks * 32], hs + cw, LDH, ks * 8, t4, gq);
      mma_tiles_rounded(a1, sw[(ks + 1) * 32], hs + cw, LDH, (ks + 1) * 8, t4, gq);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) u[nt][e] = u0r[nt][e] - (a0[nt][e] + a1[nt][e]);
  }
  // tf32(u) -> Us [64 x LDH]
  __device__ __forceinline__ void store_u(float* Us, const float (&u)[NT][4]) const {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = wi * 16 + gq + (e >> 1) * 8;
        Us[r * LDH + cw + nt * 8 + 2 * t4 + (e & 1)] = tf32_round(u[nt][e]);
      }
  }
  // h <- Diag(decay) h + k~^T U (Us: the whole chunk's U)
  __device__ __forceinline__ void h_step(const unsigned char* buf, const float* Us) {
    using S = Scan4Smem<KP>;
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
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks)
        mma_tiles_rounded(hacc[mt], sk[(mt * (kChunk / 8) + ks) * 32], Us + cw, LDH, ks * 8, t4, gq);
    }
  }
};

// One thread: the recurrence's operands of a chunk (w in pieces of at most 16 KB, k~^T, decay; src its workspace
// slice) into the shared region dst, complete_tx on bar (armed by the caller with Scan4Smem::region bytes).
template <int KP>
__device__ __forceinline__ void scan4_issue(uint32_t dst, const float* ws, const WsLayout<KP>& WL, uint32_t bar) {
  using S = Scan4Smem<KP>;
  constexpr uint32_t kBulkMax = 16384;
  const char* src = reinterpret_cast<const char*>(ws);
  for (uint32_t b = 0; b < S::w_bytes; b += kBulkMax)
    bulk_copy(dst + b, src + WL.w * 4 + b, min(kBulkMax, S::w_bytes - b), bar);
  for (uint32_t b = 0; b < S::kg_bytes; b += kBulkMax)
    bulk_copy(dst + S::w_bytes + b, src + WL.kg * 4 + b, min(kBulkMax, S::kg_bytes - b), bar);
  bulk_copy(dst + S::w_bytes + S::kg_bytes, src + WL.decay * 4, S::dec_bytes, bar);
}
#endif  // __CUDA_ARCH__ >= 900

template <int KP, bool HB>
__global__ void __launch_bounds__(kScan4Threads, 1) delta_chunk_scan4_kernel(const ChunkFwdParams p,
                                                                             const ChunkSplitWs sws) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Scan4Smem<KP>;
  using R = ScanRec<KP>;
  constexpr uint32_t RB = S::region;
  const WsLayout<KP> WL(true);
  extern __shared__ __align__(128) unsigned char smem4[];
  float* hs = reinterpret_cast<float*>(smem4 + S::hs_off);
  float* Us = reinterpret_cast<float*>(smem4 + S::us_off);
  const uint32_t bar0 = smem_u32(smem4 + S::bar_off);  // buffer b's mbarrier: bar0 + 8 b

  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * R::BV;
  const int tid = threadIdx.x;
  const int HV = p.HV, vp = sws.vp;
  R rec(tid);
  int64_t bos;
  int len;
  seq_bounds(p.cu_seqlens, n, p.T, bos, len);
  const int nch = (len + kChunk - 1) / kChunk;
  const int c_first = p.cu_seqlens != nullptr ? p.chunk_off[n] : n * p.nc_per_seq;
  const int64_t sbase = (static_cast<int64_t>(n) * HV + hv) * p.K * p.V;

  auto slot = [&](int ci) { return static_cast<int64_t>(c_first + ci) * HV + hv; };
  auto chunk_ws = [&](int ci) { return p.ws + slot(ci) * p.ws_stride; };
  auto issue = [&](int ci) { scan4_issue<KP>(smem_u32(smem4 + (ci & 1) * RB), chunk_ws(ci), WL, bar0 + 8 * (ci & 1)); };

  rec.init_h(p, sbase, v0);
  if (tid == 0) {
    mbar_init(bar0, 1);
    mbar_init(bar0 + 8, 1);
    mbar_init_fence();
    if (nch > 0) mbar_arrive_expect_tx(bar0, RB);
    if (nch > 1) mbar_arrive_expect_tx(bar0 + 8, RB);
  }
  rec.store_h(hs);
  __syncthreads();  // mbarriers initialised; hs complete
  if (tid == 0) {
    if (nch > 0) issue(0);
    if (nch > 1) issue(1);
  }
  if (nch > 0) rec.load_u0(chunk_ws(0), WL, v0, p.V);

  for (int ci = 0; ci < nch; ++ci) {
    const int64_t sl = slot(ci);
    // h_c, the state at the start of this chunk (columns < vp; those >= V are zero)
    {
      char* hc = reinterpret_cast<char*>(sws.hc) + sl * KP * vp * (HB ? 2 : 4);
#pragma unroll
      for (int mt = 0; mt < R::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < R::NT; ++nt) {
          const int r = (rec.wi * R::MT + mt) * 16 + rec.gq;
          const int c = v0 + rec.cw + nt * 8 + 2 * rec.t4;
          if (c < vp) {
            split_put2<HB>(hc, static_cast<int64_t>(r) * vp + c, rec.hacc[mt][nt][0], rec.hacc[mt][nt][1]);
            split_put2<HB>(hc, static_cast<int64_t>(r + 8) * vp + c, rec.hacc[mt][nt][2], rec.hacc[mt][nt][3]);
          }
        }
    }
    const unsigned char* buf = smem4 + (ci & 1) * RB;
    mbar_wait_parity(bar0 + 8 * (ci & 1), (ci >> 1) & 1);

    // U = u0 - w h
    float u[R::NT][4];
    rec.u_step(buf, hs, u);
    rec.store_u(Us, u);
    {
      char* uc = reinterpret_cast<char*>(sws.uc) + sl * kChunk * vp * (HB ? 2 : 4);
#pragma unroll
      for (int nt = 0; nt < R::NT; ++nt) {
        const int r = rec.wi * 16 + rec.gq;
        const int c = v0 + rec.cw + nt * 8 + 2 * rec.t4;
        if (c < vp) {
          split_put2<HB>(uc, static_cast<int64_t>(r) * vp + c, u[nt][0], u[nt][1]);
          split_put2<HB>(uc, static_cast<int64_t>(r + 8) * vp + c, u[nt][2], u[nt][3]);
        }
      }
    }
    if (ci + 1 < nch) rec.load_u0(chunk_ws(ci + 1), WL, v0, p.V);
    __syncthreads();  // Us complete; every warp is done reading hs

    rec.h_step(buf, Us);  // h <- Diag(decay) h + k~^T U
    rec.store_h(hs);      // nothing reads hs between the barrier above and the one below
    __syncthreads();      // hs complete for the next chunk; every warp is done with Us and buffer ci & 1
    if (tid == 0 && ci + 2 < nch) {
      mbar_arrive_expect_tx(bar0 + 8 * (ci & 1), RB);
      issue(ci + 2);
    }
  }
  rec.store_ht(p, sbase, v0);
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace cuda
}  // namespace kda_kernels
