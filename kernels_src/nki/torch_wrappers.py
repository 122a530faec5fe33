"""Torch-facing wrappers of the NKI kernels: docs/ops.md layouts in, docs/ops.md layouts out.

Each function takes the core op's arguments (q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] or [B,T,HV]; beta
[B,T,HV]; states [N,HV,K,V] fp32; cu_seqlens [N+1] or None), re-lays them out per sequence and head with torch
ops on the tensors' own device, launches the kernels over an SPMD grid (sequence, value head) and returns
results in the contract's layout and dtypes. `register_neuron_impls(lib, namespace)` registers them for the
PrivateUse1 ("neuron") dispatch key.

Sizes: K <= 128 (the state's rows are the partitions); any V (tiled in launches of <= 128 value columns, which
are independent in the delta rule); any T (padded per sequence to a multiple of the chunk with g = beta = 0,
which leaves the state unchanged).
"""
import torch

from ._common import MAX_V, PMAX, SUB, chunk_layout
from .kda_chunk_bwd import kda_chunk_bwd_kernel
from .kda_chunk_fwd import kda_chunk_fwd_kernel
from .kda_recurrent_fwd import kda_recurrent_fwd_kernel

FWD_CHUNK = 128   # tokens per chunk of the forward kernel
BWD_CHUNK = 64    # tokens per checkpoint of the backward (its stash of decayed states must fit SBUF)

_consts_cache = {}


