// Decode kernel for K-first 2-byte (bf16 / fp16) state pools, K = V = 128, one token per sequence (session 12,
// KDA_CUDA_DEC_KF16=1..4; off by default). Same math as delta_decode_kernel (delta_recurrent_fwd.cuh): pass 1
// p = (Diag(e^g) S)^T k, del = beta (v - p), pass 2 S' = Diag(e^g) S + k del^T stored, o = scale S'^T q.
//
// Why another tiling: with K-first 2-byte states the default (cfg 1: 32 columns, 2 warps per item) moves 64
// contiguous bytes of a row per 4 lanes, so one warp-wide 16-byte access touches 8 half lines; the one-warp tiling
// (cfg 0: 16 columns) touches 16 quarter lines and measured 17 % slower than cfg 1, while V-first cfg 0 (one warp
// per item, 2 x 256 contiguous bytes per access) is 6 % faster than K-first cfg 1. Here:
//   - a block = 4 warps = one (sequence, value head, half of the columns): 128 rows x 64 columns = 128 rows of 128
//     contiguous bytes (full L2 lines), 16 KB, copied into shared memory cooperatively: each warp-wide cp.async
//     moves 4 whole rows (8 lanes x 16 B per row), 8 per lane;
//   - each warp then computes one item of 16 columns x all 128 rows on its own (no cross-warp reduction, no named
//     barriers): lane = 2 kg + vg holds rows 8 kg .. 8 kg + 7 and columns 8 (2 w + vg) .. + 7 of the block's 64
//     (8 chunks of 16 B, read from shared memory with an XOR swizzle of the 16-byte column groups so that every
//     quarter warp hits 8 different bank groups); p summed over the 16 kg lanes (4 butterfly rounds per column),
//     o by the reduce-scatter dec_rs_sum (8 shuffles, then one column per lane);
//   - one __syncthreads per block (after the copies land; the 4 warps share the same bytes in flight), KDA's 128
//     gate exps computed once per block (one per thread) before the wait;
//   - KF16=1: each lane stores its 8 updated chunks straight to the pool (streaming stores, 16 segments of 32 B per
//     warp-wide store); KF16=2 (CST): the updated chunks go back into the shared tile, and after a second barrier the
//     block stores whole 128-byte rows with the copy's mapping (one extra LDS / STS per chunk);
//   - KF16=3 / 4 (PRS): as 1 / 2 with p reduce-scattered over the kg lanes (8 shuffles, as o) and the warp's 16 column
//     sums gathered through 64 bytes of shared memory, instead of the 32-shuffle butterfly.
#pragma once

#include "delta_host.cuh"
#include "delta_recurrent_fwd.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kKf16Threads = 128;
// 16-byte column group cg (0..7) of tile row r is stored at slot cg ^ kf16_sw(r)
__host__ __device__ constexpr int kf16_sw(int r) { return ((r >> 3) << 1) & 7; }

