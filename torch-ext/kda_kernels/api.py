"""Public API: flash-linear-attention's names and argument order (DESIGN.md section 2).

Each function validates its arguments, applies the optional pre-processing of section 1 with differentiable
PyTorch ops (q/k L2 norm, beta sigmoid, fused gate), puts states into the K-first layout and calls one core
op (docs/ops.md), which runs the native kernel of the tensors' device when this build has one.
"""
import os

import torch

from . import _validate
from .gate import _gate
from . import _ops
from .ops import NATIVE, ops

# Keyword arguments flash-linear-attention or Transformers pass that change nothing here (safe_gate: our gates
# are exact for any gate, bounded or not; the rest are fla's scheduling hints or Transformers' bookkeeping).
_IGNORED_KWARGS = {"cu_seqlens_cpu", "use_cache", "safe_gate", "disable_recompute", "chunk_indices", "layer_idx",
                   "output_attentions", "use_graph", "max_num_seqs", "chunk_size"}
# fla keyword arguments this package supports only at their default value (anything else would change the result;
# _check_kwargs refuses the others one by one, with what to use instead).
_DEFAULT_ONLY_KWARGS = {"head_first", "transpose_state_layout", "return_intermediate_states", "cp_context"}


def _check_kwargs(op, kwargs):
    """Unknown keywords raise (a misspelt `initial_states=` must not be dropped silently)."""
    if kwargs.get("head_first", False):
        raise ValueError(f"[{op}] head_first=True is not supported: inputs are time-major [B, T, H, K]")
    if kwargs.get("transpose_state_layout", False):
        raise ValueError(f"[{op}] use state_v_first=True for [N, HV, V, K] states")
    if kwargs.get("return_intermediate_states", False):
        raise ValueError(f"[{op}] return_intermediate_states=True is not supported")
    if kwargs.get("cp_context") is not None:
        raise ValueError(f"[{op}] fla's cp_context is not supported: use kda_kernels.context_parallel "
                         "(chunk_kda_cp / chunk_gated_delta_rule_cp, docs/context_parallel.md)")
    unknown = sorted(set(kwargs) - _IGNORED_KWARGS - _DEFAULT_ONLY_KWARGS)
    if unknown:
        raise TypeError(f"[{op}] unexpected keyword argument(s) {unknown}")


def _l2norm(x):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _prepare(op, family, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
             use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias, kwargs):
    per_channel = family == "kda"
    _check_kwargs(op, kwargs)
    _validate.check_bool(op, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    B, T, H, K, HV, V, scale = _validate.check_core(op, q, k, v, g, beta, scale, per_channel)
    if use_gate_in_kernel:
        _validate.check_gate_params(op, A_log, dt_bias, HV, K, per_channel, q.device)
    if lower_bound is not None and not use_gate_in_kernel:
        raise ValueError(f"[{op}] lower_bound applies to the fused gate: pass use_gate_in_kernel=True with it")
    _validate.check_lower_bound(op, lower_bound)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate_in_kernel:
        g = _gate(g, A_log, dt_bias, lower_bound, per_channel)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    return q, k, v, g, beta, scale, (B, T, H, K, HV, V)


def _to_k_first(state, state_v_first):
    if state is None:
        return None
    state = state.float()
    return (state.transpose(-1, -2) if state_v_first else state).contiguous()


def _from_k_first(state, state_v_first):
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def _chunk(op, family, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
           use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens,
           state_v_first, A_log, dt_bias, kwargs, mode="chunk"):
    _validate.check_bool(op, output_final_state=output_final_state, state_v_first=state_v_first)
    q, k, v, g, beta, scale, (B, T, H, K, HV, V) = _prepare(
        op, family, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias, kwargs)
    N = _validate.check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    _validate.check_state(op, "initial_state", initial_state, N, HV, K, V, state_v_first, q.device)
    cu = cu_seqlens.to(torch.long).contiguous() if cu_seqlens is not None else None
    fwd = getattr(ops, f"{family}_{mode}_fwd")
    h0 = _to_k_first(initial_state, state_v_first)
    plan = []
    if mode == "chunk" and cu is None and torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, h0)):
        plan = train_windows(B, T, HV, q.device.type)
    if plan:
        o, final_state = _windowed_fwd(fwd, plan, q, k, v, g, beta, scale, h0, output_final_state)
    else:
        o, final_state = fwd(q, k, v, g, beta, scale, h0, cu)
    return o, (_from_k_first(final_state, state_v_first) if output_final_state else None)


