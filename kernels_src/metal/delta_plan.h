// Host-side launch plans of the Metal backend: for each core op (docs/ops.md), which buffers exist, which
// kernels run in which order, on what grid, with which buffer bound at which [[buffer(i)]] index.
// Plain C++ (no Objective-C, no ATen): delta_ops.mm executes a plan on the MPS stream, and the CPU emulation
// harness (tests/metal_emu) executes the very same plan on the emulated kernels, checking every binding against
// the kernel's declared parameters (index and name) at every launch.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "delta_params.h"

namespace kda_kernels {
namespace metal {

enum class Dt { f32, f16, bf16 };

inline Dt dt_from_name(const char* s) {
  std::string n(s);
  if (n == "f32") return Dt::f32;
  if (n == "f16") return Dt::f16;
  if (n == "bf16") return Dt::bf16;
  throw std::invalid_argument("unknown dtype " + n);
}
inline const char* dt_suffix(Dt d) { return d == Dt::f32 ? "f32" : d == Dt::f16 ? "f16" : "bf16"; }
inline int64_t dt_bytes(Dt d) { return d == Dt::f32 ? 4 : 2; }

struct Problem {
  Dt dt = Dt::f32;
  int B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0;
  float scale = 1.0f;
  bool has_h0 = false, has_cu = false, has_dht = false;
  // serving op
  bool has_nat = false;
  int idx_cols = 0;        // 0: ssm_state_indices is [N]; else [N, idx_cols]
  int state_v_first = 0;
  int pool_rows = 0;       // P
  Dt pool_dt = Dt::f32;    // state pool dtype
};

enum class BufKind { Input, InOut, Output, Scratch };

struct BufferSpec {
  std::string name;
  int64_t bytes;
  BufKind kind;
  bool zero;  // Output/Scratch: must be zero-filled before the first launch
};

struct Bind {
  int index;           // [[buffer(index)]]
  std::string buffer;  // plan buffer name, or "params" (setBytes of the launch's DeltaParams)
  std::string param;   // the kernel parameter this binding is meant for (checked by the emulator)
};

struct LaunchSpec {
  std::string kernel;
  uint32_t grid[3];  // threadgroups per grid
  uint32_t tg[3];    // threads per threadgroup
  std::vector<Bind> binds;
  DeltaParams params;
};

struct Plan {
  std::vector<BufferSpec> buffers;
  std::vector<LaunchSpec> launches;
  std::map<std::string, std::string> aliases;  // output name -> buffer holding it (no copy needed)
};

namespace detail {

inline uint32_t ceil_div(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

inline DeltaParams base_params(const Problem& p) {
  DeltaParams d{};
  d.B = p.B;
  d.T = p.T;
  d.H = p.H;
  d.HV = p.HV;
  d.K = p.K;
  d.V = p.V;
  d.N = p.N;
  d.has_h0 = p.has_h0;
  d.has_cu = p.has_cu;
  d.has_dht = p.has_dht;
  d.scale = p.scale;
  d.state_v_first = p.state_v_first;
  d.idx_cols = p.idx_cols;
  d.has_nat = p.has_nat;
  return d;
}

struct Builder {
  Plan plan;
  void input(const std::string& n, int64_t bytes) { plan.buffers.push_back({n, bytes, BufKind::Input, false}); }
  void inout(const std::string& n, int64_t bytes) { plan.buffers.push_back({n, bytes, BufKind::InOut, false}); }
  void output(const std::string& n, int64_t bytes, bool zero = false) {
    plan.buffers.push_back({n, bytes, BufKind::Output, zero});
  }
  void scratch(const std::string& n, int64_t bytes, bool zero = false) {
    plan.buffers.push_back({n, bytes, BufKind::Scratch, zero});
  }
  // binds `name` at `index`, or the dummy buffer when the optional input is absent
  static Bind opt(int index, const std::string& name, bool present) {
    return Bind{index, present ? name : std::string("dummy"), name};
  }
  static Bind b(int index, const std::string& name) { return Bind{index, name, name}; }
  static Bind as(int index, const std::string& buffer, const std::string& param) { return Bind{index, buffer, param}; }
  void launch(const std::string& kernel, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t tx, std::vector<Bind> binds,
              const DeltaParams& prm) {
    if (gx == 0 || gy == 0 || gz == 0) return;  // nothing to do (no sequences / no tokens)
    LaunchSpec l;
    l.kernel = kernel;
    l.grid[0] = gx;
    l.grid[1] = gy;
    l.grid[2] = gz;
    l.tg[0] = tx;
    l.tg[1] = 1;
    l.tg[2] = 1;
    l.binds = std::move(binds);
    l.params = prm;
    plan.launches.push_back(std::move(l));
  }
};

inline void common_inputs(Builder& b, const Problem& p, bool per_channel) {
  const int64_t tok = int64_t(p.B) * p.T;
  b.input("q", tok * p.H * p.K * dt_bytes(p.dt));
  b.input("k", tok * p.H * p.K * dt_bytes(p.dt));
  b.input("v", tok * p.HV * p.V * dt_bytes(p.dt));
  b.input("g", tok * p.HV * (per_channel ? p.K : 1) * 4);
  b.input("beta", tok * p.HV * 4);
  if (p.has_h0) b.input("initial_state", int64_t(p.N) * p.HV * p.K * p.V * 4);
  if (p.has_cu) b.input("cu_seqlens", int64_t(p.N + 1) * 8);
  b.scratch("dummy", 16, true);
}

inline void check(const Problem& p) {
  if (p.K < 1 || p.K > KDA_REC_MAX_K) throw std::invalid_argument("Metal backend: K must be in [1, 256]");
  if (p.V < 1) throw std::invalid_argument("Metal backend: V must be positive");
  if (p.H < 1 || p.HV % p.H != 0) throw std::invalid_argument("Metal backend: HV must be a multiple of H");
}

// Recurrent and chunked forward share buffer indices:
// 0 q, 1 k, 2 v, 3 g, 4 beta, 5 initial_state, 6 cu_seqlens, 7 o, 8 final_state, 9 params
inline std::vector<Bind> fwd_binds(const Problem& p) {
  return {Builder::b(0, "q"), Builder::b(1, "k"), Builder::b(2, "v"), Builder::b(3, "g"), Builder::b(4, "beta"),
          Builder::opt(5, "initial_state", p.has_h0), Builder::opt(6, "cu_seqlens", p.has_cu), Builder::b(7, "o"),
          Builder::b(8, "final_state"), Builder::b(9, "params")};
}

inline void fwd_outputs(Builder& b, const Problem& p) {
  b.output("o", int64_t(p.B) * p.T * p.HV * p.V * dt_bytes(p.dt));
  b.output("final_state", int64_t(p.N) * p.HV * p.K * p.V * 4);
}

inline bool chunk_supported(const Problem& p) {
  return p.K % 8 == 0 && p.K <= KDA_CHUNK_MAX_K && p.V % 8 == 0;
}

inline Plan recurrent_fwd(const std::string& fam, const Problem& p) {
  check(p);
  Builder b;
  common_inputs(b, p, fam == "kda");
  fwd_outputs(b, p);
  b.launch(fam + "_recurrent_fwd_" + dt_suffix(p.dt), ceil_div(p.V, KDA_REC_ROWS), p.HV, p.N, 32 * KDA_REC_ROWS,
           fwd_binds(p), base_params(p));
  return b.plan;
}

inline Plan chunk_fwd(const std::string& fam, const Problem& p) {
  check(p);
  if (!chunk_supported(p)) return recurrent_fwd(fam, p);  // same math, one token at a time
  Builder b;
  common_inputs(b, p, fam == "kda");
  fwd_outputs(b, p);
  b.launch(fam + "_chunk_fwd_" + dt_suffix(p.dt), ceil_div(p.V, KDA_CHUNK_VB), p.HV, p.N, 32 * KDA_CHUNK_NSG,
           fwd_binds(p), base_params(p));
  return b.plan;
}

// Checkpoint segment of the recurrent backward: about sqrt(total tokens), a power of two in [16, 256].
inline int recurrent_bwd_segment(int64_t tokens) {
  int seg = 16;
  while (seg < 256 && int64_t(seg) * seg < tokens) seg *= 2;
  return seg;
}

inline void cast_out(Builder& b, const Problem& p, const std::string& acc, const std::string& out, int64_t count) {
  if (p.dt == Dt::f32) {
    b.plan.aliases[out] = acc;
    return;
  }
  b.output(out, count * dt_bytes(p.dt));
  DeltaParams prm = base_params(p);
  prm.count = int(count);
  b.launch(std::string("delta_cast_") + dt_suffix(p.dt), ceil_div(count, KDA_CAST_TG), 1, 1, KDA_CAST_TG,
           {Builder::as(0, acc, "src"), Builder::as(1, out, "dst"), Builder::b(2, "params")}, prm);
}

inline Plan recurrent_bwd(const std::string& fam, const Problem& p) {
  check(p);
  const bool kda = fam == "kda";
  const int64_t tok = int64_t(p.B) * p.T;
  Builder b;
  common_inputs(b, p, kda);
  b.input("grad_o", tok * p.HV * p.V * dt_bytes(p.dt));
  if (p.has_dht) b.input("grad_final_state", int64_t(p.N) * p.HV * p.K * p.V * 4);
  DeltaParams prm = base_params(p);
  prm.seg = recurrent_bwd_segment(tok);
  // sequence n's checkpoints start at slot n + bos_n / seg (see recurrent_bwd.metal), so this many slots suffice
  prm.nslots = int(p.N + tok / prm.seg + 1);
  const int64_t kv = int64_t(p.K) * p.V;
  b.scratch("dq_acc", tok * p.H * p.K * 4, true);
  b.scratch("dk_acc", tok * p.H * p.K * 4, true);
  b.output("dv", tok * p.HV * p.V * dt_bytes(p.dt));
  b.output("dg", tok * p.HV * (kda ? p.K : 1) * 4, true);
  b.output("dbeta", tok * p.HV * 4, true);
  b.output("dh0", int64_t(p.N) * p.HV * kv * 4);
  b.scratch("ckpt", int64_t(p.HV) * prm.nslots * kv * 4);
  b.scratch("replay", int64_t(p.N) * p.HV * p.V * prm.seg * p.K * 4);
  // 0 q 1 k 2 v 3 g 4 beta 5 initial_state 6 cu_seqlens 7 grad_o 8 grad_final_state 9 dq_acc 10 dk_acc 11 dv
  // 12 dg 13 dbeta 14 dh0 15 ckpt 16 replay 17 params
  b.launch(fam + "_recurrent_bwd_" + dt_suffix(p.dt), ceil_div(p.V, KDA_REC_ROWS), p.HV, p.N, 32 * KDA_REC_ROWS,
           {Builder::b(0, "q"), Builder::b(1, "k"), Builder::b(2, "v"), Builder::b(3, "g"), Builder::b(4, "beta"),
            Builder::opt(5, "initial_state", p.has_h0), Builder::opt(6, "cu_seqlens", p.has_cu),
            Builder::b(7, "grad_o"), Builder::opt(8, "grad_final_state", p.has_dht), Builder::b(9, "dq_acc"),
            Builder::b(10, "dk_acc"), Builder::b(11, "dv"), Builder::b(12, "dg"), Builder::b(13, "dbeta"),
            Builder::b(14, "dh0"), Builder::b(15, "ckpt"), Builder::b(16, "replay"), Builder::b(17, "params")},
           prm);
  cast_out(b, p, "dq_acc", "dq", tok * p.H * p.K);
  cast_out(b, p, "dk_acc", "dk", tok * p.H * p.K);
  return b.plan;
}

// Checkpoint segment of the chunked backward, in 16-token chunks: the largest power of two whose square is at
// most the number of chunks, in [1, 32].
inline int chunk_bwd_segment(int64_t tokens) {
  const int64_t chunks = (tokens + KDA_CHUNK - 1) / KDA_CHUNK;
  int seg = 1;
  while (seg < 32 && int64_t(2 * seg) * (2 * seg) <= chunks) seg *= 2;
  return seg;
}

inline Plan chunk_bwd(const std::string& fam, const Problem& p) {
  check(p);
  if (!chunk_supported(p)) return recurrent_bwd(fam, p);  // exact gradients, one token at a time
  const bool kda = fam == "kda";
  const int64_t tok = int64_t(p.B) * p.T;
  Builder b;
  common_inputs(b, p, kda);
  b.input("grad_o", tok * p.HV * p.V * dt_bytes(p.dt));
  if (p.has_dht) b.input("grad_final_state", int64_t(p.N) * p.HV * p.K * p.V * 4);
  DeltaParams prm = base_params(p);
  prm.seg = chunk_bwd_segment(tok);
  // sequence n's checkpoints start at slot n + bos_n / (16 seg) (see chunk_bwd.metal), so this many slots suffice
  prm.nslots = int(p.N + tok / (int64_t(KDA_CHUNK) * prm.seg) + 1);
  const int64_t kv = int64_t(p.K) * p.V;
  b.scratch("dq_acc", tok * p.H * p.K * 4, true);
  b.scratch("dk_acc", tok * p.H * p.K * 4, true);
  b.output("dv", tok * p.HV * p.V * dt_bytes(p.dt));
  b.output("dg", tok * p.HV * (kda ? p.K : 1) * 4, true);
  b.output("dbeta", tok * p.HV * 4, true);
  b.output("dh0", int64_t(p.N) * p.HV * kv * 4);
  b.scratch("ckpt", int64_t(p.HV) * prm.nslots * kv * 4);
  b.scratch("replay", int64_t(p.N) * p.HV * prm.seg * kv * 4);
  // same buffer indices as the recurrent backward
  b.launch(fam + "_chunk_bwd_" + dt_suffix(p.dt), ceil_div(p.V, KDA_CHUNK_VB), p.HV, p.N, 32 * KDA_CHUNK_NSG,
           {Builder::b(0, "q"), Builder::b(1, "k"), Builder::b(2, "v"), Builder::b(3, "g"), Builder::b(4, "beta"),
            Builder::opt(5, "initial_state", p.has_h0), Builder::opt(6, "cu_seqlens", p.has_cu),
            Builder::b(7, "grad_o"), Builder::opt(8, "grad_final_state", p.has_dht), Builder::b(9, "dq_acc"),
            Builder::b(10, "dk_acc"), Builder::b(11, "dv"), Builder::b(12, "dg"), Builder::b(13, "dbeta"),
            Builder::b(14, "dh0"), Builder::b(15, "ckpt"), Builder::b(16, "replay"), Builder::b(17, "params")},
           prm);
  cast_out(b, p, "dq_acc", "dq", tok * p.H * p.K);
  cast_out(b, p, "dk_acc", "dk", tok * p.H * p.K);
  return b.plan;
}

// Serving op: recurrent forward on a state pool updated in place (recurrent_serve.metal). With per-token indices
// [N, idx_cols] the start states are gathered first (a start row may be another sequence's write row).
inline Plan recurrent_serve(const std::string& fam, const Problem& p) {
  check(p);
  if (p.has_h0 || p.has_dht) throw std::invalid_argument("Metal serve plan: no initial_state/grad_final_state");
  const bool kda = fam == "kda";
  const int64_t tok = int64_t(p.B) * p.T;
  const int64_t kv = int64_t(p.K) * p.V;
  const bool per_token = p.idx_cols > 0;
  Builder b;
  common_inputs(b, p, kda);
  b.inout("state_pool", int64_t(p.pool_rows) * p.HV * kv * dt_bytes(p.pool_dt));
  b.input("ssm_state_indices", int64_t(p.N) * (per_token ? p.idx_cols : 1) * 8);
  if (p.has_nat) b.input("num_accepted_tokens", int64_t(p.N) * 8);
  b.output("o", tok * p.HV * p.V * dt_bytes(p.dt));
  const DeltaParams prm = base_params(p);
  if (per_token) {
    b.scratch("starts", int64_t(p.N) * p.HV * kv * 4);
    b.launch(std::string("delta_serve_gather_") + dt_suffix(p.pool_dt), ceil_div(int64_t(p.N) * p.HV * kv, KDA_CAST_TG),
             1, 1, KDA_CAST_TG,
             {Builder::b(0, "state_pool"), Builder::b(1, "ssm_state_indices"),
              Builder::opt(2, "num_accepted_tokens", p.has_nat), Builder::b(3, "starts"), Builder::b(4, "params")},
             prm);
  }
  // 0 q 1 k 2 v 3 g 4 beta 5 state_pool 6 starts 7 ssm_state_indices 8 num_accepted_tokens 9 cu_seqlens 10 o
  // 11 params
  b.launch(fam + "_recurrent_serve_" + dt_suffix(p.dt) + "_state_" + dt_suffix(p.pool_dt), ceil_div(p.V, KDA_REC_ROWS),
           p.HV, p.N, 32 * KDA_REC_ROWS,
           {Builder::b(0, "q"), Builder::b(1, "k"), Builder::b(2, "v"), Builder::b(3, "g"), Builder::b(4, "beta"),
            Builder::b(5, "state_pool"), Builder::opt(6, "starts", per_token), Builder::b(7, "ssm_state_indices"),
            Builder::opt(8, "num_accepted_tokens", p.has_nat), Builder::opt(9, "cu_seqlens", p.has_cu),
            Builder::b(10, "o"), Builder::b(11, "params")},
           prm);
  return b.plan;
}

}  // namespace detail

// op: "{kda,gdn}_{recurrent,chunk}_{fwd,bwd}" or "{kda,gdn}_recurrent_serve"
inline Plan make_plan(const std::string& op, const Problem& p) {
  const std::string fam = op.substr(0, 3);
  if (fam != "kda" && fam != "gdn") throw std::invalid_argument("unknown op " + op);
  const std::string rest = op.substr(3);
  if (rest == "_recurrent_fwd") return detail::recurrent_fwd(fam, p);
  if (rest == "_chunk_fwd") return detail::chunk_fwd(fam, p);
  if (rest == "_recurrent_bwd") return detail::recurrent_bwd(fam, p);
  if (rest == "_chunk_bwd") return detail::chunk_bwd(fam, p);
  if (rest == "_recurrent_serve") return detail::recurrent_serve(fam, p);
  throw std::invalid_argument("op " + op + " has no Metal plan");
}

}  // namespace metal
}  // namespace kda_kernels