template <bool PC, typename S, bool CST, bool PRS>
__global__ void __launch_bounds__(kKf16Threads, 8) delta_decode_kf16_kernel(const FwdParams p) {
  static_assert(sizeof(S) == 2, "2-byte states");
  constexpr int K = 128, V = 128, E = 8;
  __shared__ __align__(16) uint4 tile[K][8];  // [row][16-byte column group, swizzled]: 16 KB
  __shared__ __align__(16) float gexp[PC ? K : 1];
  __shared__ __align__(16) float psum[PRS ? 4 : 1][PRS ? 16 : 1];  // PRS: p of each warp's 16 columns

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int HV = p.HV, H = p.H, dt = p.in_dtype;
  // block b: (sequence n, value head hv) = b / 2, column half b % 2 (32-bit: the host checks 2 N HV < 2^31)
  const unsigned nh = blockIdx.x >> 1, half = blockIdx.x & 1u;
  const unsigned n32 = nh / static_cast<unsigned>(HV);
  const int n = static_cast<int>(n32), hv = static_cast<int>(nh - n32 * static_cast<unsigned>(HV));
  const int64_t tok = n;  // one token per sequence
  int64_t in_row = n, out_row = n;
  if (p.serve) {
    if (p.idx_cols == 0) {
      in_row = out_row = p.idx[n];
    } else {
      const int start_col = p.num_accepted ? static_cast<int>(p.num_accepted[n]) - 1 : 0;
      in_row = p.idx[static_cast<int64_t>(n) * p.idx_cols + start_col];
      out_row = p.idx[static_cast<int64_t>(n) * p.idx_cols];  // token 0 writes column 0 (negative: none)
    }
  }
  const int64_t head_elems = static_cast<int64_t>(K) * V, row_elems = head_elems * HV;
  // o of this warp's 16 columns (a function: held from here to the end, the offset made ptxas spill 8 bytes)
  auto o_base = [&]() -> int64_t { return (tok * HV + hv) * V + 64 * half + 16 * warp; };
  if (in_row < 0) {  // padding slot (uniform over the block): zero outputs, no state read or written
    if (lane < 16) store_in(p.o, o_base() + lane, dt, 0.f);
    return;
  }

  // ---- cooperative copy: warp w, copy j (0..7) moves tile rows 32 w + 4 j + lane / 8, column group lane % 8
  const int crow = 32 * warp + (lane >> 3), ccg = lane & 7;
  const int64_t coff = hv * head_elems + static_cast<int64_t>(crow) * V + 64 * half + 8 * ccg;
  if (p.s_in != nullptr) {
    const S* src = reinterpret_cast<const S*>(p.s_in) + in_row * row_elems + coff;
#pragma unroll
    for (int j = 0; j < 8; ++j)  // kf16_sw(crow + 4 j) = 2 (j / 2): a constant per copy
      cp_async16(&tile[crow + 4 * j][ccg ^ (2 * (j >> 1))], src + 4 * j * V);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) tile[crow + 4 * j][ccg ^ (2 * (j >> 1))] = make_uint4(0, 0, 0, 0);
  }
  cp_async_commit();
  const int h = hv / (HV / H);  // (after the copies: two integer divisions the copies need not wait for)

  // ---- compute mapping: lane = 2 kg + vg; rows 8 kg + c (c = chunk 0..7), columns 8 cg .. 8 cg + 7 of the block's
  // 64, cg = 2 w + vg (this warp's item: columns 16 w .. 16 w + 15)
  const int kg = lane >> 1, vg = lane & 1, cg = 2 * warp + vg;
  const int row0 = 8 * kg;
  const int col0 = 64 * half + 8 * cg;  // first column of this lane in the head
  float qv[E], kv[E], vv[E], d0 = 1.f;
  dec_load_in<E>(p.q, (tok * H + h) * K + row0, dt, E, true, qv, 0.f);
  dec_load_in<E>(p.k, (tok * H + h) * K + row0, dt, E, true, kv, 0.f);
  dec_load_in<E>(p.v, (tok * HV + hv) * V + col0, dt, E, true, vv, 0.f);
  const float beta = p.beta[tok * HV + hv];
  if constexpr (PC) {  // the block's 128 gate exps, one per thread, before the copies land
    gexp[tid] = expf(p.g[(tok * HV + hv) * K + tid]);
  } else {
    d0 = expf(p.g[tok * HV + hv]);
  }
  cp_async_wait<0>();
  __syncthreads();
  // e^g of row 8 kg + c (KDA: read from shared memory in each pass rather than held in 8 registers across both:
  // holding them made ptxas spill 8 bytes)
  auto gate = [&](int c) -> float {
    if constexpr (PC) return gexp[row0 + c];
    else return d0;
  };
  uint4* tp = &tile[row0][cg ^ kf16_sw(row0)];  // chunk c at tp + 8 c (kf16_sw(row0 + c) = kf16_sw(row0))

  // pass 1: p = (Diag(e^g) S)^T k, summed over the 16 kg lanes
  float pr[E];
