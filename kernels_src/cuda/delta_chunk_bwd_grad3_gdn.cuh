// grad3_gdn (issue #7): the last kernel of the split grad v3 for GDN (per-head gate, PC = false), replacing
// grad3_ch_kernel<false> (KDA_CUDA_CHUNK_BWD_CH=2, the default; =1 runs grad3_ch, kept to compare). Same inputs
// (grad3_vc's dQG, dKend, dGam_last, grad3_wy's dR_w, dA_qk, dA_kk and partial dbeta), same outputs: dq, dk
// [tokens, HV, K] fp32, dbeta (+ dRg . k), and dg per head: p.dg is [tokens, HV] fp32 here (grad3_ch writes
// [tokens, HV, K] and the host sums the channels; with this kernel the host allocates [tokens, HV], see
// bwd_dg_per_head in delta_chunk_bwd_host.cuh).
//
// With a scalar gate per (token, value head), every decay factor of grad3_ch's per-channel running products is
// one number: Gam_t = e^{G_t}, Eend_t = e^{G_last - G_t}, E[t, j] = D[t, j] = e^{G_t - G_j} (j <= t), where G
// is the chunk prefix of the gate, summed in double, and each factor is the exp of a difference <= 0 (as
// gdn_chunk_prep.cuh / the CPU's gdn_prep_chunk). grad3_ch's stages become row scalings and plain products:
//   dq = Gam dQG + Mq K,   dk = Eend dKend + Diag(beta) Gam dR_w + Mq^T Q + Ms K,   dbeta += (Gam dR_w) . k,
// with Mq = dA_qk o D (lower, diagonal included, D = 1 there) and Ms = Mk + Mk^T, Mk = dA_kk o D (strictly
// lower). The gate gradient of token i, summed over channels, is formed directly as grad3_ch forms it per channel
// (every term whose decay factor contains a_i, none added and later subtracted):
//   dg_i = sum_{t >= i} (q_t . Gam_t dQG_t + beta_t k_t . Gam_t dR_w,t) + Gam_last sum_c dGam_last,c
//        + sum_{t < i} k_t . Eend_t dKend_t + sum_{t >= i} sum_{j < i} P[t, j],
//   P[t, j] = Mq[t, j] (q_t . k_j) + Mk[t, j] (k_t . k_j)   (j < t; the rectangle sums through row prefixes).
// Per (chunk, value head), 8 warps, 2 blocks per SM (75 KB of shared memory for bf16/fp16, 107 KB for fp32):
//   - q, k (cp.async, raw 16-bit or fp32), dA_qk, dA_kk (cp.async) into shared memory, dQG, dKend, dR_w straight
//     into the accumulators' fragment layout (registers), the gates' double prefix on warp 0: all issued first;
//   - the products on tensor cores, mma.sync m16n8k8 tf32 with fp32 accumulation: raw bf16 / fp16 q, k are exact
//     in tf32, so a product with an fp32 operand takes two (a_lo b + a_hi b) and Q K^T, K K^T one; fp32 inputs
//     take 3xTF32 everywhere (about fp32). Triangular k-ranges skipped where Mq is zero.
#pragma once

#include <type_traits>

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_state_bwd3.cuh"
#include "gdn_chunk_prep.cuh"  // gate_prefix_warp