# ---------------------------------------------------------------- training windows (docs/ops.md)
# A long training call runs its forward as consecutive windows of the token axis through the same core op, each
# window starting from the previous one's final state. Autograd then runs the windows' backward ops one at a
# time, last first, each with the state it saved at its start (no recompute) and the dh0 of the window after it as
# grad_final_state, so the backward's working memory is one window's instead of the whole call's.
TRAIN_WINDOW_ENV = "KDA_TRAIN_WINDOW"
# The knob's value when the environment does not set it: 0 = off; -1 = automatic size (applied on CUDA tensors
# only when it comes from this default; an explicit KDA_TRAIN_WINDOW applies on every device).
TRAIN_WINDOW_DEFAULT = 0
_WINDOW_TOKEN_HEADS = 65536  # the CUDA host's kBwdWindowTokenHeads (delta_chunk_bwd_host.cuh)
_CHUNK = 64


def _cdiv(a, b):
    return -(-a // b)


def _train_window_knob(device_type):
    raw = os.environ.get(TRAIN_WINDOW_ENV, "").strip()
    if not raw:
        return TRAIN_WINDOW_DEFAULT if device_type == "cuda" else 0
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{TRAIN_WINDOW_ENV} must be an integer (tokens per window; -1 automatic, 0 off), "
                         f"got {raw!r}") from None


