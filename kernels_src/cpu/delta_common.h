// Shared helpers of the CPU backend (docs/ops.md): input checks, sequence layout, dtype conversion,
// a vectorised exp, the denormal guard and a register-blocked fp32 GEMM used by the chunked kernels.
// Everything lives in kda_kernels::cpu; only the op entry points (kda_chunk_fwd, ...) are global.
//
// Both families share one implementation: a GDN gate (one log decay per head and token) is the KDA gate
// with the same value on every channel, and its dg is the sum of the per-channel dg.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

// The few ATen pieces used, not ATen/ATen.h: that header alone costs ~20 s of compile per file.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "torch_binding.h"

namespace kda_kernels::cpu {

// ------------------------------------------------------------------------------------------- checks
inline void check_cpu(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), op, ": the CPU kernel got ", name, " on ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_cpu(const char* op, const char* name, const std::optional<at::Tensor>& t) {
  if (t.has_value()) check_cpu(op, name, *t);
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
}

struct Dims {
  int64_t B, T, H, K, HV, V, G;  // G = HV / H (value heads per q/k head)
};

// Validates the core-op inputs of docs/ops.md (the Python layer already did; this guards direct calls).
inline Dims check_inputs(const char* op, bool per_channel, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                         const std::optional<at::Tensor>& initial_state,
                         const std::optional<at::Tensor>& cu_seqlens) {
  check_cpu(op, "q", q);
  check_cpu(op, "k", k);
  check_cpu(op, "v", v);
  check_cpu(op, "g", g);
  check_cpu(op, "beta", beta);
  check_cpu(op, "initial_state", initial_state);
  check_cpu(op, "cu_seqlens", cu_seqlens);
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4, op, ": q, k must be [B,T,H,K], v [B,T,HV,V]");
  Dims d{q.size(0), q.size(1), q.size(2), q.size(3), v.size(2), v.size(3), 0};
  TORCH_CHECK(v.size(0) == d.B && v.size(1) == d.T, op, ": v must share q's batch and time sizes");
  TORCH_CHECK(d.H > 0 && d.HV % d.H == 0, op, ": HV (", d.HV, ") must be a multiple of H (", d.H, ")");
  d.G = d.HV / d.H;
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must share one dtype");
  auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, op,
              ": q, k, v must be float32, bfloat16 or float16, got ", st);
  check_float(op, "g", g);
  check_float(op, "beta", beta);
  if (per_channel) {
    TORCH_CHECK(g.dim() == 4 && g.size(0) == d.B && g.size(1) == d.T && g.size(2) == d.HV && g.size(3) == d.K,
                op, ": g must be [B,T,HV,K]");
  } else {
    TORCH_CHECK(g.dim() == 3 && g.size(0) == d.B && g.size(1) == d.T && g.size(2) == d.HV, op,
                ": g must be [B,T,HV]");
  }
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == d.B && beta.size(1) == d.T && beta.size(2) == d.HV, op,
              ": beta must be [B,T,HV]");
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(cu_seqlens->scalar_type() == at::kLong && cu_seqlens->dim() == 1 && cu_seqlens->numel() >= 1, op,
                ": cu_seqlens must be int64 [N+1]");
    TORCH_CHECK(d.B == 1, op, ": cu_seqlens needs B == 1");
  }
  if (initial_state.has_value()) {
    check_float(op, "initial_state", *initial_state);
    const int64_t N = cu_seqlens.has_value() ? cu_seqlens->numel() - 1 : d.B;
    TORCH_CHECK(initial_state->dim() == 4 && initial_state->size(0) == N && initial_state->size(1) == d.HV &&
                    initial_state->size(2) == d.K && initial_state->size(3) == d.V,
                op, ": initial_state must be [N,HV,K,V]");
  }
  return d;
}

// ------------------------------------------------------------------------------------------- sequences
struct Seq {
  int64_t b, start, len;  // batch row, first token (in that row), number of tokens
};

inline std::vector<Seq> make_seqs(const Dims& d, const std::optional<at::Tensor>& cu_seqlens) {
  std::vector<Seq> seqs;
  if (!cu_seqlens.has_value()) {
    for (int64_t b = 0; b < d.B; ++b) seqs.push_back({b, 0, d.T});
    return seqs;
  }
  const int64_t* cu = cu_seqlens->data_ptr<int64_t>();
  const int64_t n = cu_seqlens->numel() - 1;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(cu[i] >= 0 && cu[i + 1] >= cu[i] && cu[i + 1] <= d.T,
                "cu_seqlens must be non-decreasing within [0, T]");
    seqs.push_back({0, cu[i], cu[i + 1] - cu[i]});
  }
  return seqs;
}

