// GDN prep kernel v3 of the chunked forward (KDA_CUDA_GDN_PREP=3; session 13, off by default): v2
// (gdn_chunk_prep2_kernel) for a pair of value heads of one GVA group per block. The two heads share q and k, so
// the q / k loads (S0) and the raw products Q K^T, K K^T of S1 (its mma and ldmatrix: about a quarter of v2's
// shared-memory wavefronts) are done once per pair; the scalar gate enters only as the per-element factor
// e^{G_t - G_j} beta_j applied after the product, exactly as v2 applies it, so every value is v2's bit for bit.
//  - S0: q, k staged once; warp r computes the gates of head r (its own Gh / Ea / Ck / Bs, 1.25 KB more shared
//    memory: 72.4 KB, still three blocks per SM).
//  - S1: both heads' factors per element: A~ of both heads -> workspace; A_kk Diag(beta) of head 0 into Ab's
//    strict lower triangle, of head 1 transposed into its strict upper triangle (prep_inverse_diag and the 3xTF32
//    products read only the strict lower triangle; S1's zeros on and above the diagonal are not stored). S3 / S4's
//    16x16 scratch moves from Ab's upper triangle to T's strictly upper blocks (never written nor read otherwise).
//  - S2: warps 0-3 T's diagonal blocks of head 0, then q~ of head 1; warps 4-7 q~ of head 0 (q is dead after S2).
//  - S3-S5 of head 0 as v2; meanwhile (after S4) head 1's A is copied from the upper to the lower triangle.
//  - head 1: v's cp.async into q's tile again, S2-S5 of v2 (k~^T's first quarter moves to S2's warps 4-7).
// Pairs exist where HV / H is even; otherwise (HV == H, odd ratios) each block takes one head (a group of one).
#pragma once

#include "gdn_chunk_prep2.cuh"

