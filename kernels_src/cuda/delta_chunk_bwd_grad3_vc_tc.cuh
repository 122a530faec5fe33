// grad3_vc on tensor cores (issue #7): the contractions over V of the split grad v3 (see the comment above
// grad3_vc_kernel in delta_chunk_bwd.cuh), for bf16/fp16 inputs (KDA_CUDA_CHUNK_BWD_VC=2, the default; =1 runs the
// fp32 SIMT grad3_vc_kernel, which fp32 inputs and V % 4 != 0 always run). Same outputs and layouts, per
// (chunk, value head), three launches Z = 0, 1, 2:
//   Z = 0: dQG = scale dO S0^T -> gdqg [CH][KP], dA_qk = scale dO U^T (j <= t, zeros above) -> aqk [CH][CH];
//   Z = 1: dKend = U dS1^T -> gdkend [CH][KP], dGam_last = sum_v dS1 * S0 -> gdgl [KP] (fp32 on CUDA cores);
//   Z = 2: dw = -dU S0^T -> gdw [CH][KP].
// S0 = hs, dS1 = dhs of the chunk ([K][V] fp32), U, dU [tokens][HV][V] fp32, dO = grad_o (bf16/fp16).
//  - mma.sync m16n8k8 tf32, fp32 accumulators, 3xTF32 (a_lo b_hi + a_hi b_lo + a_hi b_hi into one accumulator
//    that starts at zero): about fp32 accuracy. Raw bf16/fp16 dO is exact in tf32, so its products take two
//    (a b_lo + a b_hi); `scale` multiplies the sums. The fragment helpers are state_bwd3's (sb3_*).
//    KDA_CUDA_CHUNK_BWD_VC=3: plain tf32 products (kept to measure; not the default).
//  - V in slices of 32 columns, double-buffered: the fp32 operands by cp.async (16 bytes: V % 4 == 0, zero-filled
//    past K, V and the chunk's Cc rows), dO through registers (converted to fp32, one slice ahead); padded rows of
//    36 floats (fragment reads conflict-free).
//  - 8 warps; the 64 x 128 product: warp w rows 32 (w % 2) .. + 31, columns 32 (w / 2) .. + 31 (2 x 4 tiles);
//    Z = 0's 64 x 64 dA_qk: rows 16 (w % 4) .. + 15, columns 32 (w / 4) .. + 31, tiles wholly above the diagonal
//    skipped (stored as zeros).
#pragma once

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_state_bwd3.cuh"

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

constexpr int kVcS = 32;       // V columns per slice
constexpr int kVcLd = kVcS + 4;  // padded row stride (floats): bank 4 g + t for both fragment kinds

// shared floats of one buffer: B [KP][kVcLd] (S0 or dS1), C (z = 0: U [CH]; z = 1: S0 [KP]; z = 2: none),
// A [CH][kVcLd] (dO, U or dU)
template <int Z>
constexpr int vctc_buf_floats() {
  return (KP + (Z == 0 ? CH : (Z == 1 ? KP : 0)) + CH) * kVcLd;
}
template <int Z>
constexpr size_t vctc_smem() {
  return 2 * vctc_buf_floats<Z>() * sizeof(float);
}
static_assert(CH == 64 && KP == 128 && NT == 256, "grad3_vc_tc's warp tiling assumes CH = 64, KP = 128, 256 threads");

// 16 bytes global -> shared, zero-filled when !ok (src must still be a valid address)
__device__ __forceinline__ void vctc_cpa16z(float* smem, const float* gmem, bool ok) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(n) : "memory");
}