def train_windows(B, T, HV, device_type, knob=None):
    """The windows [(b0, nb, t0, nt), ...] of a fixed-length training call (sequences b0:b0+nb, tokens t0:t0+nt),
    in order; [] for none. knob None reads KDA_TRAIN_WINDOW: N > 0 = at most about N tokens (all sequences of a
    window together) per window, -1 = automatic (N = B * max(512, 65536 // (B * HV)), the token-heads of the CUDA
    backward's windows), 0 or unset = off (TRAIN_WINDOW_DEFAULT). Sequences are independent, so a batch is cut into
    groups of whole sequences first (each group's slice of a contiguous [B, T, ...] tensor is contiguous); a sequence
    longer than N runs alone, cut in time into balanced windows that start at multiples of the chunk (64 tokens),
    so every window's chunks are the unwindowed call's."""
    if knob is None:
        knob = _train_window_knob(device_type)
    if knob == 0 or knob < -1 or B <= 0 or T <= 0:
        return []
    budget = B * max(512, _WINDOW_TOKEN_HEADS // (B * HV)) if knob == -1 else knob
    if B * T <= budget:
        return []
    if T <= budget or T <= _CHUNK:
        nb = _cdiv(B, _cdiv(B, max(1, budget // T)))  # balanced groups: B = 5, at most 2 -> 2, 2, 1
        return [(b0, min(nb, B - b0), 0, T) for b0 in range(0, B, nb)]
    nw = _cdiv(T, _cdiv(budget, _CHUNK) * _CHUNK)
    per = _cdiv(_cdiv(T, nw), _CHUNK) * _CHUNK  # balanced: T = 8200, N = 2048 -> 5 windows of 1664 (last 1544)
    return [(b, 1, t0, min(per, T - t0)) for b in range(B) for t0 in range(0, T, per)]


def _windowed_fwd(fwd, plan, q, k, v, g, beta, scale, h0, output_final_state):
    """The core forward op window by window (plan from train_windows). Inputs are cut with one torch.split each
    over the flattened (batch, time) axis, so each input's gradient is assembled by one concatenation; o likewise."""
    B, T = q.shape[0], q.shape[1]
    sizes = [nb * nt for (_, nb, _, nt) in plan]
    cut = [torch.split(x.reshape((B * T,) + tuple(x.shape[2:])), sizes) for x in (q, k, v, g, beta)]
    starts = [nb for (_, nb, t0, _) in plan if t0 == 0]
    h0s = torch.split(h0, starts) if h0 is not None else [None] * len(starts)
    outs, finals, group = [], [], -1
    h = None
    for i, (_, nb, t0, nt) in enumerate(plan):
        if t0 == 0:
            group += 1
            h = h0s[group]
        xs = [c[i].view((nb, nt) + tuple(c[i].shape[1:])) for c in cut]
        o_w, h = fwd(*xs, scale, h, None)
        outs.append(o_w.view((nb * nt,) + tuple(o_w.shape[2:])))
        if t0 + nt == T:
            finals.append(h)
    o = torch.cat(outs).view((B, T) + tuple(outs[0].shape[1:]))
    if not output_final_state:
        return o, None
    return o, (finals[0] if len(finals) == 1 else torch.cat(finals))


# Positional order: flash-linear-attention 0.6.0's, argument for argument, as far as its own list goes (so calls
# written for fla bind the same way); this package's extras are keyword-only after it.
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, *, A_log=None, dt_bias=None,
              **kwargs):
    """Chunked Kimi Delta Attention (per-channel gate g [B, T, HV, K], log space). Returns (o, final_state|None).

    safe_gate and disable_recompute are accepted for fla compatibility and change nothing (the gate is exact for
    any values); return_intermediate_states must be False."""
    kwargs = dict(kwargs, return_intermediate_states=return_intermediate_states)
    return _chunk("chunk_kda", "kda", q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                  lower_bound, cu_seqlens, state_v_first, A_log, dt_bias, kwargs)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, *, use_gate_in_kernel=False, lower_bound=None,
                           A_log=None, dt_bias=None, **kwargs):
    """Chunked Gated DeltaNet (per-head gate g [B, T, HV], log space). Returns (o, final_state|None)."""
    return _chunk("chunk_gated_delta_rule", "gdn", q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                  lower_bound, cu_seqlens, state_v_first, A_log, dt_bias, kwargs)


def _check_serving(op, state_pool, ssm_state_indices, num_accepted_tokens, inplace_final_state, N, T,
                   cu_seqlens, HV, K, V, state_v_first, device):
    """Validate a state-pool call completely before anything is read or written. Returns the indices (int64)."""
    if state_pool is None:
        raise ValueError(f"[{op}] ssm_state_indices needs initial_state: the state pool [P, HV, K, V]")
    _validate.check_state(op, "initial_state", state_pool, None, HV, K, V, state_v_first, device, rows_desc="P")
    _validate.tensor("ssm_state_indices", ssm_state_indices, op)
    idx = ssm_state_indices
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dtype.is_complex:
        raise TypeError(f"[{op}] ssm_state_indices must be an integer tensor, got {idx.dtype}")
    if idx.dim() not in (1, 2) or idx.shape[0] != N:
        raise ValueError(f"[{op}] ssm_state_indices must be [N] or [N, T] with N={N} sequences, "
                         f"got {list(idx.shape)}")
    if idx.device != device:
        raise ValueError(f"[{op}] ssm_state_indices must be on q's device {device}, got {idx.device}")
    if idx.dim() == 2 and not inplace_final_state:
        raise ValueError(f"[{op}] per-token ssm_state_indices [N, T] write every token's state into the pool: "
                         f"they need inplace_final_state=True")
    if num_accepted_tokens is not None:
        _validate.tensor("num_accepted_tokens", num_accepted_tokens, op)
        if idx.dim() != 2:
            raise ValueError(f"[{op}] num_accepted_tokens needs per-token ssm_state_indices [N, T]")
        if list(num_accepted_tokens.shape) != [N] or num_accepted_tokens.dtype.is_floating_point:
            raise ValueError(f"[{op}] num_accepted_tokens must be an integer tensor [N] = [{N}], got "
                             f"{list(num_accepted_tokens.shape)} {num_accepted_tokens.dtype}")
        if num_accepted_tokens.device != device:
            raise ValueError(f"[{op}] num_accepted_tokens must be on q's device {device}, got "
                             f"{num_accepted_tokens.device}")
    if not _validate._tracing() and not _validate._capturing(idx):
        # one host read of the indices (skipped under torch.compile and while a CUDA graph is captured) serves the range, num_accepted_tokens and duplicate-write checks
        P = state_pool.shape[0]
        rows = idx.tolist()
        if idx.dim() == 2:  # per-token indices [N, T] (speculative decoding)
            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() if cu_seqlens is not None else [T] * N
            if idx.shape[1] < max(lens, default=0):
                raise ValueError(f"[{op}] per-token ssm_state_indices need a column per token: [N, >= "
                                 f"{max(lens)}], got {list(idx.shape)}")
        flat = rows if idx.dim() == 1 else [r for row in rows for r in row]
        if flat and max(flat) >= P:
            raise ValueError(f"[{op}] ssm_state_indices must be < the pool size P={P}, got max {max(flat)}")
        if idx.dim() == 1:  # one row per sequence: read and written back
            writes = [r for r in rows if r >= 0]
        else:  # one row per (active sequence, token)
            acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else [1] * N
            if num_accepted_tokens is not None and any(a < 1 or a > idx.shape[1] for a in acc):
                raise ValueError(f"[{op}] num_accepted_tokens must be in [1, {idx.shape[1]}], got {acc}")
            starts = [rows[n][acc[n] - 1] for n in range(N)]
            writes = [r for n in range(N) if starts[n] >= 0 for r in rows[n][:lens[n]] if r >= 0]
        if len(writes) != len(set(writes)):
            dup = sorted({r for r in writes if writes.count(r) > 1})
            raise ValueError(f"[{op}] ssm_state_indices write pool rows {dup} more than once in one call")
    return idx if idx.dtype == torch.long and idx.is_contiguous() else idx.to(torch.long).contiguous()


_Tensor = torch.Tensor
_FLOAT_DTYPES = frozenset(_validate._FLOATS)
_INF = float("inf")
# This build's CPU kernels (kernels_src/cpu, recurrent_serve_entry) check every tensor's device, contiguity,
# dtype and shape and the index range themselves, all before they read or write anything.
_CPU_KERNEL_CHECKS = NATIVE and _ops.BACKEND == "cpu"


def _serve_fast(family, q, k, v, g, beta, scale, pool, idx, output_final_state, state_v_first):
    """The plain serving call (decode): [N] indices into a pool, fp32 g and beta, nothing to pre-process, no
    gradient. Returns (o, state|None), or None on anything unusual or wrong: the full path (_recurrent below)
    then handles the call or raises its error naming the argument and what was expected.

    Every attribute read costs ~0.2 us and runs cold after a decode step (the state sweep evicts the
    interpreter's caches), so the checks here are one pass over plain attributes, no tensor ops, no messages.
    On this build's own CPU kernel, once every tensor is on the CPU, the checks that kernel repeats (contiguity,
    dtypes, shapes, index range; all before it touches memory) are left to it: a RuntimeError from it sends the
    call to the full path, which raises the clear error (or runs input it converts, e.g. int32 indices)."""
    T_ = _Tensor
    if (type(q) is not T_ or type(k) is not T_ or type(v) is not T_ or type(g) is not T_ or type(beta) is not T_
            or type(pool) is not T_ or type(idx) is not T_):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad
                                    or beta.requires_grad or pool.requires_grad):
        return None
    if g.dtype is not torch.float32 or beta.dtype is not torch.float32:
        return None
    qs = q.shape
    if len(qs) != 4:
        return None
    B, T, H, K = qs
    vs = v.shape
    if K == 0 or len(vs) != 4 or vs[3] == 0 or B == 0:
        return None
    if scale is None:
        scale = K ** -0.5
    elif type(scale) is not float or not 0.0 < scale < _INF:
        return None
    if _validate._tracing():
        return None
    # all on the CPU, so that dispatch reaches the CPU kernel (a meta or CUDA tensor among them would pick
    # another kernel, which need not check)
    native = (_CPU_KERNEL_CHECKS and q.is_cpu and k.is_cpu and v.is_cpu and g.is_cpu and beta.is_cpu and pool.is_cpu
              and idx.is_cpu)
    if not native:
        if k.shape != qs or vs[0] != B or vs[1] != T:
            return None
        HV = vs[2]
        if H == 0 or HV % H:
            return None
        if g.shape != ((B, T, HV, K) if family == "kda" else (B, T, HV)) or beta.shape != (B, T, HV):
            return None
        ps = pool.shape
        if (len(ps) != 4 or ps[1] != HV or (ps[2], ps[3]) != ((vs[3], K) if state_v_first else (K, vs[3]))
                or idx.shape != (B,)):
            return None
        qd = q.dtype
        if (qd not in _FLOAT_DTYPES or k.dtype is not qd or v.dtype is not qd or pool.dtype not in _FLOAT_DTYPES
                or idx.dtype is not torch.long):
            return None
        dev = q.device
        if (k.device != dev or v.device != dev or g.device != dev or beta.device != dev or pool.device != dev
                or idx.device != dev):
            return None
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and g.is_contiguous()
                and beta.is_contiguous() and pool.is_contiguous() and idx.is_contiguous()):
            return None
    if idx.dim() != 1:  # [N, T] per-token rows: the full path checks every row
        return None
    if (B > 1 or not native) and not _validate._capturing(idx):
        # the index values (one host read; not while a CUDA graph is captured): rows < P, no pool row written twice
        # (negative rows are padding)
        rows = idx.tolist()
        if max(rows) >= pool.shape[0]:
            return None
        writes = [r for r in rows if r >= 0]
        if len(writes) != len(set(writes)):
            return None
    serve = getattr(ops, _SERVE_NAME[family])
    serve = getattr(serve, "default", serve)
    if native:
        try:
            o = serve(q, k, v, g, beta, scale, pool, idx, None, None, state_v_first)
        except RuntimeError:
            return None
    else:
        o = serve(q, k, v, g, beta, scale, pool, idx, None, None, state_v_first)
    return o, (pool if output_final_state else None)


