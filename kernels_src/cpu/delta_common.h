// Shared helpers of the CPU backend (docs/ops.md): input checks, sequence layout, dtype conversion,
// a vectorised exp, the denormal guard and the parallel_for grain (the GEMM is in delta_chunk.h).
// Everything lives in kda_kernels::cpu; only the op entry points (kda_chunk_fwd, ...) are global.
//
// The families share one implementation except for the chunked forward, where GDN (one log decay per head and
// token) takes its own cheaper intra-chunk path (delta_chunk.h); elsewhere a GDN gate is the KDA gate with the
// same value on every channel, and its dg is the sum of the per-channel dg.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

// parallel_for grain over (sequence, value head) items: work per item = mean tokens per sequence x K x V
// (grain_for below).
inline int64_t grain_for(int64_t work_per_item);
inline int64_t item_grain(const std::vector<Seq>& seqs, int64_t KV) {
  int64_t tokens = 0;
  for (const auto& s : seqs) tokens += s.len;
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(seqs.size()));
  return grain_for(std::max<int64_t>(1, tokens / n) * KV);
}

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

// store_row for the chunked paths' per-token outputs: rows of an [B, T, HV, V] tensor are written once, one
// chunk at a time, 16 KB apart at HV*V = 4096, so plain stores first read every destination line from memory
// (read for ownership; ~20 % of the fp32 chunked forward's time in a profile). fp32 rows that are whole 32-byte
// vectors go out with non-temporal stores instead, which skip that read; callers run stream_fence() before
// their parallel task ends (non-temporal stores are weakly ordered).
template <typename T>
inline void store_row_stream(T* __restrict dst, const float* __restrict src, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    if (n % 8 == 0 && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) {
      for (int64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
      return;
    }
  }
  store_row(dst, src, n);
}
inline void stream_fence() { _mm_sfence(); }

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

// Items per at::parallel_for task over (sequence, value head): at least kTaskWork token x state-element
// updates (about 30 us on one core) per task, so small calls (decode of a few heads, short sequences) stay on
// the calling thread instead of paying for waking the others; large ones still split into one task per thread.
constexpr int64_t kTaskWork = int64_t(1) << 17;
inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, work_per_item));
}

// Per-thread scratch that survives between calls (no page faults on every call). The pointer is 64-byte
// aligned: every buffer carved from it and every padded row (multiples of 8 floats) is then 32-byte aligned,
// so no 8-float load or store splits a cache line (a large std::vector sits 16 bytes into its page).
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n + 16) buf.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Output buffers: above glibc's largest mmap threshold (32 MiB) every at::empty is a fresh mmap, and the first
// touch of each 4 KiB page faults into the kernel (fault + zeroing: ~10 us per token of a B=1 H=32 K=V=128 fp32
// forward at T=4096, a tenth of its time; measured, session 8). Asking for transparent huge pages on the
// 2 MiB-aligned interior of such a buffer before it is touched takes 512 times fewer faults (this machine's
// THP mode is "madvise"; elsewhere the call is a no-op or refused, both harmless). KDA_DEV_CPU_THP=0: off.
inline bool thp_enabled() {
  const char* e = std::getenv("KDA_DEV_CPU_THP");
  return !(e && e[0] == '0');
}

inline void advise_huge(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t n = static_cast<uintptr_t>(t.numel()) * t.element_size();
  if (n < 4 * kHuge || !thp_enabled()) return;
  const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), e = (p + n) & ~(kHuge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)t;
#endif
}

// at::empty for a buffer the kernel fills (see advise_huge).
inline at::Tensor empty_out(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor t = at::empty(sizes, opts);
  advise_huge(t);
  return t;
}

// The part of every backward entry point that does not depend on the algorithm: checks of grad_o and
// grad_final_state, the output buffers (dq, dk per value head in fp32), zeros for tokens outside every varlen
// sequence, and the sum of the expanded q/k heads onto their H heads in the input dtype. `impl(tag, dout, seqs,
// d, dqe, dke, dv, dg, dbeta, dh0)` runs the algorithm for the input type of `tag`, with grad_o in q's dtype.
template <bool PC, typename Impl>
DeltaBwdResult bwd_entry(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& h0,
                         const std::optional<at::Tensor>& cu, const at::Tensor& dout,
                         const std::optional<at::Tensor>& dfin, Impl&& impl) {
  const Dims d = check_inputs(op, PC, q, k, v, g, beta, h0, cu);
  check_cpu(op, "grad_o", dout);
  check_cpu(op, "grad_final_state", dfin);
  TORCH_CHECK(dout.sizes() == v.sizes(), op, ": grad_o must be shaped like o");
  if (dfin.has_value()) check_float(op, "grad_final_state", *dfin);
  const auto seqs = make_seqs(d, cu);
  const int64_t N = static_cast<int64_t>(seqs.size());
  at::Tensor dout_c = dout.scalar_type() == q.scalar_type() ? dout : dout.to(q.scalar_type());
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dqe = empty_out({d.B, d.T, d.HV, d.K}, f32), dke = empty_out({d.B, d.T, d.HV, d.K}, f32);
  at::Tensor dv = empty_out(v.sizes(), v.options()), dg = empty_out(g.sizes(), g.options());
  at::Tensor dbeta = at::empty_like(beta);
  at::Tensor dh0 = at::empty({N, d.HV, d.K, d.V}, f32);
  dispatch_io(q.scalar_type(), op,
              [&](auto tag) { impl(tag, dout_c, seqs, d, dqe, dke, dv, dg, dbeta, dh0); });
  if (cu.has_value()) {
    for (at::Tensor* x : {&dqe, &dke, &dv, &dg, &dbeta}) zero_uncovered(seqs, d, *x);
  }
  auto reduce_heads = [&](const at::Tensor& x, at::ScalarType dtype) {
    return d.G == 1 ? x.to(dtype) : x.view({d.B, d.T, d.H, d.G, d.K}).sum(3).to(dtype);
  };
  return {reduce_heads(dqe, q.scalar_type()), reduce_heads(dke, k.scalar_type()), dv, dg, dbeta, dh0};
}

}  // namespace kda_kernels::cpu
