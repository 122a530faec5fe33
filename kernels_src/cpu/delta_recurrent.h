// Recurrent (token by token) delta rule on the CPU: forward, backward and the in-place serving step.
// Shared by kda_recurrent_{fwd,bwd,serve}.cpp and gdn_recurrent_{fwd,bwd,serve}.cpp.
//
// Token step, per value head, S is K x V fp32 (docs/ops.md):
//   pass 1 (reads S once):   pred = (Diag(a) S)^T k,  db = beta (v - pred)            with a = exp(g)
//   pass 2 (reads+writes S): S = Diag(a) S + k db^T,  o = scale S^T q   (same sweep)
// The columns of S evolve independently, so the state is processed in blocks of VB = 32 columns that stay
// in L1 for a window of tokens; the per-token vectors (scale q, k, a, a k) are prepared once per window.
// Tried in session 4 and not kept: one sweep per token instead of two, holding S = Diag(D) Ŝ with a running row
// scale D so the decay costs nothing per element (3 vector ops and one load + store per element instead of 4 and
// two loads; rows folded when D < 2^-40). Exact, but no faster: both forms run at ~8-9 cycles per 32-column state
// row on this project's AVX2 EPYC, so the two-pass step is not FMA-bound; software prefetch of the strided
// per-head q/k/v rows made no measurable difference either.
//
// Backward (derived by hand; P = S_{t-1}, S = S_t, dS = dL/dS_t carried backwards, Tt = dS + scale q do^T):
//   dq = scale S do,  d(db) = Tt^T k,  dk = Tt db + a (P dpred),  da = rowsum(Tt * P) + k (P dpred),
//   dbeta = e . d(db) (e = v - pred),  dv = beta d(db),  dpred = -dv,  dS_{t-1} = Diag(a) Tt + (a k) dpred^T,
//   dg = a da (KDA; GDN: a sum_k da).
// The state is checkpointed every SEG tokens; each segment is replayed (keeping its states) and walked back.
#pragma once

#include "delta_common.h"

namespace kda_kernels::cpu {

constexpr int64_t VB = 32;      // state columns per block
constexpr int64_t WINDOW = 64;  // tokens whose vectors are prepared at once
constexpr int64_t SEG = 16;     // backward checkpoint interval

// Per-token vectors of one (sequence, value head): sq = scale q, kk = k, a = exp(g), kd = a k.
struct TokenVecs {
  float *sq, *kk, *a, *kd, *beta;
  int64_t K;
};

template <typename T, bool PC>
inline void prep_tokens(const T* q, const T* k, const float* g, const float* beta, const Dims& d, const Seq& s,
                        int64_t hv, int64_t t0, int64_t n, float scale, TokenVecs tv) {
  const int64_t h = hv / d.G, K = d.K;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = s.b * d.T + s.start + t0 + i;  // token row in [B*T]
    const T* qp = q + (row * d.H + h) * K;
    const T* kp = k + (row * d.H + h) * K;
    float* sq = tv.sq + i * K;
    float* kk = tv.kk + i * K;
    float* a = tv.a + i * K;
    float* kd = tv.kd + i * K;
    load_row(qp, sq, K, K, scale);
    load_row(kp, kk, K, K);
    if (PC) {
      exp_row(g + (row * d.HV + hv) * K, a, K, K);
    } else {
      const float av = std::exp(g[row * d.HV + hv]);
      for (int64_t c = 0; c < K; ++c) a[c] = av;
    }
    for (int64_t c = 0; c < K; ++c) kd[c] = a[c] * kk[c];
    tv.beta[i] = beta[row * d.HV + hv];
  }
}

