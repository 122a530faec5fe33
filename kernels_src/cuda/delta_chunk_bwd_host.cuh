// Host side of the chunked backward (kda_chunk_bwd, gdn_chunk_bwd): checks, work buffers, the five launches of
// delta_chunk_bwd.cuh. K > 128 runs the recurrent backward (same function, exact). V > 128 runs the chunked
// backward on column blocks of <= 128: every column of the state evolves with its own column of v, so dv and
// dh0 are per block and dq, dk, dg, dbeta are sums over blocks (summed in fp32 before the cast). This keeps a
// wide call -- the context-parallel transition at value width K + V -- on the chunked kernels.
#pragma once

#include <functional>
#include <type_traits>
#include <vector>

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_prep.cuh"
#include "delta_chunk_bwd_prep4.cuh"
#include "delta_chunk_bwd_state_fwd3.cuh"
#include "delta_chunk_bwd_state_bwd3.cuh"
#include "delta_chunk_bwd_grad3_wy2.cuh"
#include "delta_chunk_bwd_grad3_vc_tc.cuh"
#include "delta_chunk_bwd_grad3_gdn.cuh"
#include "delta_chunk_bwd_grad3_ch2.cuh"
#include "delta_gva_reduce.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

// One call of the five kernels for V <= 128. dq, dk, dg are per value head and fp32 (before the GVA sum).
struct ChunkBwdF32 {
  at::Tensor dq, dk, dg, dbeta, dv, dh0;
};

// Work buffers of one backward call (V <= 128), shared by the one-call backward and its stages
// (chunk_bwd_stage): indices into the list, then the buffers. cfg is a CPU int64 [kBwCfgLen] (BwdCfg), the knobs
// as stage 0 read them, so that later stages cannot read them differently.
enum BwdWork {
  kBwOff = 0, kBwAqk, kBwAkk, kBwWc, kBwKend, kBwQg, kBwGl, kBwU0, kBwU, kBwDU, kBwHs, kBwDhs, kBwG3w, kBwCfg,
  kBwWorkSize
};
// cfg entries: prep mode, chunks (nc_max), and the kernel choice of each stage (KDA_CUDA_CHUNK_BWD_STATE_FWD /
// _BWD / _VC / _CH / _WY, read once at stage 0, so the staged ops run one choice throughout; see chunk_bwd_params).
enum BwdCfg { kCfgPrep = 0, kCfgChunks, kCfgStateFwd, kCfgStateBwd, kCfgVc, kCfgCh, kCfgWy, kBwCfgLen };

