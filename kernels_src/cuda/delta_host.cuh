// Host side of the CUDA backend: checks, allocation and kernel dispatch shared by the KDA (per-channel gate)
// and GDN (per-head gate) entry points. Entry points are defined in {kda,gdn}_recurrent_{fwd,serve,bwd}.cu.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "delta_recurrent_bwd.cuh"
#include "delta_recurrent_fwd.cuh"  // FwdParams; kernels are instantiated in delta_fwd_launch_*.cu
#include "torch_binding.h"

namespace kda_kernels {
namespace cuda {

inline int in_dtype_of(const at::Tensor& x, const char* op) {
  switch (x.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "[", op, "] q, k, v must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
  return kF32;
}

inline int env_int(const char* name, int dflt) {
  const char* s = std::getenv(name);
  return (s && *s) ? std::atoi(s) : dflt;
}

// A knob's text as a whole decimal integer (leading blanks and a sign allowed, nothing after the digits).
inline bool env_text_int(const char* s, long& v) {
  char* end = nullptr;
  errno = 0;
  v = std::strtol(s, &end, 10);
  return end != s && *end == '\0' && errno == 0;
}

// A knob value whose kernel was retired (docs/cuda.md, "Retired kernels"): refused with a clear error rather than
// silently running another kernel. `what` names the retired kernel. The knob must be that whole number (since
// session 12; before, any text atoi read as it, e.g. "abc" as a retired 0).
inline void refuse_retired(const char* op, const char* knob, int value, const char* what, int session = 9) {
  const char* s = std::getenv(knob);
  long v = 0;
  TORCH_CHECK(!(s && *s && env_text_int(s, v) && v == value), "[", op, "] ", knob, "=", value, " selected ", what,
              ", retired in session ", session, " (docs/cuda.md, \"Retired kernels\"): unset ", knob,
              " or pick another value");
}

// A knob with a fixed set of accepted values: its value, or dflt when unset / empty. Anything else (a number not in
// `accepted`, or text that is not a whole number) raises a RuntimeError naming the knob, the value and the
// accepted values, rather than silently running another path. Retired values are refused first (refuse_retired).
inline int env_choice_n(const char* op, const char* knob, int dflt, const int* accepted, size_t n) {
  const char* s = std::getenv(knob);
  if (!(s && *s)) return dflt;
  long v = 0;
  const bool number = env_text_int(s, v);
  for (size_t i = 0; number && i < n; ++i)
    if (v == accepted[i]) return accepted[i];
  std::string list;
  for (size_t i = 0; i < n; ++i) list += (i ? ", " : "") + std::to_string(accepted[i]);
  TORCH_CHECK(false, "[", op, "] ", knob, "=", s, " is not an accepted value: ", knob, " takes ", list,
              " (unset: ", dflt, "; docs/cuda.md lists the knobs)");
  return dflt;
}
inline int env_choice(const char* op, const char* knob, int dflt, std::initializer_list<int> accepted) {
  return env_choice_n(op, knob, dflt, accepted.begin(), accepted.size());
}
template <size_t N>
inline int env_choice(const char* op, const char* knob, int dflt, const int (&accepted)[N]) {
  return env_choice_n(op, knob, dflt, accepted, N);
}

// Lets `kern` launch with `bytes` of dynamic shared memory on the current device. The attribute belongs to the
// device's context, so it is set once per (kernel, device), and again only when a later launch needs more (the
// recurrent backward's size depends on its block shape): a process that runs the ops on two GPUs gets it on both,
// and repeated launches pay a map lookup instead of a driver call.
template <typename Kernel>
inline void allow_dynamic_smem(Kernel* kern, size_t bytes, bool max_carveout = false) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  size_t& have = allowed[{reinterpret_cast<const void*>(kern), dev}];
  if (have >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  // max_carveout: several large blocks per SM need the largest shared-memory carveout, not the driver's choice
  if (max_carveout)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        static_cast<int>(cudaSharedmemCarveoutMaxShared)));
  have = bytes;
}

// Attribute A of the current device, queried once per device: a process may drive GPUs of different kinds (an
// sm_80 next to an sm_90 must not inherit the first one's answer). Every attribute used here is > 0, so 0 marks
// "not queried yet".
template <cudaDeviceAttr A>
inline int device_attr() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0, v = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < kMaxDevices && (v = cache[dev].load(std::memory_order_relaxed)) != 0) return v;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, A, dev));
  if (dev < kMaxDevices) cache[dev].store(v, std::memory_order_relaxed);
  return v;
}