// One token on a K x 32 state block (row stride ld). v, o: 32 floats (padding columns of v are zero).
inline void token_step(float* __restrict S, int64_t ld, int64_t K, const float* __restrict sq,
                       const float* __restrict kk, const float* __restrict a, const float* __restrict kd, float beta,
                       const float* __restrict v, float* __restrict o) {
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, r0 = p0, r1 = p0, r2 = p0, r3 = p0;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {  // pass 1: pred = S^T (a k), two rows at a time (8 independent sums)
    const float* s0 = S + k * ld;
    const float* s1 = s0 + ld;
    const __m256 x0 = _mm256_broadcast_ss(kd + k), x1 = _mm256_broadcast_ss(kd + k + 1);
    p0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0), p0);
    p1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 8), p1);
    p2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 16), p2);
    p3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 24), p3);
    r0 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s1), r0);
    r1 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s1 + 8), r1);
    r2 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s1 + 16), r2);
    r3 = _mm256_fmadd_ps(x1, _mm256_loadu_ps(s1 + 24), r3);
  }
  if (k < K) {
    const float* s0 = S + k * ld;
    const __m256 x0 = _mm256_broadcast_ss(kd + k);
    p0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0), p0);
    p1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 8), p1);
    p2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 16), p2);
    p3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(s0 + 24), p3);
  }
  const __m256 vb = _mm256_set1_ps(beta);
  const __m256 d0 = _mm256_mul_ps(vb, _mm256_sub_ps(_mm256_loadu_ps(v), _mm256_add_ps(p0, r0)));
  const __m256 d1 = _mm256_mul_ps(vb, _mm256_sub_ps(_mm256_loadu_ps(v + 8), _mm256_add_ps(p1, r1)));
  const __m256 d2 = _mm256_mul_ps(vb, _mm256_sub_ps(_mm256_loadu_ps(v + 16), _mm256_add_ps(p2, r2)));
  const __m256 d3 = _mm256_mul_ps(vb, _mm256_sub_ps(_mm256_loadu_ps(v + 24), _mm256_add_ps(p3, r3)));
  __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  for (k = 0; k < K; ++k) {  // pass 2: S = a S + k db^T, o += (scale q) S
    float* s = S + k * ld;
    const __m256 ak = _mm256_broadcast_ss(a + k), kb = _mm256_broadcast_ss(kk + k), qb = _mm256_broadcast_ss(sq + k);
    const __m256 n0 = _mm256_fmadd_ps(kb, d0, _mm256_mul_ps(ak, _mm256_loadu_ps(s)));
    const __m256 n1 = _mm256_fmadd_ps(kb, d1, _mm256_mul_ps(ak, _mm256_loadu_ps(s + 8)));
    const __m256 n2 = _mm256_fmadd_ps(kb, d2, _mm256_mul_ps(ak, _mm256_loadu_ps(s + 16)));
    const __m256 n3 = _mm256_fmadd_ps(kb, d3, _mm256_mul_ps(ak, _mm256_loadu_ps(s + 24)));
    _mm256_storeu_ps(s, n0);
    _mm256_storeu_ps(s + 8, n1);
    _mm256_storeu_ps(s + 16, n2);
    _mm256_storeu_ps(s + 24, n3);
    o0 = _mm256_fmadd_ps(qb, n0, o0);
    o1 = _mm256_fmadd_ps(qb, n1, o1);
    o2 = _mm256_fmadd_ps(qb, n2, o2);
    o3 = _mm256_fmadd_ps(qb, n3, o3);
  }
  _mm256_storeu_ps(o, o0);
  _mm256_storeu_ps(o + 8, o1);
  _mm256_storeu_ps(o + 16, o2);
  _mm256_storeu_ps(o + 24, o3);
}

// Copy columns [vb, vb+w) of a K x V fp32 state (row stride V) into a K x 32 block, zero-padded, and back.
inline void block_in(const float* __restrict W, int64_t V, int64_t K, int64_t vb, int64_t w, float* __restrict blk) {
  for (int64_t k = 0; k < K; ++k) {
    const float* src = W + k * V + vb;
    float* dst = blk + k * VB;
    for (int64_t j = 0; j < w; ++j) dst[j] = src[j];
    for (int64_t j = w; j < VB; ++j) dst[j] = 0.f;
  }
}