// `work` empty: allocate it (knobs read now); else check it. Returns Params with every work pointer and the inputs
// set; the output pointers (dq, dk, dg, dbeta, dv, dh0) are the stages' business.
inline chunk_bwd::Params chunk_bwd_params(const char* op, const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                          double scale, const std::optional<at::Tensor>& initial_state,
                                          const std::optional<at::Tensor>& cu, const at::Tensor& grad_o,
                                          std::vector<at::Tensor>& work) {
  namespace cb = chunk_bwd;
  const int64_t tokens = static_cast<int64_t>(s.B) * s.T;
  auto f32 = q.options().dtype(at::kFloat);
  if (work.empty()) {
    // chunks: sum over sequences of ceil(len / 64) <= tokens / 64 + N
    const int64_t nc_max = cu.has_value() ? tokens / cb::CH + s.N : static_cast<int64_t>(s.B) * ((s.T + cb::CH - 1) / cb::CH);
    const int64_t nc1 = std::max<int64_t>(nc_max, 1);
    // the state kernels read w per chunk padded (wc, read by grad too) plus K Eend, Q Gam, Gam_last from prep
    // (KDA_CUDA_CHUNK_BWD_STATE=1, the v1 state kernels that rescanned the decays per chunk step: retired)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE", 1, "the v1 state kernels state_fwd_kernel / state_bwd_kernel");
    // grad: the split grad v3 (grad3_vc / grad3_wy / the per-channel stage; KDA_CUDA_CHUNK_BWD_GRAD=1 / 2, the
    // single-kernel grad v1 / grad2: retired). Its intermediates reuse the state buffers qgc / kendc / glc (dead
    // after state_bwd) and aqk / akk in place; dw is one more [chunks, HV, CH, KP] buffer.
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_GRAD", 1, "the v1 grad kernel grad_kernel");
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_GRAD", 2, "the single-kernel grad2_kernel");
    // the per-channel grad stage (KDA_CUDA_CHUNK_BWD_CH=1, grad3_ch_kernel: retired; see chunk_bwd_grad_stage)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_CH", 1, "the per-channel grad3_ch_kernel");
    // (=4, grad3_ch2g with the GVA reduce of dq, dk fused in: 1.47 ms against grad3_ch2 + gva_reduce's 1.02 in
    // session 10's candidate call -- its head loop spilled and ran the body G times per block -- and removed)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_CH", 4, "grad3_ch2g_kernel (the GVA reduce fused into grad3_ch2)",
                   /*session=*/10);
    // (=3, grad3_ch2's 128-register instance: 0.99 ms against the default's 0.93 in session 7; removed)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_CH", 3, "grad3_ch2_kernel's 128-register instance", 11);
    // (KDA_CUDA_CHUNK_BWD_WY=3, grad3_wy2 with plain tf32 products for bf16 inputs, kept to measure since session 7:
    // no committed measurement shows it faster than the 3xTF32 default, 0.60 ms; removed)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_WY", 3, "grad3_wy2_kernel with plain tf32 products (bf16)", 11);
    // prep: 4 = KDA's prep v4 with the 8x8 split (default for bf16/fp16 inputs; delta_chunk_bwd_prep4.cuh; 0.84 vs
    // prep v3's 1.02 ms at B1 T8192 H16 HV32 K=V=128 on the H200, session 8; GDN runs its prep v3,
    // delta_chunk_bwd_prep.cuh, for every value but 2), 2 = the fp32 SIMT v2 with the forward substitution in
    // registers (always for fp32 inputs). Retired: 3 and 5 for KDA (prep v3; v4 without the split, 0.91 ms, in
    // session 11; refused by chunk_bwd_prep_stage) and 1 (v1, the serial forward substitution). 6 = KDA's prep v6
    // (session 13, opt-in): v4 with each 3xTF32 split formed once, the same outputs bit for bit (GDN: its prep v3).
    // Other values are refused here.
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_PREP", 1, "the v1 prep prep_kernel<FS2 = false>");
    // 6 = KDA's prep v6 (v4's products and order with each tf32 split formed once per shared fragment; bit for bit
    // v4's gradients, 0.665 vs 0.770 ms at B1 T8192 H16 HV32 K=V=128 on the H200, session 13's candidate call):
    // the default since session 13; 4 keeps v4 (GDN runs its prep v3 for every value but 2)
    const int prep_mode = env_choice(op, "KDA_CUDA_CHUNK_BWD_PREP", 6, {2, 3, 4, 5, 6});
    const int64_t ctile = nc1 * s.HV * cb::CH * cb::KP;
    const int64_t tv = std::max<int64_t>(tokens * s.HV * s.V, 1);
    work.assign(kBwWorkSize, at::Tensor());
    work[kBwOff] = at::empty({s.N + 1}, q.options().dtype(at::kInt));
    work[kBwAqk] = at::empty({nc1 * s.HV * cb::CH * cb::CH}, f32);
    work[kBwAkk] = at::empty({nc1 * s.HV * cb::CH * cb::CH}, f32);
    work[kBwWc] = at::empty({ctile}, f32);
    work[kBwKend] = at::empty({ctile}, f32);
    work[kBwQg] = at::empty({ctile}, f32);
    work[kBwGl] = at::empty({nc1 * s.HV * cb::KP}, f32);
    work[kBwU0] = at::empty({tv}, f32);
    work[kBwU] = at::empty({tv}, f32);
    work[kBwDU] = at::empty({tv}, f32);
    work[kBwHs] = at::empty({nc1 * s.HV * s.K * s.V}, f32);
    work[kBwDhs] = at::empty({nc1 * s.HV * s.K * s.V}, f32);
    work[kBwG3w] = at::empty({ctile}, f32);
    at::Tensor cfg = at::empty({kBwCfgLen}, at::TensorOptions().dtype(at::kLong));
    int64_t* c = cfg.data_ptr<int64_t>();
    c[kCfgPrep] = prep_mode; c[kCfgChunks] = nc_max;
    // state_fwd (delta_chunk_bwd_state_fwd3.cuh): 7 = state_fwd3 on tensor cores with tf32 products, narrow: 16
    // value columns per block (256 blocks at B1 T8192 H16 HV32 for 132 SMs), single-buffered operands, two blocks
    // per SM -- the default for bf16/fp16 inputs since session 10 (0.572 vs 0.636 ms at that shape, K=V=128 on the
    // H200, KDA and GDN alike, same gradients), 3 = state_fwd3 with 3xTF32 products and 32 columns per block (0.82
    // ms; about fp32), 2 = the fp32 SIMT state_fwd2 (1.29 ms; always for fp32 inputs); 6 is left unused. Retired
    // in session 11: 4, state_fwd3 tf32 with 32 columns per block (the default from session 6 to 10; 0.636 ms).
    // (Session 9 tried bulk-copy versions of both state scans, state_fwd4 / state_bwd4: slower -- 0.86 / 1.66 ms
    // against 0.64 / 0.84 -- and removed; docs/cuda.md, "Retired kernels".)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 5, "the bulk-copy state_fwd4_kernel");
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 4, "state_fwd3_kernel tf32 with 32 columns per block", 11);
    // (8 / 9 / 10, state_fwd on bf16 operands, session 13: 0.569 / 0.565 / 0.601 ms against 0.577, no gain; reverted)
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 8, "state_fwd_bf16_kernel (bf16 operands, U plain bf16)", 13);
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 9, "state_fwd_bf16_kernel (bf16 operands, U as hi + lo)", 13);
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 10, "state_fwd_bf16_kernel (U and K Eend as hi + lo)", 13);
    // Session 13, both bit-identical to 7 (same warp tiles, mma chains and tf32 operands; torch.equal in every GPU
    // test of the verification call): 11 = state_fwd3 shared-operand, the default since then (two narrow column
    // groups per block, each with its own barriers, sharing double-buffered w / K Eend tiles: half the L2 reads,
    // operands a step ahead; sm_90+, else 7; 0.466 vs 0.575 ms, GDN 0.467 vs 0.582), 12 = state_fwd3 wide-block
    // (=7's warp tiles on 16 warps of one 32-column block, =3's cp.async double buffers; 0.525 ms).
    c[kCfgStateFwd] = env_choice(op, "KDA_CUDA_CHUNK_BWD_STATE_FWD", 11, {7, 3, 2, 11, 12});
    // state_bwd: 4 = state_bwd3 on tensor cores with plain tf32 products (default for bf16/fp16 inputs, as
    // state_fwd; 0.87 vs 1.22 ms with 3xTF32 in session 8's candidate call, windowed backward; with grad3_vc in
    // tf32 too, every gradient's error against the float64 reference at most 0.0018 (bound 0.008), dg / dbeta /
    // dh0 at most 4.2e-4 (bound 0.02): benchmarks/cuda/bwd_accuracy.py), 3 = it with 3xTF32 (about fp32; 1.19 vs
    // state_bwd2's 1.94 ms, session 6; delta_chunk_bwd_state_bwd3.cuh), 2 = the fp32 SIMT state_bwd2 (always for
    // fp32 inputs), 10 = state_bwd3 with bf16 operands (m16n8k16, fp32 accumulators and fp32 dS, 16-byte A-operand
    // reads; session 12, delta_chunk_bwd_state_bwd3_bf16.cuh; opt-in: 0.747 vs 0.850 ms at B1 T8192 H16 HV32 on the
    // H200, but ~10x the dbeta / dh0 error, within DESIGN.md section 6). Retired in session 12: 9, the same with
    // state_bwd3's 4-byte fragment reads (0.755 ms, the same numerics as 10). 11 = state_bwd3f, =4 with its
    // operands rounded to tf32 once where written, 3 barriers per chunk instead of 4 and the warp's dS rows
    // permuted for 8-byte A reads; 12 = it with =4's fragment addresses, the default since session 13 (the same mma
    // on the same operands in the same chains: dhs, dU, dh0 torch.equal to =4's in every GPU test of the
    // verification call; 0.822 vs 0.851 ms KDA, 0.819 vs 0.849 GDN; 11 0.826 / 0.820).
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_BWD", 5, "the bulk-copy state_bwd4_kernel (tf32)");
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_BWD", 6, "the bulk-copy state_bwd4_kernel (3xTF32)");
    refuse_retired(op, "KDA_CUDA_CHUNK_BWD_STATE_BWD", 9,
                   "state_bwd3_bf16_kernel with 4-byte fragment reads (=10 is the same numerics, faster)", 12);
    c[kCfgStateBwd] = env_choice(op, "KDA_CUDA_CHUNK_BWD_STATE_BWD", 12, {4, 3, 10, 11, 12, 2});
    // grad3_vc (the contractions over V of grad v3): 3 = grad3_vc_tc on tensor cores with plain tf32 products
    // (default for bf16/fp16 inputs with V % 4 == 0; its three launches 0.71 vs 0.85 ms with 3xTF32, same call;
    // errors above), 2 = it with 3xTF32 (about fp32; delta_chunk_bwd_grad3_vc_tc.cuh), 1 = the fp32 SIMT grad3_vc
    // (always for fp32 inputs)
    c[kCfgVc] = env_choice(op, "KDA_CUDA_CHUNK_BWD_VC", 3, {3, 2, 1});
    // the per-channel stage (KDA): 5 = grad3_ch2's F5 instance, the default since session 13 (the same gradients
    // bit for bit from fewer integer / shuffle instructions; 0.885 vs 0.94 ms), 2 = grad3_ch2 without it
    // (delta_chunk_bwd_grad3_ch2.cuh). GDN ignores it.
    c[kCfgCh] = env_choice(op, "KDA_CUDA_CHUNK_BWD_CH", 5, {2, 5});
    // grad3_wy where V % 4 == 0: 4 = grad3_wy4, the default since session 13 (grad3_wy2 with T^T's splits formed
    // once and dL rebalanced, bit for bit its outputs; 0.510 vs 0.604 ms, KDA and GDN), 2 = grad3_wy2, 1 = the SIMT
    // grad3_wy (always where V % 4 != 0)
    c[kCfgWy] = env_choice(op, "KDA_CUDA_CHUNK_BWD_WY", 4, {2, 1, 4});
    // read again where it acts (the GVA reduce), which has no op name: checked here, at stage 0
    env_choice(op, "KDA_CUDA_CHUNK_BWD_GVA", 1, {1, 0});
    work[kBwCfg] = cfg;
  }
  TORCH_CHECK(static_cast<int>(work.size()) == kBwWorkSize && work[kBwCfg].defined() &&
                  work[kBwCfg].device().is_cpu() && work[kBwCfg].numel() == kBwCfgLen,
              "[", op, "] work must be the list stage 0 returned");
  const int64_t* c = work[kBwCfg].data_ptr<int64_t>();
  TORCH_CHECK(work[kBwOff].numel() == s.N + 1 &&
                  work[kBwHs].numel() == std::max<int64_t>(c[kCfgChunks], 1) * s.HV * s.K * s.V,
              "[", op, "] work does not match these inputs (pass the list stage 0 returned for the same inputs)");
  for (int i = 0; i < kBwCfg; ++i)
    TORCH_CHECK(work[i].defined() && work[i].device() == q.device(), "[", op, "] work[", i, "] is not on q's device");
  auto fp = [&](int i) { return work[i].data_ptr<float>(); };

  cb::Params p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.grad_o = grad_o.data_ptr();
  p.g = g.data_ptr<float>(); p.beta = beta.data_ptr<float>();
  p.h0 = initial_state_data(op, initial_state);
  p.cu = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  p.in_dtype = in_dtype_of(q, op);
  p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V; p.N = s.N;
  p.scale = static_cast<float>(scale);
  p.chunk_off = work[kBwOff].data_ptr<int>();
  p.aqk = fp(kBwAqk); p.akk = fp(kBwAkk);
  p.u = fp(kBwU0); p.U = fp(kBwU); p.dU = fp(kBwDU);
  p.hs = fp(kBwHs); p.dhs = fp(kBwDhs);
  p.wc = fp(kBwWc); p.kendc = fp(kBwKend); p.qgc = fp(kBwQg); p.glc = fp(kBwGl);
  p.gdw = fp(kBwG3w);
  p.gdqg = p.qgc; p.gdkend = p.kendc; p.gdgl = p.glc;
  return p;
}