def chunk_constants(L, device=None):
    """The [L, W] fp32 mask constants of the chunked kernels (layout: _common.chunk_layout)."""
    key = (L, str(device))
    if key in _consts_cache:
        return _consts_cache[key]
    lay = chunk_layout(L)
    r = torch.arange(L)
    m, i = r[:, None], r[None, :]
    blocks = [m == i, m <= i, m > i, (m // SUB == i // SUB) & (m <= i)]
    for I in range(1, L // SUB):
        w = SUB * I
        jj = torch.arange(w)[None, :]
        blocks.append((jj < m) & (m <= w - 1))
    for lvl in range(lay["levels"]):
        s = 1 << lvl
        a, b = m, i
        blocks.append((a // (2 * s) == b // (2 * s)) & ((a // s) % 2 == 1) & ((b // s) % 2 == 0))
    out = torch.cat([blk.to(torch.float32) for blk in blocks], dim=1).contiguous()
    assert out.shape == (L, lay["W"]), (out.shape, lay)
    if device is not None:
        out = out.to(device)
    _consts_cache[key] = out
    return out


# ---------------------------------------------------------------- validation and layout
def _check_sizes(op, q, v, g):
    K, V = q.shape[-1], v.shape[-1]
    if K > PMAX:
        raise ValueError(f"[{op}] the NKI kernels need K <= {PMAX} (the state's rows live on the {PMAX} "
                         f"partitions); got K = {K} (last dimension of q and k)")
    if K < 1 or V < 1:
        raise ValueError(f"[{op}] empty head dimension: K = {K}, V = {V}")
    if g.dim() == 4 and g.shape[-1] != K:
        raise ValueError(f"[{op}] g's last dimension must equal K = {K}, got {g.shape[-1]}")


def _seq_bounds(B, T, cu_seqlens):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(0, cu[j], cu[j + 1]) for j in range(len(cu) - 1)]


def _pack(x, bounds, Tp):
    """[B, T, X, D] -> [N, X, Tp, D] (zero padded per sequence), contiguous."""
    N = len(bounds)
    out = x.new_zeros((N, Tp) + tuple(x.shape[2:]))
    for j, (b, s, e) in enumerate(bounds):
        if e > s:
            out[j, :e - s] = x[b, s:e]
    return out.transpose(1, 2).contiguous()


def _unpack(y, bounds, B, T):
    """[N, X, Tp, D] -> [B, T, X, D]."""
    y = y.transpose(1, 2)
    out = y.new_zeros((B, T) + tuple(y.shape[2:]))
    for j, (b, s, e) in enumerate(bounds):
        if e > s:
            out[b, s:e] = y[j, :e - s]
    return out


def _padded_len(bounds, L):
    longest = max([e - s for _, s, e in bounds] + [1])
    return -(-longest // L) * L


def _prepare(q, k, v, g, beta, cu_seqlens, L):
    B, T, H, K = q.shape
    HV = v.shape[2]
    if g.dim() == 3:   # GDN: one gate per head, the same for every channel
        g = g.unsqueeze(-1).expand(B, T, HV, K)
    bounds = _seq_bounds(B, T, cu_seqlens)
    Tp = _padded_len(bounds, L)
    P = dict(
        q=_pack(q, bounds, Tp), k=_pack(k, bounds, Tp), v=_pack(v, bounds, Tp),
        g=_pack(g.to(torch.float32), bounds, Tp), beta=_pack(beta.to(torch.float32).unsqueeze(-1), bounds, Tp))
    return P, bounds, Tp, HV // H


def _v_tiles(V):
    return [(s, min(s + MAX_V, V)) for s in range(0, V, MAX_V)]


def _initial(initial_state, N, HV, K, V, ref):
    if initial_state is None:
        return ref.new_zeros((N, HV, K, V), dtype=torch.float32)
    return initial_state.to(torch.float32).contiguous()


# ---------------------------------------------------------------- forward
def _chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, L=FWD_CHUNK, want_checkpoints=False):
    _check_sizes("chunk_fwd", q, v, g)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    P, bounds, Tp, rep = _prepare(q, k, v, g, beta, cu_seqlens, L)
    N = len(bounds)
    h0 = _initial(initial_state, N, HV, K, V, q)
    consts = chunk_constants(L, q.device)
    outs, finals, ckpts = [], [], []
    for s, e in _v_tiles(V):
        o, ht, hs = kda_chunk_fwd_kernel[N, HV](P["q"], P["k"], P["v"][..., s:e].contiguous(), P["g"], P["beta"],
                                                h0[..., s:e].contiguous(), consts, float(scale), rep)
        outs.append(o)
        finals.append(ht)
        ckpts.append(hs)
    o = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
    ht = torch.cat(finals, -1) if len(finals) > 1 else finals[0]
    o = _unpack(o.to(q.device), bounds, B, T).to(q.dtype)
    if want_checkpoints:
        return o, ht.to(q.device), (P, bounds, Tp, rep, ckpts)
    return o, ht.to(q.device)


def kda_chunk_fwd(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None):
    """Exact chunked forward (docs/ops.md kda_chunk_fwd / gdn_chunk_fwd): returns (o, final_state)."""
    return _chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def kda_recurrent_fwd(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, return_all_states=False):
    """Token-by-token forward (the decode kernel): returns (o, final_state[, states after every token])."""
    _check_sizes("recurrent_fwd", q, v, g)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    P, bounds, Tp, rep = _prepare(q, k, v, g, beta, cu_seqlens, 1)
    N = len(bounds)
    h0 = _initial(initial_state, N, HV, K, V, q)
    q_col, k_col, k_row = P["q"].unsqueeze(-1), P["k"].unsqueeze(-1), P["k"].unsqueeze(-2)
    g_col, b_col = P["g"].unsqueeze(-1), P["beta"].unsqueeze(-1)
    outs, finals, alls = [], [], []
    for s, e in _v_tiles(V):
        res = kda_recurrent_fwd_kernel[N, HV](q_col, k_col, k_row, P["v"][..., s:e].unsqueeze(-2).contiguous(),
                                              g_col, b_col, h0[..., s:e].contiguous(), float(scale), rep,
                                              store_states=return_all_states)
        outs.append(res[0].squeeze(-2))
        finals.append(res[1])
        if return_all_states:
            alls.append(res[2])
    o = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
    ht = torch.cat(finals, -1) if len(finals) > 1 else finals[0]
    o = _unpack(o.to(q.device), bounds, B, T).to(q.dtype)
    if return_all_states:
        hall = torch.cat(alls, -1) if len(alls) > 1 else alls[0]
        return o, ht.to(q.device), hall.to(q.device)     # hall [N, HV, Tp, K, V]
    return o, ht.to(q.device)


# ---------------------------------------------------------------- backward
def kda_chunk_bwd(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, grad_o=None, grad_final_state=None):
    """Exact backward: returns (dq, dk, dv, dg, dbeta, dh0) in the docs/ops.md layouts and dtypes."""
    _check_sizes("chunk_bwd", q, v, g)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gdn = g.dim() == 3
    _, _, (P, bounds, Tp, rep, ckpts) = _chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                                   L=BWD_CHUNK, want_checkpoints=True)
    N = len(bounds)
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    dO = _pack(grad_o.to(torch.float32), bounds, Tp)
    dht = (torch.zeros((N, HV, K, V), dtype=torch.float32, device=q.device) if grad_final_state is None
           else grad_final_state.to(torch.float32).contiguous())
    q_row, k_row = P["q"].unsqueeze(-2), P["k"].unsqueeze(-2)
    beta_row = P["beta"].squeeze(-1).unsqueeze(2).contiguous()        # [N, HV, 1, Tp]
    dq = dk = dg = dbeta = None
    dvs, dh0s = [], []
    for (s, e), hs in zip(_v_tiles(V), ckpts):
        r = kda_chunk_bwd_kernel[N, HV](P["q"], P["k"], P["g"], hs, q_row, k_row,
                                        P["v"][..., s:e].unsqueeze(-2).contiguous(),
                                        dO[..., s:e].unsqueeze(-2).contiguous(), beta_row,
                                        dht[..., s:e].contiguous(), float(scale), rep)
        tdq, tdk, tdv, tdg, tdb, tdh0 = [x.to(q.device) for x in r]
        dq = tdq if dq is None else dq + tdq          # q, k, g, beta gradients add up over V tiles
        dk = tdk if dk is None else dk + tdk
        dg = tdg if dg is None else dg + tdg
        dbeta = tdb if dbeta is None else dbeta + tdb
        dvs.append(tdv.squeeze(-2))
        dh0s.append(tdh0)
    dv = torch.cat(dvs, -1) if len(dvs) > 1 else dvs[0]
    dh0 = torch.cat(dh0s, -1) if len(dh0s) > 1 else dh0s[0]
    # per value head -> per q/k head (GVA: value head hv reads q/k head hv // rep)
    dq = dq.view(N, H, rep, Tp, K).sum(2)
    dk = dk.view(N, H, rep, Tp, K).sum(2)
    dq = _unpack(dq, bounds, B, T).to(q.dtype)
    dk = _unpack(dk, bounds, B, T).to(k.dtype)
    dv = _unpack(dv, bounds, B, T).to(v.dtype)
    dg = _unpack(dg, bounds, B, T)
    if gdn:
        dg = dg.sum(-1)
    dbeta = _unpack(dbeta.squeeze(2).unsqueeze(-1), bounds, B, T).squeeze(-1)
    return dq, dk, dv, dg, dbeta, dh0


kda_recurrent_bwd = kda_chunk_bwd   # the same exact gradient of the same recurrence


# ---------------------------------------------------------------- serving (state pool, in place)
def kda_recurrent_serve(q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens=None,
                        cu_seqlens=None, state_v_first=False):
    """docs/ops.md serving op: gathers the start rows of the pool, runs the decode kernel, scatters back."""
    _check_sizes("recurrent_serve", q, v, g)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    bounds = _seq_bounds(B, T, cu_seqlens)
    N = len(bounds)
    idx = ssm_state_indices.to(torch.long)
    multi = idx.dim() == 2
    if multi:
        acc = (torch.ones(N, dtype=torch.long, device=idx.device) if num_accepted_tokens is None
               else num_accepted_tokens.to(torch.long))
        start = idx.gather(1, (acc - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    else:
        start = idx
    live = start >= 0
    pool = state_pool.transpose(-1, -2) if state_v_first else state_pool
    h0 = torch.zeros((N, HV, K, V), dtype=torch.float32, device=q.device)
    if bool(live.any()):
        h0[live] = pool[start[live]].to(torch.float32)
    o, ht, hall = kda_recurrent_fwd(q, k, v, g, beta, scale, h0, cu_seqlens, return_all_states=True)
    o = o.clone()
    for j, (b, s, e) in enumerate(bounds):
        if not bool(live[j]):
            o[b, s:e] = 0
            continue
        if multi:
            for t in range(e - s):
                row = int(idx[j, t])
                if row >= 0:
                    pool[row] = hall[j, :, t].to(pool.dtype)
        elif e > s:
            pool[int(start[j])] = ht[j].to(pool.dtype)
    return o


# ---------------------------------------------------------------- registration
NEURON_IMPLS = {
    "chunk_fwd": kda_chunk_fwd,
    "chunk_bwd": kda_chunk_bwd,
    "recurrent_fwd": kda_recurrent_fwd,
    "recurrent_bwd": kda_recurrent_bwd,
    "recurrent_serve": kda_recurrent_serve,
}


def register_neuron_impls(lib, namespace=None, dispatch_key="PrivateUse1"):
    """Register the NKI implementations of every core op (kda_* and gdn_*) on `lib` for the neuron device.

    `lib` is a torch.library.Library for the ops' namespace (kind "DEF" or "IMPL"); `namespace` is accepted
    for symmetry with the other backends and checked against lib.ns when given. Returns the registered names.
    """
    if namespace is not None and getattr(lib, "ns", namespace) != namespace:
        raise ValueError(f"register_neuron_impls: library namespace {lib.ns!r} != {namespace!r}")
    names = []
    for family in ("kda", "gdn"):
        for suffix, fn in NEURON_IMPLS.items():
            name = f"{family}_{suffix}"
            impl = _make_impl(name, fn)
            lib.impl(name, impl, dispatch_key)
            names.append(name)
    return names


def _make_impl(name, fn):
    if name.endswith("_bwd"):
        def impl(q, k, v, g, beta, scale, initial_state, cu_seqlens, grad_o, grad_final_state):
            return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens, grad_o, grad_final_state)
    elif name.endswith("_serve"):
        def impl(q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                 state_v_first):
            return fn(q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                      state_v_first)
    else:
        def impl(q, k, v, g, beta, scale, initial_state, cu_seqlens):
            return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    impl.__name__ = f"_{name}_neuron"
    return impl
