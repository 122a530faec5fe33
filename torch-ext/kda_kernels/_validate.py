"""Argument checks for the public API. Every error names the argument and what was expected.

Checks on tensor values (cu_seqlens contents, index ranges) read the tensor on the host; they run in eager mode
and are skipped while torch.compile traces, where they would break the graph (cu_seqlens also while a CUDA graph
is being captured, where a device-to-host copy is an error).
"""
import math

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _name(t):
    return str(t).replace("torch.", "")


def _shape(x):
    return list(x.shape)


def tensor(name, x, op):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"[{op}] {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _tracing():
    return torch.compiler.is_compiling()


def _capturing(t):
    """A CUDA graph is being captured on the current stream (t on a GPU): reading t on the host would be an error."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_core(op, q, k, v, g, beta, scale, per_channel):
    """Shapes, dtypes, devices and scale of the inputs of every public function. Returns (B, T, H, K, HV, V, scale).

    Runs on every call (decode included): the common valid case takes the cheapest comparisons (torch.Size
    against tuples, dtype identity); the messages are built only when a check fails.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            tensor(name, x, op)
    qs, vs = q.shape, v.shape
    if len(qs) != 4:
        raise ValueError(f"[{op}] q must be [B, T, H, K] (4 dims), got shape {_shape(q)}")
    B, T, H, K = qs
    if k.shape != qs:
        raise ValueError(f"[{op}] k must have q's shape [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if len(vs) != 4 or vs[0] != B or vs[1] != T:
        raise ValueError(f"[{op}] v must be [B, T, HV, V] = [{B}, {T}, HV, V], got shape {_shape(v)}")
    HV, V = vs[2], vs[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"[{op}] the number of value heads HV={HV} (v.shape[2]) must be a positive multiple of "
                         f"the q/k heads H={H} (q.shape[2])")
    if K == 0 or V == 0:
        raise ValueError(f"[{op}] head dims must be positive, got K={K} (q.shape[3]) and V={V} (v.shape[3])")
    want_g = (B, T, HV, K) if per_channel else (B, T, HV)
    if g.shape != want_g:
        kind = "[B, T, HV, K] (per-channel KDA gate)" if per_channel else "[B, T, HV] (per-head GDN gate)"
        raise ValueError(f"[{op}] g must be {kind} = {list(want_g)}, got {_shape(g)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"[{op}] beta must be [B, T, HV] = {[B, T, HV]}, got {_shape(beta)}")
    qd = q.dtype
    if qd not in _FLOATS or k.dtype is not qd or v.dtype is not qd:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dtype not in _FLOATS:
                raise TypeError(f"[{op}] {name} must be float32, bfloat16 or float16, got {_name(x.dtype)}")
        raise TypeError(f"[{op}] q, k and v must share one dtype, got q {_name(q.dtype)}, k {_name(k.dtype)}, "
                        f"v {_name(v.dtype)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype not in _FLOATS:
            raise TypeError(f"[{op}] {name} must be float32, bfloat16 or float16, got {_name(x.dtype)}")
    dev = q.device
    if k.device != dev or v.device != dev or g.device != dev or beta.device != dev:
        same_device(op, q=q, k=k, v=v, g=g, beta=beta)
    if scale is None:
        scale = K ** -0.5
    else:
        if isinstance(scale, torch.Tensor) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"[{op}] scale must be a Python float or None, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"[{op}] scale must be a finite number > 0, got {scale}")
    return B, T, H, K, HV, V, scale


def same_device(op, **tensors):
    items = [(n, x) for n, x in tensors.items() if x is not None]
    dev = items[0][1].device
    for n, x in items[1:]:
        if x.device != dev:
            raise ValueError(f"[{op}] all tensors must be on one device: {items[0][0]} is on {dev}, "
                             f"{n} is on {x.device}")


def check_cu_seqlens(op, cu_seqlens, B, T, device):
    """Returns the number of sequences N."""
    if cu_seqlens is None:
        return B
    tensor("cu_seqlens", cu_seqlens, op)
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"[{op}] cu_seqlens must be an integer tensor (int32 or int64), got "
                        f"{_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"[{op}] cu_seqlens must be 1-D [N+1], got shape {_shape(cu_seqlens)}")
    if B != 1:
        raise ValueError(f"[{op}] with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
    if cu_seqlens.device != device:
        raise ValueError(f"[{op}] cu_seqlens must be on q's device {device}, got {cu_seqlens.device}")
    if not _tracing() and not _capturing(cu_seqlens):
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            raise ValueError(f"[{op}] cu_seqlens must start at 0, got {cu[0]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"[{op}] cu_seqlens must be non-decreasing, got {cu}")
        if cu[-1] != T:
            raise ValueError(f"[{op}] cu_seqlens must end at T={T} (q.shape[1]), got {cu[-1]}")
    return cu_seqlens.numel() - 1


def check_state(op, name, state, rows, HV, K, V, state_v_first, device, rows_desc="N"):
    if state is None:
        return
    tensor(name, state, op)
    want = (HV, V, K) if state_v_first else (HV, K, V)
    shape = state.shape
    if len(shape) != 4 or shape[1:] != want or (rows is not None and shape[0] != rows):
        layout = ("[{}, HV, V, K]" if state_v_first else "[{}, HV, K, V]").format(rows_desc)
        full = ([rows] if rows is not None else [rows_desc]) + list(want)
        raise ValueError(f"[{op}] {name} must be {layout} = {full}, got shape {_shape(state)}")
    if state.dtype not in _FLOATS:
        raise TypeError(f"[{op}] {name} must be float32 (bfloat16/float16 accepted, computed in float32), "
                        f"got {_name(state.dtype)}")
    if state.device != device:
        raise ValueError(f"[{op}] {name} must be on q's device {device}, got {state.device}")


def check_gate_params(op, A_log, dt_bias, HV, K, per_channel, device):
    if A_log is None:
        raise ValueError(f"[{op}] use_gate_in_kernel=True needs A_log of shape [HV] = [{HV}]")
    tensor("A_log", A_log, op)
    if _shape(A_log) != [HV]:
        raise ValueError(f"[{op}] A_log must be [HV] = [{HV}], got {_shape(A_log)}")
    if dt_bias is not None:
        tensor("dt_bias", dt_bias, op)
        allowed = [[HV * K], [HV, K]] if per_channel else [[HV]]
        if _shape(dt_bias) not in allowed:
            desc = f"[HV*K] = [{HV * K}] (or [HV, K] = [{HV}, {K}])" if per_channel else f"[HV] = [{HV}]"
            raise ValueError(f"[{op}] dt_bias must be {desc}, got {_shape(dt_bias)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and x.dtype not in _FLOATS:
            raise TypeError(f"[{op}] {name} must be float32, bfloat16 or float16, got {_name(x.dtype)}")
    same_device(op, q_device_ref=torch.empty(0, device=device), A_log=A_log, dt_bias=dt_bias)


def check_lower_bound(op, lower_bound):
    if lower_bound is None:
        return
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"[{op}] lower_bound must be a Python float or None, got {type(lower_bound).__name__}")
    if not (-float("inf") < lower_bound < 0):
        # the gate is lower_bound * sigmoid(...): a bound >= 0 would make the decay >= 1 (a growing state)
        raise ValueError(f"[{op}] lower_bound must be a finite number < 0, got {lower_bound}")


def check_gate_inputs(op, g, A_log, dt_bias, lower_bound):
    """Types, dtypes, devices and lower_bound of the standalone gate functions (shapes are checked by each)."""
    tensor("g", g, op)
    tensor("A_log", A_log, op)
    if dt_bias is not None:
        tensor("dt_bias", dt_bias, op)
    for name, x in (("g", g), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and x.dtype not in _FLOATS:
            raise TypeError(f"[{op}] {name} must be float32, bfloat16 or float16, got {_name(x.dtype)}")
    same_device(op, g=g, A_log=A_log, dt_bias=dt_bias)
    check_lower_bound(op, lower_bound)


def check_bool(op, **flags):
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"[{op}] {name} must be a bool, got {type(value).__name__}")