// Rows of [B,T,...] outputs that no sequence covers (varlen with cu_seqlens[-1] < T) must read zero.
inline void zero_uncovered(const std::vector<Seq>& seqs, const Dims& d, at::Tensor& x) {
  if (d.T == 0 || x.numel() == 0) return;
  std::vector<char> covered(d.B * d.T, 0);
  for (const auto& s : seqs)
    for (int64_t t = 0; t < s.len; ++t) covered[s.b * d.T + s.start + t] = 1;
  const int64_t row = x.numel() / (d.B * d.T);
  char* base = static_cast<char*>(x.data_ptr());
  const int64_t bytes = row * x.element_size();
  for (int64_t i = 0; i < d.B * d.T; ++i)
    if (!covered[i]) std::memset(base + i * bytes, 0, bytes);
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ------------------------------------------------------------------------------------------- dtypes
template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// dst[0:n) = mul * src[0:n), dst[n:npad) = 0
template <typename T>
inline void load_row(const T* __restrict src, float* __restrict dst, int64_t n, int64_t npad, float mul = 1.f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = mul * to_f(src[i]);
  for (int64_t i = n; i < npad; ++i) dst[i] = 0.f;
}

template <typename T>
inline void store_row(T* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Calls fn.template operator()<scalar_t>() for the input dtype (float32, bfloat16, float16).
template <typename Fn>
inline void dispatch_io(at::ScalarType st, const char* op, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", st);
  }
}

// ------------------------------------------------------------------------------------------- math
// Flush denormals to zero inside the kernels (products of many decays underflow; denormal arithmetic
// is slow and changes nothing at fp32 tolerance). Restores the caller's MXCSR.
struct DenormalGuard {
  unsigned int saved;
  DenormalGuard() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~DenormalGuard() { _mm_setcsr(saved); }
};

// exp(x) for 8 floats, Cephes-style polynomial (about 1 ulp); exp(x) = 0 for x < -87.3, inf above 88.7.
inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-87.3365f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // 2^n: n in [-126, 128]; split in two factors so n = 128 (x near 88.7) does not overflow the exponent
  __m256i n = _mm256_cvtps_epi32(fx);
  __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
  y = _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
  y = _mm256_andnot_ps(under, y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
}

// dst[0:n) = exp(src[0:n)), dst[n:npad) = 1 (padding channels do not decay)
inline void exp_row(const float* __restrict src, float* __restrict dst, int64_t n, int64_t npad) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, exp8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = std::exp(src[i]);
  for (; i < npad; ++i) dst[i] = 1.f;
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of a[i] * b[i], n a multiple of 8.
inline float dot8(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  if (i < n) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  return hsum8(_mm256_add_ps(s0, s1));
}

// dst = src^T: src is [rows_src x cols_src] (row stride lds), dst [cols_src x rows_src] (row stride ldd).
// 8 x 8 tiles in registers when both sizes are multiples of 8 (always, for the padded chunk buffers).
inline void transpose(const float* __restrict src, int64_t lds, float* __restrict dst, int64_t ldd, int64_t rows_src,
                      int64_t cols_src) {
  if (rows_src % 8 == 0 && cols_src % 8 == 0) {
    for (int64_t i0 = 0; i0 < rows_src; i0 += 8)
      for (int64_t j0 = 0; j0 < cols_src; j0 += 8) {
        const float* s = src + i0 * lds + j0;
        __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + lds), r2 = _mm256_loadu_ps(s + 2 * lds),
               r3 = _mm256_loadu_ps(s + 3 * lds), r4 = _mm256_loadu_ps(s + 4 * lds), r5 = _mm256_loadu_ps(s + 5 * lds),
               r6 = _mm256_loadu_ps(s + 6 * lds), r7 = _mm256_loadu_ps(s + 7 * lds);
        __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
               t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
        r0 = _mm256_shuffle_ps(t0, t2, 0x44);
        r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        r2 = _mm256_shuffle_ps(t1, t3, 0x44);
        r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        r4 = _mm256_shuffle_ps(t4, t6, 0x44);
        r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        r6 = _mm256_shuffle_ps(t5, t7, 0x44);
        r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* d = dst + j0 * ldd + i0;
        _mm256_storeu_ps(d, _mm256_permute2f128_ps(r0, r4, 0x20));
        _mm256_storeu_ps(d + ldd, _mm256_permute2f128_ps(r1, r5, 0x20));
        _mm256_storeu_ps(d + 2 * ldd, _mm256_permute2f128_ps(r2, r6, 0x20));
        _mm256_storeu_ps(d + 3 * ldd, _mm256_permute2f128_ps(r3, r7, 0x20));
        _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(r0, r4, 0x31));
        _mm256_storeu_ps(d + 5 * ldd, _mm256_permute2f128_ps(r1, r5, 0x31));
        _mm256_storeu_ps(d + 6 * ldd, _mm256_permute2f128_ps(r2, r6, 0x31));
        _mm256_storeu_ps(d + 7 * ldd, _mm256_permute2f128_ps(r3, r7, 0x31));
      }
    return;
  }
  for (int64_t i = 0; i < rows_src; ++i)
    for (int64_t j = 0; j < cols_src; ++j) dst[j * ldd + i] = src[i * lds + j];
}

