"""Independent float64 reference of DESIGN.md section 1: a plain token loop, no chunking, no shared code
with the package. Tests compare every backend against this, and autograd through it gives reference gradients.
"""
import torch
import torch.nn.functional as F


def ref_gate(g, A_log, dt_bias=None, lower_bound=None, per_channel=True):
    """g_out = -exp(A_log) * softplus(g + dt_bias), or lower_bound * sigmoid(exp(A_log) * (g + dt_bias))."""
    g = g.double()
    HV = A_log.shape[0]
    if dt_bias is not None:
        g = g + (dt_bias.double().view(HV, -1) if per_channel else dt_bias.double())
    a = A_log.double().exp()
    if per_channel:
        a = a.view(HV, 1)
    if lower_bound is None:
        return -a * F.softplus(g)
    return lower_bound * torch.sigmoid(a * g)


def ref_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                   use_qk_l2norm=False, use_beta_sigmoid=False, allow_neg_eigval=False,
                   A_log=None, dt_bias=None, lower_bound=None, use_gate=False, state_v_first=False):
    """Returns (o float64 [B,T,HV,V], final_state float64 [N,HV,K,V] (or [N,HV,V,K] if state_v_first)).

    g: [B,T,HV,K] (KDA, per channel) or [B,T,HV] (GDN, per head). All math in float64.
    """
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    per_channel = g.dim() == 4
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm:
        # x / sqrt(sum(x^2) + 1e-6), as flash-linear-attention and Transformers define it
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta) * (2.0 if allow_neg_eigval else 1.0)
    if use_gate:
        g = ref_gate(g, A_log, dt_bias, lower_bound, per_channel)
    g = g.double()
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        seqs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = q.new_zeros(B, T, HV, V)
    finals = []
    for n, (b, s, e) in enumerate(seqs):
        if initial_state is not None:
            S = initial_state[n].double()
            if state_v_first:
                S = S.transpose(-1, -2)
            S = S.clone()
        else:
            S = q.new_zeros(HV, K, V)
        for t in range(s, e):
            qt = q[b, t].repeat_interleave(G, dim=0)  # [HV, K]
            kt = k[b, t].repeat_interleave(G, dim=0)
            decay = g[b, t].exp()
            S = S * (decay.unsqueeze(-1) if per_channel else decay.view(HV, 1, 1))
            pred = torch.einsum("hkv,hk->hv", S, kt)
            delta = v[b, t] - pred
            S = S + beta[b, t].view(HV, 1, 1) * kt.unsqueeze(-1) * delta.unsqueeze(-2)
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, qt)
        finals.append(S.transpose(-1, -2) if state_v_first else S)
    return o, torch.stack(finals) if finals else q.new_zeros(0, HV, K, V)


def rel_err(ref, out):
    """RMS(ref - out) / RMS(ref): the metric of DESIGN.md section 6 (flash-linear-attention's)."""
    ref = ref.detach().double()
    out = out.detach().double()
    if ref.numel() == 0:
        return 0.0
    den = ref.pow(2).mean().sqrt()
    num = (ref - out).pow(2).mean().sqrt()
    if den == 0:
        return float(num)
    return float(num / den)


def assert_close(name, ref, out, tol):
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values in output"
    err = rel_err(ref, out)
    assert err <= tol, f"{name}: relative RMS error {err:.3g} > {tol}"
