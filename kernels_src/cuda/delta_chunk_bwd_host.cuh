// Host side of the chunked backward (kda_chunk_bwd, gdn_chunk_bwd): checks, work buffers, the five launches of
// delta_chunk_bwd.cuh. K > 128 runs the recurrent backward (same function, exact). V > 128 runs the chunked
// backward on column blocks of <= 128: every column of the state evolves with its own column of v, so dv and
// dh0 are per block and dq, dk, dg, dbeta are sums over blocks (summed in fp32 before the cast). This keeps a
// wide call -- the context-parallel transition at value width K + V -- on the chunked kernels.
#pragma once

#include <vector>

#include "delta_chunk_bwd.cuh"
#include "delta_chunk_bwd_prep.cuh"
#include "delta_host.cuh"

namespace kda_kernels {
namespace cuda {

// One call of the five kernels for V <= 128. dq, dk, dg are per value head and fp32 (before the GVA sum).
struct ChunkBwdF32 {
  at::Tensor dq, dk, dg, dbeta, dv, dh0;
};

template <bool PC>
ChunkBwdF32 chunk_bwd_block(const char* op, const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double scale,
                            const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                            const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state) {
  namespace cb = chunk_bwd;
  const int64_t tokens = static_cast<int64_t>(s.B) * s.T;
  // chunks: sum over sequences of ceil(len / 64) <= tokens / 64 + N
  const int64_t nc_max = cu.has_value() ? tokens / cb::CH + s.N : static_cast<int64_t>(s.B) * ((s.T + cb::CH - 1) / cb::CH);
  auto f32 = q.options().dtype(at::kFloat);
  const bool varlen = cu.has_value();
  auto out_buf = [&](std::initializer_list<int64_t> shape) {
    return varlen ? at::zeros(shape, f32) : at::empty(shape, f32);  // varlen: tokens outside every sequence stay 0
  };
  at::Tensor dq = out_buf({tokens, s.HV, s.K});
  at::Tensor dk = out_buf({tokens, s.HV, s.K});
  at::Tensor dg = out_buf({tokens, s.HV, s.K});
  at::Tensor dbeta = out_buf({s.B, s.T, s.HV});
  at::Tensor dv = varlen ? at::zeros_like(v) : at::empty_like(v);
  at::Tensor dh0 = at::empty({s.N, s.HV, s.K, s.V}, f32);
  const int64_t nc1 = std::max<int64_t>(nc_max, 1);
  at::Tensor aqk = at::empty({nc1 * s.HV * cb::CH * cb::CH}, f32);
  at::Tensor akk = at::empty({nc1 * s.HV * cb::CH * cb::CH}, f32);
  // state kernels: v2 (default) or v1 (KDA_CUDA_CHUNK_BWD_STATE=1: the kernels that rescan the decays per chunk
  // step; kept to compare). v2 stores w per chunk padded (wc, read by grad too) plus K Eend, Q Gam, Gam_last.
  const bool v2 = env_int("KDA_CUDA_CHUNK_BWD_STATE", 2) != 1;
  const int64_t ctile = nc1 * s.HV * cb::CH * cb::KP;
  at::Tensor w = at::empty({v2 ? 1 : std::max<int64_t>(tokens * s.HV * s.K, 1)}, f32);
  at::Tensor wc, kendc, qgc, glc;
  if (v2) {
    wc = at::empty({ctile}, f32);
    kendc = at::empty({ctile}, f32);
    qgc = at::empty({ctile}, f32);
    glc = at::empty({nc1 * s.HV * cb::KP}, f32);
  }
  at::Tensor u = at::empty({std::max<int64_t>(tokens * s.HV * s.V, 1)}, f32);
  at::Tensor U = at::empty({std::max<int64_t>(tokens * s.HV * s.V, 1)}, f32);
  at::Tensor dU = at::empty({std::max<int64_t>(tokens * s.HV * s.V, 1)}, f32);
  at::Tensor hs = at::empty({nc1 * s.HV * s.K * s.V}, f32);
  at::Tensor dhs = at::empty({nc1 * s.HV * s.K * s.V}, f32);
  at::Tensor off = at::empty({s.N + 1}, q.options().dtype(at::kInt));

  cb::Params p{};
  p.q = q.data_ptr(); p.k = k.data_ptr(); p.v = v.data_ptr(); p.grad_o = grad_o.data_ptr();
  p.g = g.data_ptr<float>(); p.beta = beta.data_ptr<float>();
  p.h0 = initial_state_data(op, initial_state);
  at::Tensor dht;  // holds a converted copy of grad_final_state alive
  p.dht = grad_state_data(grad_final_state, dht);
  p.cu = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  p.in_dtype = in_dtype_of(q, op);
  p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V; p.N = s.N;
  p.scale = static_cast<float>(scale);
  p.chunk_off = off.data_ptr<int>();
  p.aqk = aqk.data_ptr<float>(); p.akk = akk.data_ptr<float>(); p.w = w.data_ptr<float>();
  p.u = u.data_ptr<float>(); p.U = U.data_ptr<float>(); p.dU = dU.data_ptr<float>();
  p.hs = hs.data_ptr<float>(); p.dhs = dhs.data_ptr<float>();
  if (v2) {
    p.wc = wc.data_ptr<float>(); p.kendc = kendc.data_ptr<float>(); p.qgc = qgc.data_ptr<float>();
    p.glc = glc.data_ptr<float>();
  }
  // grad kernel: 3 = the split grad3_vc / grad3_wy / grad3_ch (default: 12.3 vs grad2's 15.3 ms for the KDA
  // backward at B1 T8192 H16 HV32 on the H200, session 5), 2 = grad2, 1 = v1 grad_kernel (read on every call). grad3's intermediates reuse the v2 state buffers qgc / kendc / glc (dead after state_bwd2) and
  // aqk / akk in place; dw is one more [chunks, HV, CH, KP] buffer.
  const int grad_mode = env_int("KDA_CUDA_CHUNK_BWD_GRAD", 3);
  at::Tensor g3w, g3q, g3k, g3l;
  if (grad_mode == 3) {
    g3w = at::empty({ctile}, f32);
    p.gdw = g3w.data_ptr<float>();
    if (v2) {
      p.gdqg = p.qgc; p.gdkend = p.kendc; p.gdgl = p.glc;
    } else {
      g3q = at::empty({ctile}, f32);
      g3k = at::empty({ctile}, f32);
      g3l = at::empty({nc1 * s.HV * cb::KP}, f32);
      p.gdqg = g3q.data_ptr<float>(); p.gdkend = g3k.data_ptr<float>(); p.gdgl = g3l.data_ptr<float>();
    }
  }
  p.dq = dq.data_ptr<float>(); p.dk = dk.data_ptr<float>(); p.dg = dg.data_ptr<float>();
  p.dbeta = dbeta.data_ptr<float>(); p.dv = dv.data_ptr(); p.dh0 = dh0.data_ptr<float>();

  auto st = c10::cuda::getCurrentCUDAStream().stream();
  allow_dynamic_smem(cb::prep_kernel<PC, true>, cb::kPrepSmem);
  allow_dynamic_smem(cb::prep_kernel<PC, false>, cb::kPrepSmem);
  // prep v3 (tensor cores, bf16/fp16 inputs): two blocks per SM need the largest shared-memory carveout
  auto prep3_bf16 = cb::prep3_kernel<PC, __nv_bfloat16>();
  auto prep3_f16 = cb::prep3_kernel<PC, __half>();
  constexpr size_t prep3_smem = cb::prep3_smem<PC>();
  allow_dynamic_smem(prep3_bf16, prep3_smem, /*max_carveout=*/true);
  allow_dynamic_smem(prep3_f16, prep3_smem, /*max_carveout=*/true);
  allow_dynamic_smem(cb::state_fwd_kernel<PC>, cb::kStateFwdSmem);
  allow_dynamic_smem(cb::state_bwd_kernel<PC>, cb::kStateBwdSmem);
  allow_dynamic_smem(cb::state_fwd2_kernel<PC>, cb::kStateFwd2Smem);
  allow_dynamic_smem(cb::state_bwd2_kernel<PC>, cb::kStateBwd2Smem);
  allow_dynamic_smem(cb::grad_kernel<PC>, cb::kGradSmem);
  allow_dynamic_smem(cb::grad2_kernel<PC>, cb::kGradSmem);
  allow_dynamic_smem(cb::grad3_wy_kernel<PC>, cb::kWySmem, /*max_carveout=*/true);  // two 105 KB blocks per SM
  allow_dynamic_smem(cb::grad3_ch_kernel<PC>, cb::kGradSmem);
  cb::chunk_table_kernel<PC><<<1, 32, 0, st>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int nsl = (s.V + cb::VS - 1) / cb::VS;
  if (nc_max > 0 && s.HV > 0) {
    const dim3 gchunks(static_cast<unsigned>(nc_max), s.HV);
    // prep: v3 on tensor cores (default for bf16/fp16 inputs; delta_chunk_bwd_prep.cuh), the fp32 SIMT v2 with
    // the forward substitution in registers (KDA_CUDA_CHUNK_BWD_PREP=2, and always for fp32 inputs) or v1 (=1);
    // the older two kept to compare
    const int prep_mode = env_int("KDA_CUDA_CHUNK_BWD_PREP", 3);
    if (prep_mode == 1)
      cb::prep_kernel<PC, false><<<gchunks, cb::NT, cb::kPrepSmem, st>>>(p);
    else if (prep_mode == 2 || p.in_dtype == kF32)
      cb::prep_kernel<PC, true><<<gchunks, cb::NT, cb::kPrepSmem, st>>>(p);
    else
      (p.in_dtype == kBF16 ? prep3_bf16 : prep3_f16)<<<gchunks, cb::NT, prep3_smem, st>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (s.N > 0 && s.HV > 0) {
    const dim3 gseq(s.N, s.HV, nsl);
    if (v2) {
      cb::state_fwd2_kernel<PC><<<gseq, cb::NT2, cb::kStateFwd2Smem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::state_bwd2_kernel<PC><<<gseq, cb::NT2, cb::kStateBwd2Smem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      cb::state_fwd_kernel<PC><<<gseq, cb::NT, cb::kStateFwdSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::state_bwd_kernel<PC><<<gseq, cb::NT, cb::kStateBwdSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (nc_max > 0 && s.HV > 0) {
    const dim3 gchunks(static_cast<unsigned>(nc_max), s.HV);
    // grad kernel: the split v3 (default), v2 (KDA_CUDA_CHUNK_BWD_GRAD=2) or v1 (=1); see grad_mode above
    if (grad_mode == 1) {
      cb::grad_kernel<PC><<<gchunks, cb::NT, cb::kGradSmem, st>>>(p);
    } else if (grad_mode == 3) {
      static_assert(cb::kVcSmem <= 48 * 1024, "grad3_vc needs no shared-memory attribute");
      cb::grad3_vc_kernel<PC, 0><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_vc_kernel<PC, 1><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_vc_kernel<PC, 2><<<gchunks, cb::NT, cb::kVcSmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_wy_kernel<PC><<<gchunks, cb::NT, cb::kWySmem, st>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cb::grad3_ch_kernel<PC><<<gchunks, cb::NT3, cb::kGradSmem, st>>>(p);
    } else {
      cb::grad2_kernel<PC><<<gchunks, cb::NT, cb::kGradSmem, st>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {dq, dk, dg, dbeta, dv, dh0};
}

template <bool PC>
DeltaBwdResult chunk_bwd_run(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta, double scale,
                             const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu,
                             const at::Tensor& grad_o, const std::optional<at::Tensor>& grad_final_state) {
  namespace cb = chunk_bwd;
  const Shapes s = check_core(op, q, k, v, g, beta, cu, PC);
  if (s.K > cb::KP || env_int("KDA_CUDA_CHUNK_BWD_RECURRENT", 0) == 1)
    return recurrent_bwd<PC>(op, q, k, v, g, beta, scale, initial_state, cu, grad_o, grad_final_state);
  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(grad_o.is_contiguous() && grad_o.scalar_type() == q.scalar_type() && grad_o.sizes() == v.sizes(), "[",
              op, "] grad_o must be contiguous, shaped like v, with q's dtype");
  std::optional<at::Tensor> dht;
  if (grad_final_state.has_value() && grad_final_state->defined()) dht = *grad_final_state;
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
  at::Tensor dq_out = sum_gva(r.dq, s.B, s.T, s.H, s.HV, s.K).to(q.scalar_type()).contiguous();
  at::Tensor dk_out = sum_gva(r.dk, s.B, s.T, s.H, s.HV, s.K).to(k.scalar_type()).contiguous();
  at::Tensor dg_out = PC ? r.dg.view({s.B, s.T, s.HV, s.K}) : r.dg.view({s.B, s.T, s.HV, s.K}).sum(-1);
  return {dq_out, dk_out, r.dv, dg_out.contiguous(), r.dbeta, r.dh0};
}

}  // namespace cuda
}  // namespace kda_kernels
