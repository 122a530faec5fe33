"""The core ops (docs/ops.md): schemas, the pure-PyTorch fallback, fake kernels and autograd, one block each.

Schemas are defined here once for every build variant. A compiled variant's shared library only adds kernels
for its dispatch key (CPU, CUDA, MPS); whatever it leaves out runs the pure-PyTorch fallback, which is
registered as CompositeExplicitAutograd and warns once per (device, op) that no native kernel ran.
"""
import os
import warnings
from pathlib import Path

import torch

from . import _ops
from .fallback.chunk import delta_chunk_bwd, delta_chunk_fwd
from .fallback.recurrent import delta_recurrent_bwd, delta_recurrent_fwd, delta_recurrent_serve

FAMILIES = ("kda", "gdn")
_FWD = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
        "Tensor? cu_seqlens) -> (Tensor o, Tensor final_state)")
_BWD = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
        "Tensor? cu_seqlens, Tensor grad_o, Tensor? grad_final_state) "
        "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dh0)")
_SERVE = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) state_pool, "
          "Tensor ssm_state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, bool state_v_first) -> Tensor")

# Staged forms of the chunked ops (context parallelism's relay, docs/context_parallel.md): the same kernels as
# *_chunk_fwd / *_chunk_bwd launched in stages that hand their work tensors back to the caller. Schemas only, no
# fallback: a compiled backend that implements them registers kernels (CUDA); `has_stages` says where they run.
_FWD_STAGE = ("(Tensor(a!)[] work, int stage, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
              "Tensor? initial_state, Tensor? cu_seqlens) -> Tensor[]")
_BWD_STAGE = ("(Tensor(a!)[] work, int stage, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
              "Tensor? initial_state, Tensor? cu_seqlens, Tensor grad_o, Tensor? grad_final_state) -> Tensor[]")

_FALLBACKS = {
    "chunk_fwd": (_FWD, delta_chunk_fwd),
    "chunk_bwd": (_BWD, delta_chunk_bwd),
    "recurrent_fwd": (_FWD, delta_recurrent_fwd),
    "recurrent_bwd": (_BWD, delta_recurrent_bwd),
    "recurrent_serve": (_SERVE, delta_recurrent_serve),
}

_warned = set()


def _warn_fallback(op, device):
    key = (op, device.type)
    if key in _warned or os.environ.get("KDA_KERNELS_QUIET_FALLBACK"):
        return
    _warned.add(key)
    warnings.warn(
        f"kda-kernels: no native {device.type} kernel for {op} in this build (variant {_ops.VARIANT}); "
        f"using the pure-PyTorch implementation.", RuntimeWarning, stacklevel=3)


def _with_warning(op, fn):
    def impl(q, *args):
        _warn_fallback(op, q.device)
        return fn(q, *args)
    impl.__name__ = f"_{op}_fallback"
    return impl


# ---------------------------------------------------------------- fake (meta) kernels
def _num_states(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty(B, T, HV, V)
    return o, q.new_empty(_num_states(q, cu_seqlens), HV, K, V, dtype=torch.float32)


def _bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, grad_o, grad_final_state):
    N = _num_states(q, cu_seqlens)
    dh0 = q.new_empty(N, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g, dtype=torch.float32),
            torch.empty_like(beta, dtype=torch.float32), dh0)


def _serve_fake(q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                state_v_first):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2], v.shape[3])


# ---------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens = inputs
    ctx.scale = scale
    ctx.has_initial_state = initial_state is not None
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)


def _make_backward(bwd_qualname):
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        bwd = _op(bwd_qualname)
        dq, dk, dv, dg, dbeta, dh0 = bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
                                         grad_o.contiguous(), grad_final_state.contiguous())
        return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None), None
    return backward


def _op(qualname):
    ns, name = qualname.split("::")
    return getattr(getattr(torch.ops, ns), name)


# ---------------------------------------------------------------- registration
def _already_defined(qualname):
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def _register():
    ns = _ops.NAMESPACE
    if _already_defined(f"{ns}::kda_chunk_fwd"):
        # The same build imported twice (e.g. from build/ and from a hub cache copy): the ops already exist.
        return None
    lib = torch.library.Library(ns, "DEF")
    for family in FAMILIES:
        for suffix, (schema, fn) in _FALLBACKS.items():
            name = f"{family}_{suffix}"
            lib.define(name + schema)
            lib.impl(name, _with_warning(name, fn), "CompositeExplicitAutograd")
            fake = {"fwd": _fwd_fake, "bwd": _bwd_fake, "serve": _serve_fake}[suffix.split("_")[1]]
            torch.library.register_fake(f"{ns}::{name}", fake, lib=lib)
        lib.define(f"{family}_chunk_fwd_stage" + _FWD_STAGE)
        lib.define(f"{family}_chunk_bwd_stage" + _BWD_STAGE)
        for mode in ("chunk", "recurrent"):
            torch.library.register_autograd(
                f"{ns}::{family}_{mode}_fwd", _make_backward(f"{ns}::{family}_{mode}_bwd"),
                setup_context=_setup_context, lib=lib)
    return lib


def _cpu_supports_native_build():
    """The CPU library is built for x86-64 with AVX2 and FMA; refuse it (and fall back) on older CPUs."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return " avx2" in flags and " fma" in flags


def _load_native():
    if not _ops.NATIVE_LIBRARY:
        return False
    path = Path(__file__).parent / _ops.NATIVE_LIBRARY
    if _ops.BACKEND == "cpu" and not _cpu_supports_native_build():
        warnings.warn("kda-kernels: this CPU lacks AVX2/FMA, which the native CPU build needs; "
                      "using the pure-PyTorch implementation.", RuntimeWarning)
        return False
    torch.ops.load_library(str(path))
    return True


_lib = _register()
NATIVE = _load_native() if _lib is not None else bool(_ops.NATIVE_LIBRARY)
if _lib is not None and _ops.BACKEND == "neuron":
    from .nki.torch_wrappers import register_neuron_impls  # shipped in the torch-neuron variant only

    register_neuron_impls(_lib, _ops.NAMESPACE)

ops = getattr(torch.ops, _ops.NAMESPACE)


def has_stages(family, device):
    """Whether the staged chunked ops (`{family}_chunk_fwd_stage` / `_bwd_stage`) have a native kernel for
    `device` in this build (the CUDA build has them; see docs/context_parallel.md)."""
    key = {"cuda": "CUDA", "cpu": "CPU", "mps": "MPS"}.get(torch.device(device).type)
    if key is None:
        return False
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"{_ops.NAMESPACE}::{family}_chunk_{d}_stage", key)
               for d in ("fwd", "bwd"))
