// Tensor-core helpers shared by the chunked kernels: tf32 conversion and the m16n8k8 tf32 MMA (sm_80+), with a
// 3xTF32 variant (a_hi b_hi + a_hi b_lo + a_lo b_hi) of about fp32 accuracy for fp32 inputs.
#pragma once

#include <cstdint>

namespace kda_kernels {
namespace cuda {

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

}  // namespace cuda
}  // namespace kda_kernels
