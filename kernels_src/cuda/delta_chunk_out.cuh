// Split chunked forward, part 2 (KDA_CUDA_CHUNK_SCAN=5 / 6, off by default): delta_chunk_out_kernel, the output
// of every chunk in parallel from the state-only scan's h_c and U_c (delta_chunk_scan4.cuh):
//   o_c = q~_c h_c + A~_c U_c   (q~ = scale q e^G, A~ = scale A_qk Diag(beta): the prep's workspace, bf16)
// Block (chunk slot x 64-column tile, value head), 8 warps: warp w = 4 wc + wi computes rows 16 wi .. 16 wi + 15 of
// o for the 32 columns 32 wc .. 32 wc + 31 of the block's 64. h_c [KP x 64] and U_c [64 x 64] are staged in shared
// memory as tf32 (fp32 storage: rounded as scan3 rounds its fp32 h and U; bf16 storage: exact); q~ and A~ A
// fragments come straight from the workspace (bf16, m16n8k8 fragment order, exact in tf32); tf32 mma m16n8k8
// with fp32 accumulation in two chains (q~ h, A~ U), as in scan3. A~ is lower triangular: warp wi runs the
// 2 wi + 2 k-steps of A~ that reach its rows. 55 KB (KP 128) of shared memory: four blocks per SM.
#pragma once

#include "delta_chunk_scan4.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kOutThreads = 256;
constexpr int kOutBV = 64;

template <int KP>
struct OutSmem {
  static constexpr int LDB = kOutBV + 8;  // conflict-free B-fragment reads (8 t4 + gq covers the 32 banks)
  static constexpr size_t us_off = sizeof(uint32_t) * KP * LDB;
  static constexpr size_t bytes = us_off + sizeof(uint32_t) * kChunk * LDB;
};

template <int KP, bool HB>
__global__ void __launch_bounds__(kOutThreads, 4) delta_chunk_out_kernel(const ChunkFwdParams p, const ChunkSplitWs sws) {
  using S = OutSmem<KP>;
  constexpr int LDB = S::LDB;
  constexpr int NT = 4;  // 8-column tiles per warp (32 columns)
  // blockIdx.x = chunk slot * column tiles + tile: the tiles of one (chunk, head) run side by side (q~, A~ from L2)
  const int ntile = (sws.vp + kOutBV - 1) / kOutBV;
  const int cid = blockIdx.x / ntile, hv = blockIdx.y, c0 = (blockIdx.x - cid * ntile) * kOutBV;
  int64_t tok0;
  int L;
  if (!chunk_coords(p, cid, tok0, L)) return;  // a slot past the last chunk (varlen)
  extern __shared__ __align__(16) unsigned char smo[];
  uint32_t* hs = reinterpret_cast<uint32_t*>(smo);
  uint32_t* us = reinterpret_cast<uint32_t*>(smo + S::us_off);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, wi = w & 3, wc = w >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int HV = p.HV, V = p.V, vp = sws.vp;
  const int64_t sl = static_cast<int64_t>(cid) * HV + hv;
  const WsLayout<KP> WL(true);
  const float* ws = p.ws + sl * p.ws_stride;

  // stage R rows x 64 columns (from column c0) of a row-major [R x vp] block as tf32; columns >= vp are zero
  auto stage = [&](uint32_t* dst, const void* src, int R) {
    for (int i = tid; i < R * (kOutBV / 4); i += kOutThreads) {
      const int r = i / (kOutBV / 4), c4 = (i % (kOutBV / 4)) * 4, c = c0 + c4;
      uint4 t = make_uint4(0u, 0u, 0u, 0u);
      if (c < vp) {  // vp and c are multiples of 4: the whole group is in range
        const int64_t e = static_cast<int64_t>(r) * vp + c;
        if constexpr (HB) {
          const uint2 u = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(src) + e));
          t = make_uint4(u.x << 16, u.x & 0xffff0000u, u.y << 16, u.y & 0xffff0000u);  // bf16 is exact in tf32
        } else {
          const float4 x = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(src) + e));
          t = make_uint4(to_tf32(x.x), to_tf32(x.y), to_tf32(x.z), to_tf32(x.w));
        }
      }
      *reinterpret_cast<uint4*>(dst + r * LDB + c4) = t;
    }
  };
  const size_t esz = HB ? 2 : 4;
  stage(hs, reinterpret_cast<const char*>(sws.hc) + sl * KP * vp * esz, KP);
  stage(us, reinterpret_cast<const char*>(sws.uc) + sl * kChunk * vp * esz, kChunk);

  // A fragments of this warp's rows (bf16 in the workspace), loaded while the tiles above land
  const uint2* sq = reinterpret_cast<const uint2*>(ws + WL.qg) + wi * (KP / 8) * 32 + lane;
  const uint2* sa = reinterpret_cast<const uint2*>(ws + WL.aqk) + wi * (kChunk / 8) * 32 + lane;
  uint2 qf[KP / 8];
#pragma unroll
  for (int ks = 0; ks < KP / 8; ++ks) qf[ks] = __ldg(sq + ks * 32);
  __syncthreads();

  float a0[NT][4], a1[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) a0[nt][e] = a1[nt][e] = 0.f;
  const int cw = wc * 32;
  auto kstep = [&](float (&acc)[NT][4], const uint2& f, const uint32_t* B, int k0) {
    const uint32_t x0 = f.x << 16, x1 = f.x & 0xffff0000u, x2 = f.y << 16, x3 = f.y & 0xffff0000u;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mma_tf32_raw(acc[nt], x0, x1, x2, x3, B[(k0 + t4) * LDB + cw + nt * 8 + gq],
                   B[(k0 + t4 + 4) * LDB + cw + nt * 8 + gq]);
  };
#pragma unroll
  for (int ks = 0; ks < KP / 8; ++ks) kstep(a0, qf[ks], hs, ks * 8);
#pragma unroll
  for (int ks = 0; ks < kChunk / 8; ++ks)
    if (ks < 2 * wi + 2) kstep(a1, __ldg(sa + ks * 32), us, ks * 8);

  // o: pairs of adjacent columns in one 4-byte store for bf16 / fp16 outputs with V even (rounding as store_in)
  const bool pair = p.in_dtype != kF32 && (V & 1) == 0;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wi * 16 + gq + h * 8;
      const int c = c0 + cw + nt * 8 + 2 * t4;
      const float x = a0[nt][2 * h] + a1[nt][2 * h], y = a0[nt][2 * h + 1] + a1[nt][2 * h + 1];
      if (r >= L || c >= V) continue;
      const int64_t i = ((tok0 + r) * HV + hv) * V + c;  // even when V is
      store_o2(p.o, i, p.in_dtype, pair, x, y, c + 1 < V);
    }
}

}  // namespace cuda
}  // namespace kda_kernels
