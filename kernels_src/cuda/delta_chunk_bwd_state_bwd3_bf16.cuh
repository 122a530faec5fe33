// state_bwd3 with bf16 tensor-core operands (session 12, branch sbwd12; KDA_CUDA_CHUNK_BWD_STATE_BWD=10, off by
// default; instantiated only in delta_chunk_bwd_state_bwd3_bf16.cu): the chunk-end state gradients of the chunked
// backward for bf16/fp16 inputs, the kernel of delta_chunk_bwd_state_bwd3.cuh (same Params, buffers, cp.async
// prefetch schedule, barriers, warp tiling and outputs dhs / dU / dh0, all fp32; its own shared layout SbbSmem for
// 16-byte A reads) with its products as mma.sync m16n8k16 bf16 with fp32 accumulators instead of m16n8k8 tf32:
// half the mma instructions and one cvt (cvt.rn.bf16x2.f32) per two operand elements instead of one per element. dS
// stays fp32 in registers and is carried in fp32; only its operand copy (the B operand of K Eend dS1, read from the
// fp32 shared copy) is rounded to bf16, as are every other operand (A_qk, Q Gam, K Eend, w: fp32 in shared memory,
// rounded at the fragment read; dO: exact for bf16 inputs, rounded for fp16; dU: rounded). This is flash-linear-
// attention's precision regime for the dh recurrence (bf16 operands, fp32 accumulation); DESIGN.md section 6's
// bf16/fp16 tolerances are the bound (tests/test_cuda_state_bwd_bf16.py).
//
// k order inside a k16 step of the products over the chunk's tokens (dO, dU as B): the fragment's k slots 2t, 2t + 1,
// 2t + 8, 2t + 9 of lane (g, t) hold physical k = t, t + 4, t + 8, t + 12 (a permutation of the contraction index,
// the same for A and B), so the B reads of dO / dU hit the addresses the tf32 kernel reads in its two k8 steps:
//   a0 = (A[g][t], A[g][t+4]), a1 = (A[g+8][t], A[g+8][t+4]), a2 = (A[g][t+8], A[g][t+12]), a3 = (A[g+8][t+8], ..)
//   b0 = (B[t][g], B[t+4][g]), b1 = (B[t+8][g], B[t+12][g])        (low half first)
// (K Eend dS1 takes physical k 4t .. 4t + 3 instead: see the kernel.) The two products with dO share their B
// fragments (one loop). Retired in session 12: =9, the same kernel with state_bwd3's 4-byte fragment reads and
// shared layout (0.755 ms against this one's 0.747, the same numerics; docs/cuda.md, "Retired kernels").
#pragma once

#include <cuda_bf16.h>

#include "delta_chunk_bwd_state_bwd3.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

