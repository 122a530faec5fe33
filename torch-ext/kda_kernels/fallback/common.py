"""Helpers shared by the pure-PyTorch chunked and recurrent implementations: layouts and the replayed backward."""
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


def replay_backward(xs, S0, do, dS, run_block, block, dim):
    """Gradients of a blockwise scan by checkpoint and replay (the chunked and the recurrent fallback share it).

    xs: the scan's inputs, blocked along `dim`; run_block(ins, S) -> (o, S_next) runs one block from state S.
    A no-grad sweep keeps the state at each block start; then, last block first, each block is re-run under
    autograd from its saved state, its inputs' gradients are taken and dS is carried to the block before.
    Memory: the block-start states plus one block's graph. Returns (grads of xs, grad of S0).
    """
    T = xs[0].shape[dim]
    starts = list(range(0, T, block))

    def cut(x, t0):
        return x.narrow(dim, t0, min(block, T - t0))

    with torch.no_grad():
        states, S = [], S0
        for t0 in starts:
            states.append(S)
            if t0 + block < T:  # the last block's final state is not needed
                _, S = run_block([cut(x, t0) for x in xs], S)
    grads = [torch.zeros_like(x) for x in xs]
    for t0, S_start in zip(reversed(starts), reversed(states)):
        ins = [cut(x, t0).detach().requires_grad_(True) for x in xs]
        S_in = S_start.detach().requires_grad_(True)
        with torch.enable_grad():
            o, S_out = run_block(ins, S_in)
            gi = torch.autograd.grad((o, S_out), ins + [S_in], (cut(do, t0), dS), allow_unused=True)
        for acc, d in zip(grads, gi[:-1]):
            if d is not None:
                cut(acc, t0).copy_(d)
        dS = gi[-1]
    return grads, dS
