"""Pure-PyTorch recurrent (token by token) delta rule, forward, backward and the in-place serving step.

Token step, per value head (S is K x V, fp32):
    S <- exp(g_t) * S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = scale * S^T q_t
The backward keeps the state every SEGMENT tokens, replays one segment under autograd and walks the
segments last to first carrying dS, so memory holds one segment's graph.
"""
import torch

from .common import expand_heads, from_padded_batch, reduce_heads, replay_backward, to_padded_batch

SEGMENT = 64


def recurrent_step(q, k, v, g, beta, S, scale):
    """q,k [b,h,K], v [b,h,V], g [b,h,K] or [b,h], beta [b,h], S [b,h,K,V] -> (o [b,h,V], S)."""
    decay = torch.exp(g)
    S = S * (decay.unsqueeze(-1) if decay.dim() == q.dim() else decay[..., None, None])
    pred = (S * k.unsqueeze(-1)).sum(-2)
    S = S + (beta.unsqueeze(-1) * k).unsqueeze(-1) * (v - pred).unsqueeze(-2)
    o = scale * (S * q.unsqueeze(-1)).sum(-2)
    return o, S


def _run(q, k, v, g, beta, S, scale, t0, t1):
    outs = []
    for t in range(t0, t1):
        o, S = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, scale)
        outs.append(o)
    return (torch.stack(outs, 1) if outs else v.new_zeros(v.shape[0], 0, *v.shape[2:])), S


def _prepare(q, k, v, g, beta, cu_seqlens):
    HV = v.shape[2]
    xs = (expand_heads(q.float(), HV), expand_heads(k.float(), HV), v.float(), g.float(), beta.float())
    if cu_seqlens is None:
        return (*xs, None)
    *xs, _, valid = to_padded_batch(cu_seqlens, *xs)
    return (*xs, valid)


def delta_recurrent_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    q32, k32, v32, g32, b32, valid = _prepare(q, k, v, g, beta, cu_seqlens)
    N = q32.shape[0]
    S = initial_state.float() if initial_state is not None else q32.new_zeros(N, HV, K, Vd)
    o, S = _run(q32, k32, v32, g32, b32, S, scale, 0, q32.shape[1])
    if valid is not None:
        o = from_padded_batch(o, valid, T)
    return o.to(q.dtype).contiguous(), S.contiguous()


def delta_recurrent_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, grad_o, grad_final_state):
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    with torch.no_grad():
        q32, k32, v32, g32, b32, valid = _prepare(q, k, v, g, beta, cu_seqlens)
        N = q32.shape[0]
        do = grad_o.float()
        if valid is not None:
            do, _, _ = to_padded_batch(cu_seqlens, do)
        S0 = initial_state.float() if initial_state is not None else q32.new_zeros(N, HV, K, Vd)
    dS = grad_final_state.float() if grad_final_state is not None else q32.new_zeros(N, HV, K, Vd)
    grads, dS = replay_backward((q32, k32, v32, g32, b32), S0, do, dS,
                                lambda ins, S: _run(*ins, S, scale, 0, ins[0].shape[1]), SEGMENT, dim=1)

    def back(x):
        return from_padded_batch(x, valid, T) if valid is not None else x

    dq = reduce_heads(back(grads[0]), H).to(q.dtype).contiguous()
    dk = reduce_heads(back(grads[1]), H).to(k.dtype).contiguous()
    dv = back(grads[2]).to(v.dtype).contiguous()
    return dq, dk, dv, back(grads[3]).contiguous(), back(grads[4]).contiguous(), dS.contiguous()


def delta_recurrent_serve(q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens,
                          cu_seqlens, state_v_first):
    """In-place decode on a state pool (docs/ops.md). Returns o; writes the pool rows the indices name."""
    B, T, H, K = q.shape
    HV, Vd = v.shape[2], v.shape[3]
    pool = state_pool.transpose(-1, -2) if state_v_first else state_pool  # a view: writes reach the pool
    q32, k32, v32, g32, b32, valid = _prepare(q, k, v, g, beta, cu_seqlens)
    N, Tp = q32.shape[0], q32.shape[1]
    idx = ssm_state_indices.to(torch.long)
    per_token = idx.dim() == 2
    if per_token:
        start_col = (num_accepted_tokens.to(torch.long) - 1) if num_accepted_tokens is not None \
            else torch.zeros(N, dtype=torch.long, device=idx.device)
        start = idx.gather(1, start_col.view(N, 1)).view(N)
    else:
        start = idx
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() if cu_seqlens is not None else [T] * N
    active = start >= 0
    S = torch.zeros(N, HV, K, Vd, dtype=torch.float32, device=q.device)
    if bool(active.any()):
        S[active] = pool[start[active]].float()
    o = torch.zeros(N, Tp, HV, Vd, dtype=torch.float32, device=q.device)
    for t in range(Tp):
        o[:, t], S_new = recurrent_step(q32[:, t], k32[:, t], v32[:, t], g32[:, t], b32[:, t], S, scale)
        # sequences already past their end keep their state (their padded g = beta = 0 keep it anyway)
        S = S_new
        if per_token and t < idx.shape[1]:
            for n in range(N):
                row = int(idx[n, t])
                if bool(active[n]) and t < lens[n] and row >= 0:
                    pool[row] = S[n].to(pool.dtype)
    if not per_token:
        for n in range(N):
            if bool(active[n]):
                pool[int(start[n])] = S[n].to(pool.dtype)
    o = o * active.view(N, 1, 1, 1)
    if valid is not None:
        o = from_padded_batch(o, valid, T)
    return o.to(q.dtype).contiguous()
