"""Layout helpers shared by the pure-PyTorch chunked and recurrent implementations."""
import torch


def to_padded_batch(cu_seqlens, *xs):
    """Varlen [1, T, ...] tensors -> padded [N, Tmax, ...] (zeros after each sequence's end).

    Zero padding is harmless for the delta rule when g (log decay) and beta are padded with zeros too:
    the state is then unchanged by a padded token and padded outputs are dropped by `from_padded_batch`.
    Returns (padded tensors..., gather index [N, Tmax], valid mask [N, Tmax]).
    """
    cu = cu_seqlens.to(torch.long)
    lens = cu[1:] - cu[:-1]
    n = lens.numel()
    tmax = int(lens.max()) if n > 0 else 0
    pos = torch.arange(tmax, device=cu.device)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)  # [N, Tmax]
    total = xs[0].shape[1]
    idx = (cu[:-1].unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(total - 1, 0))
    out = []
    for x in xs:
        flat = x[0]  # [T, ...]
        if total == 0:
            padded = flat.new_zeros((n, tmax) + tuple(flat.shape[1:]))
        else:
            padded = flat[idx.reshape(-1)].reshape((n, tmax) + tuple(flat.shape[1:]))
            mask = valid.reshape((n, tmax) + (1,) * (flat.dim() - 1))
            padded = torch.where(mask, padded, torch.zeros((), dtype=padded.dtype, device=padded.device))
        out.append(padded)
    return (*out, idx, valid)


def from_padded_batch(padded, valid, total):
    """Inverse of to_padded_batch for an output [N, Tmax, ...] -> [1, total, ...]."""
    return padded[valid].reshape((1, total) + tuple(padded.shape[2:]))


def expand_heads(x, hv):
    """GVA: q/k [B, T, H, K] -> [B, T, HV, K]; value head hv reads q/k head hv // (HV // H)."""
    h = x.shape[2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=2)


def reduce_heads(dx, h):
    """Sum gradients of expanded q/k heads back onto their H source heads."""
    b, t, hv, k = dx.shape
    return dx if h == hv else dx.reshape(b, t, h, hv // h, k).sum(3)