#pragma unroll
  for (int j = 0; j < E; ++j) pr[j] = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float x[E];
    dec_load_state<S, E>(reinterpret_cast<const S*>(tp + 8 * c), x, E, true);
    const float kd = kv[c] * gate(c);
#pragma unroll
    for (int j = 0; j < E; ++j) pr[j] = fmaf(x[j], kd, pr[j]);
  }
  float del[E];
  if constexpr (PRS) {  // reduce-scatter (8 SHFL), then the 16 column sums gathered through shared memory
    int pown = 0;
    dec_rs_sum<false, 2, 16, E>(pr, lane, pown);
    if (lane < 16) psum[warp][8 * vg + pown] = pr[0];
    __syncwarp();
    const float4 a = *reinterpret_cast<const float4*>(&psum[warp][8 * vg]);
    const float4 b = *reinterpret_cast<const float4*>(&psum[warp][8 * vg + 4]);
    const float ps[E] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < E; ++j) del[j] = beta * (vv[j] - ps[j]);
  } else {  // butterfly all-reduce over the 16 kg lanes (32 SHFL)
#pragma unroll
    for (int j = 0; j < E; ++j) del[j] = beta * (vv[j] - warp_sum_from<2>(pr[j]));
  }

  // pass 2: S = Diag(e^g) S + k del^T (stored chunk by chunk), o = S^T q
  S* dst = out_row >= 0 ? reinterpret_cast<S*>(p.s_out) + out_row * row_elems + hv * head_elems : nullptr;
  S* dl = dst + static_cast<int64_t>(row0) * V + col0;  // (used only when dst != nullptr)
  float ov[E];
#pragma unroll
  for (int j = 0; j < E; ++j) ov[j] = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    float x[E];
    dec_load_state<S, E>(reinterpret_cast<const S*>(tp + 8 * c), x, E, true);
    const float dc = gate(c);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      x[j] = fmaf(x[j], dc, kv[c] * del[j]);
      ov[j] = fmaf(x[j], qv[c], ov[j]);
    }
    if (dst != nullptr) {
      if constexpr (CST) dec_store_state<S, E>(reinterpret_cast<S*>(tp + 8 * c), x, E, true, false);
      else dec_store_state<S, E>(dl + c * V, x, E, true, true);
    }
  }
  // o: reduce-scatter over the 16 kg lanes (xor 2, 4, 8, 16): lanes l and l ^ 16 end with the same column's sum
  int own = 0;
  dec_rs_sum<false, 2, 16, E>(ov, lane, own);
  if (lane < 16) store_in(p.o, o_base() + 8 * vg + own, dt, p.scale * ov[0]);
  if constexpr (CST) {
    if (dst != nullptr) {  // uniform over the block
      __syncthreads();
      S* d = reinterpret_cast<S*>(p.s_out) + out_row * row_elems + coff;  // (coff includes the head's offset)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        __stcs(reinterpret_cast<uint4*>(d + 4 * j * V), tile[crow + 4 * j][ccg ^ (2 * (j >> 1))]);
    }
  }
}

// mode = KDA_CUDA_DEC_KF16: 1 chunk stores, 2 whole-row stores (CST), 3 / 4: as 1 / 2 with p reduce-scattered (PRS)
template <bool PC, typename S>
void launch_dec_kf16(const FwdParams& p, int mode, cudaStream_t st) {
  const int64_t blocks = 2LL * p.N * p.HV;
  if (blocks == 0) return;
  const unsigned nb = static_cast<unsigned>(blocks);
  switch (mode) {
    case 1: delta_decode_kf16_kernel<PC, S, false, false><<<nb, kKf16Threads, 0, st>>>(p); break;
    case 2: delta_decode_kf16_kernel<PC, S, true, false><<<nb, kKf16Threads, 0, st>>>(p); break;
    case 3: delta_decode_kf16_kernel<PC, S, false, true><<<nb, kKf16Threads, 0, st>>>(p); break;
    default: delta_decode_kf16_kernel<PC, S, true, true><<<nb, kKf16Threads, 0, st>>>(p); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace kda_kernels