inline int num_sms() { return device_attr<cudaDevAttrMultiProcessorCount>(); }
inline int cc_major() { return device_attr<cudaDevAttrComputeCapabilityMajor>(); }

inline int kmax_for(int K, const char* op) {
  TORCH_CHECK(K >= 1 && K <= 256, "[", op, "] the CUDA kernels support head dim K <= 256, got K=", K);
  return K <= 128 ? 128 : 256;
}

// initial_state's data, nullptr without one; the kernels read it as contiguous float32 [N, HV, K, V].
inline const float* initial_state_data(const char* op, const std::optional<at::Tensor>& initial_state) {
  if (!initial_state.has_value()) return nullptr;
  TORCH_CHECK(initial_state->scalar_type() == at::kFloat && initial_state->is_contiguous(), "[", op,
              "] initial_state must be contiguous float32");
  return initial_state->data_ptr<float>();
}

// grad_final_state as contiguous float32 (`keep` holds a converted copy alive), nullptr without one.
inline const float* grad_state_data(const std::optional<at::Tensor>& grad_final_state, at::Tensor& keep) {
  if (!grad_final_state.has_value() || !grad_final_state->defined()) return nullptr;
  keep = grad_final_state->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// Shared memory per block the current device lets a kernel opt into (H100/H200: 227 KB; A100: 163 KB; sm_86/89:
// 99 KB). The chunked kernels' largest blocks need an sm_90-class device; elsewhere the hosts route to the
// recurrent kernels (exact, slower) or refuse the staged ops with this number in the message.
inline int smem_optin() { return device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(); }

struct Shapes {
  int B, T, H, K, HV, V, N;
};

inline Shapes check_core(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, const std::optional<at::Tensor>& cu,
                         bool per_channel) {
  TORCH_CHECK(q.is_cuda(), "[", op, "] expects CUDA tensors");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4, "[", op, "] bad q/k/v shapes");
  Shapes s{};
  s.B = q.size(0); s.T = q.size(1); s.H = q.size(2); s.K = q.size(3); s.HV = v.size(2); s.V = v.size(3);
  TORCH_CHECK(s.H > 0 && s.HV % s.H == 0, "[", op, "] HV must be a multiple of H");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "[", op,
              "] q, k, v must share one dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, "[", op,
              "] g and beta must be float32");
  TORCH_CHECK(per_channel ? g.dim() == 4 : g.dim() == 3, "[", op, "] bad g shape");
  for (const at::Tensor* x : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(x->is_contiguous() && x->device() == q.device(), "[", op,
                "] inputs must be contiguous and on one device");
  if (cu.has_value()) {
    TORCH_CHECK(cu->scalar_type() == at::kLong && cu->is_contiguous() && cu->device() == q.device(), "[", op,
                "] cu_seqlens must be a contiguous int64 tensor on q's device");
    TORCH_CHECK(s.B == 1, "[", op, "] cu_seqlens needs B == 1");
    s.N = cu->numel() - 1;
  } else {
    s.N = s.B;
  }
  return s;
}

// ------------------------------------------------------------------------------------------------ forward
// Columns per warp. K-first states always use 16 (4 lanes x 16 B cover 64 contiguous bytes of a row; with 4
// columns a lane would read 16 B of its own row, half a 32 B sector, which measured 1.2x-2x slower on an H200).
// V-first states use 4 (8 lanes x 16 B = 128 contiguous bytes of a column) when few (sequence, head) pairs would
// leave SMs idle, else 16. K > 128 always uses 4 (register budget). KDA_CUDA_FWD_CW=4|16 overrides.
inline int choose_fwd_cw(int N, int HV, int V, int kmax, bool v_first) {
  if (kmax > 128) return 4;
  const int cw = env_int("KDA_CUDA_FWD_CW", 0);
  if (cw == 4 || cw == 16) return cw;
  if (!v_first) return 16;
  const int64_t heads = static_cast<int64_t>(N) * HV;
  return heads * ((V + 15) / 16) >= 8LL * num_sms() ? 16 : 4;
}

// Decode kernel configuration (dec_cw / dec_wk in delta_recurrent_fwd.cuh): KDA_CUDA_DEC_CFG=0..3 and
// KDA_CUDA_DEC_STAGE=0|1|2 override. The defaults are the fastest variants of the sweep on the H200
// (benchmarks/results/cuda_decode_session2.json, H=16 HV=32 K=V=128, B in {1, 64, 256}, CUDA graphs): shared-memory
// staging (1) everywhere; K-first fp32 (32 columns, 4 warps), K-first bf16/fp16 (32 columns, 2 warps), V-first
// fp32 (8 columns, 1 warp), V-first bf16/fp16 (16 columns, 1 warp; 2 warps when few (sequence, head) pairs).
// Memory hints (dec_default_hint, compiled into the kernels): streaming stores for 2-byte states (bf16/fp16 pools,
// KDA at B=256 on the H200: 2.7 % faster K-first, 1.0 % V-first; benchmarks/results/cuda_decode_session7.json, rows
// s1_h*), none for fp32 states (2 % slower there). KDA_CUDA_DEC_HINT (a sum of kDecEvictFirstLoad (1),
// kDecStreamStore (2), kDecPrefetch256 (8)) runs the stage-1 K = V = 128 kernels that read the hints at run time
// (FwdParams::dec_flags: session 7's flag tests per state access); other stages and shapes keep the
// compiled-in default. KDA_CUDA_DEC_FUSE=1: the stage-1 K = V = 128 kernels with FUSE (o from pass 1, see
// delta_decode_kernel; the default hints; KDA_CUDA_DEC_HINT is then ignored) for configurations 1-3 (several warps
// per item: the K-first defaults; the one-warp cfg 0, the V-first default at large batches, keeps the default
// kernel: FUSE spilled there). KDA_CUDA_DEC_LEAN=1 (session 10; the default when KDA_CUDA_DEC_LEAN, _FUSE and _HINT
// are unset, and set explicitly it overrides the other two): the stage-1 K = V = 128 kernels with LEAN (fewer
// instructions per item: 32-bit item indices, KDA gate exps once per row before the state arrives, reduce-scatter of
// o; see delta_decode_kernel), every cfg;
// KDA_CUDA_DEC_LEAN=2: the same with more blocks per SM (dec_lean_minb: fp32 states 10, K-first 2-byte states 9;
// V-first 2-byte states as =1).
constexpr int kDecVarDefault = 0, kDecVarRuntimeHint = 1, kDecVarFuse = 2, kDecVarLean = 3, kDecVarLeanOcc = 4;
struct DecChoice {
  int cfg;    // 0..3, see dec_cw / dec_wk
  int stage;  // 0 registers, 1 shared memory via cp.async, 2 the same with 2 items per warp (K = V = 128 only)
  int flags;  // FwdParams::dec_flags (read by the kernel only with var == kDecVarRuntimeHint)
  int var;    // kDecVar*: which stage-1 K = V = 128 kernel (launch_dec_fixed)
};

inline DecChoice choose_dec(int N, int HV, bool v_first, int esize) {
  DecChoice c{};
  const int cfg = env_int("KDA_CUDA_DEC_CFG", -1);
  if (cfg >= 0 && cfg < kDecCfgs) {
    c.cfg = cfg;
  } else if (!v_first) {
    c.cfg = esize == 4 ? 2 : 1;
  } else {
    c.cfg = esize == 4 ? 0 : (static_cast<int64_t>(N) * HV < 2LL * num_sms() ? 1 : 0);
  }
  const int stage = env_int("KDA_CUDA_DEC_STAGE", -1);
  c.stage = stage >= 0 && stage <= 2 ? stage : 1;
  const int hint = env_int("KDA_CUDA_DEC_HINT", -1);
  c.flags = hint >= 0 ? hint & (kDecEvictFirstLoad | kDecStreamStore | kDecPrefetch256) : dec_default_hint(esize);
  // LEAN=1 is the default since session 10 (fewer instructions per item; 0.5-6 % faster at B=256 / 64 for every pool
  // kind in the candidate call, cuda_decode_session10_candidates.json); an explicit FUSE=1 or HINT still selects its
  // kernels when LEAN is unset, and LEAN=0 the session-8 kernels.
  const int lean = env_int("KDA_CUDA_DEC_LEAN", -1);
  c.var = lean == 1                              ? kDecVarLean
          : lean == 2                            ? kDecVarLeanOcc
          : env_int("KDA_CUDA_DEC_FUSE", 0) == 1 ? kDecVarFuse
          : hint >= 0                            ? kDecVarRuntimeHint
          : lean == 0                            ? kDecVarDefault
                                                 : kDecVarLean;
  return c;
}

// Defined in delta_fwd_launch.cuh and explicitly instantiated in delta_fwd_launch_{f32,bf16,f16}.cu (one file
// per state dtype, so the kernels compile in parallel).
template <bool PC, bool VF, typename S>
void launch_fwd(FwdParams& p, int kmax, cudaStream_t st);

inline FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                 const at::Tensor& beta, double scale, const std::optional<at::Tensor>& cu,
                                 const Shapes& s, at::Tensor& o, const char* op) {
  FwdParams p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  p.g = g.data_ptr<float>(); p.beta = beta.data_ptr<float>(); p.o = o.data_ptr();
  p.in_dtype = in_dtype_of(q, op);
  p.cu_seqlens = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V; p.N = s.N;
  p.scale = static_cast<float>(scale);
  return p;
}

