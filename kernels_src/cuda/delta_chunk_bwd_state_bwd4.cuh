// state_bwd v4 of the chunked backward (issue #7, session 9; KDA_CUDA_CHUNK_BWD_STATE_BWD=5 (tf32) / 6 (3xTF32),
// off by default): state_bwd3_kernel (delta_chunk_bwd_state_bwd3.cuh) with the operand traffic of the forward's
// state-only scan (delta_chunk_scan4.cuh). Same inputs, outputs, layouts, products and product order as state_bwd3
// (so its results bit for bit): per chunk, backwards, dU = A_qk^T dO + (K Eend) dS1, dS0 = Gam_last dS1 +
// (Q Gam)^T dO - w^T dU; writes dhs, dU, dh0 (fp32).
// What changes:
//  - the operands arrive by cp.async.bulk instead of 16-byte cp.async pieces by every thread: warp 0 issues one
//    bulk copy per tile row (lane l: rows l and l + 32) straight into state_bwd3's padded shared rows (K Eend rows
//    KP + 4 floats, w and Q Gam rows KP + 8, A_qk rows CH + 8: 16-byte aligned strides and sizes), completion
//    tracked by mbarriers (complete_tx): K Eend + w double-buffered (one mbarrier per buffer), issued two chunk
//    steps ahead after the step's last barrier; A_qk + Q Gam + Gam_last single-buffered (one mbarrier), issued one
//    step ahead right after their only use, as in state_bwd3;
//  - the A fragments of K Eend (read as stored) come from one ldmatrix.x4 each (8 x 4 fp32 matrices: lane i
//    receives row i / 4, word i % 4 -- the tf32 m16n8k8 A fragment) instead of four scalar loads.
// Four barriers per chunk step as in state_bwd3. Shared memory: state_bwd3's 217 KB plus three mbarriers.
#pragma once

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_state_bwd3.cuh"
#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr uint32_t kSb4G1Tx = 2 * CH * KP * sizeof(float);                            // K Eend + w
constexpr uint32_t kSb4G2Tx = (CH * CH + CH * KP + KP) * sizeof(float);               // A_qk + Q Gam + Gam_last
struct StateBwd4Smem {
  static constexpr size_t bar_off = kStateBwd3Smem;  // bytes
  static constexpr size_t bytes = bar_off + 3 * sizeof(uint64_t);
};
constexpr size_t kStateBwd4Smem = StateBwd4Smem::bytes;
static_assert(StateBwd4Smem::bar_off % 16 == 0 && (kSb3LdKe * 4) % 16 == 0 && (kSb3LdT * 4) % 16 == 0 &&
                  (kSb3LdA * 4) % 16 == 0 && (Sb3Smem::kend * 4) % 16 == 0 && (Sb3Smem::w * 4) % 16 == 0 &&
                  (Sb3Smem::qg * 4) % 16 == 0 && (Sb3Smem::aqk * 4) % 16 == 0 && (Sb3Smem::gl * 4) % 16 == 0,
              "bulk copies need 16-byte aligned shared addresses and sizes");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void sb4_ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void sb4_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

