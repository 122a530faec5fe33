// Objective-C++ host of the Metal backend: implements the core ops of docs/ops.md (declared in
// torch-ext/torch_binding.h) for MPS tensors by executing the launch plans of delta_plan.h on PyTorch's MPS
// stream. The same plans run in the CPU emulator (tests/metal_emu), which checks every binding against the
// kernels' declared [[buffer(i)]] parameters; what is specific to this file is the Metal encoding below.
// NOT YET RUN ON APPLE HARDWARE (see docs/metal.md).
//
// Library: kernel-builder compiles the .metal sources into a metallib and passes EMBEDDED_METALLIB_HEADER;
// a build that embeds the source text instead defines KDA_METAL_SOURCE_HEADER, a header defining
// `static const char kKdaMetalSource[]` (all .metal files with delta_common.h / delta_params.h inlined),
// compiled at first use with newLibraryWithSource (Metal 3.1, for bfloat).
#include "../../torch-ext/torch_binding.h"

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "delta_plan.h"

#if defined(EMBEDDED_METALLIB_HEADER)
#include EMBEDDED_METALLIB_HEADER
#elif defined(KDA_METAL_SOURCE_HEADER)
#include KDA_METAL_SOURCE_HEADER
#else
#error "define EMBEDDED_METALLIB_HEADER (kernel-builder) or KDA_METAL_SOURCE_HEADER (embedded .metal source)"
#endif