inline void block_out(const float* __restrict blk, int64_t V, int64_t K, int64_t vb, int64_t w, float* __restrict W) {
  for (int64_t k = 0; k < K; ++k) {
    const float* src = blk + k * VB;
    float* dst = W + k * V + vb;
    for (int64_t j = 0; j < w; ++j) dst[j] = src[j];
  }
}

// A pool row (one value head) of dtype PT, K-first [K, V] or V-first [V, K].
template <typename PT>
inline void pool_load(const PT* row, bool vfirst, int64_t K, int64_t V, float* __restrict W) {
  if (!vfirst) {
    for (int64_t i = 0; i < K * V; ++i) W[i] = to_f(row[i]);
  } else {
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < K; ++k) W[k * V + j] = to_f(row[j * K + k]);
  }
}

// Columns [vb, vb+w) of a K x 32 block (row stride ld) into a pool row.
template <typename PT>
inline void pool_store_block(PT* row, bool vfirst, int64_t K, int64_t V, int64_t vb, int64_t w,
                             const float* __restrict blk, int64_t ld) {
  if (!vfirst) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < w; ++j) row[k * V + vb + j] = static_cast<PT>(blk[k * ld + j]);
  } else {
    for (int64_t j = 0; j < w; ++j)
      for (int64_t k = 0; k < K; ++k) row[(vb + j) * K + k] = static_cast<PT>(blk[k * ld + j]);
  }
}

struct ThreadScratch {
  std::vector<float> tok, state, blk, ck, grads;
};

inline ThreadScratch& thread_scratch() {
  static thread_local ThreadScratch s;
  return s;
}

// Runs tokens [0, s.len) of one (sequence, value head) on the K x V fp32 state W (row stride V).
// after_token(t, blk, ld, vb, w): called after each token with the updated columns [vb, vb+w).
template <typename T, bool PC, typename AfterToken>
inline void run_sequence(const T* q, const T* k, const T* v, const float* g, const float* beta, float scale,
                         const Dims& d, const Seq& s, int64_t hv, float* W, T* o, AfterToken&& after_token) {
  const int64_t K = d.K, V = d.V;
  ThreadScratch& ts = thread_scratch();
  float* tok = scratch(ts.tok, 4 * WINDOW * K + WINDOW);
  TokenVecs tv{tok, tok + WINDOW * K, tok + 2 * WINDOW * K, tok + 3 * WINDOW * K, tok + 4 * WINDOW * K, K};
  float* blk = scratch(ts.blk, K * VB + 2 * VB);
  float* vbuf = blk + K * VB;
  float* obuf = vbuf + VB;
  for (int64_t t0 = 0; t0 < s.len; t0 += WINDOW) {
    const int64_t n = std::min(WINDOW, s.len - t0);
    prep_tokens<T, PC>(q, k, g, beta, d, s, hv, t0, n, scale, tv);
    for (int64_t vb = 0; vb < V; vb += VB) {
      const int64_t w = std::min(VB, V - vb);
      const bool inplace = (n == 1 && w == VB);  // decode: one sweep over the state where it lives
      float* S = inplace ? W + vb : blk;
      const int64_t ld = inplace ? V : VB;
      if (!inplace) block_in(W, V, K, vb, w, blk);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = s.b * d.T + s.start + t0 + i;
        load_row(v + (row * d.HV + hv) * V + vb, vbuf, w, VB);
        token_step(S, ld, K, tv.sq + i * K, tv.kk + i * K, tv.a + i * K, tv.kd + i * K, tv.beta[i], vbuf, obuf);
        store_row(o + (row * d.HV + hv) * V + vb, obuf, w);
        after_token(t0 + i, S, ld, vb, w);
      }
      if (!inplace) block_out(blk, V, K, vb, w, W);
    }
  }
}