template <bool PC, bool PRECISE>
__global__ void __launch_bounds__(kSb3Threads, 1) state_bwd4_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using L = Sb3Smem;
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS;
  extern __shared__ __align__(128) float sm4b[];
  // mbarriers: K Eend + w of buffer 0 / 1 (bar0, bar0 + 8), A_qk + Q Gam + Gam_last (bar0 + 16)
  const uint32_t bar0 = smem_u32(reinterpret_cast<unsigned char*>(sm4b) + StateBwd4Smem::bar_off);
  float* qgs = sm4b + L::qg;
  float* aqs = sm4b + L::aqk;
  float* gls = sm4b + L::gl;
  float* dss = sm4b + L::ds;
  float* ous = sm4b + L::ou;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 16 * wc;        // the warp's first column in the block's VS
  const int r0 = 32 * wi + gq;   // the warp's first dS row (tile mt: + 16 mt, second half + 8)
  const int u0 = 16 * wi + gq;   // the warp's first dU row (second half + 8)
  const int K = p.K, V = p.V, HV = p.HV;
  const float scale = p.scale;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // dS: ds[mt][nt][e] at row r0 + 16 mt + 8 (e / 2), column cw + 8 nt + 2 t4 + e % 2 (+ v0 in V)
  float ds[2][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + 16 * mt + 8 * (e >> 1), c = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        ds[mt][nt][e] = (p.dht != nullptr && r < K && c < V) ? p.dht[nbase + static_cast<int64_t>(r) * V + c] : 0.f;
      }
  auto put_ds = [&]() {  // fp32 copy for the next step's B operand
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* d = dss + (r0 + 16 * mt) * kSb3LdB + cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(d) = make_float2(ds[mt][nt][0], ds[mt][nt][1]);
        *reinterpret_cast<float2*>(d + 8 * kSb3LdB) = make_float2(ds[mt][nt][2], ds[mt][nt][3]);
      }
  };
  auto store_ds = [&](float* dst) {  // a [K, V] state
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 16 * mt + 8 * h;
        if (r >= K) continue;
        float* row = dst + static_cast<int64_t>(r) * V;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
      }
  };

  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  // warp 0 only: lane 0 arms the mbarrier, then the lanes copy one shared row per bulk copy (rows lane, lane + 32)
  auto issue_g1 = [&](int cid, int b) {  // K Eend and w of chunk cid into buffer b
    const uint32_t bar = bar0 + 8 * b;
    const uint32_t ke = smem_u32(sm4b + L::kend + b * CH * kSb3LdKe);
    const uint32_t ww = smem_u32(sm4b + L::w + b * CH * kSb3LdT);
    const float* ksrc = p.kendc + tile(cid);
    const float* wsrc = p.wc + tile(cid);
    sb4_fence_proxy_async();
    if (lane == 0) mbar_arrive_expect_tx(bar, kSb4G1Tx);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = lane + 32 * h;
      bulk_copy(ke + t * kSb3LdKe * 4, ksrc + t * KP, KP * 4, bar);
      bulk_copy(ww + t * kSb3LdT * 4, wsrc + t * KP, KP * 4, bar);
    }
  };
  auto issue_g2 = [&](int cid) {  // A_qk, Q Gam, Gam_last of chunk cid
    const uint32_t bar = bar0 + 16;
    const float* asrc = p.aqk + (static_cast<size_t>(cid) * HV + hv) * CH * CH;
    const float* qsrc = p.qgc + tile(cid);
    sb4_fence_proxy_async();
    if (lane == 0) mbar_arrive_expect_tx(bar, kSb4G2Tx);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = lane + 32 * h;
      bulk_copy(smem_u32(aqs + t * kSb3LdA), asrc + t * CH, CH * 4, bar);
      bulk_copy(smem_u32(qgs + t * kSb3LdT), qsrc + t * KP, KP * 4, bar);
    }
    if (lane == 0) bulk_copy(smem_u32(gls), p.glc + (static_cast<size_t>(cid) * HV + hv) * KP, KP * 4, bar);
  };
  // raw dO (no scale) of chunk c: row tid / 4, columns 8 (tid % 4) .. + 7 of the block's VS
  float dn[8];
  auto load_do = [&](int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    const int t = tid >> 2, vc = v0 + 8 * (tid & 3);
    const bool tok = t < cp.Cc;
    const int64_t base = ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V) + vc;
