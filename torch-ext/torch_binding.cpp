// Registers the compiled backend's implementations of the core ops (docs/ops.md).
// The schemas themselves are defined once, in Python (kda_kernels/ops.py), so the pure-PyTorch variant and
// every compiled variant share them; a compiled library only adds kernels for its dispatch key.
// KDA_NAMESPACE is the variant's metadata id, passed by scripts/build.py.
#include <torch/library.h>

#include "torch_binding.h"
// Each backend lists the ops it implements: kernels_src/<backend>/backend_ops.h defines
// KDA_BACKEND_OPS(X) as X(kda_chunk_fwd) X(...) ...; ops it leaves out use the pure-PyTorch fallback.
#include "backend_ops.h"

#ifndef KDA_NAMESPACE
#error "KDA_NAMESPACE must be defined (scripts/build.py passes the variant's metadata id)"
#endif

#if defined(CPU_KERNEL)
#define KDA_DISPATCH_KEY CPU
#elif defined(CUDA_KERNEL)
#define KDA_DISPATCH_KEY CUDA
#elif defined(METAL_KERNEL)
#define KDA_DISPATCH_KEY MPS
#else
#error "define one of CPU_KERNEL, CUDA_KERNEL, METAL_KERNEL"
#endif

#define KDA_IMPL(name) m.impl(#name, &name);

TORCH_LIBRARY_IMPL(KDA_NAMESPACE, KDA_DISPATCH_KEY, m) { KDA_BACKEND_OPS(KDA_IMPL) }