template <bool PC>
DeltaFwdResult recurrent_fwd(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, double scale,
                             const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu) {
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  const int kmax = kmax_for(s.K, op);
  c10::cuda::CUDAGuard guard(q.device());
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, q.options());
  at::Tensor final_state = at::empty({s.N, s.HV, s.K, s.V}, q.options().dtype(at::kFloat));
  FwdParams p = make_fwd_params(q, k, v, g, beta, scale, cu, s, o, op);
  p.s_in = initial_state_data(op, initial_state);
  p.s_out = final_state.data_ptr();
  p.serve = false;
  p.vec = (s.V % 4 == 0) && reinterpret_cast<uintptr_t>(p.s_out) % 16 == 0 &&
          (p.s_in == nullptr || reinterpret_cast<uintptr_t>(p.s_in) % 16 == 0);
  launch_fwd<PC, false, float>(p, kmax, c10::cuda::getCurrentCUDAStream().stream());
  return {o, final_state};
}

template <bool PC>
at::Tensor recurrent_serve(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta, double scale, at::Tensor& pool,
                           const at::Tensor& idx, const std::optional<at::Tensor>& num_accepted,
                           const std::optional<at::Tensor>& cu, bool state_v_first) {
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  const int kmax = kmax_for(s.K, op);
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(pool.is_contiguous() && pool.device() == q.device() && pool.dim() == 4, "[", op,
              "] state_pool must be a contiguous 4-D tensor on q's device");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.is_contiguous() && (idx.dim() == 1 || idx.dim() == 2) &&
                  idx.size(0) == s.N, "[", op, "] ssm_state_indices must be contiguous int64 [N] or [N, T]");
  at::Tensor o = at::empty({s.B, s.T, s.HV, s.V}, q.options());
  FwdParams p = make_fwd_params(q, k, v, g, beta, scale, cu, s, o, op);
  p.s_in = pool.data_ptr();
  p.s_out = pool.data_ptr();
  p.serve = true;
  p.idx = idx.data_ptr<int64_t>();
  p.idx_cols = idx.dim() == 2 ? static_cast<int>(idx.size(1)) : 0;
  if (num_accepted.has_value()) {
    TORCH_CHECK(num_accepted->scalar_type() == at::kLong && num_accepted->is_contiguous(), "[", op,
                "] num_accepted_tokens must be contiguous int64");
    p.num_accepted = num_accepted->data_ptr<int64_t>();
  }
  const int inner = state_v_first ? s.K : s.V;
  const size_t esize = pool.element_size();
  p.vec = (inner % 4 == 0) && (reinterpret_cast<uintptr_t>(pool.data_ptr()) % (4 * esize) == 0);
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  const auto dt = pool.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "[", op,
              "] state_pool must be float32, bfloat16 or float16");
  if (state_v_first) {
    if (dt == at::kFloat) launch_fwd<PC, true, float>(p, kmax, st);
    else if (dt == at::kBFloat16) launch_fwd<PC, true, __nv_bfloat16>(p, kmax, st);
    else launch_fwd<PC, true, __half>(p, kmax, st);
  } else {
    if (dt == at::kFloat) launch_fwd<PC, false, float>(p, kmax, st);
    else if (dt == at::kBFloat16) launch_fwd<PC, false, __nv_bfloat16>(p, kmax, st);
    else launch_fwd<PC, false, __half>(p, kmax, st);
  }
  return o;
}

