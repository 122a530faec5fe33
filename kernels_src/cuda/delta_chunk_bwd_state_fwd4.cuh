// state_fwd v4 of the chunked backward (issue #7, session 9; KDA_CUDA_CHUNK_BWD_STATE_FWD=5, off by default):
// state_fwd3's recurrence (delta_chunk_bwd_state_fwd3.cuh, tf32 mode 4) with the operand traffic of the forward's
// state-only scan (delta_chunk_scan4_kernel, delta_chunk_scan4.cuh). Same inputs and outputs (Params of
// delta_chunk_bwd.cuh): per chunk c of a sequence, with S the state at the chunk's start,
//   hs[c] = S,   U = u - w S  (stored to p.U),   S <- Diag(Gam_last) S + (K Eend)^T U,
// reading wc, kendc [chunks, HV, CH, KP] (zero padded), glc [chunks, HV, KP] and u [tokens, HV, V]; hs, U fp32.
//
// What changes against state_fwd3 (same products in the same order, so the results are state_fwd3's bit for bit):
//  - the operands arrive by cp.async.bulk, one 512-byte bulk copy per tile row issued by the 32 lanes of warp 0
//    (two rows of w and two of K Eend per lane), straight into state_fwd3's padded shared rows (w rows KP + 4
//    floats, K Eend rows KP + 8: conflict-free fragment reads; a bulk copy needs only 16-byte aligned sizes and
//    addresses, which 512-byte rows at 528 / 544-byte strides are). Completion is tracked by mbarriers
//    (complete_tx), one per buffer and operand: w of chunk c + 2 is issued right after the step's middle barrier
//    (the last read of w(c)), K Eend and Gam_last of chunk c + 1 right after the step's first barrier (the last
//    read of chunk c - 1's), as state_fwd3 did with 16 per-thread cp.async pieces and commit groups;
//  - the A fragments of w come from one ldmatrix.x4 (b16 8x8 matrices read as 8 x 4 fp32: lane i receives row
//    i / 4, word i % 4, which is the tf32 m16n8k8 A fragment) instead of four scalar loads;
//  - the shared copies of S and U (only ever B operands) are stored already rounded to tf32 (cvt.rna once per
//    element instead of once per read; converting a tf32 value again is the identity, so the products are the
//    same); the registers keep the fp32 state and p.U gets the fp32 U.
// Two barriers per chunk step, as before. Shared memory: state_fwd3's 165 KB plus four mbarriers.
#pragma once

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_state_fwd3.cuh"
#include "delta_chunk_fwd.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kSf4Threads = 256;
constexpr uint32_t kSf4RowBytes = KP * sizeof(float);                  // one global tile row: 512 bytes
constexpr uint32_t kSf4WTx = CH * kSf4RowBytes;                        // bytes per w tile
constexpr uint32_t kSf4ETx = CH * kSf4RowBytes + KP * sizeof(float);  // K Eend tile + Gam_last

// shared memory: state_fwd3's float layout, then the mbarriers (w of buffer 0 / 1, K Eend of buffer 0 / 1)
struct StateFwd4Smem {
  static constexpr size_t bar_off = StateFwd3Smem::bytes;  // bytes; a multiple of 16
  static constexpr size_t bytes = bar_off + 4 * sizeof(uint64_t);
};
constexpr size_t kStateFwd4Smem = StateFwd4Smem::bytes;
static_assert(StateFwd4Smem::bar_off % 16 == 0 && (kSf3LdW * 4) % 16 == 0 && (kSf3LdE * 4) % 16 == 0 &&
                  (StateFwd3Smem::w_off * 4) % 16 == 0 && (StateFwd3Smem::e_off * 4) % 16 == 0 &&
                  (StateFwd3Smem::gl_off * 4) % 16 == 0 && kSf4RowBytes % 16 == 0,
              "bulk copies need 16-byte aligned shared addresses and sizes");
