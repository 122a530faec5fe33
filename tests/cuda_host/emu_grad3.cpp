// CPU emulation of whole CUDA kernels of kernels_src/cuda/delta_chunk_bwd.cuh: grad2_kernel (the default) against
// the split grad3 kernels (grad3_vc<0..2>, grad3_wy, grad3_ch; KDA_CUDA_CHUNK_BWD_GRAD=3), run on the same random
// work buffers (they need not come from prep / the state kernels: both compute the same function of them). The
// kernel source is compiled by g++ with shims: each block's threads are ucontext coroutines run one after
// the other up to the next __syncthreads (so barrier semantics and shared memory are exact, shared-memory
// "atomics" need no locking), __shfl_xor_sync goes through a block-wide buffer (every warp of these kernels
// calls warp_sum the same number of times). Checks dq, dk, dg, dbeta, dv of both families, K=V=128 and odd
// K/V with a partial last chunk, varlen with an empty sequence and the token-layout w, bf16 q/k/v/dO, gates
// down to -1e4: finite and equal up to fp32 rounding. Built and run by tests/test_cuda_chunk_bwd_host.py (g++
// and the CUDA headers; no GPU). Exit 0: pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
#define __align__(n)

struct EmuDim { unsigned x = 0, y = 0, z = 0; };
EmuDim threadIdx, blockIdx, blockDim;
using std::min;
using std::max;

namespace emu {
constexpr int NTH = 512;  // most threads of a block (grad3_ch: 512)
constexpr size_t STK = 256 * 1024;
ucontext_t sched, ctx[NTH];
char* stacks = static_cast<char*>(std::malloc(NTH * STK));  // (pages touched only as the stacks grow)
int cur = 0;
bool done[NTH];
float shfl[NTH];
std::function<void()> body;
void tramp() {
  body();
  done[cur] = true;
}
void yield() { swapcontext(&ctx[cur], &sched); }
void run_block(int nth, const std::function<void()>& f) {
  body = f;
  blockDim.x = nth;
  for (int i = 0; i < nth; ++i) {
    getcontext(&ctx[i]);
    ctx[i].uc_stack.ss_sp = stacks + i * STK;
    ctx[i].uc_stack.ss_size = STK;
    ctx[i].uc_link = &sched;
    makecontext(&ctx[i], tramp, 0);
    done[i] = false;
  }
  for (;;) {
    int left = 0;
    for (int i = 0; i < nth; ++i) {
      if (done[i]) continue;
      cur = i;
      threadIdx.x = i;
      swapcontext(&sched, &ctx[i]);
      left += !done[i];
    }
    if (left == 0) break;
  }
}
}  // namespace emu

void __syncthreads() { emu::yield(); }
float __shfl_xor_sync(unsigned, float x, int m) {
  emu::shfl[emu::cur] = x;
  emu::yield();
  const float r = emu::shfl[emu::cur ^ m];
  emu::yield();
  return r;
}
size_t __cvta_generic_to_shared(const void*) { return 0; }
float atomicAdd(float* p, float x) {
  const float o = *p;
  *p = o + x;
  return o;
}

#include "delta_chunk_bwd.cuh"

namespace kda_kernels { namespace cuda { namespace chunk_bwd {
alignas(16) float sm[60000];
}}}

using namespace kda_kernels::cuda::chunk_bwd;
using kda_kernels::cuda::kF32;
using kda_kernels::cuda::kBF16;

template <typename F>
void launch(int gx, int gy, F kern, int nth = NT) {
  for (int bx = 0; bx < gx; ++bx)
    for (int by = 0; by < gy; ++by) {
      blockIdx.x = bx; blockIdx.y = by; blockIdx.z = 0;
      std::memset(sm, 0xff, sizeof(sm));  // NaN garbage: a read of shared memory nobody wrote shows up
      emu::run_block(nth, kern);
    }
}