_SERVE_NAME = {"kda": "kda_recurrent_serve", "gdn": "gdn_recurrent_serve"}


def _recurrent(op, family, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens,
               ssm_state_indices, num_accepted_tokens, inplace_final_state, state_v_first, A_log, dt_bias, kwargs):
    if (ssm_state_indices is not None and inplace_final_state is True and not kwargs and cu_seqlens is None
            and num_accepted_tokens is None and use_qk_l2norm_in_kernel is False and use_gate_in_kernel is False
            and use_beta_sigmoid_in_kernel is False and (allow_neg_eigval is False or allow_neg_eigval is True)
            and lower_bound is None and A_log is None and dt_bias is None
            and (output_final_state is False or output_final_state is True)
            and (state_v_first is False or state_v_first is True)):
        out = _serve_fast(family, q, k, v, g, beta, scale, initial_state, ssm_state_indices, output_final_state,
                          state_v_first)
        if out is not None:
            return out
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError(f"[{op}] num_accepted_tokens needs ssm_state_indices")
        return _chunk(op, family, q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      lower_bound, cu_seqlens, state_v_first, A_log, dt_bias, kwargs, mode="recurrent")
    _validate.check_bool(op, output_final_state=output_final_state, state_v_first=state_v_first,
                         inplace_final_state=inplace_final_state)
    q, k, v, g, beta, scale, (B, T, H, K, HV, V) = _prepare(
        op, family, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias, kwargs)
    N = _validate.check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    cu = cu_seqlens.to(torch.long).contiguous() if cu_seqlens is not None else None
    pool = initial_state
    idx = _check_serving(op, pool, ssm_state_indices, num_accepted_tokens, inplace_final_state, N, T, cu, HV, K,
                         V, state_v_first, q.device)
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, g, beta, pool) if x is not None)
    if idx.dim() == 1 and (needs_grad or not inplace_final_state):
        # Differentiable path: gather the rows, run the core op, then write back (in place) or return them.
        active = (idx >= 0).view(N, 1, 1, 1)
        h0 = torch.where(active, pool[idx.clamp(min=0)].float(), torch.zeros((), device=q.device))
        fwd = getattr(ops, f"{family}_recurrent_fwd")
        o, final = fwd(q, k, v, g, beta, scale, _to_k_first(h0, state_v_first), cu)
        final = _from_k_first(final, state_v_first)
        o = _zero_skipped(o, idx, cu, B, T)
        if inplace_final_state:
            with torch.no_grad():
                rows = idx[idx >= 0]
                pool[rows] = final[idx >= 0].to(pool.dtype)
            return o, (pool if output_final_state else None)
        final = torch.where(active, final, torch.zeros((), device=q.device))
        return o, (final if output_final_state else None)
    serve = getattr(ops, f"{family}_recurrent_serve")
    nacc = num_accepted_tokens.to(torch.long).contiguous() if num_accepted_tokens is not None else None
    if pool.is_contiguous():
        o = serve(q, k, v, g, beta, scale, pool, idx, nacc, cu, state_v_first)
    else:
        # Core ops take contiguous tensors (docs/ops.md). A strided pool (a view into a bigger cache) is served
        # through a contiguous copy of the rows this call names, which are then written back through the view.
        rows = torch.unique(idx[idx >= 0])
        work = pool[rows].contiguous()
        local = torch.where(idx >= 0, torch.searchsorted(rows, idx), torch.full_like(idx, -1))
        o = serve(q, k, v, g, beta, scale, work, local, nacc, cu, state_v_first)
        pool[rows] = work
    return o, (pool if output_final_state else None)


