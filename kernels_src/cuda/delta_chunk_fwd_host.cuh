// Host side of the chunked forward (kernels: delta_chunk_fwd.cuh): checks, workspace, dispatch. Used by
// kda_chunk_fwd.cu and gdn_chunk_fwd.cu. K > 128 runs the recurrent kernel (same function, exact), as does
// KDA_CUDA_CHUNK_FWD=0. fp32 inputs use 3xTF32 tensor-core products (about fp32 accuracy) and an fp32 workspace,
// bf16/fp16 inputs tf32 and bf16 q~ / k~^T / A~ in the workspace (KDA_CUDA_CHUNK_WS_BF16=0: fp32).
// GDN with bf16/fp16 inputs runs its own prep kernel (gdn_chunk_prep2.cuh, the default since session 10; the
// shared pieces of the GDN preps are in gdn_chunk_prep.cuh), as does KDA (kda_chunk_prep2.cuh with the 8x8 split of
// the diagonal blocks, 0.57 ms).
// Retired in session 9 (refused): KDA_CUDA_KDA_PREP=1 (the v1 kernel kda_chunk_prep.cuh, 0.82 ms) and
// KDA_CUDA_KDA_PREP=0 / KDA_CUDA_GDN_PREP=0 (the generic prep for 16-bit inputs; docs/cuda.md, "Retired kernels");
// in session 10 KDA_CUDA_KDA_PREP=4 / 5 (KDA prep v3); in session 11 KDA_CUDA_GDN_PREP=1 (the GDN prep v1
// gdn_chunk_prep_kernel, 0.297 ms against v2's 0.227) and KDA_CUDA_KDA_PREP=2 (kda_chunk_prep2 without the 8x8
// split, 0.617 ms against 0.571). The remaining values (GDN 2, KDA 3) are the defaults; KDA 6 (session 13, opt-in)
// runs kda_chunk_prep2's FAST instance (the same outputs bit for bit, fewer instructions). Since session 12 any
// other value raises an error (env_choice, delta_host.cuh), as do unknown values of every knob of this file
// (KDA_CUDA_CHUNK_SCAN, _WS_BF16, _BV, _FWD). Both prep variables are read at every call.
// The scan (KDA_CUDA_CHUNK_SCAN, read at every call; accepted values: kChunkScanModes below, unset or 0 = 11):
// 11 (the default since session 12) delta_chunk_scan7_kernel<KP, true> (delta_chunk_scan7.cuh) where it applies
// (scan7_applies: bf16/fp16 inputs, bf16 workspace, V <= 256, sm_90+; session 12 candidate call, one H200: scan
// 0.240 ms against scan6's 0.301 at B1 T8192 H16 HV32, the same accuracy): scan6's structure on bf16 m16n8k16
// operands (w bf16 from the prep's WB instances, u0 fp32; h_c / U_c bf16 in shared memory, U as bf16 hi + lo; the
// state fp32 in registers); 10 (opt-in) the same with U plain bf16 (0.219 ms, o's worst error / tolerance 0.82
// against 0.64). Elsewhere -- fp32 inputs / workspaces, V > 256, pre-sm_90 -- and for 1 the single kernel
// delta_chunk_scan_kernel. Any other value raises an error naming the knob and the accepted values.
// Retired (refused, docs/cuda.md "Retired kernels"): 9 (scan6 with warp pairs, 0.427 ms) in session 11; in
// session 12 4 (the bulk-prefetch scan delta_chunk_scan3_kernel, 0.48 ms, the default until session 9; with it
// KDA_CUDA_SCAN3_BV, its column width, is no longer read), 5 / 6 (the split forward delta_chunk_scan4_kernel +
// delta_chunk_out_kernel, fp32 / bf16 h_c and U_c: 0.30 / 0.32 + 0.22 / 0.15 ms, session 8), 7 (the
// warp-specialized scan5 delta_chunk_scan5_kernel, 0.350 ms, the default in sessions 9 and 10), and 8
// (scan6, delta_chunk_scan6_kernel: scan5's products in its order on tf32 operands, 0.301 ms, the default from
// session 11 until scan7, 11, in session 12).
#pragma once

#include <vector>

#include "delta_chunk_fwd.cuh"
#include "delta_chunk_scan7.cuh"
#include "gdn_chunk_prep.cuh"
#include "gdn_chunk_prep2.cuh"
#include "gdn_chunk_prep3.cuh"
#include "kda_chunk_prep2.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

