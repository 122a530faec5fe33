// Launchers of the recurrent forward kernel (any number of tokens) and of the decode kernel (about one token per
// sequence), for one (gate kind, state layout, state dtype). launch_fwd is explicitly instantiated per state dtype
// in delta_fwd_launch_{f32,bf16,f16}.cu, launch_dec in delta_fwd_launch_dec_{f32,bf16,f16}.cu (separate files so
// that they compile in parallel).
#pragma once

#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

template <bool PC, bool VF, int CW, int KMAX, typename S>
void launch_fwd_one(const FwdParams& p, cudaStream_t st) {
  const int64_t warps = static_cast<int64_t>(p.N) * p.HV * p.slices;
  if (warps == 0) return;
  const int64_t blocks = (warps + kFwdWarps - 1) / kFwdWarps;
  delta_recurrent_fwd_kernel<PC, VF, CW, KMAX, S><<<static_cast<unsigned>(blocks), 32 * kFwdWarps, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// HINT: compile-time memory hints (kDecHintRuntime: FwdParams::dec_flags at run time); FUSE, LEAN: see
// delta_decode_kernel
template <bool PC, bool VF, typename S, int CFG, int FIX, int STAGE,
          int HINT = dec_default_hint(static_cast<int>(sizeof(S))), bool FUSE = false, bool LEAN = false,
          int MINB = 0>
void launch_dec_one(FwdParams p, cudaStream_t st) {
  constexpr int CW = dec_cw(VF, static_cast<int>(sizeof(S)), CFG);
  constexpr int WK = dec_wk(VF, static_cast<int>(sizeof(S)), CFG);
  using G = DecGeo<VF, S, CW, WK, 128>;
  p.slices = (p.V + CW - 1) / CW;
  const int64_t items = static_cast<int64_t>(p.N) * p.HV * p.slices;
  if (items == 0) return;
  constexpr int per_block = G::WI * (STAGE == 2 ? 2 : 1);
  const int64_t blocks = (items + per_block - 1) / per_block;
  delta_decode_kernel<PC, VF, S, CW, WK, FIX, STAGE, HINT, FUSE, LEAN, MINB>
      <<<static_cast<unsigned>(blocks), 32 * G::NW, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Declared everywhere; launch_dec and launch_dec_generic are defined where KDA_DEFINE_LAUNCH_DEC is set
// (delta_fwd_launch_dec_*.cu), launch_dec_fixed where KDA_DEFINE_LAUNCH_DEC_FIXED is set
// (delta_fwd_launch_dec128_*.cu: the K = V = 128 kernels, the hot path of real models).
template <bool PC, bool VF, typename S>
bool launch_dec(FwdParams& p, int kmax, cudaStream_t st);
template <bool PC, bool VF, typename S>
void launch_dec_generic(const FwdParams& p, int cfg, cudaStream_t st);
template <bool PC, bool VF, typename S>
void launch_dec_fixed(const FwdParams& p, int cfg, int stage, int var, cudaStream_t st);

#ifdef KDA_DEFINE_LAUNCH_DEC_FIXED
// var (DecChoice::var): kDecVarDefault: the default hints of the state dtype, compiled in; at stage 1 only (the
// default stage), kDecVarRuntimeHint: hints read from FwdParams::dec_flags (session 7's flag tests), kDecVarFuse: FUSE
// (cfg 1-3), kDecVarLean: LEAN (any cfg; the default hints), kDecVarLeanOcc: LEAN with dec_lean_minb blocks per SM
// (fp32 10, K-first 2-byte 9; V-first 2-byte states run kDecVarLean's kernels).
template <bool PC, bool VF, typename S>
void launch_dec_fixed(const FwdParams& p, int cfg, int stage, int var, cudaStream_t st) {
  constexpr int DH = dec_default_hint(static_cast<int>(sizeof(S)));
  constexpr int MB = dec_lean_minb(VF, static_cast<int>(sizeof(S)));
  if constexpr (MB != 0) {
    if (stage == 1 && var == kDecVarLeanOcc) {
      switch (cfg) {
        case 0: return launch_dec_one<PC, VF, S, 0, 128, 1, DH, false, true, MB>(p, st);
        case 1: return launch_dec_one<PC, VF, S, 1, 128, 1, DH, false, true, MB>(p, st);
        case 2: return launch_dec_one<PC, VF, S, 2, 128, 1, DH, false, true, MB>(p, st);
        default: return launch_dec_one<PC, VF, S, 3, 128, 1, DH, false, true, MB>(p, st);
      }
    }
  }
  if (stage == 1 && (var == kDecVarLean || var == kDecVarLeanOcc)) {
    switch (cfg) {
      case 0: return launch_dec_one<PC, VF, S, 0, 128, 1, DH, false, true>(p, st);
      case 1: return launch_dec_one<PC, VF, S, 1, 128, 1, DH, false, true>(p, st);
      case 2: return launch_dec_one<PC, VF, S, 2, 128, 1, DH, false, true>(p, st);
      default: return launch_dec_one<PC, VF, S, 3, 128, 1, DH, false, true>(p, st);
    }
  }
  if (stage == 1 && var == kDecVarRuntimeHint) {
    switch (cfg) {
      case 0: return launch_dec_one<PC, VF, S, 0, 128, 1, kDecHintRuntime>(p, st);
      case 1: return launch_dec_one<PC, VF, S, 1, 128, 1, kDecHintRuntime>(p, st);
      case 2: return launch_dec_one<PC, VF, S, 2, 128, 1, kDecHintRuntime>(p, st);
      default: return launch_dec_one<PC, VF, S, 3, 128, 1, kDecHintRuntime>(p, st);
    }
  }
  // FUSE only where several warps share an item (cfg 1-3): with one warp per item (cfg 0) ptxas spilled 150-300
  // bytes (K-first fp32 / bf16, compiled for sm_90a), so cfg 0 keeps the default kernel
  if (stage == 1 && var == kDecVarFuse && cfg != 0) {
    switch (cfg) {
      case 1: return launch_dec_one<PC, VF, S, 1, 128, 1, DH, true>(p, st);
      case 2: return launch_dec_one<PC, VF, S, 2, 128, 1, DH, true>(p, st);
      default: return launch_dec_one<PC, VF, S, 3, 128, 1, DH, true>(p, st);
    }
  }
  switch (cfg * 3 + stage) {
    case 0: return launch_dec_one<PC, VF, S, 0, 128, 0>(p, st);
    case 1: return launch_dec_one<PC, VF, S, 0, 128, 1>(p, st);
    case 2: return launch_dec_one<PC, VF, S, 0, 128, 2>(p, st);
    case 3: return launch_dec_one<PC, VF, S, 1, 128, 0>(p, st);
    case 4: return launch_dec_one<PC, VF, S, 1, 128, 1>(p, st);
    case 5: return launch_dec_one<PC, VF, S, 1, 128, 2>(p, st);
    case 6: return launch_dec_one<PC, VF, S, 2, 128, 0>(p, st);
    case 7: return launch_dec_one<PC, VF, S, 2, 128, 1>(p, st);
    case 8: return launch_dec_one<PC, VF, S, 2, 128, 2>(p, st);
    case 9: return launch_dec_one<PC, VF, S, 3, 128, 0>(p, st);
    case 10: return launch_dec_one<PC, VF, S, 3, 128, 1>(p, st);
    default: return launch_dec_one<PC, VF, S, 3, 128, 2>(p, st);
  }
}
#endif  // KDA_DEFINE_LAUNCH_DEC_FIXED

#ifdef KDA_DEFINE_LAUNCH_DEC
inline bool aligned16(const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; }

template <bool PC, bool VF, typename S>
void launch_dec_generic(const FwdParams& p, int cfg, cudaStream_t st) {
  switch (cfg) {
    case 0: return launch_dec_one<PC, VF, S, 0, 0, 0>(p, st);
    case 1: return launch_dec_one<PC, VF, S, 1, 0, 0>(p, st);
    case 2: return launch_dec_one<PC, VF, S, 2, 0, 0>(p, st);
    default: return launch_dec_one<PC, VF, S, 3, 0, 0>(p, st);
  }
}

// The decode kernel runs when K <= 128 and every sequence has exactly one token (T == 1, no cu_seqlens); returns
// false when the caller should run the general kernel. KDA_CUDA_DECODE=0 disables it.
template <bool PC, bool VF, typename S>
bool launch_dec(FwdParams& p, int kmax, cudaStream_t st) {
  if (kmax != 128 || p.T != 1 || p.cu_seqlens != nullptr || env_int("KDA_CUDA_DECODE", 1) == 0) return false;
  constexpr int E = 16 / static_cast<int>(sizeof(S));
  FwdParams d = p;
  const int inner = VF ? p.K : p.V;
  d.vec = inner % E == 0 && (p.s_in == nullptr || aligned16(p.s_in)) && aligned16(p.s_out);
  d.tvec = p.K % 8 == 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.g);
  d.vvec = p.V % 8 == 0 && aligned16(p.v);
  DecChoice c = choose_dec(p.N, p.HV, VF, static_cast<int>(sizeof(S)));
  // LEAN indexes items with 32-bit unsigned math (at most 128 / 4 = 32 slices per head)
  const bool lean = c.var == kDecVarLean || c.var == kDecVarLeanOcc;
  if (lean && static_cast<int64_t>(p.N) * p.HV * 32 >= (int64_t{1} << 31)) c.var = kDecVarDefault;
  d.dec_flags = c.flags;
  if (p.K == 128 && p.V == 128 && d.vec && d.tvec && d.vvec) {
    launch_dec_fixed<PC, VF, S>(d, c.cfg, c.stage, c.var, st);
  } else {
    launch_dec_generic<PC, VF, S>(d, c.cfg, st);
  }
  return true;
}
#endif  // KDA_DEFINE_LAUNCH_DEC

template <bool PC, bool VF, typename S>
void launch_fwd(FwdParams& p, int kmax, cudaStream_t st) {
  if (launch_dec<PC, VF, S>(p, kmax, st)) return;
  const int cw = choose_fwd_cw(p.N, p.HV, p.V, kmax, VF);
  p.slices = (p.V + cw - 1) / cw;
  if (kmax > 128) return launch_fwd_one<PC, VF, 4, 256, S>(p, st);
  if (cw == 16) return launch_fwd_one<PC, VF, 16, 128, S>(p, st);
  return launch_fwd_one<PC, VF, 4, 128, S>(p, st);
}

}  // namespace cuda
}  // namespace kda_kernels