// ------------------------------------------------------------------------------------------- forward
template <typename T, bool PC>
void recurrent_fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, double scale, const std::optional<at::Tensor>& h0,
                        const std::vector<Seq>& seqs, const Dims& d, at::Tensor& o, at::Tensor& fin) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const float* h0p = h0.has_value() ? h0->data_ptr<float>() : nullptr;
  T* op = o.data_ptr<T>();
  float* fp = fin.data_ptr<float>();
  const int64_t KV = d.K * d.V, N = static_cast<int64_t>(seqs.size());
  at::parallel_for(0, N * d.HV, item_grain(seqs, KV), [&](int64_t begin, int64_t end) {
    DenormalGuard guard;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / d.HV, hv = item % d.HV;
      float* W = fp + item * KV;
      if (h0p)
        std::memcpy(W, h0p + item * KV, KV * sizeof(float));
      else
        std::memset(W, 0, KV * sizeof(float));
      run_sequence<T, PC>(qp, kp, vp, gp, bp, static_cast<float>(scale), d, seqs[n], hv, W, op,
                          [](int64_t, const float*, int64_t, int64_t, int64_t) {});
    }
  });
}

template <bool PC>
DeltaFwdResult recurrent_fwd_entry(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, double scale,
                                    const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& cu) {
  const Dims d = check_inputs(op, PC, q, k, v, g, beta, h0, cu);
  const auto seqs = make_seqs(d, cu);
  at::Tensor o = empty_out({d.B, d.T, d.HV, d.V}, q.options());
  at::Tensor fin = at::empty({static_cast<int64_t>(seqs.size()), d.HV, d.K, d.V}, q.options().dtype(at::kFloat));
  dispatch_io(q.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    recurrent_fwd_impl<T, PC>(q, k, v, g, beta, scale, h0, seqs, d, o, fin);
  });
  if (cu.has_value()) zero_uncovered(seqs, d, o);
  return {o, fin};
}

// ------------------------------------------------------------------------------------------- serving
template <typename T, typename PT, bool PC>
void recurrent_serve_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, double scale, at::Tensor& pool, const at::Tensor& idx,
                          const std::optional<at::Tensor>& nacc, const std::vector<Seq>& seqs, const Dims& d,
                          bool vfirst, at::Tensor& o) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  T* op = o.data_ptr<T>();
  PT* pp = pool.data_ptr<PT>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool per_token = idx.dim() == 2;
  const int64_t tmax = per_token ? idx.size(1) : 1;
  const int64_t KV = d.K * d.V, N = static_cast<int64_t>(seqs.size()), P = pool.size(0);
  const float sc = static_cast<float>(scale);
  std::vector<int64_t> start(N);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t col = (per_token && nacc.has_value()) ? nacc->data_ptr<int64_t>()[n] - 1 : 0;
    TORCH_CHECK(col >= 0 && col < tmax, "num_accepted_tokens out of range");
    start[n] = ip[n * tmax + col];
    TORCH_CHECK(start[n] < P, "ssm_state_indices out of range of the state pool");
  }
  auto zero_o = [&](const Seq& s, int64_t hv) {
    for (int64_t t = 0; t < s.len; ++t)
      std::memset(op + ((s.b * d.T + s.start + t) * d.HV + hv) * d.V, 0, d.V * sizeof(T));
  };
  if (!per_token) {
    // one row per sequence, read then written back by that sequence only (duplicates are rejected upstream)
    constexpr bool kDirect = std::is_same<PT, float>::value;
    at::parallel_for(0, N * d.HV, item_grain(seqs, KV), [&](int64_t begin, int64_t end) {
      DenormalGuard guard;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n = item / d.HV, hv = item % d.HV;
        if (start[n] < 0) {
          zero_o(seqs[n], hv);
          continue;
        }
        PT* row = pp + (start[n] * d.HV + hv) * KV;
        if (kDirect && !vfirst) {
          run_sequence<T, PC>(qp, kp, vp, gp, bp, sc, d, seqs[n], hv, reinterpret_cast<float*>(row), op,
                              [](int64_t, const float*, int64_t, int64_t, int64_t) {});
        } else {
          float* W = scratch(thread_scratch().state, KV);
          pool_load(row, vfirst, d.K, d.V, W);
          run_sequence<T, PC>(qp, kp, vp, gp, bp, sc, d, seqs[n], hv, W, op,
                              [](int64_t, const float*, int64_t, int64_t, int64_t) {});
          pool_store_block(row, vfirst, d.K, d.V, 0, d.V, W, d.V);
        }
      }
    });
    return;
  }
  // Per-token rows (speculative decoding): gather every start state first, since one sequence's start row
  // may be another's write row; then run and write the state after each token to its row.
  at::Tensor starts = at::empty({N, d.HV, d.K, d.V}, q.options().dtype(at::kFloat));
  float* sp = starts.data_ptr<float>();
  at::parallel_for(0, N * d.HV, item_grain(seqs, KV), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / d.HV, hv = item % d.HV;
      if (start[n] >= 0) pool_load(pp + (start[n] * d.HV + hv) * KV, vfirst, d.K, d.V, sp + item * KV);
    }
  });
  at::parallel_for(0, N * d.HV, item_grain(seqs, KV), [&](int64_t begin, int64_t end) {
    DenormalGuard guard;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / d.HV, hv = item % d.HV;
      if (start[n] < 0) {
        zero_o(seqs[n], hv);
        continue;
      }
      const int64_t* rows = ip + n * tmax;
      run_sequence<T, PC>(qp, kp, vp, gp, bp, sc, d, seqs[n], hv, sp + item * KV, op,
                          [&](int64_t t, const float* blk, int64_t ld, int64_t vb, int64_t w) {
                            if (t < tmax && rows[t] >= 0)
                              pool_store_block(pp + (rows[t] * d.HV + hv) * KV, vfirst, d.K, d.V, vb, w, blk, ld);
                          });
    }
  });
}

