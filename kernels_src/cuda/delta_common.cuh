// Shared device helpers of the CUDA backend: dtype conversion, vector state loads/stores, warp reductions.
// Math: DESIGN.md section 1. Everything is computed in fp32 whatever the storage dtype.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kda_kernels {
namespace cuda {

// Input dtypes of q, k, v, o, dq, dk, dv (runtime-switched: the switch is uniform and per token).
enum InDtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float load_in(const void* p, int64_t i, int dt) {
  if (dt == kBF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == kF16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_in(void* p, int64_t i, int dt, float x) {
  if (dt == kBF16)
    reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(x);
  else if (dt == kF16)
    reinterpret_cast<__half*>(p)[i] = __float2half(x);
  else
    reinterpret_cast<float*>(p)[i] = x;
}

// ---------------------------------------------------------------- state storage (fp32, bf16, fp16)
template <typename S>
struct StateIO;

template <>
struct StateIO<float> {
  __device__ __forceinline__ static float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
  __device__ __forceinline__ static void store4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }
  __device__ __forceinline__ static float load1(const float* p) { return *p; }
  __device__ __forceinline__ static void store1(float* p, float x) { *p = x; }
};

template <>
struct StateIO<__nv_bfloat16> {
  using T = __nv_bfloat16;
  __device__ __forceinline__ static float4 load4(const T* p) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x);
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
    float2 fa = __bfloat1622float2(a), fb = __bfloat1622float2(b);
    return make_float4(fa.x, fa.y, fb.x, fb.y);
  }
  __device__ __forceinline__ static void store4(T* p, float4 x) {
    __nv_bfloat162 a = __floats2bfloat162_rn(x.x, x.y);
    __nv_bfloat162 b = __floats2bfloat162_rn(x.z, x.w);
    uint2 raw;
    raw.x = *reinterpret_cast<uint32_t*>(&a);
    raw.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = raw;
  }
  __device__ __forceinline__ static float load1(const T* p) { return __bfloat162float(*p); }
  __device__ __forceinline__ static void store1(T* p, float x) { *p = __float2bfloat16(x); }
};

template <>
struct StateIO<__half> {
  using T = __half;
  __device__ __forceinline__ static float4 load4(const T* p) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    __half2 a = *reinterpret_cast<__half2*>(&raw.x);
    __half2 b = *reinterpret_cast<__half2*>(&raw.y);
    float2 fa = __half22float2(a), fb = __half22float2(b);
    return make_float4(fa.x, fa.y, fb.x, fb.y);
  }
  __device__ __forceinline__ static void store4(T* p, float4 x) {
    __half2 a = __floats2half2_rn(x.x, x.y);
    __half2 b = __floats2half2_rn(x.z, x.w);
    uint2 raw;
    raw.x = *reinterpret_cast<uint32_t*>(&a);
    raw.y = *reinterpret_cast<uint32_t*>(&b);
    *reinterpret_cast<uint2*>(p) = raw;
  }
  __device__ __forceinline__ static float load1(const T* p) { return __half2float(*p); }
  __device__ __forceinline__ static void store1(T* p, float x) { *p = __float2half(x); }
};

// Load 4 consecutive state values; `n` of them exist (n < 4 only at a ragged edge), `vec` says the address is
// aligned for one vector access. Missing values read as 0.
template <typename S>
__device__ __forceinline__ float4 load_state4(const S* p, int n, bool vec) {
  if (vec && n >= 4) return StateIO<S>::load4(p);
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n > 0) r.x = StateIO<S>::load1(p);
  if (n > 1) r.y = StateIO<S>::load1(p + 1);
  if (n > 2) r.z = StateIO<S>::load1(p + 2);
  if (n > 3) r.w = StateIO<S>::load1(p + 3);
  return r;
}

template <typename S>
__device__ __forceinline__ void store_state4(S* p, float4 x, int n, bool vec) {
  if (vec && n >= 4) {
    StateIO<S>::store4(p, x);
    return;
  }
  if (n > 0) StateIO<S>::store1(p, x.x);
  if (n > 1) StateIO<S>::store1(p + 1, x.y);
  if (n > 2) StateIO<S>::store1(p + 2, x.z);
  if (n > 3) StateIO<S>::store1(p + 3, x.w);
}

__device__ __forceinline__ float& f4at(float4& v, int e) {
  return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}

// Sum over the lanes that differ in the bits of [lo, 32): xor masks lo, 2lo, ..., 16.
template <int LO>
__device__ __forceinline__ float warp_sum_from(float x) {
#pragma unroll
  for (int m = LO; m < 32; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Sum over the lanes that differ in the bits of [1, HI): xor masks 1, 2, ..., HI/2.
template <int HI>
__device__ __forceinline__ float warp_sum_below(float x) {
#pragma unroll
  for (int m = 1; m < HI; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// Sequence n's tokens: [bos, bos + len) of the flattened [B*T] token axis.
__device__ __forceinline__ void seq_bounds(const int64_t* cu, int n, int T, int64_t& bos, int& len) {
  if (cu != nullptr) {
    bos = cu[n];
    len = static_cast<int>(cu[n + 1] - bos);
  } else {
    bos = static_cast<int64_t>(n) * T;
    len = T;
  }
}

}  // namespace cuda
}  // namespace kda_kernels