#define KDA_INSTANTIATE_LAUNCH_FWD(S)                                                                      \
  namespace kda_kernels {                                                                                  \
  namespace cuda {                                                                                         \
  template void launch_fwd<true, false, S>(FwdParams&, int, cudaStream_t);                                \
  template void launch_fwd<true, true, S>(FwdParams&, int, cudaStream_t);                                 \
  template void launch_fwd<false, false, S>(FwdParams&, int, cudaStream_t);                               \
  template void launch_fwd<false, true, S>(FwdParams&, int, cudaStream_t);                                 \
  }                                                                                                        \
  }

#define KDA_INSTANTIATE_LAUNCH_DEC(S)                                                                      \
  namespace kda_kernels {                                                                                  \
  namespace cuda {                                                                                         \
  template bool launch_dec<true, false, S>(FwdParams&, int, cudaStream_t);                                \
  template bool launch_dec<true, true, S>(FwdParams&, int, cudaStream_t);                                 \
  template bool launch_dec<false, false, S>(FwdParams&, int, cudaStream_t);                               \
  template bool launch_dec<false, true, S>(FwdParams&, int, cudaStream_t);                                \
  }                                                                                                        \
  }

#define KDA_INSTANTIATE_LAUNCH_DEC_FIXED(VF, S)                                                            \
  namespace kda_kernels {                                                                                  \
  namespace cuda {                                                                                         \
  template void launch_dec_fixed<true, VF, S>(const FwdParams&, int, int, int, cudaStream_t);             \
  template void launch_dec_fixed<false, VF, S>(const FwdParams&, int, int, int, cudaStream_t);            \
  }                                                                                                        \
  }
