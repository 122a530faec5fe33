// Host-side check of the C2 helpers of kernels_src/cuda/delta_chunk_bwd.cuh (c2_intra: the intra-chunk A_qk / A_kk
// terms of the pairs inside each 16-row sub-block, called by grad3_ch2; back_subst_col, grad3_wy's back
// substitution; c2_rows / c2_cols went with grad2 and grad3_ch in session 9), run thread by thread on the CPU
// against the direct float64 definition (per pair (t, j) in one sub-block: the decay product E[t, j] formed
// explicitly; dg_i summed over j < i <= t). Gates: mild, strong, logsigmoid, 30 % at -20 and at -1e4. Built and run by
// tests/test_cuda_chunk_bwd_host.py with nvcc (no GPU needed). Exit 0: within tolerance and finite.
#include <cstdio>
#include <cmath>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include "delta_chunk_bwd.cuh"
using namespace kda_kernels::cuda::chunk_bwd;
int main() {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  double worst = 0;
  for (int trial = 0; trial < 6; ++trial) {
    alignas(16) static float qs[CH * KP], ks[CH * KP], as[CH * W], xq[CH * CH], xk[CH * CH], dq[CH * KP], dk[CH * KP], dg[CH * W];
    for (int i = 0; i < CH * KP; ++i) { qs[i] = nd(rng); ks[i] = nd(rng); dq[i] = 0; dk[i] = 0; }
    for (int i = 0; i < CH * W; ++i) { dg[i] = 0; as[i] = 0; }
    for (int t = 0; t < CH; ++t)
      for (int c = 0; c < KP; ++c) {
        float g = trial == 0 ? -0.01f * ud(rng) : trial == 1 ? -5.f * ud(rng) : std::log(1.f / (1.f + std::exp(-nd(rng))));
        if (trial >= 3 && ud(rng) < 0.3f) g = trial == 3 ? -20.f : -1e4f;
        as[t * W + c] = std::exp(g);
      }
    for (int t = 0; t < CH; ++t)
      for (int j = 0; j < CH; ++j) { xq[t * CH + j] = j <= t ? nd(rng) : 0.f; xk[t * CH + j] = j < t ? nd(rng) : 0.f; }
    C2Smem m{qs, ks, as, xq, xk, dq, dk, dg};
    for (int c = 0; c < KP; ++c) {
      for (int b = 0; b < 4; ++b) c2_intra(m, b, c);
    }
    double err = 0, nrm = 0;
    for (int c = 0; c < KP; ++c) {
      std::vector<double> rq(CH, 0), rk(CH, 0), rg(CH, 0);
      for (int t = 0; t < CH; ++t)
        for (int j = 0; j < t; ++j) {
          if (j / SB != t / SB) continue;  // c2_intra: the pairs inside a sub-block (grad3_ch2 does the rest)
          double E = 1;
          for (int i = j + 1; i <= t; ++i) E *= as[i * W + c];
          const double x1 = xq[t * CH + j], x2 = xk[t * CH + j];
          rq[t] += x1 * ks[j * KP + c] * E;
          rk[t] += x2 * ks[j * KP + c] * E;
          const double mm = (x1 * qs[t * KP + c] + x2 * ks[t * KP + c]) * E;
          rk[j] += mm;
          for (int i = j + 1; i <= t; ++i) rg[i] += mm * ks[j * KP + c];
        }
      for (int t = 0; t < CH; ++t) {
        err = std::fmax(err, std::fabs(rq[t] - dq[t * KP + c]));
        err = std::fmax(err, std::fabs(rk[t] - dk[t * KP + c]));
        err = std::fmax(err, std::fabs(rg[t] - dg[t * W + c]));
        nrm = std::fmax(nrm, std::fabs(rg[t]));
        if (!std::isfinite(dq[t*KP+c]) || !std::isfinite(dk[t*KP+c]) || !std::isfinite(dg[t*W+c])) { printf("NONFINITE\n"); return 1; }
      }
    }
    printf("trial %d  max abs err %.3g  (max |dg| %.3g)\n", trial, err, nrm);
    worst = std::fmax(worst, err / nrm);
  }
  // back substitution
  alignas(16) static float L[CH * CH];
  for (int s = 0; s < CH; ++s) for (int t = 0; t < CH; ++t) L[s * CH + t] = t < s ? 0.1f * nd(rng) : 0.f;
  float x[CH]; double r[CH];
  for (int i = 0; i < CH; ++i) { x[i] = nd(rng); r[i] = x[i]; }
  back_subst_col(x, L);
  for (int t = CH - 2; t >= 0; --t) for (int s = t + 1; s < CH; ++s) r[t] -= L[s * CH + t] * r[s];
  double e2 = 0; for (int i = 0; i < CH; ++i) e2 = std::fmax(e2, std::fabs(r[i] - x[i]));
  printf("back subst max abs err %.3g\n", e2);
  printf("worst rel %.3g\n", worst);
  return (worst < 1e-5 && e2 < 1e-4) ? 0 : 1;
}