def _zero_skipped(o, idx, cu, B, T):
    """Outputs of sequences whose pool index is negative are zero (they are padding slots)."""
    if cu is None:
        return o * (idx >= 0).to(o.dtype).view(B, 1, 1, 1)
    seq_of_token = torch.bucketize(torch.arange(T, device=o.device), cu[1:], right=True)
    keep = (idx >= 0)[seq_of_token.clamp(max=max(idx.numel() - 1, 0))] if idx.numel() else None
    return o if keep is None else o * keep.to(o.dtype).view(1, T, 1, 1)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, state_v_first=False,
                        cu_seqlens=None, *, ssm_state_indices=None, num_accepted_tokens=None,
                        inplace_final_state=True, **kwargs):
    """Token-by-token KDA; same results as chunk_kda, differentiable, plus state-pool serving arguments.

    With ssm_state_indices, initial_state is a state pool [P, HV, K, V] (docs/ops.md): sequence n starts from
    row ssm_state_indices[n] and, with inplace_final_state=True (default), its final state is written back
    there in place (the only argument this package ever modifies). [N, T] indices with num_accepted_tokens
    serve speculative decoding. Without ssm_state_indices, inplace_final_state has no effect.
    """
    return _recurrent("fused_recurrent_kda", "kda", q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      lower_bound, cu_seqlens, ssm_state_indices, num_accepted_tokens, inplace_final_state,
                      state_v_first, A_log, dt_bias, kwargs)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, *, lower_bound=None, ssm_state_indices=None,
                                     num_accepted_tokens=None, inplace_final_state=True, **kwargs):
    """Token-by-token Gated DeltaNet; see fused_recurrent_kda. fla 0.6.0's order: g, gk, gv, beta.

    g (per head) and beta are required; fla's per-key / per-value gates gk, gv are not supported (a per-key gate
    is KDA: fused_recurrent_kda)."""
    op = "fused_recurrent_gated_delta_rule"
    if gk is not None or gv is not None:
        hint = ""
        if gk is not None and beta is None and gv is None:
            hint = (" (the fifth positional argument is gk in flash-linear-attention 0.6.0's order q, k, v, g, gk, gv,"
                    " beta: pass beta=... by keyword)")
        raise ValueError(f"[{op}] gk / gv (per-key / per-value gates) are not supported{hint}; a per-key gate is "
                         "KDA: use fused_recurrent_kda")
    if g is None or beta is None:
        raise ValueError(f"[{op}] g (log decay [B, T, HV]) and beta ([B, T, HV]) are required")
    return _recurrent(op, "gdn", q, k, v, g, beta, scale, initial_state,
                      output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                      inplace_final_state, state_v_first, A_log, dt_bias, kwargs)