// ------------------------------------------------------------------------------------------------ backward
template <bool PC, int CW, int KMAX>
void launch_bwd_one(BwdParams& p, int warps_per_block, cudaStream_t st) {
  constexpr int NK = KMAX / 32;
  const size_t smem = static_cast<size_t>(warps_per_block) * NK * CW * 32 * sizeof(float) +
                      static_cast<size_t>(warps_per_block) * kBwdSegment * (3 * KMAX + 1) * sizeof(float);
  auto kern = delta_recurrent_bwd_kernel<PC, CW, KMAX>;
  allow_dynamic_smem(kern, smem);
  const int64_t blocks = static_cast<int64_t>(p.N) * p.HV * p.split;
  if (blocks == 0) return;
  kern<<<static_cast<unsigned>(blocks), 32 * warps_per_block, smem, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline at::Tensor sum_gva(const at::Tensor& x, int B, int T, int H, int HV, int K) {
  // [B*T, HV, K] fp32 -> [B, T, H, K] fp32, summing the value heads that share a q/k head
  auto y = x.view({B, T, HV, K});
  if (HV == H) return y;
  return y.view({B, T, H, HV / H, K}).sum(3);
}

template <bool PC>
DeltaBwdResult recurrent_bwd(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, double scale,
                             const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                             const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state) {
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  const int kmax = kmax_for(s.K, op);
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(grad_o.is_contiguous() && grad_o.scalar_type() == q.scalar_type(), "[", op,
              "] grad_o must be contiguous with q's dtype");
  const int cw = (kmax == 128 && env_int("KDA_CUDA_BWD_CW", 16) == 16) ? 16 : 8;
  int wpb = env_int("KDA_CUDA_BWD_WARPS", 0);
  const int slices_needed = (s.V + cw - 1) / cw;
  const int sms = num_sms();
  if (wpb != 1 && wpb != 2 && wpb != 4) {
    wpb = 4;
    // fewer warps per block (more blocks per head) when there are few (sequence, head) pairs
    while (wpb > 1 && static_cast<int64_t>(s.N) * s.HV * ((slices_needed + wpb - 1) / wpb) < 2LL * sms) wpb /= 2;
  }
  wpb = std::min(wpb, std::max(1, slices_needed));
  const int split = (slices_needed + wpb - 1) / wpb;
  const int64_t tokens = static_cast<int64_t>(s.B) * s.T;
  auto f32 = q.options().dtype(at::kFloat);
  const bool atomic = split > 1;
  auto make_acc = [&](std::initializer_list<int64_t> shape) {
    return atomic ? at::zeros(shape, f32) : at::empty(shape, f32);
  };
  at::Tensor dq = make_acc({tokens, s.HV, s.K});
  at::Tensor dk = make_acc({tokens, s.HV, s.K});
  at::Tensor dg = make_acc({tokens, s.HV, s.K});
  at::Tensor dbeta = make_acc({s.B, s.T, s.HV});
  at::Tensor dv = at::empty_like(v);
  at::Tensor dh0 = at::empty({s.N, s.HV, s.K, s.V}, f32);
  const int64_t tiles = (tokens / kBwdSegment + s.N) * s.HV * static_cast<int64_t>(split * wpb);
  at::Tensor ckpt = at::empty({std::max<int64_t>(tiles, 1) * 32 * (kmax / 32) * cw}, f32);
  at::Tensor u = at::empty({std::max<int64_t>(tokens * s.HV * s.V, 1)}, f32);

  BwdParams p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr();
  p.g = g.data_ptr<float>(); p.beta = beta.data_ptr<float>(); p.grad_o = grad_o.data_ptr();
  p.h0 = initial_state_data(op, initial_state);
  at::Tensor dht;  // holds a converted copy of grad_final_state alive
  p.dht = grad_state_data(grad_final_state, dht);
  p.in_dtype = in_dtype_of(q, op);
  p.cu_seqlens = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V; p.N = s.N;
  p.scale = static_cast<float>(scale);
  p.split = split;
  p.slices = split * wpb;
  p.ckpt = ckpt.data_ptr<float>();
  p.u = u.data_ptr<float>();
  p.dq = dq.data_ptr<float>(); p.dk = dk.data_ptr<float>(); p.dg = dg.data_ptr<float>();
  p.dbeta = dbeta.data_ptr<float>();
  p.dv = dv.data_ptr();
  p.dh0 = dh0.data_ptr<float>();
  auto st = c10::cuda::getCurrentCUDAStream().stream();
  if (kmax == 128) {
    if (cw == 16) launch_bwd_one<PC, 16, 128>(p, wpb, st);
    else launch_bwd_one<PC, 8, 128>(p, wpb, st);
  } else {
    launch_bwd_one<PC, 8, 256>(p, wpb, st);
  }
  at::Tensor dq_out = sum_gva(dq, s.B, s.T, s.H, s.HV, s.K).to(q.scalar_type()).contiguous();
  at::Tensor dk_out = sum_gva(dk, s.B, s.T, s.H, s.HV, s.K).to(k.scalar_type()).contiguous();
  at::Tensor dg_out = PC ? dg.view({s.B, s.T, s.HV, s.K}) : dg.view({s.B, s.T, s.HV, s.K}).sum(-1);
  return {dq_out, dk_out, dv, dg_out.contiguous(), dbeta, dh0};
}

}  // namespace cuda
}  // namespace kda_kernels