#pragma unroll
    for (int e = 0; e < 8; ++e) dn[e] = (tok && vc + e < V) ? load_in(p.grad_o, base + e, p.in_dtype) : 0.f;
  };
  auto put_do = [&]() {
    float* d = ous + (tid >> 2) * kSb3LdB + 8 * (tid & 3);
    *reinterpret_cast<float4*>(d) = make_float4(dn[0], dn[1], dn[2], dn[3]);
    *reinterpret_cast<float4*>(d + 4) = make_float4(dn[4], dn[5], dn[6], dn[7]);
  };

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 3; ++i) mbar_init(bar0 + 8 * i, 1);
    mbar_init_fence();
  }
  put_ds();
  if (nc > 0) {
    load_do(nc - 1);
    put_do();
  }
  __syncthreads();  // mbarriers initialised
  if (warp == 0 && nc > 0) {
    issue_g1(off + nc - 1, 0);
    issue_g2(off + nc - 1);
    if (nc > 1) issue_g1(off + nc - 2, 1);
  }
  // this lane's ldmatrix row of the K Eend A fragments (matrix m = lane / 8: rows + 8 (m & 1), columns + 4 (m >> 1))
  const int lm = lane >> 3;
  const int lrow = 16 * wi + (lane & 7) + 8 * (lm & 1), lcol = 4 * (lm >> 1);

  for (int s = 0; s < nc; ++s) {
    const int c = nc - 1 - s, cid = off + c, b = s & 1;
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    store_ds(p.dhs + (static_cast<size_t>(cid) * HV + hv) * K * V);  // dS at the end of chunk c
    if (c > 0) load_do(c - 1);  // into shared memory after the step's last barrier
    mbar_wait_parity(bar0 + 8 * b, (s >> 1) & 1);  // K Eend, w (buffer b) of chunk c
    mbar_wait_parity(bar0 + 16, s & 1);             // A_qk, Q Gam, Gam_last of chunk c
    __syncthreads();                                // (also dO of chunk c and the dS copy)

    // ---- the products with dO (independent of dS): dU = scale A_qk^T dO, dS = Gam_last dS + scale (Q Gam)^T dO
    float du[2][4];
    {
      float xm[2][4], xc[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) xm[nt][e] = xc[nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        if (ks < 2 * wi) continue;  // A_qk[j, t] = 0 for j < t (rows t >= 16 wi)
        const int j0 = 8 * ks + t4;
        // A(t, j) = A_qk[j, t], zero above the diagonal (j < t) whatever the buffer holds there
        const float av[4] = {j0 >= u0 ? aqs[j0 * kSb3LdA + u0] : 0.f,
                             j0 >= u0 + 8 ? aqs[j0 * kSb3LdA + u0 + 8] : 0.f,
                             j0 + 4 >= u0 ? aqs[(j0 + 4) * kSb3LdA + u0] : 0.f,
                             j0 + 4 >= u0 + 8 ? aqs[(j0 + 4) * kSb3LdA + u0 + 8] : 0.f};
        uint32_t ah[4], al[4];
        sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint32_t b0 = __float_as_uint(ous[j0 * kSb3LdB + cw + 8 * nt + gq]);
          const uint32_t b1 = __float_as_uint(ous[(j0 + 4) * kSb3LdB + cw + 8 * nt + gq]);
          if constexpr (PRECISE) sb3_mma(xc[nt], al, b0, b1);
          sb3_mma(xm[nt], ah, b0, b1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] = scale * (xm[nt][e] + xc[nt][e]);
    }
    {
      float ym[2][2][4], yc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ym[mt][nt][e] = yc[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        const int t0 = 8 * ks + t4;
        uint32_t bv[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          bv[nt][0] = __float_as_uint(ous[t0 * kSb3LdB + cw + 8 * nt + gq]);
          bv[nt][1] = __float_as_uint(ous[(t0 + 4) * kSb3LdB + cw + 8 * nt + gq]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int i0 = r0 + 16 * mt;  // A(i, t) = Q Gam[t, i]
          const float av[4] = {qgs[t0 * kSb3LdT + i0], qgs[t0 * kSb3LdT + i0 + 8], qgs[(t0 + 4) * kSb3LdT + i0],
                               qgs[(t0 + 4) * kSb3LdT + i0 + 8]};
          uint32_t ah[4], al[4];
          sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if constexpr (PRECISE) sb3_mma(yc[mt][nt], al, bv[nt][0], bv[nt][1]);
            sb3_mma(ym[mt][nt], ah, bv[nt][0], bv[nt][1]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float g0 = gls[r0 + 16 * mt], g1 = gls[r0 + 16 * mt + 8];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            ds[mt][nt][e] = fmaf(scale, ym[mt][nt][e] + yc[mt][nt][e], (e < 2 ? g0 : g1) * ds[mt][nt][e]);
      }
    }
    __syncthreads();  // A_qk, Q Gam, Gam_last and dO consumed
    if (warp == 0 && c > 0) issue_g2(cid - 1);

    // ---- dU += (K Eend) dS1 (B: the dS1 copy); two k-chains per tile
    {
      const uint32_t ke = smem_u32(sm4b + L::kend + b * CH * kSb3LdKe + lrow * kSb3LdKe + lcol);
      float am[2][2][4], ac[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) am[h][nt][e] = ac[h][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        const int k0 = 8 * ks + t4, h = ks & 1;
        uint32_t r[4];
        sb4_ldmatrix_x4(ke + 32 * ks, r);  // state_bwd3's four scalar loads: rows u0, u0 + 8, columns k0, k0 + 4
        const float av[4] = {__uint_as_float(r[0]), __uint_as_float(r[1]), __uint_as_float(r[2]),
                             __uint_as_float(r[3])};
        uint32_t ah[4], al[4];
        sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          uint32_t bh0, bl0, bh1, bl1;
          sb3_split<PRECISE>(dss[k0 * kSb3LdB + cw + 8 * nt + gq], bh0, bl0);
          sb3_split<PRECISE>(dss[(k0 + 4) * kSb3LdB + cw + 8 * nt + gq], bh1, bl1);
          if constexpr (PRECISE) {
            sb3_mma(ac[h][nt], al, bh0, bh1);
            sb3_mma(ac[h][nt], ah, bl0, bl1);
          }
          sb3_mma(am[h][nt], ah, bh0, bh1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] += (am[0][nt][e] + am[1][nt][e]) + (ac[0][nt][e] + ac[1][nt][e]);
      // dU into shared memory (over dO, consumed) and to p.dU (rows < Cc, columns < V)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float* d = ous + u0 * kSb3LdB + cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(d) = make_float2(du[nt][0], du[nt][1]);
        *reinterpret_cast<float2*>(d + 8 * kSb3LdB) = make_float2(du[nt][2], du[nt][3]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = u0 + 8 * h;
        if (t >= cp.Cc) continue;
        float* row = p.dU + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, du[nt][2 * h], du[nt][2 * h + 1]);
      }
    }
    __syncthreads();  // dU complete; the dS1 copy consumed

    // ---- dS0 = (the above) - w^T dU
    {
      const float* ww = sm4b + L::w + b * CH * kSb3LdT;
      float zm[2][2][4], zc[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) zm[mt][nt][e] = zc[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        const int t0 = 8 * ks + t4;
        uint32_t bh[2][2], bl[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          sb3_split<PRECISE>(ous[t0 * kSb3LdB + cw + 8 * nt + gq], bh[nt][0], bl[nt][0]);
          sb3_split<PRECISE>(ous[(t0 + 4) * kSb3LdB + cw + 8 * nt + gq], bh[nt][1], bl[nt][1]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int i0 = r0 + 16 * mt;  // A(i, t) = -w[t, i]
          const float av[4] = {-ww[t0 * kSb3LdT + i0], -ww[t0 * kSb3LdT + i0 + 8], -ww[(t0 + 4) * kSb3LdT + i0],
                               -ww[(t0 + 4) * kSb3LdT + i0 + 8]};
          uint32_t ah[4], al[4];
          sb3_split4<PRECISE>(av, ah, al);
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            if constexpr (PRECISE) {
              sb3_mma(zc[mt][nt], al, bh[nt][0], bh[nt][1]);
              sb3_mma(zc[mt][nt], ah, bl[nt][0], bl[nt][1]);
            }
            sb3_mma(zm[mt][nt], ah, bh[nt][0], bh[nt][1]);
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[mt][nt][e] += zm[mt][nt][e] + zc[mt][nt][e];
      put_ds();
    }
    __syncthreads();  // dU, K Eend and w of buffer b consumed; the dS copy complete
    if (warp == 0 && c > 1) issue_g1(cid - 2, b);
    if (c > 0) put_do();
  }
  store_ds(p.dh0 + nbase);
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