namespace kda_kernels {
namespace metal {
namespace {

id<MTLLibrary> library() {
  static id<MTLLibrary> lib = nil;
  static std::once_flag once;
  std::call_once(once, [] {
    id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
    NSError* error = nil;
#if defined(EMBEDDED_METALLIB_HEADER)
    lib = EMBEDDED_METALLIB_NAMESPACE::createLibrary(device, &error);
#else
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    options.languageVersion = MTLLanguageVersion3_1;  // bfloat
    lib = [device newLibraryWithSource:[NSString stringWithUTF8String:kKdaMetalSource] options:options error:&error];
#endif
    TORCH_CHECK(lib != nil, "kda-kernels Metal: cannot create the Metal library: ",
                error ? error.localizedDescription.UTF8String : "unknown error");
  });
  return lib;
}

id<MTLComputePipelineState> pipeline(const std::string& name) {
  static std::mutex mu;
  static std::unordered_map<std::string, id<MTLComputePipelineState>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  id<MTLFunction> fn = [library() newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
  TORCH_CHECK(fn != nil, "kda-kernels Metal: kernel ", name, " is not in the library");
  NSError* error = nil;
  id<MTLComputePipelineState> pso =
      [at::mps::MPSDevice::getInstance()->device() newComputePipelineStateWithFunction:fn error:&error];
  TORCH_CHECK(pso != nil, "kda-kernels Metal: pipeline ", name, ": ",
              error ? error.localizedDescription.UTF8String : "unknown error");
  cache.emplace(name, pso);
  return pso;
}

inline id<MTLBuffer> mtl_buffer(const at::Tensor& t) { return __builtin_bit_cast(id<MTLBuffer>, t.storage().data()); }

Dt dt_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dt::f32;
    case at::kHalf: return Dt::f16;
    case at::kBFloat16: return Dt::bf16;
    default: TORCH_CHECK(false, "kda-kernels Metal: q/k/v must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

Problem problem(const at::Tensor& q, const at::Tensor& v, double scale, const std::optional<at::Tensor>& h0,
                const std::optional<at::Tensor>& cu, const std::optional<at::Tensor>& dht) {
  TORCH_CHECK(q.device().is_mps(), "kda-kernels Metal: tensors must be on the MPS device");
  Problem p;
  p.dt = dt_of(q);
  p.B = int(q.size(0));
  p.T = int(q.size(1));
  p.H = int(q.size(2));
  p.K = int(q.size(3));
  p.HV = int(v.size(2));
  p.V = int(v.size(3));
  p.N = cu ? int(cu->size(0)) - 1 : p.B;
  p.scale = float(scale);
  p.has_h0 = h0.has_value();
  p.has_cu = cu.has_value();
  p.has_dht = dht.has_value();
  return p;
}

using Buffers = std::map<std::string, at::Tensor>;

// Allocates the plan's outputs and scratch buffers (bytes), encodes its launches on the current MPS stream.
Buffers run_plan(const Plan& plan, Buffers bufs, const at::Tensor& like) {
  for (const auto& b : plan.buffers) {
    if (b.kind == BufKind::Input || b.kind == BufKind::InOut) {
      auto it = bufs.find(b.name);
      TORCH_CHECK(it != bufs.end(), "kda-kernels Metal: plan input ", b.name, " missing");
      TORCH_CHECK(it->second.is_contiguous() && int64_t(it->second.nbytes()) == b.bytes,
                  "kda-kernels Metal: input ", b.name, " has ", it->second.nbytes(), " bytes, plan expects ",
                  b.bytes);
      continue;
    }
    auto opts = like.options().dtype(at::kByte);
    bufs[b.name] = b.zero ? at::zeros({b.bytes}, opts) : at::empty({b.bytes}, opts);
  }
  if (plan.launches.empty()) return bufs;
  // Pipelines and checks before encoding: nothing may throw inside the dispatch block.
  std::vector<id<MTLComputePipelineState>> psos;
  for (const auto& l : plan.launches) {
    id<MTLComputePipelineState> pso = pipeline(l.kernel);
    const NSUInteger threads = NSUInteger(l.tg[0]) * l.tg[1] * l.tg[2];
    TORCH_CHECK(pso.maxTotalThreadsPerThreadgroup >= threads, "kda-kernels Metal: ", l.kernel, " allows ",
                pso.maxTotalThreadsPerThreadgroup, " threads per threadgroup, the plan needs ", threads);
    for (const auto& b : l.binds)
      TORCH_CHECK(b.buffer == "params" || bufs.count(b.buffer), "kda-kernels Metal: unknown buffer ", b.buffer);
    psos.push_back(pso);
  }
  const Plan* pl = &plan;
  const Buffers* bp = &bufs;
  const std::vector<id<MTLComputePipelineState>>* pp = &psos;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  dispatch_sync(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
      for (size_t i = 0; i < pl->launches.size(); ++i) {
        const LaunchSpec& l = pl->launches[i];
        [enc setComputePipelineState:(*pp)[i]];
        for (const auto& b : l.binds) {
          if (b.buffer == "params") {
            [enc setBytes:&l.params length:sizeof(DeltaParams) atIndex:NSUInteger(b.index)];
          } else {
            const at::Tensor& t = bp->at(b.buffer);
            [enc setBuffer:mtl_buffer(t)
                    offset:NSUInteger(t.storage_offset() * t.element_size())
                   atIndex:NSUInteger(b.index)];
          }
        }
        [enc dispatchThreadgroups:MTLSizeMake(l.grid[0], l.grid[1], l.grid[2])
            threadsPerThreadgroup:MTLSizeMake(l.tg[0], l.tg[1], l.tg[2])];
      }
    }
  });
  return bufs;
}

at::Tensor output(const Plan& plan, const Buffers& bufs, const std::string& name, at::ScalarType dtype,
                  at::IntArrayRef shape) {
  auto al = plan.aliases.find(name);
  const at::Tensor& raw = bufs.at(al != plan.aliases.end() ? al->second : name);
  return raw.view(dtype).view(shape);
}

Buffers common_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, const std::optional<at::Tensor>& h0,
                      const std::optional<at::Tensor>& cu) {
  Buffers b{{"q", q.contiguous()}, {"k", k.contiguous()}, {"v", v.contiguous()},
            {"g", g.contiguous().to(at::kFloat)}, {"beta", beta.contiguous().to(at::kFloat)}};
  if (h0) b["initial_state"] = h0->contiguous().to(at::kFloat);
  if (cu) b["cu_seqlens"] = cu->contiguous().to(at::kLong);
  return b;
}

DeltaFwdResult fwd(const std::string& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, double scale,
                   const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& cu) {
  Problem p = problem(q, v, scale, h0, cu, std::nullopt);
  Plan plan = make_plan(op, p);
  Buffers bufs = run_plan(plan, common_inputs(q, k, v, g, beta, h0, cu), q);
  return {output(plan, bufs, "o", q.scalar_type(), {p.B, p.T, p.HV, p.V}),
          output(plan, bufs, "final_state", at::kFloat, {p.N, p.HV, p.K, p.V})};
}

DeltaBwdResult bwd(const std::string& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, double scale,
                   const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& cu,
                   const at::Tensor& grad_o, const std::optional<at::Tensor>& dht) {
  Problem p = problem(q, v, scale, h0, cu, dht);
  Plan plan = make_plan(op, p);
  Buffers in = common_inputs(q, k, v, g, beta, h0, cu);
  in["grad_o"] = grad_o.contiguous().to(q.scalar_type());
  if (dht) in["grad_final_state"] = dht->contiguous().to(at::kFloat);
  Buffers bufs = run_plan(plan, std::move(in), q);
  return {output(plan, bufs, "dq", q.scalar_type(), q.sizes()),
          output(plan, bufs, "dk", q.scalar_type(), k.sizes()),
          output(plan, bufs, "dv", q.scalar_type(), v.sizes()),
          output(plan, bufs, "dg", at::kFloat, g.sizes()),
          output(plan, bufs, "dbeta", at::kFloat, beta.sizes()),
          output(plan, bufs, "dh0", at::kFloat, {p.N, p.HV, p.K, p.V})};
}

// Serving op: the pool is bound in place (InOut); rows the indices name are read and written by the kernels.
at::Tensor serve(const std::string& op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& g, const at::Tensor& beta, double scale, at::Tensor& pool, const at::Tensor& idx,
                 const std::optional<at::Tensor>& nat, const std::optional<at::Tensor>& cu, bool state_v_first) {
  Problem p = problem(q, v, scale, std::nullopt, cu, std::nullopt);
  TORCH_CHECK(pool.device().is_mps() && pool.is_contiguous() && pool.dim() == 4, "kda-kernels Metal: ", op,
              ": state_pool must be a contiguous 4-d MPS tensor");
  switch (pool.scalar_type()) {
    case at::kFloat: p.pool_dt = Dt::f32; break;
    case at::kHalf: p.pool_dt = Dt::f16; break;
    case at::kBFloat16: p.pool_dt = Dt::bf16; break;
    default: TORCH_CHECK(false, "kda-kernels Metal: ", op, ": state_pool must be float32, float16 or bfloat16");
  }
  TORCH_CHECK(idx.dim() == 1 || (idx.dim() == 2 && idx.size(1) > 0), "kda-kernels Metal: ", op,
              ": ssm_state_indices must be [N] or [N, T>0]");
  p.pool_rows = int(pool.size(0));
  p.state_v_first = state_v_first ? 1 : 0;
  p.idx_cols = idx.dim() == 2 ? int(idx.size(1)) : 0;
  p.has_nat = nat.has_value();
  Plan plan = make_plan(op, p);
  Buffers in = common_inputs(q, k, v, g, beta, std::nullopt, cu);
  in["state_pool"] = pool;
  in["ssm_state_indices"] = idx.contiguous().to(at::kLong);
  if (nat) in["num_accepted_tokens"] = nat->contiguous().to(at::kLong);
  Buffers bufs = run_plan(plan, std::move(in), q);
  return output(plan, bufs, "o", q.scalar_type(), {p.B, p.T, p.HV, p.V});
}

}  // namespace
}  // namespace metal
}  // namespace kda_kernels