// (lo, hi) rounded to nearest even into one bf16x2 register (lo in the low half: the lower k slot)
__device__ __forceinline__ uint32_t sbb_pack(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void sbb_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Shared layout in floats: Sb3Smem's with K Eend rows padded to KP + 16 (its 16-byte fragment reads: quarter-warp
// lanes (g, t) of g = 0, 1 at banks 16 g + 4 t.., conflict-free) and the dS copy's rows to VS + 10 (B reads of rows
// 4 t + m: banks 8 t + g, conflict-free).
struct SbbSmem {
  static constexpr int ldke = KP + 16;
  static constexpr int ldd = VS + 10;
  static constexpr int kend = 0;                         // [2][CH][ldke]
  static constexpr int w = kend + 2 * CH * ldke;         // [2][CH][kSb3LdT]
  static constexpr int qg = w + 2 * CH * kSb3LdT;        // [CH][kSb3LdT]
  static constexpr int aqk = qg + CH * kSb3LdT;          // [CH][kSb3LdA]
  static constexpr int gl = aqk + CH * kSb3LdA;          // [KP]
  static constexpr int ds = gl + KP;                     // [KP][ldd] fp32 copy of dS1
  static constexpr int ou = ds + KP * ldd;               // [CH][kSb3LdB] raw dO, then dU
  static constexpr int floats = ou + CH * kSb3LdB;
  static_assert(w % 4 == 0 && qg % 4 == 0 && aqk % 4 == 0 && gl % 4 == 0 && ds % 4 == 0 && ou % 4 == 0,
                "16-byte cp.async / vector destinations");
};
constexpr size_t kStateBwd3Bf16Smem = SbbSmem::floats * sizeof(float);

// 16-byte reads of the A operands K Eend, Q Gam and w (a quarter of state_bwd3's 4-byte fragment reads), by (i) dS
// rows permuted inside each warp's 32: the accumulator row g (+ 8 h) of tile mt is dS row 32 wi + 4 g + 2 mt + h, so
// a lane's four dS rows are adjacent and one float4 of a Q Gam / w row holds them; (ii) the k16 steps of K Eend dS1
// taking slots 2t, 2t+1, 2t+8, 2t+9 as physical k 4t .. 4t+3 (one float4 of a K Eend row; the dS copy's B reads
// follow).
template <bool PC>
__global__ void __launch_bounds__(kSb3Threads, 1) state_bwd3_bf16_kernel(Params p) {
  using L = SbbSmem;
  constexpr int LDD = L::ldd, LDKE = L::ldke;
  const int n = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * VS;
  extern __shared__ __align__(16) float sm[];
  float* qgs = sm + L::qg;
  float* aqs = sm + L::aqk;
  float* gls = sm + L::gl;
  float* dss = sm + L::ds;
  float* ous = sm + L::ou;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wi = warp & 3, wc = warp >> 2;
  const int gq = lane >> 2, t4 = lane & 3;
  const int cw = 16 * wc;        // the warp's first column in the block's VS
  const int u0 = 16 * wi + gq;   // the warp's first dU row (second half + 8)
  const int K = p.K, V = p.V, HV = p.HV;
  const float scale = p.scale;
  const int64_t nbase = (static_cast<int64_t>(n) * HV + hv) * K * V;
  const int nc = p.chunk_off[n + 1] - p.chunk_off[n];
  const int off = p.chunk_off[n];
  int64_t bos;
  int len;
  seq_bounds(p.cu, n, p.T, bos, len);

  // dS: ds[mt][nt][e] at row srow(mt, e / 2), column cw + 8 nt + 2 t4 + e % 2 (+ v0 in V)
  auto srow = [&](int mt, int h) { return 32 * wi + 4 * gq + 2 * mt + h; };
  float ds[2][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = srow(mt, e >> 1), c = v0 + cw + 8 * nt + 2 * t4 + (e & 1);
        ds[mt][nt][e] = (p.dht != nullptr && r < K && c < V) ? p.dht[nbase + static_cast<int64_t>(r) * V + c] : 0.f;
      }
  auto put_ds = [&]() {  // fp32 copy for the next step's B operand
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = cw + 8 * nt + 2 * t4;
        *reinterpret_cast<float2*>(dss + srow(mt, 0) * LDD + col) = make_float2(ds[mt][nt][0], ds[mt][nt][1]);
        *reinterpret_cast<float2*>(dss + srow(mt, 1) * LDD + col) = make_float2(ds[mt][nt][2], ds[mt][nt][3]);
      }
  };
  auto store_ds = [&](float* dst) {  // a [K, V] state
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = srow(mt, h);
        if (r >= K) continue;
        float* row = dst + static_cast<int64_t>(r) * V;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sb3_store_pair(row, v0 + cw + 8 * nt + 2 * t4, V, ds[mt][nt][2 * h], ds[mt][nt][2 * h + 1]);
      }
  };

  auto tile = [&](int cid) { return (static_cast<size_t>(cid) * HV + hv) * CH * KP; };
  auto issue_g1 = [&](int cid, int b) {  // K Eend and w of chunk cid into buffer b
    float* ke = sm + L::kend + b * CH * LDKE;
    float* ww = sm + L::w + b * CH * kSb3LdT;
    const float* ksrc = p.kendc + tile(cid);
    const float* wsrc = p.wc + tile(cid);
#pragma unroll 4
    for (int i = tid; i < CH * KP / 4; i += kSb3Threads) {
      const int t = i / (KP / 4), c = (i % (KP / 4)) * 4;
      cpa16(ke + t * LDKE + c, ksrc + t * KP + c);
      cpa16(ww + t * kSb3LdT + c, wsrc + t * KP + c);
    }
  };
  auto issue_g2 = [&](int cid) {  // A_qk, Q Gam, Gam_last of chunk cid
    const float* asrc = p.aqk + (static_cast<size_t>(cid) * HV + hv) * CH * CH;
    const float* qsrc = p.qgc + tile(cid);
#pragma unroll 4
    for (int i = tid; i < CH * CH / 4; i += kSb3Threads) {
      const int t = i / (CH / 4), c = (i % (CH / 4)) * 4;
      cpa16(aqs + t * kSb3LdA + c, asrc + t * CH + c);
    }
#pragma unroll 4
    for (int i = tid; i < CH * KP / 4; i += kSb3Threads) {
      const int t = i / (KP / 4), c = (i % (KP / 4)) * 4;
      cpa16(qgs + t * kSb3LdT + c, qsrc + t * KP + c);
    }
    if (tid < KP / 4) cpa16(gls + 4 * tid, p.glc + (static_cast<size_t>(cid) * HV + hv) * KP + 4 * tid);
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
  // B fragment of the dO / dU buffer ([CH][kSb3LdB] fp32) at k16 step base k0 = 16 ks + t4, column col
  auto bfrag = [&](const float* buf, int k0, int col, uint32_t& b0, uint32_t& b1) {
    b0 = sbb_pack(buf[k0 * kSb3LdB + col], buf[(k0 + 4) * kSb3LdB + col]);
    b1 = sbb_pack(buf[(k0 + 8) * kSb3LdB + col], buf[(k0 + 12) * kSb3LdB + col]);
  };
  // A fragments of the transposed Q Gam / w tile x ([CH][kSb3LdT]: A(i, t) = x[t][i]) for both row tiles mt at k16
  // step base t0 = 16 ks + t4
  auto afrag_t = [&](const float* x, int t0, uint32_t (&a)[2][4]) {
    const float* xa = x + t0 * kSb3LdT + 32 * wi + 4 * gq;  // dS rows srow(mt, h) = 32 wi + 4 gq + 2 mt + h
    const float4 v0 = *reinterpret_cast<const float4*>(xa);
    const float4 v1 = *reinterpret_cast<const float4*>(xa + 4 * kSb3LdT);
    const float4 v2 = *reinterpret_cast<const float4*>(xa + 8 * kSb3LdT);
    const float4 v3 = *reinterpret_cast<const float4*>(xa + 12 * kSb3LdT);
    a[0][0] = sbb_pack(v0.x, v1.x); a[0][1] = sbb_pack(v0.y, v1.y);
    a[0][2] = sbb_pack(v2.x, v3.x); a[0][3] = sbb_pack(v2.y, v3.y);
    a[1][0] = sbb_pack(v0.z, v1.z); a[1][1] = sbb_pack(v0.w, v1.w);
    a[1][2] = sbb_pack(v2.z, v3.z); a[1][3] = sbb_pack(v2.w, v3.w);
  };

  put_ds();
  if (nc > 0) {
    issue_g1(off + nc - 1, 0);
    cpa_commit();
    issue_g2(off + nc - 1);
    cpa_commit();
    if (nc > 1) issue_g1(off + nc - 2, 1);
    cpa_commit();
    load_do(nc - 1);
    put_do();
  }

  for (int s = 0; s < nc; ++s) {
    const int c = nc - 1 - s, cid = off + c, b = s & 1;
    const ChunkPos cp = seq_chunk(n, c, bos, len);
    store_ds(p.dhs + (static_cast<size_t>(cid) * HV + hv) * K * V);  // dS at the end of chunk c
    if (c > 0) load_do(c - 1);  // into shared memory after the step's last barrier
    cpa_wait<1>();              // K Eend, w (buffer b), A_qk, Q Gam, Gam_last of chunk c
    __syncthreads();            // (also dO of chunk c and the dS copy)

    // ---- the products with dO (independent of dS), sharing dO's B fragments:
    //      dU = scale A_qk^T dO, dS = Gam_last dS + scale (Q Gam)^T dO
    float du[2][4];
    {
      float xm[2][4], ym[2][2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          xm[nt][e] = 0.f;
          ym[0][nt][e] = ym[1][nt][e] = 0.f;
        }
#pragma unroll
      for (int ks = 0; ks < CH / 16; ++ks) {
        const int t0 = 16 * ks + t4;
        uint32_t bv[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) bfrag(ous, t0, cw + 8 * nt + gq, bv[nt][0], bv[nt][1]);
        if (ks >= wi) {  // A_qk[j, t] = 0 for j < t (rows t >= 16 wi)
          // A(t, j) = A_qk[j, t], zero above the diagonal (j < t) whatever the buffer holds there
          auto av = [&](int j, int t) { return j >= t ? aqs[j * kSb3LdA + t] : 0.f; };
          const uint32_t a[4] = {sbb_pack(av(t0, u0), av(t0 + 4, u0)), sbb_pack(av(t0, u0 + 8), av(t0 + 4, u0 + 8)),
                                 sbb_pack(av(t0 + 8, u0), av(t0 + 12, u0)),
                                 sbb_pack(av(t0 + 8, u0 + 8), av(t0 + 12, u0 + 8))};
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) sbb_mma(xm[nt], a, bv[nt][0], bv[nt][1]);
        }
        uint32_t a[2][4];  // A(i, t) = Q Gam[t, i]
        afrag_t(qgs, t0, a);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) sbb_mma(ym[mt][nt], a[mt], bv[nt][0], bv[nt][1]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] = scale * xm[nt][e];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float g0 = gls[srow(mt, 0)], g1 = gls[srow(mt, 1)];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[mt][nt][e] = fmaf(scale, ym[mt][nt][e], (e < 2 ? g0 : g1) * ds[mt][nt][e]);
      }
    }
    __syncthreads();  // A_qk, Q Gam, Gam_last and dO consumed
    if (c > 0) issue_g2(cid - 1);
    cpa_commit();

    // ---- dU += (K Eend) dS1 (B: the dS1 copy); two k-chains per tile
    {
      const float* ke = sm + L::kend + b * CH * LDKE;
      float am[2][2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) am[h][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KP / 16; ++ks) {
        const int h = ks & 1;
        uint32_t a[4];  // A(t, k) = K Eend[t, k], rows u0, u0 + 8; physical k 16 ks + 4 t4 .. + 3
        const int k0 = 16 * ks + 4 * t4;
        const float4 x1 = *reinterpret_cast<const float4*>(ke + u0 * LDKE + k0);
        const float4 x2 = *reinterpret_cast<const float4*>(ke + (u0 + 8) * LDKE + k0);
        a[0] = sbb_pack(x1.x, x1.y); a[1] = sbb_pack(x2.x, x2.y);
        a[2] = sbb_pack(x1.z, x1.w); a[3] = sbb_pack(x2.z, x2.w);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float* d = dss + k0 * LDD + cw + 8 * nt + gq;
          sbb_mma(am[h][nt], a, sbb_pack(d[0], d[LDD]), sbb_pack(d[2 * LDD], d[3 * LDD]));
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) du[nt][e] += am[0][nt][e] + am[1][nt][e];
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
      const float* ww = sm + L::w + b * CH * kSb3LdT;
      float zm[2][2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) zm[mt][nt][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < CH / 16; ++ks) {
        const int t0 = 16 * ks + t4;
        uint32_t bh[2][2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) bfrag(ous, t0, cw + 8 * nt + gq, bh[nt][0], bh[nt][1]);
        uint32_t a[2][4];  // A(i, t) = w[t, i] (the sum is subtracted)
        afrag_t(ww, t0, a);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) sbb_mma(zm[mt][nt], a[mt], bh[nt][0], bh[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ds[mt][nt][e] -= zm[mt][nt][e];
      put_ds();
    }
    __syncthreads();  // dU, K Eend and w of buffer b consumed; the dS copy complete
    if (c > 1) issue_g1(cid - 2, b);
    cpa_commit();
    if (c > 0) put_do();
  }
  store_ds(p.dh0 + nbase);
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