// KDA_CUDA_CHUNK_SCAN's accepted values (0: unset, runs 11; 1: the single kernel; 10 / 11: scan7, 11 the default;
// see the top of this file). A new scan: add its value here and its launch in run_chunk_scan.
constexpr int kChunkScanModes[] = {0, 1, 10, 11};

// (sequence, value head, 32 columns of V) blocks of a scan: both scan choices below compare it with the SM count.
inline int64_t scan_blocks32(int64_t N, int64_t HV, int64_t V) { return N * HV * ((V + 31) / 32); }

// fp32 inputs: the generic delta_chunk_prep_kernel with 3xTF32 products (its instance for bf16/fp16 inputs,
// PRECISE = false, KDA_CUDA_KDA_PREP=0 / KDA_CUDA_GDN_PREP=0, was retired in session 9: the families' own preps
// replace it for 16-bit inputs).
template <bool PC, int KP>
void launch_chunk_prep(const ChunkFwdParams& p, int max_chunks, cudaStream_t st) {
  constexpr size_t smem = PrepSmem<KP>::bytes;
  auto kern = delta_chunk_prep_kernel<PC, KP, true>;
  allow_dynamic_smem(kern, smem);
  kern<<<dim3(static_cast<unsigned>(max_chunks), static_cast<unsigned>(p.HV)), kPrepThreads, smem, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// GDN, bf16/fp16 inputs: gdn_chunk_prep2_kernel (gdn_chunk_prep2.cuh; the default since session 10: the workspace
// of delta_chunk_prep_kernel<false, KP, false>, 69 KB of shared memory and <= 80 registers for three blocks per SM;
// the largest carveout for them).
template <int KP, typename T16, bool WB>
void launch_gdn_prep2_t(const ChunkFwdParams& p, int max_chunks, cudaStream_t st) {
  constexpr size_t smem = GdnPrep2Smem<KP>::bytes;
  auto kern = gdn_chunk_prep2_kernel<KP, T16, WB>;
  allow_dynamic_smem(kern, smem, /*max_carveout=*/true);
  kern<<<dim3(static_cast<unsigned>(max_chunks), static_cast<unsigned>(p.HV)), kGdnThreads, smem, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// gdn_chunk_prep3_kernel (gdn_chunk_prep3.cuh; session 13): v2's values bit for bit with one block per pair of
// value heads of a GVA group (HV / H even; else one head per block).
template <int KP, typename T16, bool WB>
void launch_gdn_prep3_t(const ChunkFwdParams& p, int max_chunks, cudaStream_t st) {
  constexpr size_t smem = GdnPrep3Smem<KP>::bytes;
  auto kern = gdn_chunk_prep3_kernel<KP, T16, WB>;
  allow_dynamic_smem(kern, smem, /*max_carveout=*/true);
  const int nh = ((p.HV / p.H) % 2 == 0) ? 2 : 1;
  kern<<<dim3(static_cast<unsigned>(max_chunks), static_cast<unsigned>(p.HV / nh)), kGdnThreads, smem, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// WB: w as bf16 for scan7 (scan7_applies). Unset KDA_CUDA_GDN_PREP: v3 where HV / H is even (pairs of heads
// share S1's products: 0.210 vs 0.217 ms at B1 T8192 H16 HV32, 0.405 vs 0.431 at B4 T4096 H16 HV32 on the H200,
// session 13's candidate call), v2 elsewhere (at HV = H v3 is only overhead: 0.235 vs 0.220); 2 / 3 force one.
template <int KP>
void launch_gdn_prep(const ChunkFwdParams& p, int max_chunks, cudaStream_t st, bool wb) {
  const bool pairs = p.H > 0 && (p.HV / p.H) % 2 == 0;
  if (env_choice("gdn_chunk_fwd", "KDA_CUDA_GDN_PREP", pairs ? 3 : 2, {2, 3}) == 3) {
    if (wb) {
      if (p.in_dtype == kBF16) launch_gdn_prep3_t<KP, __nv_bfloat16, true>(p, max_chunks, st);
      else launch_gdn_prep3_t<KP, __half, true>(p, max_chunks, st);
    } else {
      if (p.in_dtype == kBF16) launch_gdn_prep3_t<KP, __nv_bfloat16, false>(p, max_chunks, st);
      else launch_gdn_prep3_t<KP, __half, false>(p, max_chunks, st);
    }
    return;
  }
  if (wb) {
    if (p.in_dtype == kBF16) launch_gdn_prep2_t<KP, __nv_bfloat16, true>(p, max_chunks, st);
    else launch_gdn_prep2_t<KP, __half, true>(p, max_chunks, st);
  } else {
    if (p.in_dtype == kBF16) launch_gdn_prep2_t<KP, __nv_bfloat16, false>(p, max_chunks, st);
    else launch_gdn_prep2_t<KP, __half, false>(p, max_chunks, st);
  }
}

// KDA, bf16/fp16 inputs: kda_chunk_prep2_kernel (same workspace as delta_chunk_prep_kernel<true, KP, false>; gate
// factors as products of e^{g_i} within a sub-chunk) with its 8x8 split of the diagonal blocks (the instance
// without, KDA_CUDA_KDA_PREP=2, was retired in session 11). FAST (KDA_CUDA_KDA_PREP=6, opt-in since session 13):
// its instance with the same outputs bit for bit from fewer instructions (kda_chunk_prep2.cuh).
template <int KP, typename T16, bool WB, bool FAST>
void launch_kda_prep2_t(const ChunkFwdParams& p, int max_chunks, cudaStream_t st) {
  constexpr size_t smem = KdaPrep2Smem<KP>::bytes;
  auto kern = kda_chunk_prep2_kernel<KP, T16, WB, FAST>;
  allow_dynamic_smem(kern, smem);
  kern<<<dim3(static_cast<unsigned>(max_chunks), static_cast<unsigned>(p.HV)), kGdnThreads, smem, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KP, bool FAST>
void launch_kda_prep_f(const ChunkFwdParams& p, int max_chunks, cudaStream_t st, bool wb) {
  if (wb) {
    if (p.in_dtype == kBF16) launch_kda_prep2_t<KP, __nv_bfloat16, true, FAST>(p, max_chunks, st);
    else launch_kda_prep2_t<KP, __half, true, FAST>(p, max_chunks, st);
  } else {
    if (p.in_dtype == kBF16) launch_kda_prep2_t<KP, __nv_bfloat16, false, FAST>(p, max_chunks, st);
    else launch_kda_prep2_t<KP, __half, false, FAST>(p, max_chunks, st);
  }
}

template <int KP>
void launch_kda_prep(const ChunkFwdParams& p, int max_chunks, cudaStream_t st, bool wb, bool fast) {
  if (fast) launch_kda_prep_f<KP, true>(p, max_chunks, st, wb);
  else launch_kda_prep_f<KP, false>(p, max_chunks, st, wb);
}

template <int KP, int BV, bool PRECISE>
void launch_chunk_scan(const ChunkFwdParams& p, cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(p.N), static_cast<unsigned>(p.HV), static_cast<unsigned>((p.V + BV - 1) / BV));
  if constexpr (PRECISE) {  // fp32 inputs: fp32 workspace only
    delta_chunk_scan_kernel<KP, BV, true, false><<<grid, kScanThreads, 0, st>>>(p);
  } else {
    if (p.ws_bf16) delta_chunk_scan_kernel<KP, BV, false, true><<<grid, kScanThreads, 0, st>>>(p);
    else delta_chunk_scan_kernel<KP, BV, false, false><<<grid, kScanThreads, 0, st>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// scan7 (KDA_CUDA_CHUNK_SCAN=10 / 11: UHL false / true, 11 the default): grid (sequence, head, ceil(V / 32)), 12
// warps, bf16 operands
// (delta_chunk_scan7.cuh), ~110 / 125 KB of dynamic shared memory at KP = 128. Runs where scan7_applies, which the
// prep reads too: there it writes w as bf16 (the prep kernels' WB instances) into the first half of its fp32
// workspace section.
template <int KP, bool UHL>
void launch_chunk_scan7(const ChunkFwdParams& p, cudaStream_t st) {
  using S = Scan7Smem<KP, UHL>;
  auto kern = delta_chunk_scan7_kernel<KP, UHL>;
  allow_dynamic_smem(kern, S::bytes);
  TORCH_CHECK(p.ws_stride % 4 == 0, "scan7: workspace slices must be 16-byte aligned");
  const dim3 grid(static_cast<unsigned>(p.N), static_cast<unsigned>(p.HV),
                  static_cast<unsigned>((p.V + S::BV - 1) / S::BV));
  kern<<<grid, kScan7Threads, S::bytes, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Where scan7 runs (p.scan == 10 / 11, KDA_CUDA_CHUNK_SCAN=10 / 11 or unset): bf16/fp16 inputs, bf16 workspace,
// V <= kScan7MaxV, sm_90+ (retired scan6's range). Elsewhere 10 / 11 run the single kernel and the prep writes the
// fp32 w it reads.
inline bool scan7_applies(const ChunkFwdParams& p) {
  return (p.scan == 10 || p.scan == 11) && p.in_dtype != kF32 && p.ws_bf16 && p.V <= kScan7MaxV && cc_major() >= 9;
}

// The state-independent half of the forward: the prep kernels fill the workspace (per chunk w, q~, k~^T, A~, u).
// kda_fast: KDA_CUDA_KDA_PREP=6 (KDA, bf16/fp16 inputs only).
template <bool PC, int KP, bool PRECISE>
void run_chunk_prep(const ChunkFwdParams& p, int max_chunks, cudaStream_t st, bool kda_fast) {
  if (max_chunks <= 0) return;
  if constexpr (!PC && !PRECISE) {  // GDN, bf16/fp16 inputs
    // gdn_chunk_prep2 (default since session 10: 0.227 vs v1's 0.297 ms at B1 T8192 H16 HV32; v1 retired)
    launch_gdn_prep<KP>(p, max_chunks, st, scan7_applies(p));
  } else if constexpr (PC && !PRECISE) {  // KDA, bf16/fp16 inputs
    launch_kda_prep<KP>(p, max_chunks, st, scan7_applies(p), kda_fast);
  } else {
    launch_chunk_prep<PC, KP>(p, max_chunks, st);
  }
}

// The state-dependent half: the scan from p.h0 over the chunks (o and the final state).
template <int KP, bool PRECISE>
void run_chunk_scan(const char* op, const ChunkFwdParams& p, cudaStream_t st) {
  // the single kernel's column width (checked at every call, also where scan7 runs): 0 by the SM count, 16, 32
  const int bv = env_choice(op, "KDA_CUDA_CHUNK_BV", 0, {0, 16, 32});
  if constexpr (!PRECISE) {
    if (scan7_applies(p)) {  // scan7 (KDA_CUDA_CHUNK_SCAN=11, the default, or 10)
      if (p.scan == 10) launch_chunk_scan7<KP, false>(p, st);
      else launch_chunk_scan7<KP, true>(p, st);
      return;
    }
  }
  // the single scan kernel (o inside the sequential loop); 16 columns per block when 32 would leave SMs idle
  const bool narrow = bv == 16 || (bv != 32 && scan_blocks32(p.N, p.HV, p.V) < 2LL * num_sms());
  if (narrow) launch_chunk_scan<KP, 16, PRECISE>(p, st);
  else launch_chunk_scan<KP, 32, PRECISE>(p, st);
}

// The two halves for the call's head-dim padding (KP) and input precision (fp32 inputs: 3xTF32, PRECISE).
template <bool PC>
void chunk_prep_dispatch(const ChunkFwdParams& p, int max_chunks, cudaStream_t st) {
  bool kda_fast = false;
  if constexpr (PC) {
    refuse_retired("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 1, "the v1 KDA prep kda_chunk_prep_kernel");
    refuse_retired("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 0, "the generic prep delta_chunk_prep_kernel for bf16/fp16");
    // (4 / 5: KDA prep v3, kda_chunk_prep3.cuh -- 0.570 / 0.585 ms against prep2's 0.569 in session 10's last
    // device call; removed)
    refuse_retired("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 4, "the KDA prep v3 kda_chunk_prep3_kernel", 10);
    refuse_retired("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 5, "the KDA prep v3 kda_chunk_prep3_kernel (unrolled)", 10);
    // (2: kda_chunk_prep2 without the 8x8 split, 0.617 ms in session 7 against 0.571 with it in session 8; removed)
    refuse_retired("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 2, "kda_chunk_prep2_kernel without the 8x8 split", 11);
    // kda_chunk_prep2 with the split (fp32 inputs: the generic prep for either value); 6, the default since session
    // 13: its FAST instance (the same outputs bit for bit from ~20 % fewer instructions, 0.468 vs 0.566 ms at B1
    // T8192 H16 HV32 K=V=128 on the H200, session 13's candidate call); 3 the former default
    kda_fast = env_choice("kda_chunk_fwd", "KDA_CUDA_KDA_PREP", 6, {3, 6}) == 6;
  } else {
    refuse_retired("gdn_chunk_fwd", "KDA_CUDA_GDN_PREP", 0, "the generic prep delta_chunk_prep_kernel for bf16/fp16");
    // (1: the GDN prep v1 gdn_chunk_prep_kernel, 0.297 ms against v2's 0.227 in session 10; kernel removed)
    refuse_retired("gdn_chunk_fwd", "KDA_CUDA_GDN_PREP", 1, "the GDN prep v1 gdn_chunk_prep_kernel", 11);
    // prep3 where HV / H is even, else prep2 (launch_gdn_prep); 2 / 3 force one (fp32 inputs: the generic prep)
    env_choice("gdn_chunk_fwd", "KDA_CUDA_GDN_PREP", p.H > 0 && (p.HV / p.H) % 2 == 0 ? 3 : 2, {2, 3});
  }
  const bool precise = p.in_dtype == kF32;
  if (p.K <= 64) {
    if (precise) run_chunk_prep<PC, 64, true>(p, max_chunks, st, kda_fast);
    else run_chunk_prep<PC, 64, false>(p, max_chunks, st, kda_fast);
  } else {
    if (precise) run_chunk_prep<PC, 128, true>(p, max_chunks, st, kda_fast);
    else run_chunk_prep<PC, 128, false>(p, max_chunks, st, kda_fast);
  }
}

inline void chunk_scan_dispatch(const char* op, const ChunkFwdParams& p, cudaStream_t st) {
  const bool precise = p.in_dtype == kF32;
  if (p.K <= 64) {
    if (precise) run_chunk_scan<64, true>(op, p, st);
    else run_chunk_scan<64, false>(op, p, st);
  } else {
    if (precise) run_chunk_scan<128, true>(op, p, st);
    else run_chunk_scan<128, false>(op, p, st);
  }
}

// Workspace of one forward call, shared by the one-call forward and its two stages (chunk_fwd_stage): ws (per
// chunk and head), map (varlen chunk table) and cfg, a CPU int64 [3] = (ws_bf16, scan choice, max_chunks) holding
// what stage 0 decided so that stage 1 cannot read the knobs differently. `work` empty: allocate (and build the
// varlen chunk table); else take the tensors from it.
enum FwdWork { kFwdWs = 0, kFwdMap, kFwdCfg, kFwdWorkSize };

inline ChunkFwdParams chunk_fwd_params(const char* op, const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                       double scale, const std::optional<at::Tensor>& cu,
                                       std::vector<at::Tensor>& work, int64_t& max_chunks, cudaStream_t st) {
  auto f32 = q.options().dtype(at::kFloat);
  ChunkFwdParams p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  p.g = g.data_ptr<float>(); p.beta = beta.data_ptr<float>();
  p.in_dtype = in_dtype_of(q, op);
  p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V; p.N = s.N;
  p.scale = static_cast<float>(scale);
  const int KP = s.K <= 64 ? 64 : 128;
  const bool fresh = work.empty();
  if (fresh) {
    // bf16 qg / kgT / aqk for bf16 and fp16 inputs (KDA_CUDA_CHUNK_WS_BF16=0: all fp32); fp32 inputs: all fp32
    const int ws_knob = env_choice(op, "KDA_CUDA_CHUNK_WS_BF16", 1, {0, 1});
    const int64_t ws_bf16 = (p.in_dtype != kF32 && ws_knob != 0) ? 1 : 0;
    // Unset (or 0): scan7 with U as bf16 hi + lo (11) where it applies, else the single kernel (see the top of this
    // file). Retired values are refused first (their own message), then anything not in kChunkScanModes.
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 9, "scan6 with warp pairs (delta_chunk_scan6_kernel<KP, true>)", 11);
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 4, "the bulk-prefetch scan delta_chunk_scan3_kernel", 12);
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 5, "the split forward delta_chunk_scan4_kernel + delta_chunk_out_kernel (fp32 h_c, U_c)", 12);
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 6, "the split forward delta_chunk_scan4_kernel + delta_chunk_out_kernel (bf16 h_c, U_c)", 12);
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 7, "the warp-specialized scan delta_chunk_scan5_kernel", 12);
    refuse_retired(op, "KDA_CUDA_CHUNK_SCAN", 8, "the tf32 warp-specialized scan delta_chunk_scan6_kernel (scan6)", 12);
    int64_t scan_mode = env_choice(op, "KDA_CUDA_CHUNK_SCAN", 0, kChunkScanModes);
    if (scan_mode == 0) scan_mode = 11;  // scan7 with U as bf16 hi + lo (session 12); elsewhere the single kernel
    const int64_t mc = cu.has_value() ? (static_cast<int64_t>(s.T) + kChunk - 1) / kChunk + s.N
                                      : static_cast<int64_t>(s.B) * ((s.T + kChunk - 1) / kChunk);
    TORCH_CHECK(mc < (1LL << 31), "[", op, "] too many chunks");
    at::Tensor cfg = at::empty({3}, at::TensorOptions().dtype(at::kLong));
    int64_t* c = cfg.data_ptr<int64_t>();
    c[0] = ws_bf16; c[1] = scan_mode; c[2] = mc;
    work.assign(kFwdWorkSize, at::Tensor());
    work[kFwdCfg] = cfg;
  }
  TORCH_CHECK(static_cast<int>(work.size()) == kFwdWorkSize && work[kFwdCfg].defined() &&
                  work[kFwdCfg].device().is_cpu() && work[kFwdCfg].numel() == 3,
              "[", op, "] work must be the list stage 0 returned");
  const int64_t* cfg = work[kFwdCfg].data_ptr<int64_t>();
  p.ws_bf16 = static_cast<int>(cfg[0]);
  const int scan_mode = static_cast<int>(cfg[1]);
  max_chunks = cfg[2];
  p.ws_stride = KP == 64 ? WsLayout<64>(p.ws_bf16 != 0).floats(s.V) : WsLayout<128>(p.ws_bf16 != 0).floats(s.V);
  p.scan = scan_mode;  // run_chunk_scan; see the top of this file
  if (fresh) {
    work[kFwdWs] = at::empty({std::max<int64_t>(max_chunks * s.HV * p.ws_stride, 1)}, f32);
    work[kFwdMap] = at::empty({cu.has_value() ? s.N + 1 + max_chunks : 1}, q.options().dtype(at::kInt));
  }
  const int64_t ws_need = std::max<int64_t>(max_chunks * s.HV * p.ws_stride, 1);
  TORCH_CHECK(work[kFwdWs].defined() && work[kFwdWs].is_cuda() && work[kFwdWs].numel() == ws_need &&
                  work[kFwdMap].defined(),
              "[", op, "] work does not match these inputs (pass the list stage 0 returned for the same inputs)");
  p.ws = work[kFwdWs].data_ptr<float>();
  if (cu.has_value()) {
    p.cu_seqlens = cu->data_ptr<int64_t>();
    p.chunk_off = work[kFwdMap].data_ptr<int>();
    p.chunk_seq = work[kFwdMap].data_ptr<int>() + s.N + 1;
    if (fresh) {
      delta_chunk_map_kernel<<<1, 1024, 0, st>>>(p.cu_seqlens, s.N, static_cast<int>(max_chunks),
                                                 work[kFwdMap].data_ptr<int>(), work[kFwdMap].data_ptr<int>() + s.N + 1);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    p.nc_per_seq = (s.T + kChunk - 1) / kChunk;
  }
  return p;
}

inline const float* chunk_fwd_h0(const char* op, const std::optional<at::Tensor>& initial_state, const at::Tensor& q,
                                 const at::Tensor& ht) {
  if (!initial_state.has_value()) return nullptr;
  TORCH_CHECK(initial_state->scalar_type() == at::kFloat && initial_state->is_contiguous() &&
                  initial_state->device() == q.device() && initial_state->numel() == ht.numel(),
              "[", op, "] initial_state must be a contiguous float32 [N, HV, K, V] tensor on q's device");
  return initial_state->data_ptr<float>();
}

// Shared memory of the chunked forward's prep for these inputs (the largest block it launches): fp32 inputs the
// generic 3xTF32 prep (~205 KB at K = 128: sm_90-class), bf16/fp16 the family's own prep (two blocks per SM). GDN:
// GdnPrepSmem (88 KB at K = 128, the backward's prep3_gdn; the retired forward v1's size) bounds v2's 69 KB and
// kept the device check as it was when v1 was retired (session 11).
template <bool PC>
size_t chunk_fwd_prep_smem(int K, bool precise) {
  if (precise) return K <= 64 ? PrepSmem<64>::bytes : PrepSmem<128>::bytes;
  if constexpr (PC) return K <= 64 ? KdaPrep2Smem<64>::bytes : KdaPrep2Smem<128>::bytes;
  else return K <= 64 ? GdnPrepSmem<64>::bytes : GdnPrepSmem<128>::bytes;
}

template <bool PC>
DeltaFwdResult chunk_fwd(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, double scale,
                         const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu) {
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  kmax_for(s.K, op);
  c10::cuda::CUDAGuard guard(q.device());
  // the recurrent kernel (exact) for K > 128, on request, and on devices without the prep's shared memory
  if (s.K > 128 || env_choice(op, "KDA_CUDA_CHUNK_FWD", 1, {0, 1}) == 0 ||
      smem_optin() < static_cast<int>(chunk_fwd_prep_smem<PC>(s.K, in_dtype_of(q, op) == kF32)))
    return recurrent_fwd<PC>(op, q, k, v, g, beta, scale, initial_state, cu);
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, q.options());
  at::Tensor ht = at::empty({s.N, s.HV, s.K, s.V}, q.options().dtype(at::kFloat));
  const float* h0 = chunk_fwd_h0(op, initial_state, q, ht);
  if (s.N == 0 || s.HV == 0 || s.V == 0) return {o, ht};
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<at::Tensor> work;
  int64_t max_chunks = 0;
  ChunkFwdParams p = chunk_fwd_params(op, s, q, k, v, g, beta, scale, cu, work, max_chunks, st);
  p.h0 = h0; p.ht = ht.data_ptr<float>(); p.o = o.data_ptr();
  const int mc = static_cast<int>(max_chunks);
  chunk_prep_dispatch<PC>(p, mc, st);
  chunk_scan_dispatch(op, p, st);
  return {o, ht};
}

// The forward in two stages for context parallelism's relay (docs/context_parallel.md): stage 0 runs the prep
// (no initial state needed) and returns the work tensors; stage 1 takes them back with initial_state and runs the
// scan, returning [o, final_state]. Same kernels and results as chunk_fwd. K and V <= 128 (the chunked kernels'
// single-block range; wider calls use chunk_fwd).
template <bool PC>
std::vector<at::Tensor> chunk_fwd_stage(const char* op, at::TensorList work_in, int64_t stage, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                        const at::Tensor& beta, double scale,
                                        const std::optional<at::Tensor>& initial_state,
                                        const std::optional<at::Tensor>& cu) {
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  TORCH_CHECK(s.K <= 128 && s.V <= 128, "[", op, "] the staged forward needs K <= 128 and V <= 128, got K=", s.K,
              " V=", s.V);
  TORCH_CHECK(s.T > 0 && s.N > 0 && s.HV > 0, "[", op, "] the staged forward needs at least one token");
  TORCH_CHECK(stage == 0 || stage == 1, "[", op, "] stage must be 0 (prep) or 1 (scan), got ", stage);
  TORCH_CHECK((stage == 0) == work_in.empty(), "[", op, "] stage 0 takes an empty work list, stage 1 the one stage 0 returned");
  c10::cuda::CUDAGuard guard(q.device());
  const size_t need = chunk_fwd_prep_smem<PC>(s.K, in_dtype_of(q, op) == kF32);
  TORCH_CHECK(smem_optin() >= static_cast<int>(need), "[", op, "] the staged forward needs ", need,
              " bytes of shared memory per block; this device offers ", smem_optin(),
              " (sm_90-class GPUs have enough; elsewhere use the one-call op, which runs the recurrent kernel)");
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<at::Tensor> work(work_in.begin(), work_in.end());
  int64_t max_chunks = 0;
  ChunkFwdParams p = chunk_fwd_params(op, s, q, k, v, g, beta, scale, cu, work, max_chunks, st);
  const int mc = static_cast<int>(max_chunks);
  if (stage == 0) {
    chunk_prep_dispatch<PC>(p, mc, st);
    return work;
  }
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, q.options());
  at::Tensor ht = at::empty({s.N, s.HV, s.K, s.V}, q.options().dtype(at::kFloat));
  p.h0 = chunk_fwd_h0(op, initial_state, q, ht);
  p.ht = ht.data_ptr<float>(); p.o = o.data_ptr();
  chunk_scan_dispatch(op, p, st);
  return {o, ht};
}

}  // namespace cuda
}  // namespace kda_kernels
