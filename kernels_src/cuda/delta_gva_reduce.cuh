// The GVA reduce of the chunked backward's dq and dk in one launch (issue #7, session 9): dq, dk come from the grad
// kernels per value head in fp32, [tokens, HV, K]; the op returns them per key head in the inputs' dtype,
// [tokens, H, K], each key head's G = HV / H value heads (hv = h * G + j, as sum_gva) summed in fp32 in the order
// j = 0, 1, ..., G - 1 and then rounded to nearest even (the torch path, sum_gva(...).to(dtype), sums the same
// terms in the same order for G <= 2 and is then bit-identical; its reduction order for larger G is torch's).
// One thread per 4 consecutive channels of one (token, key head): G 16-byte loads, one 16-byte (fp32) or 8-byte
// (bf16 / fp16) store; blockIdx.y picks dq (0) or dk (1). K % 4 != 0 takes the scalar instance (VEC = false).
// Memory floor at B1 T8192 HV32 H16 K=128, bf16 out: 2 x (134 + 34) MB -> ~0.07 ms at ~4.8 TB/s.
// The default since session 9 (measured 0.079 ms at that shape on the H200, the torch path 0.20);
// KDA_CUDA_CHUNK_BWD_GVA=0 keeps chunk_bwd_finish's torch path (read at every call).
#pragma once

#include <cstdint>

#include "delta_common.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kGvaThreads = 256;

__device__ __forceinline__ float4 gva_ld4(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }

template <typename TO, bool VEC>
__global__ void __launch_bounds__(kGvaThreads) gva_reduce_kernel(const float* __restrict__ dq32,
                                                                  const float* __restrict__ dk32, TO* __restrict__ dq,
                                                                  TO* __restrict__ dk, int64_t rows, int H, int G,
                                                                  int K) {
  const float* __restrict__ src = blockIdx.y == 0 ? dq32 : dk32;
  TO* __restrict__ dst = blockIdx.y == 0 ? dq : dk;
  const int per_row = VEC ? K / 4 : K;  // work items per (token, key head)
  const int64_t n = rows * per_row;
  const int64_t HV = static_cast<int64_t>(H) * G;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kGvaThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kGvaThreads) {
    const int64_t r = i / per_row;  // token * H + h
    const int c = static_cast<int>(i - r * per_row) * (VEC ? 4 : 1);
    const int64_t tok = r / H, h = r - tok * H;
    const float* x = src + (tok * HV + h * G) * K + c;
    if constexpr (VEC) {
      float4 acc = gva_ld4(x);
      for (int j = 1; j < G; ++j) {
        const float4 y = gva_ld4(x + static_cast<int64_t>(j) * K);
        acc.x += y.x; acc.y += y.y; acc.z += y.z; acc.w += y.w;
      }
      StateIO<TO>::store4(dst + r * K + c, acc);
    } else {
      float acc = __ldcs(x);
      for (int j = 1; j < G; ++j) acc += __ldcs(x + static_cast<int64_t>(j) * K);
      StateIO<TO>::store1(dst + r * K + c, acc);
    }
  }
}

}  // namespace cuda
}  // namespace kda_kernels