template <bool PC, int Z, typename TO, bool PRECISE>
__global__ void __launch_bounds__(NT, 2) grad3_vc_tc_kernel(Params p) {
  ChunkPos cp;
  if (!chunk_pos(p, blockIdx.x, cp)) return;
  const int cid = blockIdx.x, hv = blockIdx.y;
  extern __shared__ __align__(16) float sm[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int K = p.K, V = p.V, HV = p.HV;
  const size_t sbase = (static_cast<size_t>(cid) * HV + hv) * K * V;
  const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  constexpr int BUF = vctc_buf_floats<Z>();
  constexpr int OFF_C = KP * kVcLd;
  constexpr int OFF_A = OFF_C + (Z == 0 ? CH : (Z == 1 ? KP : 0)) * kVcLd;
  const int ns = (V + kVcS - 1) / kVcS;
  auto tok = [&](int t) { return (cp.row0 + t) * HV + hv; };

  // the fp32 operands of slice s into buffer b (cp.async, one group per call by the caller)
  const float* bsrc = Z == 1 ? p.dhs : p.hs;
  const float* rsrc = Z == 0 ? p.U : (Z == 1 ? p.U : p.dU);  // the [tokens][HV][V] operand (C for z = 0, else A)
  auto issue = [&](int s, int b) {
    float* buf = sm + b * BUF;
    const int v0 = s * kVcS;
#pragma unroll
    for (int r = 0; r < KP * kVcS / 4 / NT; ++r) {  // state rows: 128 x 8 float4
      const int i = tid + r * NT, c = i >> 3, v = v0 + 4 * (i & 7);
      const bool ok = c < K && v < V;
      const size_t o = ok ? sbase + static_cast<size_t>(c) * V + v : 0;
      vctc_cpa16z(buf + c * kVcLd + 4 * (i & 7), bsrc + o, ok);
      if constexpr (Z == 1) vctc_cpa16z(buf + OFF_C + c * kVcLd + 4 * (i & 7), p.hs + o, ok);
    }
#pragma unroll
    for (int r = 0; r < CH * kVcS / 4 / NT; ++r) {  // token rows: 64 x 8 float4
      const int i = tid + r * NT, t = i >> 3, v = v0 + 4 * (i & 7);
      const bool ok = t < cp.Cc && v < V;
      const size_t o = ok ? static_cast<size_t>(tok(t)) * V + v : 0;
      vctc_cpa16z(buf + (Z == 0 ? OFF_C : OFF_A) + t * kVcLd + 4 * (i & 7), rsrc + o, ok);
    }
  };
  // dO (z = 0) through registers: 64 x 32 raw values of slice s, 8 per thread (row i / 32, column i % 32)
  float dn[Z == 0 ? CH * kVcS / NT : 1];
  auto load_do = [&](int s) {
    if constexpr (Z == 0) {
#pragma unroll
      for (int r = 0; r < CH * kVcS / NT; ++r) {
        const int i = tid + r * NT, t = i >> 5, v = s * kVcS + (i & 31);
        dn[r] = (t < cp.Cc && v < V) ? ld_elem<TO>(p.grad_o, static_cast<int64_t>(tok(t)) * V + v) : 0.f;
      }
    }
  };
  auto put_do = [&](int b) {
    if constexpr (Z == 0) {
      float* a = sm + b * BUF + OFF_A;
#pragma unroll
      for (int r = 0; r < CH * kVcS / NT; ++r) {
        const int i = tid + r * NT;
        a[(i >> 5) * kVcLd + (i & 31)] = dn[r];
      }
    }
  };

  const int wm = warp & 1, wn = warp >> 1;  // the 64 x 128 product
  const int mi = warp & 3, nh = warp >> 2;  // z = 0's 64 x 64 dA_qk
  float acc[2][4][4], acc2[4][4], dgl = 0.f;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc2[nt][e] = 0.f;

  issue(0, 0);
  cpa_commit();
  load_do(0);
  put_do(0);
  for (int s = 0; s < ns; ++s) {
    const int b = s & 1;
    if (s + 1 < ns) {
      issue(s + 1, b ^ 1);
      load_do(s + 1);
    }
    cpa_commit();
    cpa_wait<1>();  // slice s
    __syncthreads();
    const float* Bs = sm + b * BUF;
    const float* Cs = Bs + OFF_C;
    const float* As = Bs + OFF_A;
#pragma unroll
    for (int ks = 0; ks < kVcS / 8; ++ks) {
      const int k0 = 8 * ks + t4;
      // B fragments (n = column c of the output, k = v): B(k, n) = Bs[n][k]
      uint32_t bh[4][2], bl[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const float* row = Bs + (32 * wn + 8 * nt + gq) * kVcLd + k0;
        sb3_split<PRECISE>(row[0], bh[nt][0], bl[nt][0]);
        sb3_split<PRECISE>(row[4], bh[nt][1], bl[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float* row = As + (32 * wm + 16 * mt + gq) * kVcLd + k0;
        const float av[4] = {row[0], row[8 * kVcLd], row[4], row[8 * kVcLd + 4]};
        uint32_t ah[4], al[4];
        if constexpr (Z == 0) {
#pragma unroll
          for (int e = 0; e < 4; ++e) ah[e] = __float_as_uint(av[e]);  // raw dO: exact in tf32
        } else {
          sb3_split4<PRECISE>(av, ah, al);
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if constexpr (PRECISE) {
            if constexpr (Z != 0) sb3_mma(acc[mt][nt], al, bh[nt][0], bh[nt][1]);
            sb3_mma(acc[mt][nt], ah, bl[nt][0], bl[nt][1]);
          }
          sb3_mma(acc[mt][nt], ah, bh[nt][0], bh[nt][1]);
        }
      }
      if constexpr (Z == 0) {  // dA_qk = dO U^T: B(k, n) = U[n][k]
        const float* row = As + (16 * mi + gq) * kVcLd + k0;
        const uint32_t a[4] = {__float_as_uint(row[0]), __float_as_uint(row[8 * kVcLd]), __float_as_uint(row[4]),
                               __float_as_uint(row[8 * kVcLd + 4])};
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (32 * nh + 8 * nt > 16 * mi + 15) continue;  // wholly above the diagonal (warp-uniform)
          const float* crow = Cs + (32 * nh + 8 * nt + gq) * kVcLd + k0;
          uint32_t h0, l0, h1, l1;
          sb3_split<PRECISE>(crow[0], h0, l0);
          sb3_split<PRECISE>(crow[4], h1, l1);
          if constexpr (PRECISE) sb3_mma(acc2[nt], a, l0, l1);
          sb3_mma(acc2[nt], a, h0, h1);
        }
      }
    }
    if constexpr (Z == 1) {  // dGam_last: row tid of dS1 * S0 (fp32, in v order within the thread's row)
      if (tid < KP) {
#pragma unroll
        for (int v = 0; v < kVcS; v += 4) {
          const float4 x = *reinterpret_cast<const float4*>(Bs + tid * kVcLd + v);
          const float4 y = *reinterpret_cast<const float4*>(Cs + tid * kVcLd + v);
          dgl = fmaf(x.x, y.x, dgl);
          dgl = fmaf(x.y, y.y, dgl);
          dgl = fmaf(x.z, y.z, dgl);
          dgl = fmaf(x.w, y.w, dgl);
        }
      }
    }
    __syncthreads();  // buffer b consumed
    if (s + 1 < ns) put_do(b ^ 1);
  }

  float* out = Z == 0 ? p.gdqg : (Z == 1 ? p.gdkend : p.gdw);
  const float sg = Z == 0 ? p.scale : (Z == 1 ? 1.f : -1.f);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int t = 32 * wm + 16 * mt + gq, c = 32 * wn + 8 * nt + 2 * t4;
      float* d = out + tbase + static_cast<size_t>(t) * KP + c;
      *reinterpret_cast<float2*>(d) = make_float2(sg * acc[mt][nt][0], sg * acc[mt][nt][1]);
      *reinterpret_cast<float2*>(d + 8 * KP) = make_float2(sg * acc[mt][nt][2], sg * acc[mt][nt][3]);
    }
  if constexpr (Z == 0) {
    const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int t = 16 * mi + gq, j = 32 * nh + 8 * nt + 2 * t4;
      float* d = p.aqk + abase + static_cast<size_t>(t) * CH + j;
      // dA_qk, lower including the diagonal
      *reinterpret_cast<float2*>(d) =
          make_float2(j <= t ? sg * acc2[nt][0] : 0.f, j + 1 <= t ? sg * acc2[nt][1] : 0.f);
      *reinterpret_cast<float2*>(d + 8 * CH) =
          make_float2(j <= t + 8 ? sg * acc2[nt][2] : 0.f, j + 1 <= t + 8 ? sg * acc2[nt][3] : 0.f);
    }
  }
  if constexpr (Z == 1) {
    if (tid < KP) p.gdgl[(static_cast<size_t>(cid) * HV + hv) * KP + tid] = dgl;
  }
}

// The kernel for Z, the inputs' dtype (bf16 or fp16) and the products (3xTF32 or plain tf32).
template <bool PC, int Z>
constexpr auto grad3_vc_tc(bool bf16, bool precise) {
  return bf16 ? (precise ? grad3_vc_tc_kernel<PC, Z, __nv_bfloat16, true> : grad3_vc_tc_kernel<PC, Z, __nv_bfloat16, false>)
              : (precise ? grad3_vc_tc_kernel<PC, Z, __half, true> : grad3_vc_tc_kernel<PC, Z, __half, false>);
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