template <bool PC>
at::Tensor recurrent_serve_entry(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta, double scale, at::Tensor& pool,
                                 const at::Tensor& idx, const std::optional<at::Tensor>& nacc,
                                 const std::optional<at::Tensor>& cu, bool vfirst) {
  const Dims d = check_inputs(op, PC, q, k, v, g, beta, std::nullopt, cu);
  check_cpu(op, "state_pool", pool);
  check_cpu(op, "ssm_state_indices", idx);
  check_cpu(op, "num_accepted_tokens", nacc);
  const auto seqs = make_seqs(d, cu);
  const int64_t N = static_cast<int64_t>(seqs.size());
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == d.HV &&
                  (vfirst ? (pool.size(2) == d.V && pool.size(3) == d.K) : (pool.size(2) == d.K && pool.size(3) == d.V)),
              op, ": state_pool must be [P,HV,K,V] ([P,HV,V,K] with state_v_first)");
  TORCH_CHECK(idx.scalar_type() == at::kLong && (idx.dim() == 1 || idx.dim() == 2) && idx.size(0) == N, op,
              ": ssm_state_indices must be int64 [N] or [N,T]");
  if (nacc.has_value())
    TORCH_CHECK(nacc->scalar_type() == at::kLong && nacc->numel() == N && idx.dim() == 2, op,
                ": num_accepted_tokens must be int64 [N] with [N,T] indices");
  if (idx.dim() == 2)
    for (const auto& s : seqs) TORCH_CHECK(s.len <= idx.size(1), op, ": [N,T] indices need a column per token");
  at::Tensor o = empty_out({d.B, d.T, d.HV, d.V}, q.options());
  dispatch_io(q.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    switch (pool.scalar_type()) {
      case at::kFloat: recurrent_serve_impl<T, float, PC>(q, k, v, g, beta, scale, pool, idx, nacc, seqs, d, vfirst, o); break;
      case at::kBFloat16: recurrent_serve_impl<T, at::BFloat16, PC>(q, k, v, g, beta, scale, pool, idx, nacc, seqs, d, vfirst, o); break;
      case at::kHalf: recurrent_serve_impl<T, at::Half, PC>(q, k, v, g, beta, scale, pool, idx, nacc, seqs, d, vfirst, o); break;
      default: TORCH_CHECK(false, op, ": state_pool must be float32, bfloat16 or float16, got ", pool.scalar_type());
    }
  });
  if (cu.has_value()) zero_uncovered(seqs, d, o);
  return o;
}