static_assert(CH == 64 && KP == 128 && VS == 32, "state_fwd4's tiling assumes CH = 64, KP = 128, VS = 32");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void sf4_ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// tf32(x) as a float (round to nearest, ties away: cvt.rna, as the products' operand conversion)
__device__ __forceinline__ float sf4_tf32f(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ void sf4_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif

template <bool PC>
__global__ void __launch_bounds__(kSf4Threads, 1) state_fwd4_kernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = StateFwd3Smem;
  constexpr int LDW = kSf3LdW, LDE = kSf3LdE, LDH = kSf3LdH;
  constexpr int NTW = 2;  // 8-column tiles per warp (16 columns)
  constexpr int MT = 2;   // 16-row tiles of the state per warp (32 rows)
  extern __shared__ __align__(128) float sm4[];
  float* hsm = sm4 + S::h_off;
  float* Us = sm4 + S::u_off;
  const uint32_t bar0 = smem_u32(reinterpret_cast<unsigned char*>(sm4) + StateFwd4Smem::bar_off);
  // w(buffer b): bar0 + 8 b; K Eend(buffer b): bar0 + 16 + 8 b
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 16 * wc;  // the warp's first column in the block's tile
  const int K = p.K, V = p.V, HV = p.HV;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // the state: hacc[mt][nt][e] is row 32 wi + 16 mt + gq + 8 (e >> 1), column cw + 8 nt + 2 t4 + (e & 1)
  float hacc[MT][NTW][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 32 * wi + 16 * mt + gq + 8 * (e >> 1), col = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        hacc[mt][nt][e] = (p.h0 != nullptr && r < K && col < V) ? p.h0[nbase + static_cast<int64_t>(r) * V + col] : 0.f;
      }
  auto put_h = [&]() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 32 * wi + 16 * mt + gq + 8 * hr;
          *reinterpret_cast<float2*>(hsm + r * LDH + cw + 8 * nt + 2 * t4) =
              make_float2(sf4_tf32f(hacc[mt][nt][2 * hr]), sf4_tf32f(hacc[mt][nt][2 * hr + 1]));
        }
  };
  // a (row, column pair) of a [*, V] fp32 buffer: float2 when V is even (8-byte aligned), else per element
  auto st_pair = [&](float* row, int col, float x0, float x1) {
    if ((V & 1) == 0 && col + 1 < V) {
      *reinterpret_cast<float2*>(row + col) = make_float2(x0, x1);
    } else {
      if (col < V) row[col] = x0;
      if (col + 1 < V) row[col + 1] = x1;
    }
  };
  auto store_hs = [&](int cid) {
    float* dst = p.hs + (static_cast<size_t>(cid) * HV + hv) * K * V;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = 32 * wi + 16 * mt + gq + 8 * hr;
          if (r < K)
            st_pair(dst + static_cast<int64_t>(r) * V, v0 + cw + 8 * nt + 2 * t4, hacc[mt][nt][2 * hr],
                    hacc[mt][nt][2 * hr + 1]);
        }
  };
  // u rows 16 wi + gq + 8 (e >> 1), columns cw + 8 nt + 2 t4 + (e & 1) of chunk c (zeros past the chunk and V)
  auto load_u = [&](float (&x)[NTW][4], int c) {
    const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = 16 * wi + gq + 8 * hr;
      const float* row = p.u + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = v0 + cw + 8 * nt + 2 * t4 + j;
          x[nt][2 * hr + j] = (t < cp.Cc && col < V) ? __ldg(row + col) : 0.f;
        }
    }
  };
  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  // warp 0 only: lane 0 arms the buffer's mbarrier, then every lane copies tile rows lane and lane + 32
  auto issue_w = [&](int c) {
    const uint32_t bar = bar0 + 8 * (c & 1);
    const uint32_t dst = smem_u32(sm4 + S::w_off + (c & 1) * CH * LDW);
    const float* src = p.wc + tile(off + c);
    sf4_fence_proxy_async();  // this CTA's earlier reads of the buffer (ordered by the barrier) before the copies
    if (lane == 0) mbar_arrive_expect_tx(bar, kSf4WTx);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = lane + 32 * h;
      bulk_copy(dst + t * LDW * 4, src + t * KP, kSf4RowBytes, bar);
    }
  };
  auto issue_e = [&](int c) {
    const uint32_t bar = bar0 + 16 + 8 * (c & 1);
    const uint32_t dst = smem_u32(sm4 + S::e_off + (c & 1) * CH * LDE);
    const float* src = p.kendc + tile(off + c);
    sf4_fence_proxy_async();
    if (lane == 0) mbar_arrive_expect_tx(bar, kSf4ETx);
    __syncwarp();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = lane + 32 * h;
      bulk_copy(dst + t * LDE * 4, src + t * KP, kSf4RowBytes, bar);
    }
    if (lane == 0)
      bulk_copy(smem_u32(sm4 + S::gl_off + (c & 1) * KP), p.glc + (static_cast<size_t>(off + c) * HV + hv) * KP,
                KP * sizeof(float), bar);
  };

  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < 4; ++b) mbar_init(bar0 + 8 * b, 1);
    mbar_init_fence();
  }
  put_h();
  __syncthreads();  // mbarriers initialised; hsm complete
  if (warp == 0) {  // w(0), K Eend(0), w(1), K Eend(1)
    if (nc > 0) issue_w(0);
    if (nc > 0) issue_e(0);
    if (nc > 1) issue_w(1);
    if (nc > 1) issue_e(1);
  }
  float ucur[NTW][4] = {}, unext[NTW][4] = {};
  if (nc > 0) load_u(ucur, 0);
  // this lane's ldmatrix row: matrix m = lane / 8 holds rows 8 (m & 1) .., columns 4 (m >> 1) .. of the 16 x 8 tile
  const int lm = lane >> 3;
  const int lrow = 16 * wi + (lane & 7) + 8 * (lm & 1), lcol = 4 * (lm >> 1);

  for (int c = 0; c < nc; ++c) {
    const int cid = off + c;
    const uint32_t wb = smem_u32(sm4 + S::w_off + (c & 1) * CH * LDW + lrow * LDW + lcol);
    const float* eb = sm4 + S::e_off + (c & 1) * CH * LDE;
    const float* gb = sm4 + S::gl_off + (c & 1) * KP;
    const uint32_t par = (c >> 1) & 1;  // the buffer's (c >> 1)-th use
    mbar_wait_parity(bar0 + 8 * (c & 1), par);  // w(c)
    __syncthreads();  // hsm complete; every warp finished chunk c - 1 (its K Eend buffer)
    if (warp == 0 && c >= 1 && c + 1 < nc) issue_e(c + 1);
    store_hs(cid);
    if (c + 1 < nc) load_u(unext, c + 1);

    {  // U = u - w S: rows 16 wi .., columns cw .. (two chains: even / odd k-steps)
      float acc[2][NTW][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 8; ++ks) {
        uint32_t r[4];
        sf4_ldmatrix_x4(wb + 32 * ks, r);  // 8 ks floats further along the rows
        const Sf3A<false> a(make_float4(__uint_as_float(r[0]), __uint_as_float(r[1]), __uint_as_float(r[2]),
                                        __uint_as_float(r[3])));
        const float* hb = hsm + (8 * ks + t4) * LDH + cw + gq;
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)  // hsm holds tf32(S): the B fragment needs no conversion
          mma_tf32_raw(acc[ks & 1][nt], a.h[0], a.h[1], a.h[2], a.h[3], __float_as_uint(hb[8 * nt]),
                       __float_as_uint(hb[4 * LDH + 8 * nt]));
      }
      const ChunkPos cp = seq_chunk(n, c, bos, len);
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = 16 * wi + gq + 8 * hr;
        float* grow = p.U + ((cp.row0 + t) * HV + hv) * static_cast<int64_t>(V);
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          float x[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int e = 2 * hr + j;
            x[j] = ucur[nt][e] - (acc[0][nt][e] + acc[1][nt][e]);
          }
          const int col = cw + 8 * nt + 2 * t4;
          *reinterpret_cast<float2*>(Us + t * LDH + col) = make_float2(sf4_tf32f(x[0]), sf4_tf32f(x[1]));
          if (t < cp.Cc) st_pair(grow, v0 + col, x[0], x[1]);
        }
      }
    }
    mbar_wait_parity(bar0 + 16 + 8 * (c & 1), par);  // K Eend(c), Gam_last(c)
    __syncthreads();  // Us complete; every warp finished reading w(c) and hsm
    if (warp == 0 && c + 2 < nc) issue_w(c + 2);

    {  // S <- Diag(Gam_last) S + (K Eend)^T U (Us holds tf32(U): the B fragments need no conversion)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const float d0 = gb[32 * wi + 16 * mt + gq], d1 = gb[32 * wi + 16 * mt + gq + 8];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          hacc[mt][nt][0] *= d0;
          hacc[mt][nt][1] *= d0;
          hacc[mt][nt][2] *= d1;
          hacc[mt][nt][3] *= d1;
        }
      }
      const float* er = eb + t4 * LDE + 32 * wi + gq;  // A(m, t) = K Eend(t, m)
#pragma unroll
      for (int ks = 0; ks < CH / 8; ++ks) {
        float b[NTW][2];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt) {
          b[nt][0] = Us[(8 * ks + t4) * LDH + cw + 8 * nt + gq];
          b[nt][1] = Us[(8 * ks + t4 + 4) * LDH + cw + 8 * nt + gq];
        }
        const float* ek = er + 8 * ks * LDE;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float* e0 = ek + 16 * mt;
          const Sf3A<false> a(make_float4(e0[0], e0[8], e0[4 * LDE], e0[4 * LDE + 8]));
#pragma unroll
          for (int nt = 0; nt < NTW; ++nt)
            mma_tf32_raw(hacc[mt][nt], a.h[0], a.h[1], a.h[2], a.h[3], __float_as_uint(b[nt][0]),
                         __float_as_uint(b[nt][1]));
        }
      }
    }
    put_h();  // (hsm was last read in chunk c's U, before the barrier above)
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ucur[nt][e] = unext[nt][e];
  }
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
