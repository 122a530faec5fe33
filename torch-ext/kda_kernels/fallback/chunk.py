"""Pure-PyTorch chunked delta rule (KDA per-channel gates, GDN per-head gates), forward and backward.

Within a chunk of C tokens with state S0 at its start and cumulative log decay G_t (G relative to the chunk start):
    (I + A_kk diag(beta)) U = V - (K * exp(G)) S0             # U: the deltas v_t - (decayed S)^T k_t
    O  = scale * ((Q * exp(G)) S0 + (A_qk diag(beta)) U)
    S1 = exp(G_C) * S0 + (K * exp(G_C - G) * beta)^T U
with A_kk[t, j] = sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c]) for j < t and A_qk the same with q_t, j <= t.
For per-channel gates the pairwise decay is computed exactly: inside 16-token sub-chunks as a full
[16, 16, K] tensor, across sub-chunks factored around a reference token r with j <= r <= t, so both factors
exp(G_t - G_r) and exp(G_r - G_j) are <= 1 for log decays <= 0 (no overflow whatever the gate's size).

The backward replays one chunk at a time under autograd from the chunk-boundary states saved by a forward
sweep, carrying dS from the last chunk to the first: memory is one chunk's graph, not the sequence's.
"""
import torch

from .common import expand_heads, from_padded_batch, reduce_heads, replay_backward, to_padded_batch

CHUNK = 64
SUB = 16