// ------------------------------------------------------------------------------------------- backward
// One token backwards on a K x 32 block. P = S_{t-1}, S = S_t (row stride VB), dS (row stride VB) is updated
// from dL/dS_t to dL/dS_{t-1}. e = v - pred (32), dout (32, zero padded). Accumulates into the token's
// dq, dk, da (K each) and returns the dbeta contribution; writes dv (32).
inline float token_bwd(const float* __restrict P, const float* __restrict S, float* __restrict dS, int64_t K,
                       float scale, const float* __restrict sq, const float* __restrict kk, const float* __restrict a,
                       const float* __restrict kd, float beta, const float* __restrict e,
                       const float* __restrict dout, float* __restrict dq, float* __restrict dk,
                       float* __restrict da, float* __restrict dkA, float* __restrict dv) {
  __m256 dO[4], DB[4], DDB[4];
  const __m256 vbeta = _mm256_set1_ps(beta);
  for (int i = 0; i < 4; ++i) {
    dO[i] = _mm256_loadu_ps(dout + 8 * i);
    DB[i] = _mm256_mul_ps(vbeta, _mm256_loadu_ps(e + 8 * i));
    DDB[i] = _mm256_setzero_ps();
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < K; k += 1) {  // pass A: Tt = dS + sq do^T; dq, Tt.db, Tt.P, d(db) += k Tt
    const float* s = S + k * VB;
    const float* p = P + k * VB;
    const float* ds = dS + k * VB;
    const __m256 qb = _mm256_broadcast_ss(sq + k), kb = _mm256_broadcast_ss(kk + k);
    __m256 xq = _mm256_setzero_ps(), xk = xq, xa = xq;
    for (int i = 0; i < 4; ++i) {
      const __m256 tt = _mm256_fmadd_ps(qb, dO[i], _mm256_loadu_ps(ds + 8 * i));
      xq = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8 * i), dO[i], xq);
      xk = _mm256_fmadd_ps(tt, DB[i], xk);
      xa = _mm256_fmadd_ps(tt, _mm256_loadu_ps(p + 8 * i), xa);
      DDB[i] = _mm256_fmadd_ps(kb, tt, DDB[i]);
    }
    dq[k] += hsum8(_mm256_mul_ps(vscale, xq));
    dkA[k] = hsum8(xk);
    da[k] += hsum8(xa);
  }
  __m256 dpred[4], xb = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    xb = _mm256_fmadd_ps(_mm256_loadu_ps(e + 8 * i), DDB[i], xb);
    const __m256 de = _mm256_mul_ps(vbeta, DDB[i]);
    _mm256_storeu_ps(dv + 8 * i, de);
    dpred[i] = _mm256_sub_ps(_mm256_setzero_ps(), de);
  }
  for (int64_t k = 0; k < K; ++k) {  // pass B: P dpred, dS_{t-1} = a Tt + kd dpred^T
    const float* p = P + k * VB;
    float* ds = dS + k * VB;
    const __m256 qb = _mm256_broadcast_ss(sq + k), ab = _mm256_broadcast_ss(a + k), kdb = _mm256_broadcast_ss(kd + k);
    __m256 x = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      const __m256 tt = _mm256_fmadd_ps(qb, dO[i], _mm256_loadu_ps(ds + 8 * i));
      x = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8 * i), dpred[i], x);
      _mm256_storeu_ps(ds + 8 * i, _mm256_fmadd_ps(kdb, dpred[i], _mm256_mul_ps(ab, tt)));
    }
    const float dkd = hsum8(x);
    dk[k] += dkA[k] + a[k] * dkd;
    da[k] += kk[k] * dkd;
  }
  return hsum8(xb);
}