namespace kda_kernels {
namespace cuda {

template <int KP>
struct GdnPrep3Smem {
  using S2 = GdnPrep2Smem<KP>;
  static constexpr int LDH = S2::LDH, LDV = S2::LDV, LDA = S2::LDA;
  static constexpr size_t qv = S2::qv, ks = S2::ks, ab = S2::ab, ts = S2::ts;
  static constexpr size_t gate_bytes = 20 * kChunk;  // per head: float2 Gh, float Ea, Ck, Bs
  static constexpr size_t gates = S2::gh;
  static constexpr size_t bytes = gates + 2 * gate_bytes;
  static_assert(gates % 16 == 0 && gate_bytes % 16 == 0, "16-byte aligned sections");
  static_assert(3 * (bytes + 1024) <= 228 * 1024, "three blocks per SM on sm_90 (228 KB, 1 KB reserved per block)");
};

// (S3 / S4's scratch: prep2_inverse_sub1 / _sub2 with scr = Ts, T's strictly upper blocks (0,1), (0,2), (0,3),
// (1,2), never written nor read otherwise; Ab's hold the second head.)

// q~ = scale q e^G of one head (v2's S2 items), items it0, it0 + nthr, ...
template <int KP, typename T16>
__device__ __forceinline__ void prep3_qg(float* ws, const WsLayout<KP>& WL, bool half, const uint16_t* Qs,
                                         const float* Ea, float scale, int it0, int nthr) {
  constexpr int LDH = KP + 8;
  constexpr int NQ = 4 * (KP / 8) * 32;
  auto f16 = [](uint16_t x) { return to_f32(*reinterpret_cast<const T16*>(&x)); };
  for (int it = it0; it < NQ; it += nthr) {
    const int ln = it & 31, tile = it >> 5;
    const int r0 = (tile / (KP / 8)) * kSub + (ln >> 2), c0 = (tile % (KP / 8)) * 8 + (ln & 3);
    const float e0 = scale * Ea[r0], e1 = scale * Ea[r0 + 8];
    ws_put_frag(ws + WL.qg, it, half,
                make_float4(e0 * f16(Qs[r0 * LDH + c0]), e1 * f16(Qs[(r0 + 8) * LDH + c0]),
                            e0 * f16(Qs[r0 * LDH + c0 + 4]), e1 * f16(Qs[(r0 + 8) * LDH + c0 + 4])));
  }
}

// Head 1's A_kk Diag(beta) from Ab's strict upper triangle (transposed, S1) to its strict lower triangle: thread
// (bt, bj), bj <= bt, moves the 4x4 block at rows 4 bj, columns 4 bt into rows 4 bt, columns 4 bj (16-byte
// accesses; all four rows read before any write). Sources are blocks on or above the diagonal, destinations on or
// below, and a diagonal block is both only for its own thread; what lands on or above the diagonal is never read.
__device__ __forceinline__ void prep3_untranspose(float* Ab, int tid) {
  constexpr int LDA = kPrepLDA;
  static_assert(kChunk / 4 * kChunk / 4 == kGdnThreads, "one 4x4 block per thread");
  const int bt = tid / (kChunk / 4), bj = tid % (kChunk / 4);
  if (bj <= bt) {
    float4 s[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) s[m] = *reinterpret_cast<const float4*>(Ab + (4 * bj + m) * LDA + 4 * bt);
    float4* d = reinterpret_cast<float4*>(Ab + (4 * bt) * LDA + 4 * bj);
    d[0] = make_float4(s[0].x, s[1].x, s[2].x, s[3].x);
    d[LDA / 4] = make_float4(s[0].y, s[1].y, s[2].y, s[3].y);
    d[2 * (LDA / 4)] = make_float4(s[0].z, s[1].z, s[2].z, s[3].z);
    d[3 * (LDA / 4)] = make_float4(s[0].w, s[1].w, s[2].w, s[3].w);
  }
}

template <int KP, typename T16, bool WB = false>
__global__ void __launch_bounds__(kGdnThreads, 3) gdn_chunk_prep3_kernel(const ChunkFwdParams p) {
  using SM = GdnPrep3Smem<KP>;
  constexpr int LDH = SM::LDH, LDV = SM::LDV, LDA = SM::LDA;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + SM::qv);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + SM::qv);  // v over q's tile from S3 on
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + SM::ks);
  float* Ab = reinterpret_cast<float*>(smem + SM::ab);
  float* Ts = reinterpret_cast<float*>(smem + SM::ts);
  // gates of head r: Gh (float2), Ea, Ck, Bs at gates + r * gate_bytes
  auto Ghr = [&](int r) { return reinterpret_cast<float2*>(smem + SM::gates + r * SM::gate_bytes); };
  auto Ear = [&](int r) { return reinterpret_cast<float*>(smem + SM::gates + r * SM::gate_bytes + 8 * kChunk); };
  auto Ckr = [&](int r) { return reinterpret_cast<float*>(smem + SM::gates + r * SM::gate_bytes + 12 * kChunk); };
  auto Bsr = [&](int r) { return reinterpret_cast<float*>(smem + SM::gates + r * SM::gate_bytes + 16 * kChunk); };

  const int cid = blockIdx.x;
  int64_t tok0;
  int L;
  if (!chunk_coords(p, cid, tok0, L)) return;
  const int R = p.HV / p.H;
  const int nh = (R % 2 == 0) ? 2 : 1;  // heads of this block: hv0, hv0 + 1 share h where R is even
  const int hv0 = blockIdx.y * nh;
  const int h = hv0 / R;
  const int K = p.K, V = p.V, HV = p.HV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, t4 = lane & 3;
  const bool half = p.ws_bf16 != 0;
  const WsLayout<KP> WL(half);
  auto wsr = [&](int r) { return p.ws + (static_cast<int64_t>(cid) * HV + hv0 + r) * p.ws_stride; };
  auto vgr = [&](int r) { return static_cast<const uint16_t*>(p.v) + (tok0 * HV + hv0 + r) * V; };

  // ---- S0: q, k -> shared memory (cp.async) once; warp r < nh: the gates of head hv0 + r
  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + (tok0 * p.H + h) * K;
  const uint16_t* kg = static_cast<const uint16_t*>(p.k) + (tok0 * p.H + h) * K;
  const bool vec_qk = (K % 8) == 0 && ((reinterpret_cast<uintptr_t>(p.q) | reinterpret_cast<uintptr_t>(p.k)) & 15) == 0;
  const bool vec_v = (V % 8) == 0 && (reinterpret_cast<uintptr_t>(p.v) & 15) == 0;
  gdn_stage<KP>(Qs, LDH, qg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  gdn_stage<KP>(Ks, LDH, kg, static_cast<int64_t>(p.H) * K, L, K, vec_qk, tid);
  if (warp < nh) {
    const int r = warp, t0 = 2 * lane;
    float* Ck = Ckr(r);
    float* Bs = Bsr(r);
    const GdnGatePrefix gp = gdn_gate_prefix(p.g, p.beta, tok0, L, HV, hv0 + r, lane, Ghr(r), Ear(r));
    const float b0 = gp.b0, b1 = gp.b1;
    const double G0 = gp.G0, G1 = gp.G1, Gl = gp.Gl;
    Ck[t0] = b0 * __expf(static_cast<float>(Gl - G0));
    Ck[t0 + 1] = b1 * __expf(static_cast<float>(Gl - G1));
    Bs[t0] = b0;
    Bs[t0 + 1] = b1;
    const float dec = __expf(static_cast<float>(Gl));
    float* ws = wsr(r);
    for (int c = lane; c < KP; c += 32) ws[WL.decay + c] = dec;
  }
  gdn_cp_async_wait_all();
  __syncthreads();

  // ---- S1: the 20 lower tiles of Q K^T and K K^T once (v2's fragments and mma); per head the decay and beta per
  //      element (v2's expressions); head 0's A_kk into Ab[t][j], head 1's into Ab[j][t], only j < t.
  {
    const uint32_t qs_a = static_cast<uint32_t>(__cvta_generic_to_shared(Qs));
    const uint32_t ks_a = static_cast<uint32_t>(__cvta_generic_to_shared(Ks));
    for (int job = warp; job < 20; job += kGdnThreads / 32) {
      int a, nt;
      lower_tile(job, a, nt);
      float cq[4], ckk[4];
      gdn_s1_products<KP, LDH, T16>(qs_a, ks_a, a, nt, lane, cq, ckk);
      const bool diag = nt >= 2 * a;  // tiles crossing the diagonal: element stores with j < t only
      for (int r = 0; r < nh; ++r) {
        const float2* Gh = Ghr(r);
        const float* Bs = Bsr(r);
        float vq[4], vk[4];
        gdn_s1_factors(cq, ckk, a, nt, gq, t4, Gh, Bs, p.scale, vq, vk);
        if (r == 0) {
          float* Ar = Ab + (a * kSub + gq) * LDA + nt * 8 + 2 * t4;
          if (!diag) {
            *reinterpret_cast<float2*>(Ar) = make_float2(vk[0], vk[1]);
            *reinterpret_cast<float2*>(Ar + 8 * LDA) = make_float2(vk[2], vk[3]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int t = a * kSub + gq + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
              if (j < t) Ab[t * LDA + j] = vk[e];
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int t = a * kSub + gq + (e >> 1) * 8, j = nt * 8 + 2 * t4 + (e & 1);
            if (j < t) Ab[j * LDA + t] = vk[e];
          }
        }
        ws_put_frag(wsr(r) + WL.aqk, (a * (kChunk / 8) + nt) * 32 + lane, half, acc_to_afrag(vq, lane));
      }
    }
    for (int i = tid; i < nh * 12 * 32; i += kGdnThreads) {  // tiles (0, 2..7), (1, 4..7), (2, 6..7) per head
      const int r = i / (12 * 32), z = (i >> 5) % 12;
      const int a = z < 6 ? 0 : (z < 10 ? 1 : 2);
      const int nt = z < 6 ? 2 + z : (z < 10 ? z - 2 : z - 4);
      ws_put_frag(wsr(r) + WL.aqk, (a * (kChunk / 8) + nt) * 32 + (i & 31), half, make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
  __syncthreads();

  constexpr int NK = (KP / 16) * (kChunk / 8) * 32;
  for (int r = 0; r < nh; ++r) {
    float* ws = wsr(r);
    const uint16_t* vg = vgr(r);
    if (r > 0) {  // head 1: head 0's S5 is done with Vs and Ts; its A is in Ab's lower triangle (below)
      __syncthreads();
      gdn_stage<kGdnVB>(Vs, LDV, vg, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
    }
    // ---- S2: warps 0-3: diagonal blocks of T; q~ (r == 0 only: q is overwritten by v after this phase):
    //      warps 4-7 head 0's, warps 0-3 afterwards head 1's
    //      (head 1: warps 4-7 the first quarter of its k~^T instead)
    prep_inverse_diag(Ab, Ts, warp, lane);
    const int k0 = r == 0 ? 0 : NK / 4, k1 = (k0 + NK) / 2;  // k~^T items of S3: [k0, k1), S4: [k1, NK)
    if (r == 0) {
      if (warp >= 4) prep3_qg<KP, T16>(ws, WL, half, Qs, Ear(0), p.scale, tid - 128, 128);
      else if (nh > 1) prep3_qg<KP, T16>(wsr(1), WL, half, Qs, Ear(1), p.scale, tid, 128);
    } else if (warp >= 4) {
      prep2_kg<KP, T16>(ws, WL, half, Ks, Ckr(r), 0, k0, tid - 128, 128);
    }
    __syncthreads();

    // ---- S3: (head 0) v -> q's tile; warps 0-1: T_10, T_32; warps 2-7: k~^T items [k0, k1)
    if (r == 0) gdn_stage<kGdnVB>(Vs, LDV, vg, static_cast<int64_t>(HV) * V, L, min(V, kGdnVB), vec_v, tid);
    prep2_inverse_sub1(Ab, Ts, Ts, warp, gq, t4);
    if (warp >= 2) prep2_kg<KP, T16>(ws, WL, half, Ks, Ckr(r), k0, k1, tid - 64, kGdnThreads - 64);
    __syncthreads();

    // ---- S4: warps 0-1: the lower-left 32x32 of T; warps 2-7: k~^T items [k1, NK)
    prep2_inverse_sub2(Ab, Ts, Ts, warp, gq, t4);
    if (warp >= 2) prep2_kg<KP, T16>(ws, WL, half, Ks, Ckr(r), k1, NK, tid - 64, kGdnThreads - 64);
    gdn_cp_async_wait_all();
    __syncthreads();
    prep2_round_t(Ts, tid);
    if (r == 0 && nh > 1) prep3_untranspose(Ab, tid);  // Ab is not read again by head 0
    __syncthreads();

    // ---- S5: w = T (K e^G), u0 = T V
    prep2_w_u0<KP, T16, WB>(p, ws, WL, Ts, Vs, Ks, Ear(r), vg, L, vec_v, tid);
  }
}

}  // namespace cuda
}  // namespace kda_kernels