// Global entry points declared in torch_binding.h (one set per family).
#define KDA_METAL_DEFINE_FAMILY(family)                                                                      \
  DeltaFwdResult family##_recurrent_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,       \
                                        const at::Tensor& g, const at::Tensor& beta, double scale,           \
                                        const std::optional<at::Tensor>& initial_state,                      \
                                        const std::optional<at::Tensor>& cu_seqlens) {                       \
    return kda_kernels::metal::fwd(#family "_recurrent_fwd", q, k, v, g, beta, scale, initial_state,         \
                                   cu_seqlens);                                                              \
  }                                                                                                          \
  DeltaFwdResult family##_chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,           \
                                    const at::Tensor& g, const at::Tensor& beta, double scale,               \
                                    const std::optional<at::Tensor>& initial_state,                          \
                                    const std::optional<at::Tensor>& cu_seqlens) {                           \
    return kda_kernels::metal::fwd(#family "_chunk_fwd", q, k, v, g, beta, scale, initial_state, cu_seqlens); \
  }                                                                                                          \
  DeltaBwdResult family##_recurrent_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,       \
                                        const at::Tensor& g, const at::Tensor& beta, double scale,           \
                                        const std::optional<at::Tensor>& initial_state,                      \
                                        const std::optional<at::Tensor>& cu_seqlens,                         \
                                        const at::Tensor& grad_o,                                            \
                                        const std::optional<at::Tensor>& grad_final_state) {                 \
    return kda_kernels::metal::bwd(#family "_recurrent_bwd", q, k, v, g, beta, scale, initial_state,         \
                                   cu_seqlens, grad_o, grad_final_state);                                    \
  }                                                                                                          \
  DeltaBwdResult family##_chunk_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,           \
                                    const at::Tensor& g, const at::Tensor& beta, double scale,               \
                                    const std::optional<at::Tensor>& initial_state,                          \
                                    const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& grad_o,   \
                                    const std::optional<at::Tensor>& grad_final_state) {                     \
    return kda_kernels::metal::bwd(#family "_chunk_bwd", q, k, v, g, beta, scale, initial_state, cu_seqlens, \
                                   grad_o, grad_final_state);                                                \
  }                                                                                                          \
  at::Tensor family##_recurrent_serve(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,         \
                                      const at::Tensor& g, const at::Tensor& beta, double scale,             \
                                      at::Tensor& state_pool, const at::Tensor& ssm_state_indices,           \
                                      const std::optional<at::Tensor>& num_accepted_tokens,                  \
                                      const std::optional<at::Tensor>& cu_seqlens, bool state_v_first) {     \
    return kda_kernels::metal::serve(#family "_recurrent_serve", q, k, v, g, beta, scale, state_pool,        \
                                     ssm_state_indices, num_accepted_tokens, cu_seqlens, state_v_first);     \
  }

KDA_METAL_DEFINE_FAMILY(kda)
KDA_METAL_DEFINE_FAMILY(gdn)