// The stages of one backward (V <= 128). Order: prep, then state_fwd (needs initial_state) and state_bwd (needs
// grad_final_state; writes dh0) in either order -- they read the prep's buffers and write disjoint ones -- then
// grad (overwrites buffers the state stages read).
template <bool PC>
void chunk_bwd_set_smem() {
  namespace cb = chunk_bwd;
  allow_dynamic_smem(cb::prep_kernel<PC>, cb::kPrepSmem);
  allow_dynamic_smem(cb::state_fwd2_kernel<PC>, cb::kStateFwd2Smem);
  allow_dynamic_smem(cb::state_bwd2_kernel<PC>, cb::kStateBwd2Smem);
  allow_dynamic_smem(cb::grad3_wy_kernel<PC>, cb::kWySmem, /*max_carveout=*/true);  // two 105 KB blocks per SM
}

inline int64_t bwd_cfg(const std::vector<at::Tensor>& work, BwdCfg i) { return work[kBwCfg].data_ptr<int64_t>()[i]; }
inline int64_t bwd_nc_max(const std::vector<at::Tensor>& work) { return bwd_cfg(work, kCfgChunks); }

// Stage prep: the chunk table and the per-chunk products (no state needed).
template <bool PC>
void chunk_bwd_prep_stage(const Shapes& s, const chunk_bwd::Params& p, const std::vector<at::Tensor>& work,
                          cudaStream_t st) {
  namespace cb = chunk_bwd;
  chunk_bwd_set_smem<PC>();
  cb::chunk_table_kernel<PC><<<1, 32, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t nc_max = bwd_nc_max(work);
  if (nc_max > 0 && s.HV > 0) {
    const dim3 gchunks(static_cast<unsigned>(nc_max), s.HV);
    const int64_t prep_mode = bwd_cfg(work, kCfgPrep);
    if (prep_mode == 2 || p.in_dtype == kF32) {
      cb::prep_kernel<PC><<<gchunks, cb::NT, cb::kPrepSmem, st>>>(p);
    } else {  // KDA prep v4 (with the 8x8 split); GDN: its prep v3 (any value but 2)
      if constexpr (PC) {
        TORCH_CHECK(prep_mode != 3, "KDA_CUDA_CHUNK_BWD_PREP=3 selected the KDA prep v3 prep3_kda_kernel, retired in "
                    "session 9 (docs/cuda.md, \"Retired kernels\"): unset KDA_CUDA_CHUNK_BWD_PREP or pick another "
                    "value");
        TORCH_CHECK(prep_mode != 5, "KDA_CUDA_CHUNK_BWD_PREP=5 selected the KDA prep v4 without the 8x8 split "
                    "(prep4_kda_kernel), retired in session 11 (docs/cuda.md, \"Retired kernels\"): unset "
                    "KDA_CUDA_CHUNK_BWD_PREP or pick another value");
      }
      constexpr size_t smem4 = cb::prep4_smem<PC>();
      const bool bf = p.in_dtype == kBF16;
      auto kern = bf ? cb::prep4_kernel<PC, __nv_bfloat16>() : cb::prep4_kernel<PC, __half>();
      if (prep_mode == 6)  // prep v6 (KDA; GDN: the same prep v3)
        kern = bf ? cb::prep4_kernel<PC, __nv_bfloat16, true>() : cb::prep4_kernel<PC, __half, true>();
      allow_dynamic_smem(kern, smem4, /*max_carveout=*/true);  // two blocks per SM
      kern<<<gchunks, cb::NT, smem4, st>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The one-call backward and the staged one run only on devices with kGradSmem of shared memory per block
// (smem_optin checks in chunk_bwd_run / chunk_bwd_stage); the tensor-core state kernels need no check of their own.
static_assert(chunk_bwd::kStateFwd3Smem <= chunk_bwd::kGradSmem && chunk_bwd::kStateFwd3sSmem <= chunk_bwd::kGradSmem && chunk_bwd::kStateBwd3Smem <= chunk_bwd::kGradSmem,
              "a state kernel needs more shared memory than the device check in chunk_bwd_run guarantees");

// Stage state_fwd: the chunk-start states from initial_state (p.h0).
template <bool PC>
void chunk_bwd_state_fwd_stage(const Shapes& s, const chunk_bwd::Params& p, const std::vector<at::Tensor>& work,
                               cudaStream_t st) {
  namespace cb = chunk_bwd;
  if (s.N <= 0 || s.HV <= 0) return;
  const dim3 gseq(s.N, s.HV, (s.V + cb::VS - 1) / cb::VS);
  const int64_t mode = bwd_cfg(work, kCfgStateFwd);
  if ((mode == 7 || (mode == 11 && cc_major() < 9)) && p.in_dtype != kF32) {
    // state_fwd3 narrow (KDA_CUDA_CHUNK_BWD_STATE_FWD=7): 16 columns per block, 87.5 KB, two blocks per SM
    constexpr int bv = cb::kSf3NarrowBV;
    auto kern = cb::state_fwd3_kernel<PC, false, bv, false>;
    allow_dynamic_smem(kern, cb::kStateFwd3NarrowSmem, /*max_carveout=*/true);
    const dim3 gnar(s.N, s.HV, (s.V + bv - 1) / bv);
    kern<<<gnar, cb::kSf3Threads, cb::kStateFwd3NarrowSmem, st>>>(p);
  } else if (mode == 11 && p.in_dtype != kF32 && cc_major() >= 9) {
    // state_fwd3 shared-operand (=11): two narrow column groups per block sharing double-buffered operand tiles
    // (cp.async tracked by mbarriers); 171 KB, one block per SM, sm_90+ (elsewhere =11 runs =7 below)
    auto kern = cb::state_fwd3s_kernel<PC>;
    allow_dynamic_smem(kern, cb::kStateFwd3sSmem);
    kern<<<gseq, cb::kSf3sThreads, cb::kStateFwd3sSmem, st>>>(p);
  } else if (mode == 12 && p.in_dtype != kF32) {
    // state_fwd3 wide-block (=12): =7's warp tiles on 16 warps of one 32-column block, cp.async double buffers
    auto kern = cb::state_fwd3w_kernel<PC>;
    allow_dynamic_smem(kern, cb::kStateFwd3Smem);
    kern<<<gseq, cb::kSf3WideThreads, cb::kStateFwd3Smem, st>>>(p);
  } else if (mode == 3 && p.in_dtype != kF32) {
    // state_fwd3 3xTF32 (delta_chunk_bwd_state_fwd3.cuh): tensor cores, bf16/fp16 inputs, 165 KB of shared memory
    // per block (within kGradSmem, which every chunked backward checks the device for before its first stage)
    auto kern = cb::state_fwd3_kernel<PC, true>;
    allow_dynamic_smem(kern, cb::kStateFwd3Smem);
    kern<<<gseq, cb::kSf3Threads, cb::kStateFwd3Smem, st>>>(p);
  } else {
    cb::state_fwd2_kernel<PC><<<gseq, cb::NT2, cb::kStateFwd2Smem, st>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// state_bwd3 with bf16 operands (KDA_CUDA_CHUNK_BWD_STATE_BWD=10): defined and instantiated in
// delta_chunk_bwd_state_bwd3_bf16.cu (its own translation unit: this file's kernels compile as without it)
template <bool PC>
void launch_state_bwd3_bf16(const chunk_bwd::Params& p, dim3 grid, cudaStream_t st);

// state_bwd3f (KDA_CUDA_CHUNK_BWD_STATE_BWD=11 with its dS rows permuted, 12 without): instantiated in
// delta_chunk_bwd_state_bwd3f.cu (its own translation unit, as state_bwd3_bf16)
template <bool PC>
void launch_state_bwd3f(const chunk_bwd::Params& p, dim3 grid, cudaStream_t st, bool rowp);

// Stage state_bwd: the chunk-end state gradients backwards from grad_final_state (p.dht); writes p.dh0.
template <bool PC>
void chunk_bwd_state_bwd_stage(const Shapes& s, const chunk_bwd::Params& p, const std::vector<at::Tensor>& work,
                               cudaStream_t st) {
  namespace cb = chunk_bwd;
  if (s.N <= 0 || s.HV <= 0) return;
  const dim3 gseq(s.N, s.HV, (s.V + cb::VS - 1) / cb::VS);
  const int64_t mode = bwd_cfg(work, kCfgStateBwd);
  // state_bwd3 (delta_chunk_bwd_state_bwd3.cuh): bf16/fp16 inputs, 217 KB of shared memory per block (within
  // kGradSmem, which every chunked backward checks the device for before its first stage)
  if ((mode == 3 || mode == 4) && p.in_dtype != kF32) {
    auto kern = mode == 3 ? cb::state_bwd3_kernel<PC, true> : cb::state_bwd3_kernel<PC, false>;
    allow_dynamic_smem(kern, cb::kStateBwd3Smem);
    kern<<<gseq, cb::kSb3Threads, cb::kStateBwd3Smem, st>>>(p);
  } else if ((mode == 11 || mode == 12) && p.in_dtype != kF32) {
    // state_bwd3f: =4's products on operands rounded once (delta_chunk_bwd_state_bwd3f.cu), the same grid
    launch_state_bwd3f<PC>(p, gseq, st, mode == 11);
  } else if (mode == 10 && p.in_dtype != kF32) {
    // state_bwd3 with bf16 operands (delta_chunk_bwd_state_bwd3_bf16.cu), the same grid
    launch_state_bwd3_bf16<PC>(p, gseq, st);
  } else {
    cb::state_bwd2_kernel<PC><<<gseq, cb::NT2, cb::kStateBwd2Smem, st>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Points of the grad stage where work buffers die and outputs are first written: chunk_bwd_block frees and
// allocates there (a hook), so that the grad stage's peak is the work alone; the staged op allocates every output
// before the stage and passes no hook. Grad v3 (the default; which kernel reads what: see each kernel's file):
//   kGradBeforeWy  after the three grad3_vc launches: hs, dhs, U are dead; grad3_wy writes dv and dbeta
//   kGradBeforeCh  after grad3_wy: u, dU, wc are dead; grad3_ch2 / grad3_gdn write dq, dk, dg (and add to dbeta)
enum GradPoint { kGradBeforeWy = 0, kGradBeforeCh };
using GradHook = std::function<void(GradPoint, chunk_bwd::Params&)>;

// GDN's grad3_gdn writes dg per head, [tokens, HV] (the token's gate gradient summed over channels in the kernel);
// KDA's grad3_ch2 per channel, [tokens, HV, K].
template <bool PC>
bool bwd_dg_per_head(const std::vector<at::Tensor>&) {
  return !PC;
}

// Stage grad: dq, dk, dg, dbeta, dv per chunk (p's output pointers, or set by `hook` at its points).
template <bool PC>
void chunk_bwd_grad_stage(const Shapes& s, chunk_bwd::Params p, const std::vector<at::Tensor>& work, cudaStream_t st,
                          const GradHook& hook = {}) {
  namespace cb = chunk_bwd;
  const int64_t nc_max = bwd_nc_max(work);
  if (nc_max <= 0 || s.HV <= 0) return;
  const dim3 gchunks(static_cast<unsigned>(nc_max), s.HV);
  {
    const int64_t vc_mode = bwd_cfg(work, kCfgVc);
    if ((vc_mode == 2 || vc_mode == 3) && p.in_dtype != kF32 && s.V % 4 == 0) {
      // grad3_vc_tc (tensor cores; 74 / 92 / 55 KB for Z = 0 / 1 / 2: two blocks per SM)
      const bool bf16 = p.in_dtype == kBF16, precise = vc_mode == 2;
      auto k0 = cb::grad3_vc_tc<PC, 0>(bf16, precise);
      auto k1 = cb::grad3_vc_tc<PC, 1>(bf16, precise);
      auto k2 = cb::grad3_vc_tc<PC, 2>(bf16, precise);
      allow_dynamic_smem(k0, cb::vctc_smem<0>(), /*max_carveout=*/true);
      allow_dynamic_smem(k1, cb::vctc_smem<1>(), /*max_carveout=*/true);
      allow_dynamic_smem(k2, cb::vctc_smem<2>(), /*max_carveout=*/true);
      k0<<<gchunks, cb::NT, cb::vctc_smem<0>(), st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      k1<<<gchunks, cb::NT, cb::vctc_smem<1>(), st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      k2<<<gchunks, cb::NT, cb::vctc_smem<2>(), st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      static_assert(cb::kVcSmem <= 48 * 1024, "grad3_vc needs no shared-memory attribute");
      cb::grad3_vc_kernel<PC, 0><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_vc_kernel<PC, 1><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_vc_kernel<PC, 2><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (hook) hook(kGradBeforeWy, p);
    // grad3_wy2 (delta_chunk_bwd_grad3_wy2.cuh; tensor cores, 108 KB: two blocks per SM) by default where V % 4 == 0;
    // the SIMT grad3_wy where V % 4 != 0 (the default there) and for KDA_CUDA_CHUNK_BWD_WY=1 (=3, plain tf32
    // products for bf16 inputs: retired in session 11, refused by chunk_bwd_params)
    // (=4, the default since session 13: grad3_wy4, the same file: grad3_wy2 with T^T's splits formed once and dL
    // rebalanced, bit for bit its outputs)
    if (const int64_t wy = bwd_cfg(work, kCfgWy); wy != 1 && s.V % 4 == 0) {
      auto kern = wy == 4 ? cb::grad3_wy4<PC>(p.in_dtype) : cb::grad3_wy2<PC>(p.in_dtype);
      allow_dynamic_smem(kern, cb::kWy2Smem, /*max_carveout=*/true);
      kern<<<gchunks, cb::NT, cb::kWy2Smem, st>>>(p);
    } else {
      cb::grad3_wy_kernel<PC><<<gchunks, cb::NT, cb::kWySmem, st>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (hook) hook(kGradBeforeCh, p);
    if constexpr (PC) {
      // grad3_ch2 (delta_chunk_bwd_grad3_ch2.cuh; clusters of 4 blocks of 32 channels, several blocks per SM), every
      // dtype and K
      cb::launch_grad3_ch2<PC>(nc_max, s.HV, p, st, /*f5=*/bwd_cfg(work, kCfgCh) == 5);
    } else {
      // GDN: grad3_gdn (delta_chunk_bwd_grad3_gdn.cuh; per-head decays as plain products on tensor cores, 75 / 107 KB
      // for bf16-fp16 / fp32 inputs: two blocks per SM; dg per head, bwd_dg_per_head), every dtype and K
      auto kern = cb::grad3_gdn<PC>(p.in_dtype);
      const size_t smem = cb::grad3_gdn_smem(p.in_dtype == kF32);
      allow_dynamic_smem(kern, smem, /*max_carveout=*/true);
      kern<<<gchunks, cb::NT, smem, st>>>(p);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dh0 [N, HV, K, V] fp32, written by the state_bwd stage.
inline at::Tensor bwd_alloc_dh0(const Shapes& s, const at::Tensor& q, chunk_bwd::Params& p) {
  at::Tensor dh0 = at::empty({s.N, s.HV, s.K, s.V}, q.options().dtype(at::kFloat));
  p.dh0 = dh0.data_ptr<float>();
  return dh0;
}

// The grad stage's outputs in two groups (allocated when first needed, see GradPoint; each call allocates what
// is still missing): dv, dbeta (written by grad3_wy) and dq, dk, dg (per value head, fp32; dg [tokens, HV] when
// `dg_per_head`, else [tokens, HV, K]). Varlen: tokens outside every sequence stay 0.
inline void bwd_alloc_dv_dbeta(const Shapes& s, const at::Tensor& q, const at::Tensor& v, bool varlen, ChunkBwdF32& r,
                               chunk_bwd::Params& p) {
  if (!r.dv.defined()) {
    auto shape = std::vector<int64_t>{s.B, s.T, s.HV};
    r.dbeta = varlen ? at::zeros(shape, q.options().dtype(at::kFloat)) : at::empty(shape, q.options().dtype(at::kFloat));
    r.dv = varlen ? at::zeros_like(v) : at::empty_like(v);
  }
  p.dbeta = r.dbeta.data_ptr<float>(); p.dv = r.dv.data_ptr();
}

inline void bwd_alloc_dq_dk_dg(const Shapes& s, const at::Tensor& q, bool varlen, bool dg_per_head, ChunkBwdF32& r,
                               chunk_bwd::Params& p) {
  if (!r.dq.defined()) {
    const int64_t tokens = static_cast<int64_t>(s.B) * s.T;
    auto f32 = q.options().dtype(at::kFloat);
    auto out_buf = [&](std::vector<int64_t> shape) { return varlen ? at::zeros(shape, f32) : at::empty(shape, f32); };
    r.dq = out_buf({tokens, s.HV, s.K});
    r.dk = out_buf({tokens, s.HV, s.K});
    r.dg = dg_per_head ? out_buf({tokens, s.HV}) : out_buf({tokens, s.HV, s.K});
  }
  p.dq = r.dq.data_ptr<float>(); p.dk = r.dk.data_ptr<float>(); p.dg = r.dg.data_ptr<float>();
}

inline ChunkBwdF32 bwd_alloc_grads(const Shapes& s, const at::Tensor& q, const at::Tensor& v, bool varlen,
                                   bool dg_per_head, chunk_bwd::Params& p) {
  ChunkBwdF32 r;
  bwd_alloc_dv_dbeta(s, q, v, varlen, r, p);
  bwd_alloc_dq_dk_dg(s, q, varlen, dg_per_head, r, p);
  return r;
}

// One backward call for V <= 128. Work buffers die where the grad stage's kernels stop reading them and the
// outputs are allocated where they are first written (GradPoint; KDA_CUDA_CHUNK_BWD_FREE=0: every output before
// the first stage and no work freed early, the session-7 behaviour, kept to measure). The peak of the call is then
// the work list at grad3_vc (docs/cuda.md, "Memory of the chunked backward").
template <bool PC>
ChunkBwdF32 chunk_bwd_block(const char* op, const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                            const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                            const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state) {
  std::vector<at::Tensor> work;
  chunk_bwd::Params p = chunk_bwd_params(op, s, q, k, v, g, beta, scale, initial_state, cu, grad_o, work);
  at::Tensor dht;  // holds a converted copy of grad_final_state alive
  p.dht = grad_state_data(grad_final_state, dht);
  const bool varlen = cu.has_value(), per_head = bwd_dg_per_head<PC>(work);
  const bool lazy = env_choice(op, "KDA_CUDA_CHUNK_BWD_FREE", 1, {1, 0}) != 0;
  ChunkBwdF32 r;
  if (!lazy) r = bwd_alloc_grads(s, q, v, varlen, per_head, p);
  r.dh0 = bwd_alloc_dh0(s, q, p);
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  chunk_bwd_prep_stage<PC>(s, p, work, st);
  chunk_bwd_state_fwd_stage<PC>(s, p, work, st);
  chunk_bwd_state_bwd_stage<PC>(s, p, work, st);
  // (freed tensors go back to the caching allocator in stream order: the kernels queued before still read them)
  GradHook hook = [&](GradPoint pt, chunk_bwd::Params& pp) {
    if (pt == kGradBeforeWy && lazy) {
      work[kBwHs].reset(); work[kBwDhs].reset(); work[kBwU].reset();
    }
    if (pt == kGradBeforeCh && lazy) {
      work[kBwU0].reset(); work[kBwDU].reset(); work[kBwWc].reset();
    }
    bwd_alloc_dv_dbeta(s, q, v, varlen, r, pp);
    if (pt != kGradBeforeWy) bwd_alloc_dq_dk_dg(s, q, varlen, per_head, r, pp);
  };
  chunk_bwd_grad_stage<PC>(s, p, work, st, hook);
  // no grad launch (no chunks or no heads): the outputs still exist (each call allocates only what is missing)
  bwd_alloc_dv_dbeta(s, q, v, varlen, r, p);
  bwd_alloc_dq_dk_dg(s, q, varlen, per_head, r, p);
  return r;
}

// The GVA reduce of dq, dk in one launch (delta_gva_reduce.cuh; the default since session 9: 0.079 ms against the
// torch path's 0.20 (sum + cast) at B1 T8192 H16 HV32 K=128 on the H200; KDA_CUDA_CHUNK_BWD_GVA=0 runs the torch
// path; read at every call): where HV % H == 0, q and k share a dtype and there is something to do (a sum over value heads or a cast).
// Returns false (nothing launched) otherwise; the caller then runs the torch path.
inline bool gva_reduce_cuda(const Shapes& s, const at::Tensor& q, const at::Tensor& k, const ChunkBwdF32& r,
                            at::Tensor& dq_out, at::Tensor& dk_out) {
  if (env_int("KDA_CUDA_CHUNK_BWD_GVA", 1) != 1) return false;
  if (s.H <= 0 || s.HV % s.H != 0 || q.scalar_type() != k.scalar_type()) return false;
  if (s.HV == s.H && q.scalar_type() == at::kFloat) return false;  // the torch path is a view
  TORCH_CHECK(r.dq.is_contiguous() && r.dk.is_contiguous() && r.dq.scalar_type() == at::kFloat &&
                  r.dk.scalar_type() == at::kFloat && r.dq.numel() == r.dk.numel(),
              "gva_reduce_cuda: dq, dk must be contiguous fp32 of one size");
  dq_out = at::empty({s.B, s.T, s.H, s.K}, q.options());
  dk_out = at::empty({s.B, s.T, s.H, s.K}, k.options());
  const int64_t rows = static_cast<int64_t>(s.B) * s.T * s.H;
  if (rows == 0 || s.K == 0) return true;
  const bool vec = s.K % 4 == 0;  // 16-byte rows (the buffers themselves come from the caching allocator: aligned)
  const int64_t n = rows * (vec ? s.K / 4 : s.K);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + kGvaThreads - 1) / kGvaThreads, 65535));
  const dim3 grid(blocks, 2);
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  const float* a = r.dq.data_ptr<float>();
  const float* b = r.dk.data_ptr<float>();
  const int G = s.HV / s.H;
  auto launch = [&](auto* oq, auto* ok) {
    using TO = std::remove_pointer_t<decltype(oq)>;
    if (vec) gva_reduce_kernel<TO, true><<<grid, kGvaThreads, 0, st>>>(a, b, oq, ok, rows, s.H, G, s.K);
    else gva_reduce_kernel<TO, false><<<grid, kGvaThreads, 0, st>>>(a, b, oq, ok, rows, s.H, G, s.K);
  };
  switch (q.scalar_type()) {
    case at::kBFloat16:
      launch(reinterpret_cast<__nv_bfloat16*>(dq_out.data_ptr()), reinterpret_cast<__nv_bfloat16*>(dk_out.data_ptr()));
      break;
    case at::kHalf:
      launch(reinterpret_cast<__half*>(dq_out.data_ptr()), reinterpret_cast<__half*>(dk_out.data_ptr()));
      break;
    default:
      launch(dq_out.data_ptr<float>(), dk_out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// dq, dk to the inputs' heads and dtypes, dg per channel (KDA) or per head (GDN: summed over the channels here
// unless the grad kernel wrote it per head).
template <bool PC>
DeltaBwdResult chunk_bwd_finish(const Shapes& s, const at::Tensor& q, const at::Tensor& k, const ChunkBwdF32& r) {
  at::Tensor dq_out, dk_out;
  if (!gva_reduce_cuda(s, q, k, r, dq_out, dk_out)) {
    dq_out = sum_gva(r.dq, s.B, s.T, s.H, s.HV, s.K).to(q.scalar_type()).contiguous();
    dk_out = sum_gva(r.dk, s.B, s.T, s.H, s.HV, s.K).to(k.scalar_type()).contiguous();
  }
  at::Tensor dg_out = PC ? r.dg.view({s.B, s.T, s.HV, s.K})
                         : (r.dg.dim() == 2 ? r.dg.view({s.B, s.T, s.HV}) : r.dg.view({s.B, s.T, s.HV, s.K}).sum(-1));
  return {dq_out, dk_out, r.dv, dg_out.contiguous(), r.dbeta, r.dh0};
}

// The chunked backward of one call (V > 128: on column blocks, see the top of this file); s from check_core.
template <bool PC>
DeltaBwdResult chunk_bwd_core(const char* op, const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                              const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                              const at::Tensor& grad_o, const std::optional<at::Tensor>& dht) {
  namespace cb = chunk_bwd;
  ChunkBwdF32 r;
  const int nblk = (s.V + cb::VP - 1) / cb::VP;
  if (nblk <= 1) {
    r = chunk_bwd_block<PC>(op, s, q, k, v, g, beta, scale, initial_state, cu, grad_o, dht);
  } else {
    const int64_t vb = (s.V + nblk - 1) / nblk;  // equal blocks: V = 256 -> 2 x 128, V = 200 -> 2 x 100
    std::vector<at::Tensor> dvs, dh0s;
    for (int64_t v0 = 0; v0 < s.V; v0 += vb) {
      const int64_t w = std::min<int64_t>(vb, s.V - v0);
      auto cut = [&](const at::Tensor& x) { return x.narrow(-1, v0, w).contiguous(); };
      Shapes sb = s;
      sb.V = static_cast<int>(w);
      std::optional<at::Tensor> h0b, dhtb;
      if (initial_state.has_value()) h0b = cut(*initial_state);
      if (dht.has_value()) dhtb = cut(*dht);
      ChunkBwdF32 part = chunk_bwd_block<PC>(op, sb, q, k, cut(v), g, beta, scale, h0b, cu, cut(grad_o), dhtb);
      if (v0 == 0) {
        r.dq = part.dq; r.dk = part.dk; r.dg = part.dg; r.dbeta = part.dbeta;
      } else {
        r.dq.add_(part.dq); r.dk.add_(part.dk); r.dg.add_(part.dg); r.dbeta.add_(part.dbeta);
      }
      dvs.push_back(part.dv);
      dh0s.push_back(part.dh0);
    }
    r.dv = at::cat(dvs, -1);
    r.dh0 = at::cat(dh0s, -1);
  }
  return chunk_bwd_finish<PC>(s, q, k, r);
}

// Windows of the sequence (memory): the work of one backward call grows with B * T * HV (about 1.5 GB at B1 T8192
// HV32 K=V=128, docs/cuda.md), so a long call runs as consecutive windows of the token axis, last window first,
// each a chunked backward of its own: its initial state is the state at the window's start (from the chunked
// forward over the windows before it, one extra forward pass) and its grad_final_state the dh0 of the window after
// it; the window's gradients go into the slices of the outputs. Windows start at multiples of the chunk (64), so
// the chunks are the unwindowed call's. KDA_CUDA_CHUNK_BWD_WINDOW: tokens per window (rounded up to a multiple of
// 64); -1: windows of about kBwdWindowTokenHeads / (B * HV) tokens (2048 at B1 HV32: ~385 MB of work at K=V=128),
// at least 512, when T is longer; unset or 0: no windows. Off by default: the extra forward pass and the smaller
// launches cost time (H200, B1 T8192 H16 HV32 K=V=128 bf16, fwd+bwd under graphs: KDA 6.38 -> 7.69 ms for a peak
// of 1606 -> 716 MiB above the inputs; B4 T4096 H=HV=32: 12.4 -> 17.6 ms; session 8's candidate call). Fixed-length
// batches only (varlen runs unwindowed: its windows would need cu_seqlens on the host). Returns the window length,
// 0 for none.
constexpr int64_t kBwdWindowTokenHeads = 65536;

inline int64_t bwd_window_tokens(const Shapes& s, bool varlen) {
  namespace cb = chunk_bwd;
  if (varlen || s.B <= 0 || s.HV <= 0 || s.T <= cb::CH) return 0;
  const int knob = env_int("KDA_CUDA_CHUNK_BWD_WINDOW", 0);
  if (knob == 0 || knob < -1) return 0;
  int64_t tw = knob > 0 ? knob : std::max<int64_t>(512, kBwdWindowTokenHeads / (static_cast<int64_t>(s.B) * s.HV));
  tw = std::max<int64_t>(cb::CH, (tw + cb::CH - 1) / cb::CH * cb::CH);
  if (s.T <= tw) return 0;
  const int64_t nw = (s.T + tw - 1) / tw;  // balanced windows: T = 8200, tw = 2048 -> 5 x 1664 (the last 1544)
  const int64_t per = (s.T + nw - 1) / nw;
  return (per + cb::CH - 1) / cb::CH * cb::CH;
}

template <bool PC>
DeltaBwdResult chunk_bwd_windows(const char* op, const Shapes& s, int64_t tw, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                 double scale, const std::optional<at::Tensor>& initial_state,
                                 const at::Tensor& grad_o, const std::optional<at::Tensor>& dht) {
  const int64_t nw = (s.T + tw - 1) / tw;
  auto t0_of = [&](int64_t w) { return w * tw; };
  auto len_of = [&](int64_t w) { return std::min<int64_t>(tw, s.T - w * tw); };
  auto win = [&](const at::Tensor& x, int64_t w) { return x.narrow(1, t0_of(w), len_of(w)).contiguous(); };
  // the state at each window's start: the forward over the windows before it (o of each is dropped at once)
  std::vector<std::optional<at::Tensor>> h0s(nw);
  h0s[0] = initial_state;
  for (int64_t w = 0; w + 1 < nw; ++w) {
    const at::Tensor qw = win(q, w), kw = win(k, w), vw = win(v, w), gw = win(g, w), bw = win(beta, w);
    DeltaFwdResult f = PC ? ::kda_chunk_fwd(qw, kw, vw, gw, bw, scale, h0s[w], std::nullopt)
                          : ::gdn_chunk_fwd(qw, kw, vw, gw, bw, scale, h0s[w], std::nullopt);
    h0s[w + 1] = std::get<1>(f);
  }
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  at::Tensor dg = at::empty(g.sizes(), f32), dbeta = at::empty(beta.sizes(), f32);
  std::optional<at::Tensor> carry = dht;
  for (int64_t w = nw - 1; w >= 0; --w) {
    Shapes sw = s;
    sw.T = static_cast<int>(len_of(w));
    const int64_t t0 = t0_of(w);
    DeltaBwdResult r = chunk_bwd_core<PC>(op, sw, win(q, w), win(k, w), win(v, w), win(g, w), win(beta, w), scale,
                                          h0s[w], std::nullopt, win(grad_o, w), carry);
    h0s[w].reset();
    dq.narrow(1, t0, sw.T).copy_(std::get<0>(r));
    dk.narrow(1, t0, sw.T).copy_(std::get<1>(r));
    dv.narrow(1, t0, sw.T).copy_(std::get<2>(r));
    dg.narrow(1, t0, sw.T).copy_(std::get<3>(r));
    dbeta.narrow(1, t0, sw.T).copy_(std::get<4>(r));
    carry = std::get<5>(r);
  }
  return {dq, dk, dv, dg, dbeta, *carry};
}

template <bool PC>
DeltaBwdResult chunk_bwd_run(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, double scale,
                             const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                             const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state) {
  namespace cb = chunk_bwd;
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  c10::cuda::CUDAGuard guard(q.device());
  // the recurrent backward (exact) for K > 128, on request, and on devices without the shared memory of the
  // chunked kernels' largest block (grad, kGradSmem ~226 KB: sm_90-class)
  if (s.K > cb::KP || env_choice(op, "KDA_CUDA_CHUNK_BWD_RECURRENT", 0, {0, 1}) == 1 ||
      smem_optin() < static_cast<int>(cb::kGradSmem))
    return recurrent_bwd<PC>(op, q, k, v, g, beta, scale, initial_state, cu, grad_o, grad_final_state);
  TORCH_CHECK(grad_o.is_contiguous() && grad_o.scalar_type() == q.scalar_type() && grad_o.sizes() == v.sizes(), "[",
              op, "] grad_o must be contiguous, shaped like v, with q's dtype");
  std::optional<at::Tensor> dht;
  if (grad_final_state.has_value() && grad_final_state->defined()) dht = *grad_final_state;
  if (const int64_t tw = bwd_window_tokens(s, cu.has_value()); tw > 0)
    return chunk_bwd_windows<PC>(op, s, tw, q, k, v, g, beta, scale, initial_state, grad_o, dht);
  return chunk_bwd_core<PC>(op, s, q, k, v, g, beta, scale, initial_state, cu, grad_o, dht);
}

// The backward in stages for context parallelism's relay (docs/context_parallel.md), same kernels and results as
// chunk_bwd_run: stage 0 prep (returns the work list), 1 state_fwd (reads initial_state; returns []), 2 state_bwd
// (reads grad_final_state; returns [dh0]), 3 grad (returns [dq, dk, dv, dg, dbeta]). Order: 0, then 1 and 2 in
// either order, then 3; every stage gets the same inputs. K and V <= 128.
template <bool PC>
std::vector<at::Tensor> chunk_bwd_stage(const char* op, at::TensorList work_in, int64_t stage, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                        const at::Tensor& beta, double scale,
                                        const std::optional<at::Tensor>& initial_state,
                                        const std::optional<at::Tensor>& cu, const at::Tensor& grad_o,
                                        const std::optional<at::Tensor>& grad_final_state) {
  namespace cb = chunk_bwd;
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  TORCH_CHECK(s.K <= cb::KP && s.V <= cb::VP, "[", op, "] the staged backward needs K <= ", cb::KP, " and V <= ",
              cb::VP, ", got K=", s.K, " V=", s.V);
  TORCH_CHECK(s.T > 0, "[", op, "] the staged backward needs at least one token");
  TORCH_CHECK(stage >= 0 && stage <= 3, "[", op, "] stage must be 0 (prep), 1 (state_fwd), 2 (state_bwd) or 3 (grad), got ",
              stage);
  TORCH_CHECK((stage == 0) == work_in.empty(), "[", op,
              "] stage 0 takes an empty work list, the later stages the one stage 0 returned");
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(smem_optin() >= static_cast<int>(cb::kGradSmem), "[", op, "] the staged backward needs ", cb::kGradSmem,
              " bytes of shared memory per block; this device offers ", smem_optin(),
              " (sm_90-class GPUs have enough; elsewhere use the one-call op, which runs the recurrent backward)");
  TORCH_CHECK(grad_o.is_contiguous() && grad_o.scalar_type() == q.scalar_type() && grad_o.sizes() == v.sizes(), "[",
              op, "] grad_o must be contiguous, shaped like v, with q's dtype");
  std::vector<at::Tensor> work(work_in.begin(), work_in.end());
  cb::Params p = chunk_bwd_params(op, s, q, k, v, g, beta, scale, initial_state, cu, grad_o, work);
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  switch (stage) {
    case 0:
      chunk_bwd_prep_stage<PC>(s, p, work, st);
      return work;
    case 1:
      chunk_bwd_state_fwd_stage<PC>(s, p, work, st);
      return {};
    case 2: {
      at::Tensor dht;  // holds a converted copy of grad_final_state alive
      p.dht = grad_state_data(grad_final_state, dht);
      at::Tensor dh0 = bwd_alloc_dh0(s, q, p);
      chunk_bwd_state_bwd_stage<PC>(s, p, work, st);
      return {dh0};
    }
    default: {
      ChunkBwdF32 r = bwd_alloc_grads(s, q, v, cu.has_value(), bwd_dg_per_head<PC>(work), p);
      chunk_bwd_grad_stage<PC>(s, p, work, st);
      r.dh0 = at::empty({0}, q.options().dtype(at::kFloat));
      auto [dq, dk, dv, dg, dbeta, unused] = chunk_bwd_finish<PC>(s, q, k, r);
      return {dq, dk, dv, dg, dbeta};
    }
  }
}

}  // namespace cuda
}  // namespace kda_kernels
