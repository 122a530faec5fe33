"""Gate activations (DESIGN.md section 1), differentiable PyTorch in float32.

KDA:  g = -exp(A_log[h]) * softplus(g + dt_bias[h, c])          A_log [HV], dt_bias [HV*K]
GDN:  g = -exp(A_log[h]) * softplus(g + dt_bias[h])             A_log [HV], dt_bias [HV]
With lower_bound: g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), bounded in (lower_bound, 0).
"""
import torch
import torch.nn.functional as F

from . import _validate


def _gate(g, A_log, dt_bias, lower_bound, per_channel):
    # Computed in float64 (cheap: elementwise) so that the reductions of its backward over B*T*K into
    # dA_log / dt_bias keep fp32 inputs within the 1e-5 budget of DESIGN.md section 6.
    HV = A_log.shape[0]
    g = g.double()
    if dt_bias is not None:
        g = g + (dt_bias.double().reshape(HV, -1) if per_channel else dt_bias.double())
    a = A_log.double().exp()
    if per_channel:
        a = a.view(HV, 1)
    if lower_bound is None:
        out = -a * F.softplus(g)
    else:
        out = lower_bound * torch.sigmoid(a * g)
    return out.float()


def fused_kda_gate(g, A_log, dt_bias=None, lower_bound=None, head_k_dim=None, **kwargs):
    """Per-channel KDA gate. g: [..., HV, K], or [..., HV*K] with head_k_dim=K. Returns float32 [..., HV, K]."""
    op = "fused_kda_gate"
    _validate.check_gate_inputs(op, g, A_log, dt_bias, lower_bound)
    HV = A_log.shape[0] if A_log.dim() == 1 else -1
    if A_log.dim() != 1:
        raise ValueError(f"[{op}] A_log must be [HV], got {list(A_log.shape)}")
    if head_k_dim is not None:
        if g.shape[-1] != HV * head_k_dim:
            raise ValueError(f"[{op}] g's last dim must be HV*head_k_dim = {HV * head_k_dim}, got {g.shape[-1]}")
        g = g.unflatten(-1, (HV, head_k_dim))
    if g.dim() < 2 or g.shape[-2] != HV:
        raise ValueError(f"[{op}] g must be [..., HV, K] with HV={HV} (A_log.shape[0]), got {list(g.shape)}")
    K = g.shape[-1]
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"[{op}] dt_bias must have HV*K = {HV * K} elements, got {list(dt_bias.shape)}")
    return _gate(g, A_log, dt_bias, lower_bound, per_channel=True)


def fused_gdn_gate(g, A_log, dt_bias=None, lower_bound=None, **kwargs):
    """Per-head GDN gate. g: [..., HV]. Returns float32 [..., HV]."""
    op = "fused_gdn_gate"
    _validate.check_gate_inputs(op, g, A_log, dt_bias, lower_bound)
    if A_log.dim() != 1 or g.shape[-1] != A_log.shape[0]:
        raise ValueError(f"[{op}] g must be [..., HV] and A_log [HV]; got g {list(g.shape)}, "
                         f"A_log {list(A_log.shape)}")
    if dt_bias is not None and list(dt_bias.shape) != list(A_log.shape):
        raise ValueError(f"[{op}] dt_bias must be [HV] = {list(A_log.shape)}, got {list(dt_bias.shape)}")
    return _gate(g, A_log, dt_bias, lower_bound, per_channel=False)