// C[M x N] (ACC ? += : =) alpha * A B with A(i, k) = A[i * sai + k * sak] (so A^T is free) and B row-major
// [Kd x N] (row stride ldb), C row-major (row stride ldc). M % 4 == 0 and N % 8 == 0.
// 4 x 16 register tile: 8 accumulators, two B loads and four broadcasts per k.
template <bool ACC>
inline void gemm(int64_t M, int64_t N, int64_t Kd, float alpha, const float* __restrict A, int64_t sai, int64_t sak,
                 const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc) {
  const __m256 va = _mm256_set1_ps(alpha);
  int64_t n0 = 0;
  for (; n0 + 16 <= N; n0 += 16) {
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
      __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
      const float* a = A + i0 * sai;
      const float* b = B + n0;
      for (int64_t k = 0; k < Kd; ++k) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        __m256 x = _mm256_broadcast_ss(a);
        c00 = _mm256_fmadd_ps(x, b0, c00);
        c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a + sai);
        c10 = _mm256_fmadd_ps(x, b0, c10);
        c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a + 2 * sai);
        c20 = _mm256_fmadd_ps(x, b0, c20);
        c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a + 3 * sai);
        c30 = _mm256_fmadd_ps(x, b0, c30);
        c31 = _mm256_fmadd_ps(x, b1, c31);
        a += sak;
        b += ldb;
      }
      float* c = C + i0 * ldc + n0;
#define KDA_GEMM_STORE(row, lo, hi)                                                                           \
  if (ACC) {                                                                                                  \
    _mm256_storeu_ps(c + (row) * ldc, _mm256_fmadd_ps(va, lo, _mm256_loadu_ps(c + (row) * ldc)));             \
    _mm256_storeu_ps(c + (row) * ldc + 8, _mm256_fmadd_ps(va, hi, _mm256_loadu_ps(c + (row) * ldc + 8)));     \
  } else {                                                                                                    \
    _mm256_storeu_ps(c + (row) * ldc, _mm256_mul_ps(va, lo));                                                 \
    _mm256_storeu_ps(c + (row) * ldc + 8, _mm256_mul_ps(va, hi));                                             \
  }
      KDA_GEMM_STORE(0, c00, c01)
      KDA_GEMM_STORE(1, c10, c11)
      KDA_GEMM_STORE(2, c20, c21)
      KDA_GEMM_STORE(3, c30, c31)
#undef KDA_GEMM_STORE
    }
  }
  if (n0 < N) {  // one 8-wide column block left
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
      __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      const float* a = A + i0 * sai;
      const float* b = B + n0;
      for (int64_t k = 0; k < Kd; ++k) {
        const __m256 b0 = _mm256_loadu_ps(b);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a), b0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a + sai), b0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a + 2 * sai), b0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a + 3 * sai), b0, c3);
        a += sak;
        b += ldb;
      }
      float* c = C + i0 * ldc + n0;
      const __m256 r[4] = {c0, c1, c2, c3};
      for (int i = 0; i < 4; ++i) {
        if (ACC)
          _mm256_storeu_ps(c + i * ldc, _mm256_fmadd_ps(va, r[i], _mm256_loadu_ps(c + i * ldc)));
        else
          _mm256_storeu_ps(c + i * ldc, _mm256_mul_ps(va, r[i]));
      }
    }
  }
}

// Per-thread scratch that survives between calls (no page faults on every call).
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace kda_kernels::cpu
