// fp32 -> fp16/bf16 conversion of gradients accumulated in fp32 (dq, dk of the backward kernels).
#include "delta_common.h"

template <typename T>
inline void cast_body(device const float* src, device T* dst, constant DeltaParams& params, uint i) {
  if (int(i) < params.count) dst[i] = T(src[i]);
}

kernel void delta_cast_f16(device const float* src [[buffer(0)]], device half* dst [[buffer(1)]],
                           constant DeltaParams& params [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  cast_body<half>(src, dst, params, i);
}
kernel void delta_cast_bf16(device const float* src [[buffer(0)]], device bfloat* dst [[buffer(1)]],
                            constant DeltaParams& params [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  cast_body<bfloat>(src, dst, params, i);
}