// Replays one token forward on a K x 32 block (copying P into S) and returns e = v - pred.
inline void token_replay(const float* __restrict P, float* __restrict S, int64_t K, const float* __restrict kk,
                         const float* __restrict a, const float* __restrict kd, float beta, const float* __restrict v,
                         float* __restrict e) {
  float pred[VB] = {0};
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < VB; ++j) pred[j] += kd[k] * P[k * VB + j];
  float db[VB];
  for (int64_t j = 0; j < VB; ++j) {
    e[j] = v[j] - pred[j];
    db[j] = beta * e[j];
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < VB; ++j) S[k * VB + j] = a[k] * P[k * VB + j] + kk[k] * db[j];
}

template <typename T, bool PC>
void recurrent_bwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                        const at::Tensor& beta, double scale, const std::optional<at::Tensor>& h0,
                        const at::Tensor& dout, const std::optional<at::Tensor>& dfin, const std::vector<Seq>& seqs,
                        const Dims& d, at::Tensor& dqe, at::Tensor& dke, at::Tensor& dv, at::Tensor& dg,
                        at::Tensor& dbeta, at::Tensor& dh0) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* dop = dout.data_ptr<T>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const float* h0p = h0.has_value() ? h0->data_ptr<float>() : nullptr;
  const float* dfp = dfin.has_value() ? dfin->data_ptr<float>() : nullptr;
  float* dqp = dqe.data_ptr<float>();
  float* dkp = dke.data_ptr<float>();
  T* dvp = dv.data_ptr<T>();
  float* dgp = dg.data_ptr<float>();
  float* dbp = dbeta.data_ptr<float>();
  float* dh0p = dh0.data_ptr<float>();
  const int64_t K = d.K, V = d.V, KV = K * V, N = static_cast<int64_t>(seqs.size());
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, N * d.HV, item_grain(seqs, KV), [&](int64_t begin, int64_t end) {
    DenormalGuard guard;
    ThreadScratch& ts = thread_scratch();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / d.HV, hv = item % d.HV;
      const Seq& s = seqs[n];
      const int64_t L = s.len, nseg = (L + SEG - 1) / SEG;
      // per-token vectors for the whole sequence, and gradient accumulators
      float* tok = scratch(ts.tok, 4 * L * K + L + 4 * L * K + L + 2 * K);
      TokenVecs tv{tok, tok + L * K, tok + 2 * L * K, tok + 3 * L * K, tok + 4 * L * K, K};
      float* gq = tok + 4 * L * K + L;
      float* gk = gq + L * K;
      float* ga = gk + L * K;
      float* gb = ga + L * K;  // L
      float* dkA = gb + L;     // K
      if (L > 0) prep_tokens<T, PC>(qp, kp, gp, bp, d, s, hv, 0, L, sc, tv);
      std::fill(gq, gq + 3 * L * K + L, 0.f);
      float* ck = scratch(ts.ck, (nseg + 1) * K * VB);        // checkpoints
      float* st = scratch(ts.state, (SEG + 1) * K * VB + K * VB + SEG * VB + 3 * VB);  // segment states
      float* dS = st + (SEG + 1) * K * VB;
      float* ev = dS + K * VB;  // SEG x 32
      float* vbuf = ev + SEG * VB;
      float* dob = vbuf + VB;
      float* dvb = dob + VB;
      for (int64_t vb = 0; vb < V; vb += VB) {
        const int64_t w = std::min(VB, V - vb);
        // forward: checkpoint at the start of each segment
        if (h0p)
          block_in(h0p + item * KV, V, K, vb, w, ck);
        else
          std::fill(ck, ck + K * VB, 0.f);
        for (int64_t sg = 0; sg + 1 < nseg; ++sg) {
          std::memcpy(ck + (sg + 1) * K * VB, ck + sg * K * VB, K * VB * sizeof(float));
          float* S = ck + (sg + 1) * K * VB;
          for (int64_t t = sg * SEG; t < (sg + 1) * SEG; ++t) {
            const int64_t row = s.b * d.T + s.start + t;
            load_row(vp + (row * d.HV + hv) * V + vb, vbuf, w, VB);
            token_step(S, VB, K, tv.sq + t * K, tv.kk + t * K, tv.a + t * K, tv.kd + t * K, tv.beta[t], vbuf, dob);
          }
        }
        if (dfp)
          block_in(dfp + item * KV, V, K, vb, w, dS);
        else
          std::fill(dS, dS + K * VB, 0.f);
        for (int64_t sg = nseg - 1; sg >= 0; --sg) {
          const int64_t t0 = sg * SEG, t1 = std::min(L, t0 + SEG);
          std::memcpy(st, ck + sg * K * VB, K * VB * sizeof(float));
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t row = s.b * d.T + s.start + t;
            load_row(vp + (row * d.HV + hv) * V + vb, vbuf, w, VB);
            token_replay(st + (t - t0) * K * VB, st + (t - t0 + 1) * K * VB, K, tv.kk + t * K, tv.a + t * K,
                         tv.kd + t * K, tv.beta[t], vbuf, ev + (t - t0) * VB);
          }
          for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t row = s.b * d.T + s.start + t;
            load_row(dop + (row * d.HV + hv) * V + vb, dob, w, VB);
            gb[t] += token_bwd(st + (t - t0) * K * VB, st + (t - t0 + 1) * K * VB, dS, K, sc, tv.sq + t * K,
                               tv.kk + t * K, tv.a + t * K, tv.kd + t * K, tv.beta[t], ev + (t - t0) * VB, dob,
                               gq + t * K, gk + t * K, ga + t * K, dkA, dvb);
            store_row(dvp + (row * d.HV + hv) * V + vb, dvb, w);
          }
        }
        block_out(dS, V, K, vb, w, dh0p + item * KV);
      }
      for (int64_t t = 0; t < L; ++t) {
        const int64_t row = s.b * d.T + s.start + t;
        std::memcpy(dqp + (row * d.HV + hv) * K, gq + t * K, K * sizeof(float));
        std::memcpy(dkp + (row * d.HV + hv) * K, gk + t * K, K * sizeof(float));
        const float* a = tv.a + t * K;
        if (PC) {
          float* dgr = dgp + (row * d.HV + hv) * K;
          for (int64_t c = 0; c < K; ++c) dgr[c] = a[c] * ga[t * K + c];
        } else {
          float acc = 0.f;
          for (int64_t c = 0; c < K; ++c) acc += ga[t * K + c];
          dgp[row * d.HV + hv] = a[0] * acc;
        }
        dbp[row * d.HV + hv] = gb[t];
      }
    }
  });
}

template <bool PC>
DeltaBwdResult recurrent_bwd_entry(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& g, const at::Tensor& beta, double scale,
                                   const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& cu,
                                   const at::Tensor& dout, const std::optional<at::Tensor>& dfin) {
  return bwd_entry<PC>(op, q, k, v, g, beta, h0, cu, dout, dfin,
                       [&](auto tag, const at::Tensor& dout_c, const std::vector<Seq>& seqs, const Dims& d,
                           at::Tensor& dqe, at::Tensor& dke, at::Tensor& dv, at::Tensor& dg, at::Tensor& dbeta,
                           at::Tensor& dh0) {
                         using T = decltype(tag);
                         recurrent_bwd_impl<T, PC>(q, k, v, g, beta, scale, h0, dout_c, dfin, seqs, d, dqe, dke, dv, dg,
                                                   dbeta, dh0);
                       });
}

}  // namespace kda_kernels::cpu