namespace kda_kernels {
namespace cuda {
namespace chunk_bwd {

static_assert(CH == 64 && KP == 128 && NT == 256, "grad3_gdn's warp tiling assumes CH = 64, KP = 128, 256 threads");

// Shared-memory layout (offsets in floats). q, k rows of LQ elements (fp32, or the raw 16-bit inputs): LQ = 4 mod
// 32 words for fp32 and 4 mod 32 words (8 halves) for 16-bit, so both fragment kinds read conflict-free.
template <bool F32>
struct Gg3Smem {
  static constexpr int LQ = F32 ? KP + 4 : KP + 8;  // elements
  static constexpr int LM = CH + 4;                 // Mq, Ms rows (floats)
  static constexpr int qk = F32 ? CH * LQ : CH * LQ / 2;
  static constexpr int qs = 0;
  static constexpr int ks = qs + qk;
  static constexpr int mq = ks + qk;
  static constexpr int ms = mq + CH * LM;
  static constexpr int gd = ms + CH * LM;    // G_t, double [CH]
  static constexpr int gam = gd + 2 * CH;    // e^{G_t}
  static constexpr int eend = gam + CH;      // e^{G_last - G_t}
  static constexpr int bet = eend + CH;      // beta_t
  static constexpr int dbi = bet + CH;       // dbeta from grad3_wy
  static constexpr int part = dbi + CH;      // [3][4][CH]: q . Gam dQG, k . Gam dR_w, k . Eend dKend per column quarter
  static constexpr int rr = part + 12 * CH;  // the rectangle sums of P
  static constexpr int misc = rr + CH;       // [0..3] sums of dGam_last per warp, [4] Gam_last
  static constexpr int total = misc + 8;
  static constexpr size_t bytes = total * sizeof(float);
  static_assert(ks % 4 == 0 && mq % 4 == 0 && ms % 4 == 0 && gd % 2 == 0, "16-byte rows, 8-byte doubles");
};

constexpr size_t grad3_gdn_smem(bool f32) { return f32 ? Gg3Smem<true>::bytes : Gg3Smem<false>::bytes; }

// 16 bytes global -> shared, zero-filled when !ok (src must still be a valid address)
__device__ __forceinline__ void gg3_cpa16z(void* smem, const void* gmem, bool ok) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(n) : "memory");
}

// The fp32 value of a stored q / k element.
template <typename T>
__device__ __forceinline__ float gg3_val(const void* s, int i) {
  if constexpr (std::is_same<T, float>::value) {
    return static_cast<const float*>(s)[i];
  } else {
    const uint16_t x = static_cast<const uint16_t*>(s)[i];
    if constexpr (std::is_same<T, __half>::value) return __half2float(__ushort_as_half(x));
    else return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
}

// tf32 operand(s) of a stored q / k element: 16-bit inputs are exact (lo unused), fp32 split hi + lo.
template <typename T>
__device__ __forceinline__ void gg3_qk(const void* s, int i, uint32_t& hi, uint32_t& lo) {
  if constexpr (std::is_same<T, float>::value) sb3_split<true>(static_cast<const float*>(s)[i], hi, lo);
  else hi = __float_as_uint(gg3_val<T>(s, i)), lo = 0u;
}

template <typename T>
__global__ void __launch_bounds__(NT, 2) grad3_gdn_kernel(Params p) {
  constexpr bool F32 = std::is_same<T, float>::value;
  using L = Gg3Smem<F32>;
  constexpr int LQ = L::LQ, LM = L::LM;
  ChunkPos cp;
  if (!chunk_pos(p, blockIdx.x, cp)) return;
  const int cid = blockIdx.x, hv = blockIdx.y;
  extern __shared__ __align__(16) float sm[];
  void* Qs = sm + L::qs;
  void* Ks = sm + L::ks;
  float* Mq = sm + L::mq;
  float* Ms = sm + L::ms;
  double* Gd = reinterpret_cast<double*>(sm + L::gd);
  float* gam = sm + L::gam;
  float* eend = sm + L::eend;
  float* bet = sm + L::bet;
  float* dbi = sm + L::dbi;
  float* part = sm + L::part;
  float* rr = sm + L::rr;
  float* misc = sm + L::misc;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, t4 = lane & 3;
  const int K = p.K, HV = p.HV, Cc = cp.Cc;
  const int h = hv / (HV / p.H);
  const size_t abase = (static_cast<size_t>(cid) * HV + hv) * CH * CH;
  const size_t tbase = (static_cast<size_t>(cid) * HV + hv) * CH * KP;
  auto tok = [&](int t) { return (cp.row0 + t) * HV + hv; };

  // ---- loads, all issued before any use
  {  // q, k -> Qs, Ks (zeros past the chunk's rows and past K)
    constexpr int ES = F32 ? 4 : 2;  // bytes per element
    constexpr int EPC = 16 / ES, CPR = KP / EPC;
    const char* qg = static_cast<const char*>(p.q) + (cp.row0 * p.H + h) * K * ES;
    const char* kg = static_cast<const char*>(p.k) + (cp.row0 * p.H + h) * K * ES;
    const int64_t rs = static_cast<int64_t>(p.H) * K * ES;  // bytes between tokens
    const bool vec = K % EPC == 0 && ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k)) & 15) == 0;
    if (vec) {
#pragma unroll
      for (int r = 0; r < CH * CPR / NT; ++r) {
        const int i = tid + r * NT, t = i / CPR, c = (i % CPR) * EPC;
        const bool ok = t < Cc && c < K;
        const int64_t o = ok ? t * rs + c * ES : 0;
        gg3_cpa16z(static_cast<char*>(Qs) + (t * LQ + c) * ES, qg + o, ok);
        gg3_cpa16z(static_cast<char*>(Ks) + (t * LQ + c) * ES, kg + o, ok);
      }
    } else {
      using ST = typename std::conditional<F32, float, uint16_t>::type;
      for (int i = tid; i < CH * KP; i += NT) {
        const int t = i / KP, c = i % KP;
        const bool ok = t < Cc && c < K;
        const int64_t o = t * (rs / ES) + c;
        static_cast<ST*>(Qs)[t * LQ + c] = ok ? reinterpret_cast<const ST*>(qg)[o] : ST(0);
        static_cast<ST*>(Ks)[t * LQ + c] = ok ? reinterpret_cast<const ST*>(kg)[o] : ST(0);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < CH * CH / 4 / NT; ++r) {  // dA_qk -> Mq, dA_kk -> Ms (scaled below)
    const int i = tid + r * NT, t = i >> 4, c4 = (i & 15) * 4;
    cpa16(Mq + t * LM + c4, p.aqk + abase + t * CH + c4);
    cpa16(Ms + t * LM + c4, p.akk + abase + t * CH + c4);
  }
  cpa_commit();
  // dQG, dKend, dR_w in the accumulator layout of the 64 x 128 products: warp rows 32 wm + 16 mt + gq (+ 8),
  // columns 32 wn + 8 nt + 2 t4 (+ 1)
  const int wm = warp & 1, wn = warp >> 1;
  float2 fq[2][2][4], fe[2][2][4], fr[2][2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const size_t o = tbase + static_cast<size_t>(32 * wm + 16 * mt + gq + 8 * hh) * KP + 32 * wn + 8 * nt + 2 * t4;
        fq[mt][hh][nt] = *reinterpret_cast<const float2*>(p.gdqg + o);
        fe[mt][hh][nt] = *reinterpret_cast<const float2*>(p.gdkend + o);
        fr[mt][hh][nt] = *reinterpret_cast<const float2*>(p.gdw + o);
      }
  if (warp == 0) {  // gates: G_t (double prefix), e^{G_t}, e^{G_last - G_t}, Gam_last; beta, dbeta
    const int t0 = 2 * lane;
    float g0 = 0.f, g1 = 0.f, b0 = 0.f, b1 = 0.f, d0 = 0.f, d1 = 0.f;
    if (t0 < Cc) {
      g0 = p.g[tok(t0)];
      b0 = p.beta[tok(t0)];
      d0 = p.dbeta[tok(t0)];
    }
    if (t0 + 1 < Cc) {
      g1 = p.g[tok(t0 + 1)];
      b1 = p.beta[tok(t0 + 1)];
      d1 = p.dbeta[tok(t0 + 1)];
    }
    double G0, G1, Gl;
    gate_prefix_warp(g0, g1, lane, G0, G1, Gl);  // the GDN preps' double prefix (gdn_chunk_prep.cuh)
    Gd[t0] = G0;
    Gd[t0 + 1] = G1;
    gam[t0] = expf(static_cast<float>(G0));
    gam[t0 + 1] = expf(static_cast<float>(G1));
    eend[t0] = expf(static_cast<float>(Gl - G0));
    eend[t0 + 1] = expf(static_cast<float>(Gl - G1));
    bet[t0] = b0;
    bet[t0 + 1] = b1;
    dbi[t0] = d0;
    dbi[t0 + 1] = d1;
    if (lane == 0) misc[4] = expf(static_cast<float>(Gl));
  } else if (warp >= 4) {  // the sum of dGam_last over the channels, per warp
    const int c = tid - 4 * 32;
    float x = c < K ? p.gdgl[(static_cast<size_t>(cid) * HV + hv) * KP + c] : 0.f;
    x = warp_sum(x);
    if (lane == 0) misc[warp - 4] = x;
  }
  cpa_wait<0>();
  __syncthreads();

  // ---- the row-scaled terms into the accumulators, and their channel sums for dg / dbeta
  float acq[2][4][4], ack[2][4][4];
  {
    float rq[2][2], rk[2][2], re[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = 32 * wm + 16 * mt + gq + 8 * hh;
        const float gm = gam[t], ee = eend[t], bb = bet[t];
        float sq = 0.f, sk = 0.f, se = 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int c = 32 * wn + 8 * nt + 2 * t4;
          const float q0 = gg3_val<T>(Qs, t * LQ + c), q1 = gg3_val<T>(Qs, t * LQ + c + 1);
          const float k0 = gg3_val<T>(Ks, t * LQ + c), k1 = gg3_val<T>(Ks, t * LQ + c + 1);
          const float xq0 = gm * fq[mt][hh][nt].x, xq1 = gm * fq[mt][hh][nt].y;
          const float xr0 = gm * fr[mt][hh][nt].x, xr1 = gm * fr[mt][hh][nt].y;
          const float xe0 = ee * fe[mt][hh][nt].x, xe1 = ee * fe[mt][hh][nt].y;
          acq[mt][nt][2 * hh] = xq0;
          acq[mt][nt][2 * hh + 1] = xq1;
          ack[mt][nt][2 * hh] = fmaf(bb, xr0, xe0);
          ack[mt][nt][2 * hh + 1] = fmaf(bb, xr1, xe1);
          sq = fmaf(q1, xq1, fmaf(q0, xq0, sq));
          sk = fmaf(k1, xr1, fmaf(k0, xr0, sk));
          se = fmaf(k1, xe1, fmaf(k0, xe0, se));
        }
        rq[mt][hh] = sq;
        rk[mt][hh] = sk;
        re[mt][hh] = se;
      }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
        for (int m = 1; m < 4; m <<= 1) {
          rq[mt][hh] += __shfl_xor_sync(0xffffffffu, rq[mt][hh], m);
          rk[mt][hh] += __shfl_xor_sync(0xffffffffu, rk[mt][hh], m);
          re[mt][hh] += __shfl_xor_sync(0xffffffffu, re[mt][hh], m);
        }
        if (t4 == 0) {
          const int t = 32 * wm + 16 * mt + gq + 8 * hh;
          part[(0 * 4 + wn) * CH + t] = rq[mt][hh];
          part[(1 * 4 + wn) * CH + t] = rk[mt][hh];
          part[(2 * 4 + wn) * CH + t] = re[mt][hh];
        }
      }
  }
  // ---- Mq = dA_qk o D in place (zeros above the diagonal), Ms = Mk + Mk^T (two passes: every read of dA_kk
  // before the mirrored writes). D is never formed above the diagonal (e^{positive} could overflow).
  {
    float mk[CH * CH / NT];
#pragma unroll
    for (int r = 0; r < CH * CH / NT; ++r) {
      const int i = tid + r * NT, t = i >> 6, j = i & 63;
      mk[r] = 0.f;
      if (j < t) {
        const float d = expf(static_cast<float>(Gd[t] - Gd[j]));
        Mq[t * LM + j] *= d;
        mk[r] = Ms[t * LM + j] * d;
      } else if (j > t) {
        Mq[t * LM + j] = 0.f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < CH * CH / NT; ++r) {
      const int i = tid + r * NT, t = i >> 6, j = i & 63;
      if (j <= t) {
        Ms[t * LM + j] = mk[r];
        Ms[j * LM + t] = mk[r];
      }
    }
  }
  __syncthreads();

  // ---- dq += Mq K (j <= t: k-steps up to the warp's last row), dk += Mq^T Q (t >= j) + Ms K
  auto mma2 = [&](float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0, uint32_t bh1,
                  uint32_t bl0, uint32_t bl1) {
    sb3_mma(c, al, bh0, bh1);
    if constexpr (F32) sb3_mma(c, ah, bl0, bl1);
    sb3_mma(c, ah, bh0, bh1);
  };
  // op 0: dq += Mq K; op 1: dk += Mq^T Q; op 2: dk += Ms K
#pragma unroll
  for (int op = 0; op < 3; ++op) {
    const float* M = op == 2 ? Ms : Mq;
    const void* Bs = op == 1 ? Qs : Ks;
    const bool tr = op == 1;
    const int ks0 = op == 1 ? 4 * wm : 0, ks1 = op == 0 ? 4 * wm + 4 : 8;
#pragma unroll 2
    for (int ks = ks0; ks < ks1; ++ks) {
      const int k0 = 8 * ks + t4;
      uint32_t bh[4][2], bl[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int c = 32 * wn + 8 * nt + gq;
        gg3_qk<T>(Bs, k0 * LQ + c, bh[nt][0], bl[nt][0]);
        gg3_qk<T>(Bs, (k0 + 4) * LQ + c, bh[nt][1], bl[nt][1]);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const int r0 = 32 * wm + 16 * mt + gq;
        float av[4];
        if (tr) {
          av[0] = M[k0 * LM + r0];
          av[1] = M[k0 * LM + r0 + 8];
          av[2] = M[(k0 + 4) * LM + r0];
          av[3] = M[(k0 + 4) * LM + r0 + 8];
        } else {
          av[0] = M[r0 * LM + k0];
          av[1] = M[(r0 + 8) * LM + k0];
          av[2] = M[r0 * LM + k0 + 4];
          av[3] = M[(r0 + 8) * LM + k0 + 4];
        }
        uint32_t ah[4], al[4];
        sb3_split4<true>(av, ah, al);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (op == 0) mma2(acq[mt][nt], ah, al, bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
          else mma2(ack[mt][nt], ah, al, bh[nt][0], bh[nt][1], bl[nt][0], bl[nt][1]);
        }
      }
    }
  }
  // dq, dk out (rows < Cc, columns < K)
  {
    const bool pair = (K & 1) == 0;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int t = 32 * wm + 16 * mt + gq + 8 * hh;
        if (t >= Cc) continue;
        const int64_t ro = tok(t) * K;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int c = 32 * wn + 8 * nt + 2 * t4;
          const float a0 = acq[mt][nt][2 * hh], a1 = acq[mt][nt][2 * hh + 1];
          const float b0 = ack[mt][nt][2 * hh], b1 = ack[mt][nt][2 * hh + 1];
          if (pair && c + 1 < K) {
            *reinterpret_cast<float2*>(p.dq + ro + c) = make_float2(a0, a1);
            *reinterpret_cast<float2*>(p.dk + ro + c) = make_float2(b0, b1);
          } else {
            if (c < K) p.dq[ro + c] = a0, p.dk[ro + c] = b0;
            if (c + 1 < K) p.dq[ro + c + 1] = a1, p.dk[ro + c + 1] = b1;
          }
        }
      }
  }
  // ---- P[t, j] = Mq[t, j] (q_t . k_j) + Mk[t, j] (k_t . k_j), j < t: Q K^T and K K^T on the 20 lower 16 x 8 tiles
  // (warp: rows 16 a .. + 15, columns 32 nh .. + 31)
  {
    const int a = warp & 3, nh = warp >> 2;
    float sq[4][4], sk[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sq[nt][e] = sk[nt][e] = 0.f;
#pragma unroll 2
    for (int ks = 0; ks < KP / 8; ++ks) {
      const int k0 = 8 * ks + t4, r0 = 16 * a + gq;
      uint32_t qh[4], ql[4], kh[4], kl[4];
      gg3_qk<T>(Qs, r0 * LQ + k0, qh[0], ql[0]);
      gg3_qk<T>(Qs, (r0 + 8) * LQ + k0, qh[1], ql[1]);
      gg3_qk<T>(Qs, r0 * LQ + k0 + 4, qh[2], ql[2]);
      gg3_qk<T>(Qs, (r0 + 8) * LQ + k0 + 4, qh[3], ql[3]);
      gg3_qk<T>(Ks, r0 * LQ + k0, kh[0], kl[0]);
      gg3_qk<T>(Ks, (r0 + 8) * LQ + k0, kh[1], kl[1]);
      gg3_qk<T>(Ks, r0 * LQ + k0 + 4, kh[2], kl[2]);
      gg3_qk<T>(Ks, (r0 + 8) * LQ + k0 + 4, kh[3], kl[3]);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int nb = 4 * nh + nt;
        if (8 * nb > 16 * a + 15) continue;  // wholly above the diagonal (warp-uniform)
        const int j = 8 * nb + gq;
        uint32_t bh0, bl0, bh1, bl1;
        gg3_qk<T>(Ks, j * LQ + k0, bh0, bl0);
        gg3_qk<T>(Ks, j * LQ + k0 + 4, bh1, bl1);
        if constexpr (F32) {
          sb3_mma(sq[nt], ql, bh0, bh1);
          sb3_mma(sq[nt], qh, bl0, bl1);
          sb3_mma(sk[nt], kl, bh0, bh1);
          sb3_mma(sk[nt], kh, bl0, bl1);
        }
        sb3_mma(sq[nt], qh, bh0, bh1);
        sb3_mma(sk[nt], kh, bh0, bh1);
      }
    }
    float pv[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * a + gq + 8 * (e >> 1), j = 8 * (4 * nh + nt) + 2 * t4 + (e & 1);
        pv[nt][e] = j < t ? fmaf(Mq[t * LM + j], sq[nt][e], Ms[t * LM + j] * sk[nt][e]) : 0.f;
      }
    __syncthreads();  // every read of Mq done: P goes over it
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int nb = 4 * nh + nt;
      if (8 * nb > 16 * a + 15) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * a + gq + 8 * (e >> 1), j = 8 * nb + 2 * t4 + (e & 1);
        Mq[t * LM + j] = pv[nt][e];
      }
    }
  }
  __syncthreads();
  // row prefixes: Mq[t][i] <- sum_{j < i} P[t, j] (warp per row, 2 columns per lane; only j < t read)
  for (int t = warp; t < CH; t += NT / 32) {
    const float2 v = *reinterpret_cast<const float2*>(Mq + t * LM + 2 * lane);
    const float x0 = 2 * lane < t ? v.x : 0.f, x1 = 2 * lane + 1 < t ? v.y : 0.f;
    float s = x0 + x1;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float o = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += o;
    }
    float ex = __shfl_up_sync(0xffffffffu, s, 1);
    if (lane == 0) ex = 0.f;
    *reinterpret_cast<float2*>(Mq + t * LM + 2 * lane) = make_float2(ex, ex + x0);
  }
  __syncthreads();
  // rectangle sums rr[i] = sum_{t >= i} (row prefix of t at i), 4 threads per column
  {
    const int i = tid >> 2, pp = tid & 3;
    float s = 0.f;
    for (int t = i + pp; t < CH; t += 4) s += Mq[t * LM + i];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (pp == 0) rr[i] = s;
  }
  __syncthreads();
  // ---- dg (per head, [tokens, HV]) and dbeta, warp 0: suffix sums of r1 = q . Gam dQG + beta k . Gam dR_w, prefix sums of
  // r2 = k . Eend dKend (both direct: no difference of partial sums)
  if (warp == 0) {
    const int t0 = 2 * lane;
    float r1[2], r2[2], rk[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = t0 + e;
      const float sq = ((part[0 * CH + t] + part[1 * CH + t]) + part[2 * CH + t]) + part[3 * CH + t];
      const float sk = ((part[4 * CH + t] + part[5 * CH + t]) + part[6 * CH + t]) + part[7 * CH + t];
      const float se = ((part[8 * CH + t] + part[9 * CH + t]) + part[10 * CH + t]) + part[11 * CH + t];
      rk[e] = sk;
      r1[e] = fmaf(bet[t], sk, sq);
      r2[e] = se;
    }
    // suffix: s = sum over lanes >= lane of (r1[0] + r1[1])
    float s = r1[0] + r1[1];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float o = __shfl_down_sync(0xffffffffu, s, d);
      if (lane + d < 32) s += o;
    }
    float nx = __shfl_down_sync(0xffffffffu, s, 1);
    if (lane == 31) nx = 0.f;
    const float suf1 = r1[1] + nx, suf0 = r1[0] + suf1;
    // prefix (exclusive) of r2
    float u = r2[0] + r2[1];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float o = __shfl_up_sync(0xffffffffu, u, d);
      if (lane >= d) u += o;
    }
    float pv = __shfl_up_sync(0xffffffffu, u, 1);
    if (lane == 0) pv = 0.f;
    const float pre0 = pv, pre1 = pv + r2[0];
    const float cgl = misc[4] * (((misc[0] + misc[1]) + misc[2]) + misc[3]);
    const float dg0 = ((suf0 + cgl) + pre0) + rr[t0], dg1 = ((suf1 + cgl) + pre1) + rr[t0 + 1];
    if (t0 < Cc) {
      p.dg[tok(t0)] = dg0;
      p.dbeta[tok(t0)] = dbi[t0] + rk[0];
    }
    if (t0 + 1 < Cc) {
      p.dg[tok(t0 + 1)] = dg1;
      p.dbeta[tok(t0 + 1)] = dbi[t0 + 1] + rk[1];
    }
  }
}

// The kernel for the inputs' dtype (a template so that only the GDN translation unit instantiates the kernels).
template <bool PC>
auto grad3_gdn(int in_dtype) {
  static_assert(!PC, "grad3_gdn is GDN's (per-head gate)");
  return in_dtype == kF32 ? grad3_gdn_kernel<float>
                          : (in_dtype == kBF16 ? grad3_gdn_kernel<__nv_bfloat16> : grad3_gdn_kernel<__half>);
}

}  // namespace chunk_bwd
}  // namespace cuda
}  // namespace kda_kernels
