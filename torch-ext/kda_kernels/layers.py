"""nn.Modules for `kernels.kernelize`: Transformers' delta-rule functions, routed to this package.

Transformers (5.x) wraps four functions of its Kimi-Linear, Qwen3-Next and Qwen3.5 modeling code with
`use_kernel_func_from_hub_with_fallback`, which makes each one a module that `kernelize` can re-point:

    Transformers layer key              its torch fallback                      layer here
    chunk_kda                           chunk_kimi_delta_attention              chunk_kimi_delta_attention
    fused_recurrent_kda                 recurrent_kimi_delta_attention          recurrent_kimi_delta_attention
    chunk_gated_delta_rule              torch_chunk_gated_delta_rule            chunk_gated_delta_rule
    fused_recurrent_gated_delta_rule    torch_recurrent_gated_delta_rule        recurrent_gated_delta_rule
    causal_conv1d_fn                    causal_conv1d_fn (torch conv1d)         causal_conv1d_fn (optional, see below)

Each `forward` has the parameters of the function it replaces, in the same order and of the same kinds (the
kernels library checks count and kinds), because the models call them as
`fn(query, key, value, g=..., beta=..., initial_state=..., output_final_state=..., use_qk_l2norm_in_kernel=True,
**kwargs)`. Layers are stateless: no `__init__`, only `forward` and the `has_backward` / `can_torch_compile` flags.

Packed sequences: the models forward their keyword arguments. A packed batch (B == 1) is described by
`cu_seqlens` or, as Transformers' flash-attention packing passes it, `cu_seq_lens_q`; `seq_idx` ([1, T] sequence
id per token) is accepted too. The causal conv1d in front of the delta rule must not mix sequences either, and
Transformers' torch conv does (it raises on `cu_seqlens`, and silently mixes with `cu_seq_lens_q`), so
`causal_conv1d_fn` here is a varlen-aware depthwise causal conv (pure PyTorch) to register alongside on devices
without a native one. See docs/transformers.md.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from .api import chunk_gated_delta_rule as _chunk_gdn
from .api import chunk_kda as _chunk_kda
from .api import fused_recurrent_gated_delta_rule as _recurrent_gdn
from .api import fused_recurrent_kda as _recurrent_kda

__all__ = [
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "causal_conv1d_fn",
]


def _packing(batch_size, kwargs):
    """cu_seqlens [N+1] (int64) of a packed batch from the keyword arguments a model forwards, or None."""
    cu = kwargs.get("cu_seqlens")
    if cu is None and batch_size == 1:
        cu = kwargs.get("cu_seq_lens_q")
    if cu is None and batch_size == 1 and kwargs.get("seq_idx") is not None:
        cu = _cu_from_seq_idx(kwargs["seq_idx"])
    return None if cu is None else cu.to(torch.long)


def _cu_from_seq_idx(seq_idx):
    """[1, T] sequence id per token (non-decreasing, from 0) -> cu_seqlens [N+1]."""
    ids = seq_idx.reshape(-1).to(torch.long)
    counts = torch.bincount(ids, minlength=int(ids.max()) + 1 if ids.numel() else 1)
    return F.pad(counts.cumsum(0), (1, 0))


def _delta(fn, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs):
    # g and beta by keyword: fla 0.6.0's fused_recurrent_gated_delta_rule has gk, gv before beta
    return fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
              output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
              cu_seqlens=_packing(query.shape[0], kwargs))


class chunk_kimi_delta_attention(nn.Module):
    """Replaces Transformers' `chunk_kimi_delta_attention` (layer key `chunk_kda`) with `chunk_kda`.

    query, key [B, T, H, K]; value [B, T, HV, V]; g [B, T, HV, K] log-space decay; beta [B, T, HV] (already
    sigmoid-ed by the model); initial_state [B, HV, K, V]. `chunk_size` is accepted and ignored (the kernels pick
    their own). Returns (o [B, T, HV, V] in query's dtype, final state float32 or None).
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _delta(_chunk_kda, query, key, value, g, beta, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, kwargs)


class recurrent_kimi_delta_attention(nn.Module):
    """Replaces Transformers' `recurrent_kimi_delta_attention` (layer key `fused_recurrent_kda`), used to decode,
    with `fused_recurrent_kda`. Differentiable, unlike flash-linear-attention's."""

    has_backward = True
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _delta(_recurrent_kda, query, key, value, g, beta, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, kwargs)


class chunk_gated_delta_rule(nn.Module):
    """Replaces Transformers' `torch_chunk_gated_delta_rule` (layer key `chunk_gated_delta_rule`; Qwen3-Next,
    Qwen3.5) with `chunk_gated_delta_rule`. g is [B, T, HV], one decay per head."""

    has_backward = True
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _delta(_chunk_gdn, query, key, value, g, beta, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, kwargs)


class recurrent_gated_delta_rule(nn.Module):
    """Replaces Transformers' `torch_recurrent_gated_delta_rule` (layer key `fused_recurrent_gated_delta_rule`)
    with `fused_recurrent_gated_delta_rule`."""

    has_backward = True
    can_torch_compile = True

    def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        return _delta(_recurrent_gdn, query, key, value, g, beta, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, kwargs)


class causal_conv1d_fn(nn.Module):
    """Depthwise causal conv1d that keeps packed sequences apart (layer key `causal_conv1d_fn`).

    hidden_states [B, D, T]; weight [D, W]; bias [D] or None; activation None, "silu" or "swish". With packing
    (cu_seqlens / cu_seq_lens_q / seq_idx, B == 1) a token only sees earlier tokens of its own sequence; without,
    it equals Transformers' torch fallback. Pure PyTorch, differentiable.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"[causal_conv1d_fn] activation must be None, 'silu' or 'swish', got {activation!r}")
        B, D, T = hidden_states.shape
        W = weight.shape[-1]
        x = hidden_states.to(weight.dtype)
        cu = _packing(B, kwargs)
        if cu is None:
            out = F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=D)[:, :, :T]
        else:
            # position of each token inside its sequence; tap j (looking j tokens back) only where pos >= j
            t = torch.arange(T, device=x.device)
            starts = cu[torch.bucketize(t, cu[1:], right=True).clamp(max=cu.numel() - 2)]
            pos = t - starts
            xp = F.pad(x, (W - 1, 0))
            out = x.new_zeros(B, D, T) if bias is None else bias.to(x.dtype).view(1, D, 1).expand(B, D, T)
            for j in range(W):
                shifted = xp[:, :, W - 1 - j:W - 1 - j + T]
                out = out + shifted * weight[:, W - 1 - j].view(1, D, 1) * (pos >= j).to(x.dtype)
        if activation is not None:
            out = F.silu(out)
        return out.to(hidden_states.dtype)