template <bool PC>
int check(int T, int HV, int K, int V, int seed, bool extreme, bool varlen = false, bool bf16 = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  // varlen: sequences [0, 0), [0, 70), [70, T) (an empty one, partial chunks), and w in the token layout (the path
  // of the v1 state kernels, wc == nullptr)
  const int H = 1, N = varlen ? 3 : 1, tokens = T;
  std::vector<int64_t> cu = {0, 0, 70, T};
  std::vector<int> off = {0, (T + CH - 1) / CH};
  if (varlen) off = {0, 0, (70 + CH - 1) / CH, (70 + CH - 1) / CH + (T - 70 + CH - 1) / CH};
  const int nc = off[N];
  auto vec = [&](size_t n, float s) { std::vector<float> x(n); for (auto& e : x) e = s * nd(rng); return x; };
  auto q = vec(tokens * H * K, 1), k = vec(tokens * H * K, 0.3f), v = vec(tokens * HV * V, 1), dO = vec(tokens * HV * V, 1);
  std::vector<float> g(static_cast<size_t>(tokens) * HV * (PC ? K : 1)), beta(tokens * HV);
  for (auto& e : g) {  // mild gates (decays across the whole chunk matter) or logsigmoid with 30 % at -1e4
    if (!extreme) e = -0.03f * ud(rng);
    else e = ud(rng) < 0.3f ? -1e4f : std::log(1.f / (1.f + std::exp(-nd(rng))));
  }
  for (auto& e : beta) e = ud(rng);
  auto hs = vec(size_t(nc) * HV * K * V, 1), dhs = vec(size_t(nc) * HV * K * V, 1);
  auto u = vec(tokens * HV * V, 1), U = vec(tokens * HV * V, 1), dU = vec(tokens * HV * V, 1);
  const size_t ct = size_t(nc) * HV * CH * KP;
  std::vector<float> wc(ct, 0.f), akk(size_t(nc) * HV * CH * CH, 0.f);
  for (int c = 0; c < nc; ++c)
    for (int h = 0; h < HV; ++h)
      for (int t = 0; t < CH; ++t) {
        const bool real = c * CH + t < T;
        for (int j = 0; j < KP; ++j) wc[((size_t(c) * HV + h) * CH + t) * KP + j] = (real && j < K) ? 0.3f * nd(rng) : 0.f;
        for (int j = 0; j < t; ++j) akk[((size_t(c) * HV + h) * CH + t) * CH + j] = real ? 0.2f * nd(rng) : 0.f;
      }
  auto w = vec(size_t(tokens) * HV * K, 0.3f);
  Params p{};
  p.q = q.data(); p.k = k.data(); p.v = v.data(); p.grad_o = dO.data(); p.g = g.data(); p.beta = beta.data();
  p.cu = varlen ? cu.data() : nullptr; p.in_dtype = kF32;
  auto to_bf = [](const std::vector<float>& x) {
    std::vector<__nv_bfloat16> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = __float2bfloat16(x[i]);
    return y;
  };
  auto qb = to_bf(q), kb = to_bf(k), vb = to_bf(v), db = to_bf(dO);
  std::vector<__nv_bfloat16> dvb2(tokens * HV * V), dvb3(tokens * HV * V);
  if (bf16) {  // q, k, v, dO (and so dv) in bf16, as the benchmark shape runs
    p.q = qb.data(); p.k = kb.data(); p.v = vb.data(); p.grad_o = db.data(); p.in_dtype = kBF16;
  }
  p.B = 1; p.T = T; p.H = H; p.HV = HV; p.K = K; p.V = V; p.N = N; p.scale = 0.7f; p.chunk_off = off.data();
  p.u = u.data(); p.U = U.data(); p.dU = dU.data(); p.hs = hs.data(); p.dhs = dhs.data();
  if (varlen) p.w = w.data(); else p.wc = wc.data();
  struct Out { std::vector<float> dq, dk, dg, dbeta, dv; };
  auto fresh = [&](Out& o) {
    o.dq.assign(tokens * HV * K, NAN); o.dk.assign(tokens * HV * K, NAN); o.dg.assign(tokens * HV * K, NAN);
    o.dbeta.assign(tokens * HV, NAN); o.dv.assign(tokens * HV * V, NAN);
    p.dq = o.dq.data(); p.dk = o.dk.data(); p.dg = o.dg.data(); p.dbeta = o.dbeta.data(); p.dv = o.dv.data();
  };
  // grad2
  Out a;
  auto akk2 = akk;
  std::vector<float> aqk_dummy(akk.size(), NAN);
  p.akk = akk2.data(); p.aqk = aqk_dummy.data();
  fresh(a);
  if (bf16) p.dv = dvb2.data();
  launch(nc, HV, [&] { grad2_kernel<PC>(p); });
  // grad3 (intermediates in their own buffers, NaN-filled: a read of an element nobody wrote shows up)
  Out b;
  auto akk3 = akk;
  std::vector<float> aqk3(akk.size(), NAN), gq(ct, NAN), gk(ct, NAN), gw(ct, NAN), gl(size_t(nc) * HV * KP, NAN);
  p.akk = akk3.data(); p.aqk = aqk3.data(); p.gdqg = gq.data(); p.gdkend = gk.data(); p.gdw = gw.data(); p.gdgl = gl.data();
  fresh(b);
  if (bf16) p.dv = dvb3.data();
  launch(nc, HV, [&] { grad3_vc_kernel<PC, 0>(p); });
  launch(nc, HV, [&] { grad3_vc_kernel<PC, 1>(p); });
  launch(nc, HV, [&] { grad3_vc_kernel<PC, 2>(p); });
  launch(nc, HV, [&] { grad3_wy_kernel<PC>(p); });
  launch(nc, HV, [&] { grad3_ch_kernel<PC>(p); }, NT3);
  int fail = 0;
  auto cmp = [&](const char* name, const std::vector<float>& x, const std::vector<float>& y) {
    double e = 0, m = 0;
    bool fin = true;
    for (size_t i = 0; i < x.size(); ++i) {
      fin = fin && std::isfinite(x[i]) && std::isfinite(y[i]);
      e = std::max(e, std::fabs(double(x[i]) - y[i]));
      m = std::max(m, std::fabs(double(x[i])));
    }
    const bool ok = fin && e <= 5e-6 * std::max(m, 1.0);  // (measured: <= 5.3e-7; fp32 summation order only)
    printf("  %-5s max|grad2| %.3g  max|grad3 - grad2| %.3g  %s\n", name, m, e, ok ? "ok" : (fin ? "MISMATCH" : "NONFINITE"));
    fail += !ok;
  };
  printf("%s T=%d HV=%d K=%d V=%d gates %s%s%s\n", PC ? "kda" : "gdn", T, HV, K, V, extreme ? "extreme" : "mild",
         varlen ? ", varlen with an empty sequence, token-layout w" : "", bf16 ? ", bf16 q/k/v/dO" : "");
  if (bf16)
    for (size_t i = 0; i < a.dv.size(); ++i) { a.dv[i] = __bfloat162float(dvb2[i]); b.dv[i] = __bfloat162float(dvb3[i]); }
  cmp("dq", a.dq, b.dq); cmp("dk", a.dk, b.dk); cmp("dg", a.dg, b.dg); cmp("dbeta", a.dbeta, b.dbeta); cmp("dv", a.dv, b.dv);
  return fail;
}

int main() {
  int fail = 0;
  for (int ex = 0; ex < 2; ++ex) {
    fail += check<true>(100, 2, 128, 128, 1, ex);
    fail += check<true>(77, 1, 40, 30, 2, ex);
    fail += check<false>(100, 1, 128, 128, 3, ex);
    fail += check<false>(64, 1, 40, 30, 4, ex);
    fail += check<true>(150, 2, 32, 100, 5, ex, true);
    fail += check<false>(150, 1, 128, 128, 6, ex, true);
    fail += check<true>(100, 2, 128, 128, 7, ex, false, true);
  }
  printf(fail ? "FAIL\n" : "PASS\n");
  return fail ? 1 : 0;
}