def _kda_intra(q, k, G):
    """Exact A_qk (lower incl. diagonal) and A_kk (strictly lower) for per-channel decays. [..., C, K] -> [..., C, C].

    G is float64: exponents are differences of cumulative sums that can be large (-100s) while the differences
    are small, so they are formed in float64 and only the resulting factors (all <= 1) are rounded to float32.
    """
    C = q.shape[-2]
    dev = q.device
    tril = torch.ones(SUB, SUB, dtype=torch.bool, device=dev).tril()
    strict = tril.clone().fill_diagonal_(False)
    rows_qk, rows_kk = [], []
    for a in range(C // SUB):
        s = a * SUB
        qa, ka, Ga = q[..., s:s + SUB, :], k[..., s:s + SUB, :], G[..., s:s + SUB, :]
        D = Ga.unsqueeze(-2) - Ga.unsqueeze(-3)  # [..., 16(t), 16(j), K] = G_t - G_j
        E = torch.exp(torch.where(tril.unsqueeze(-1), D, torch.full_like(D, -float("inf")))).to(q.dtype)
        diag_qk = torch.einsum("...tc,...jc,...tjc->...tj", qa, ka, E)
        diag_kk = torch.einsum("...tc,...jc,...tjc->...tj", ka, ka, E).masked_fill(~strict, 0.0)
        parts_qk, parts_kk = [], []
        if s > 0:
            Gr = G[..., s - 1:s, :]  # reference token r = s - 1: j <= r < t
            kb = k[..., :s, :] * torch.exp(Gr - G[..., :s, :]).to(q.dtype)
            left = torch.exp(Ga - Gr).to(q.dtype)
            parts_qk.append((qa * left) @ kb.transpose(-1, -2))
            parts_kk.append((ka * left) @ kb.transpose(-1, -2))
        parts_qk.append(diag_qk)
        parts_kk.append(diag_kk)
        if s + SUB < C:
            z = q.new_zeros(q.shape[:-2] + (SUB, C - s - SUB))
            parts_qk.append(z)
            parts_kk.append(z)
        rows_qk.append(torch.cat(parts_qk, -1))
        rows_kk.append(torch.cat(parts_kk, -1))
    return torch.cat(rows_qk, -2), torch.cat(rows_kk, -2)


def _gdn_intra(q, k, G):
    """A_qk and A_kk for per-head decays: G [..., C] -> [..., C, C]."""
    C = q.shape[-2]
    tril = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = G.unsqueeze(-1) - G.unsqueeze(-2)
    E = torch.exp(torch.where(tril, D, torch.full_like(D, -float("inf")))).to(q.dtype)
    A_qk = (q @ k.transpose(-1, -2)) * E
    A_kk = ((k @ k.transpose(-1, -2)) * E).masked_fill(~tril.clone().fill_diagonal_(False), 0.0)
    return A_qk, A_kk


def chunk_step(q, k, v, g, beta, S, scale):
    """One chunk. q,k [b,h,C,K], v [b,h,C,V], g [b,h,C,K] or [b,h,C], beta [b,h,C], S [b,h,K,V] -> (o, S_next)."""
    per_channel = g.dim() == q.dim()
    G = g.double().cumsum(-2 if per_channel else -1)  # float64 exponents; see _kda_intra
    f32 = q.dtype
    if per_channel:
        A_qk, A_kk = _kda_intra(q, k, G)
        Gamma = torch.exp(G).to(f32)  # [b,h,C,K], <= 1
        G_last = G[..., -1:, :]  # [b,h,1,K]
        k_to_end = k * torch.exp(G_last - G).to(f32)
        decay_state = torch.exp(G_last).to(f32).transpose(-1, -2)  # [b,h,K,1]
    else:
        A_qk, A_kk = _gdn_intra(q, k, G)
        Gamma = torch.exp(G).to(f32).unsqueeze(-1)
        G_last = G[..., -1:]
        k_to_end = k * torch.exp(G_last - G).to(f32).unsqueeze(-1)
        decay_state = torch.exp(G_last).to(f32).unsqueeze(-1)  # [b,h,1,1]
    C = q.shape[-2]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    M = eye + A_kk * beta.unsqueeze(-2)
    rhs = torch.cat([v, k * Gamma], -1)
    sol = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
    Vd = v.shape[-1]
    u0, w = sol[..., :Vd], sol[..., Vd:]
    U = u0 - w @ S
    o = scale * ((q * Gamma) @ S + (A_qk * beta.unsqueeze(-2)) @ U)
    S_next = decay_state * S + (k_to_end * beta.unsqueeze(-1)).transpose(-1, -2) @ U
    return o, S_next


def _prepare(q, k, v, g, beta, cu_seqlens):
    """Common input shaping: fp32, GVA-expanded, varlen padded, time padded to the chunk, head-major chunks."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    q32, k32 = expand_heads(q.float(), HV), expand_heads(k.float(), HV)
    v32, g32, b32 = v.float(), g.float(), beta.float()
    valid = None
    if cu_seqlens is not None:
        q32, k32, v32, g32, b32, _, valid = to_padded_batch(cu_seqlens, q32, k32, v32, g32, b32)
    Tp = q32.shape[1]
    pad = (-Tp) % CHUNK
    if pad:
        def padt(x):
            return torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], 1)
        q32, k32, v32, g32, b32 = map(padt, (q32, k32, v32, g32, b32))
    # [N, Tp, HV, ...] -> [N, HV, Tp, ...]
    q32, k32, v32 = (x.transpose(1, 2) for x in (q32, k32, v32))
    g32 = g32.transpose(1, 2)
    b32 = b32.transpose(1, 2)
    return q32, k32, v32, g32, b32, Tp, valid


def _finish_o(o, Tp, valid, T, dtype):
    o = o[:, :, :Tp].transpose(1, 2)  # [N, Tp, HV, V]
    if valid is not None:
        o = from_padded_batch(o, valid, T)
    return o.to(dtype).contiguous()


def _chunks(x, i):
    return x[:, :, i * CHUNK:(i + 1) * CHUNK]


def _initial(initial_state, N, HV, K, V, ref):
    if initial_state is None:
        return ref.new_zeros(N, HV, K, V)
    return initial_state.float()


def delta_chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    qc, kc, vc, gc, bc, Tp, valid = _prepare(q, k, v, g, beta, cu_seqlens)
    N = qc.shape[0]
    S = _initial(initial_state, N, HV, K, Vd, qc)
    outs = []
    for i in range(qc.shape[2] // CHUNK):
        o, S = chunk_step(_chunks(qc, i), _chunks(kc, i), _chunks(vc, i), _chunks(gc, i), _chunks(bc, i), S, scale)
        outs.append(o)
    o = torch.cat(outs, 2) if outs else vc.new_zeros(N, HV, 0, Vd)
    return _finish_o(o, Tp, valid, T, q.dtype), S.contiguous()


def delta_chunk_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, grad_o, grad_final_state):
    """Gradients by replaying each chunk under autograd, last chunk first, carrying dS between chunks."""
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    with torch.no_grad():
        qc, kc, vc, gc, bc, Tp, valid = _prepare(q, k, v, g, beta, cu_seqlens)
        N = qc.shape[0]
        # grad_o in the same padded, head-major layout as the chunks
        do = grad_o.float()
        if valid is not None:
            (do, _, _) = to_padded_batch(cu_seqlens, do)
        do = torch.cat([do, do.new_zeros((do.shape[0], qc.shape[2] - do.shape[1]) + tuple(do.shape[2:]))], 1)
        do = do.transpose(1, 2)
    dS = grad_final_state.float() if grad_final_state is not None else qc.new_zeros(N, HV, K, Vd)
    (gq, gk, gv, gg, gb), dS = replay_backward(
        (qc, kc, vc, gc, bc), _initial(initial_state, N, HV, K, Vd, qc), do, dS,
        lambda ins, S: chunk_step(*ins, S, scale), CHUNK, dim=2)

    def back(x):  # head-major padded -> caller's layout
        x = x[:, :, :Tp].transpose(1, 2)
        return from_padded_batch(x, valid, T) if valid is not None else x

    dq = reduce_heads(back(gq), H).to(q.dtype)
    dk = reduce_heads(back(gk), H).to(k.dtype)
    dv = back(gv).to(v.dtype)
    dg = back(gg).contiguous()
    dbeta = back(gb).contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dg, dbeta, dS.contiguous()
