// Host-side check of the grad3 contraction helpers of kernels_src/cuda/delta_chunk_bwd.cuh (mma_64x128, the
// dQG / dKend / dw products of grad3_vc, and mma_64x64, its dA_qk product): every one of the 256 threads run on
// the CPU with its tid, the scattered outputs (the same index expressions as grad3_vc's stores) compared with a
// float64 product, and every output element checked to be written by exactly one thread. Built and run by
// tests/test_cuda_chunk_bwd_host.py with nvcc (no GPU needed). Exit 0: within tolerance, full coverage.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include "delta_chunk_bwd.cuh"
using namespace kda_kernels::cuda::chunk_bwd;
int main() {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  static float A[CH * TS], Bm[KP * TS], B2[CH * TS];
  for (int i = 0; i < CH * TS; ++i) { A[i] = nd(rng); B2[i] = nd(rng); }
  for (int i = 0; i < KP * TS; ++i) Bm[i] = nd(rng);
  const int Kd = 32;
  std::vector<float> out(CH * KP, 0.f), out2(CH * CH, 0.f);
  std::vector<int> cnt(CH * KP, 0), cnt2(CH * CH, 0);
  for (int tid = 0; tid < NT; ++tid) {
    float acc[2][4][4] = {}, acc2[4][4] = {};
    // two calls of 16 contraction indices each, as the kernel accumulates across slices
    mma_64x128(acc, tid, A, Bm, 16);
    mma_64x128(acc, tid, A + 16, Bm + 16, 16);
    mma_64x64(acc2, tid, A, B2, Kd);
    const int m0 = (tid >> 5) * 4, n0 = tid & 31;
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) {
          const int o = (m0 + 32 * r + i) * KP + n0 + 32 * j;
          out[o] = acc[r][i][j];
          ++cnt[o];
        }
    const int q0 = (tid >> 4) * 4, p0 = tid & 15;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) {
        const int o = (q0 + i) * CH + p0 + 16 * j;
        out2[o] = acc2[i][j];
        ++cnt2[o];
      }
  }
  double e1 = 0, e2 = 0;
  int bad = 0;
  for (int t = 0; t < CH; ++t) {
    for (int c = 0; c < KP; ++c) {
      double s = 0;
      for (int k = 0; k < Kd; ++k) s += double(A[t * TS + k]) * Bm[c * TS + k];
      e1 = std::fmax(e1, std::fabs(s - out[t * KP + c]));
      bad += cnt[t * KP + c] != 1;
    }
    for (int j = 0; j < CH; ++j) {
      double s = 0;
      for (int k = 0; k < Kd; ++k) s += double(A[t * TS + k]) * B2[j * TS + k];
      e2 = std::fmax(e2, std::fabs(s - out2[t * CH + j]));
      bad += cnt2[t * CH + j] != 1;
    }
  }
  printf("mma_64x128 max abs err %.3g, mma_64x64 %.3g, elements not written exactly once: %d\n", e1, e2, bad);
  return (e1 < 1e-4 && e2 < 1e-4 && bad == 0) ? 0 : 1;
}
