"""Context parallelism: one long sequence (or a packed varlen batch) split along time across the ranks of a
torch.distributed process group, forward and backward. docs/context_parallel.md has the full derivation.

The per-token update S <- (I - beta k k^T) Diag(exp g) S + beta k v^T (state S is [K, V], K-first) is affine
in S, so a rank's whole slice is an affine map  S_out = P S_in + Q  with P [K, K] and Q [K, V] per value head.
Every column of S evolves independently with the matching column of v, so ONE core-op call on this rank's
slice with the value width extended to K + V,

    v' = [0_K | v]          initial state [I_K | 0]

returns the final state [P | Q] and the output [o_P | o_Q], where o_Q is the output from a zero initial state
and o_P[t] = scale * P_t^T q_t. Once the true incoming state S_in is known the true output is

    o = o_Q + o_P S_in            (and the state at the end of the slice is Q + P S_in)

so no second pass over the tokens is needed. The ranks all_gather their (P, Q) (bytes independent of T),
every rank composes the maps of the ranks before it to get its S_in, and finishes. The backward is the same
scan reversed: the ranks all_gather their local dL/dS_in (K x V per head) and each rank sums the
contributions of the ranks after it through their P^T to get dL/dS_out, from which dP = dS_out S_in^T and
dQ = dS_out; autograd through the core ops does the rest (dq, dk, dv, dg, dbeta, d initial_state).

A rank whose slice does not continue a sequence from the previous rank (rank 0; a varlen slice that starts on
a sequence boundary) needs no S_in and runs the plain core op at width V.

Varlen convention (see `split_varlen`): each rank passes the cu_seqlens of its own slice (starting at 0,
ending at its local T) and `continues_from_prev`: True when its first local sequence is the continuation of
the last local sequence of the previous rank. Rows of `initial_state` are per local sequence; the row of a
continued sequence is ignored (its state comes from the previous rank). Row n of the returned final state is
the true state after the last token of local sequence n on this rank, i.e. the sequence's final state when it
ends on this rank, the state at the rank boundary when it continues on the next rank.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _validate
from .api import _from_k_first, _prepare, _to_k_first, _check_kwargs
from .ops import has_stages, ops

__all__ = ["chunk_kda_cp", "chunk_gated_delta_rule_cp", "split_varlen", "balanced_bounds", "CPSlice"]

_TRANSITIONS = ("fused", "split")
_SCHEDULES = ("auto", "relay", "affine")
_RELAY_MAX_RANKS = 4  # schedule="auto" relays up to this many ranks (see _pick_schedule)


# ---------------------------------------------------------------- collectives with autograd
def _group_info(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(x, group):
    W, _ = _group_info(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(parts, x, group=group)
    return parts


def _peer(group, r):
    return dist.get_global_rank(group, r) if group is not dist.group.WORLD else r


def _send(x, dst, group):
    """Sends x to rank `dst` of `group` (the relay's point-to-point traffic; one place to count it)."""
    dist.isend(x.contiguous(), _peer(group, dst), group=group).wait()


def _irecv(x, src, group):
    return dist.irecv(x, _peer(group, src), group=group)


class _StateScan(torch.autograd.Function):
    """(P_r [M,HV,K,K], Q_r [M,HV,K,V]) on every rank r  ->  S_in_r, the state entering rank r.

    S_in_0 = 0 and S_in_{j+1} = P_j S_in_j + Q_j. Forward: one all_gather of [P | Q]. Backward: one all_gather of
    the local dL/dS_in, then E_r = dL/dS_out_r = sum over j > r of the chain G_j + P_j^T(...) (reverse scan).
    `anchor` (any input of the call that requires grad, or None) only puts this node into the graph on every
    rank whose call is differentiable, so that the backward's collective runs on all ranks even where P and Q
    do not depend on anything differentiable (an empty slice without initial state).
    """

    @staticmethod
    def forward(ctx, P, Q, group, anchor):
        W, r = _group_info(group)
        K = P.shape[-1]
        parts = _all_gather(torch.cat([P, Q], -1), group)
        S = torch.zeros_like(Q)
        for j in range(r):
            S = torch.matmul(parts[j][..., :K], S) + parts[j][..., K:]
        ctx.group = group
        ctx.K = K
        later = [parts[j][..., :K] for j in range(r + 1, W)]
        ctx.save_for_backward(S, *later)
        return S

    @staticmethod
    def backward(ctx, dS_in):
        S_in, *later = ctx.saved_tensors
        W, r = _group_info(ctx.group)
        G = _all_gather(dS_in, ctx.group)
        E = torch.zeros_like(S_in)
        for j in range(W - 1, r, -1):  # E = dL/dS_in_{j} total, walking back to dL/dS_out_r
            E = G[j] + torch.matmul(later[j - r - 1].transpose(-1, -2), E)
        dP = torch.matmul(E, S_in.transpose(-1, -2))
        return dP, E, None, None


class _Tie(torch.autograd.Function):
    """Returns x unchanged but makes it depend on s (zero gradient), so that every rank's backward reaches the
    scan's collective even where the result does not use S_in (a rank that does not continue a sequence)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s_meta = (s.shape, s.dtype, s.device)
        # detach(): same storage and version counter, but not an autograd view, so in-place ops on the result
        # stay legal (a view returned from a custom Function may not be modified in place)
        return x.detach()

    @staticmethod
    def backward(ctx, dx):
        shape, dtype, device = ctx.s_meta
        return dx, torch.zeros(shape, dtype=dtype, device=device)


# ---------------------------------------------------------------- relay schedule
# The state passes from rank to rank (forward: r -> r+1; backward: dL/dS from r+1 -> r) and each rank runs its
# slice once at value width V, from its true incoming state. What makes it parallel is the kernels' stages: the
# state-independent work (the forward's prep; the backward's prep and, on the last rank, its state-gradient scan)
# runs while the rank waits for its neighbour, and only the sequential state scans form the chain. With the
# staged CUDA ops (two ranks, K = V = 128: prep ~60 % of the forward, the state scans ~25 % of the backward) that
# is the better schedule; with the one-call ops (other backends) the ranks simply take turns (correct, not faster).

class _OneCallStages:
    """The relay's stages over the one-call core ops (every backend): the prep stages do nothing, the scan runs the
    whole forward and state_bwd the whole backward (grad hands back what it computed)."""

    def __init__(self, family):
        self.fwd = getattr(ops, f"{family}_chunk_fwd")
        self.bwd = getattr(ops, f"{family}_chunk_bwd")

    def fwd_prep(self, x):
        return None

    def fwd_scan(self, work, x, h0):
        return self.fwd(*x[:6], h0, x[6])

    def bwd_prep(self, x, grad_o):
        return {}

    def bwd_state_fwd(self, work, x, h0, grad_o):
        pass

    def bwd_state_bwd(self, work, x, h0, grad_o, dht):
        work["all"] = self.bwd(*x[:6], h0, x[6], grad_o, dht)
        return work["all"][5]

    def bwd_grad(self, work, x, h0, grad_o):
        return work["all"][:5]


class _NativeStages:
    """The relay's stages over the staged ops ({family}_chunk_fwd_stage / _bwd_stage; CUDA)."""

    def __init__(self, family):
        self.fs = getattr(ops, f"{family}_chunk_fwd_stage")
        self.bs = getattr(ops, f"{family}_chunk_bwd_stage")

    def fwd_prep(self, x):
        return self.fs([], 0, *x[:6], None, x[6])

    def fwd_scan(self, work, x, h0):
        o, final = self.fs(work, 1, *x[:6], h0, x[6])  # [o, final_state]
        return o, final

    def bwd_prep(self, x, grad_o):
        return self.bs([], 0, *x[:6], None, x[6], grad_o, None)

    def bwd_state_fwd(self, work, x, h0, grad_o):
        self.bs(work, 1, *x[:6], h0, x[6], grad_o, None)

    def bwd_state_bwd(self, work, x, h0, grad_o, dht):
        return self.bs(work, 2, *x[:6], h0, x[6], grad_o, dht)[0]

    def bwd_grad(self, work, x, h0, grad_o):
        return self.bs(work, 3, *x[:6], h0, x[6], grad_o, None)


# The staged CUDA kernels' largest block (the backward's grad, kGradSmem in delta_chunk_bwd.cuh) needs this much
# shared memory per block: sm_90-class GPUs (227 KB opt-in); A100 (163 KB) and sm_86/89 (99 KB) run the one-call
# ops, whose hosts route to the recurrent kernels there.
_STAGED_SMEM_BYTES = 230912


def _native_stages_fit(family, q, v):
    """The staged ops exist for q's device and fit this call's head dims and the device (tokens not considered)."""
    if not (q.shape[3] <= 128 and v.shape[3] <= 128 and has_stages(family, q.device)):
        return False
    props = torch.cuda.get_device_properties(q.device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    return props.major in (9, 10) if optin is None else optin >= _STAGED_SMEM_BYTES


def _stages_for(family, q, v):
    """Native stages where this build has them for q's device and the call fits them (K, V <= 128, tokens > 0,
    enough shared memory per block); else the one-call ops."""
    return _NativeStages(family) if q.shape[1] > 0 and _native_stages_fit(family, q, v) else _OneCallStages(family)


class _Relay(torch.autograd.Function):
    """One rank's slice under the relay schedule. Rows exchanged with the neighbours: without cu_seqlens all B
    rows (each row is one sequence split across the ranks), with cu_seqlens one row (local sequence 0 comes in,
    the last local sequence goes out). A rank always receives from rank - 1 and sends to rank + 1 (zeros / an
    unused state where nothing continues), so that no rank needs to know its neighbours' slices."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, cu, family, group, cont):
        W, r = _group_info(group)
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        N = B if cu is None else cu.numel() - 1
        M = B if cu is None else 1
        f32 = dict(dtype=torch.float32, device=q.device)
        stages = _stages_for(family, q, v)
        x = (q, k, v, g, beta, scale, cu)
        recv = None
        if r > 0:
            s_prev = torch.empty(M, HV, K, V, **f32)
            recv = _irecv(s_prev, r - 1, group)
        work = stages.fwd_prep(x) if T > 0 else None  # overlaps the wait
        if recv is not None:
            recv.wait()
        h0_eff = h0
        if cont:
            if cu is None:
                h0_eff = s_prev
            else:
                rest = h0[1:] if h0 is not None else torch.zeros(N - 1, HV, K, V, **f32)
                h0_eff = torch.cat([s_prev, rest], 0)
        if T > 0:
            o, final = stages.fwd_scan(work, x, None if h0_eff is None else h0_eff.contiguous())
        else:  # an empty slice: the states pass through
            o = v.new_zeros(B, 0, HV, V)
            final = h0_eff.clone() if h0_eff is not None else torch.zeros(N, HV, K, V, **f32)
        if r < W - 1:
            _send(final if cu is None else final[-1:], r + 1, group)
        ctx.save_for_backward(q, k, v, g, beta, h0_eff, cu)
        ctx.scale, ctx.stages, ctx.group, ctx.cont, ctx.has_h0 = scale, stages, group, cont, h0 is not None
        return o, final

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        q, k, v, g, beta, h0_eff, cu = ctx.saved_tensors
        W, r = _group_info(ctx.group)
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        N = B if cu is None else cu.numel() - 1
        M = B if cu is None else 1
        f32 = dict(dtype=torch.float32, device=q.device)
        stages = ctx.stages  # the forward's choice (same inputs)
        x = (q, k, v, g, beta, ctx.scale, cu)
        grad_o = torch.zeros_like(v) if grad_o is None else grad_o.contiguous()
        dht = torch.zeros(N, HV, K, V, **f32) if grad_final is None else grad_final.float().contiguous()
        recv = None
        if r < W - 1:
            ds_next = torch.empty(M, HV, K, V, **f32)
            recv = _irecv(ds_next, r + 1, ctx.group)
        h0c = None if h0_eff is None else h0_eff.contiguous()
        if T > 0:
            work = stages.bwd_prep(x, grad_o)
            if recv is not None:  # not the last rank: the state scan overlaps the wait for dL/dS
                stages.bwd_state_fwd(work, x, h0c, grad_o)
        if recv is not None:
            recv.wait()
            dht = dht.clone()
            if cu is None:
                dht += ds_next
            else:
                dht[-1:] += ds_next
        if T > 0:
            dh0 = stages.bwd_state_bwd(work, x, h0c, grad_o, dht)
        else:
            dh0 = dht
        if r > 0:  # dL/dS for the rows that came from rank - 1 (zeros where nothing continued)
            rows = dh0 if cu is None else dh0[:1]
            out = rows if ctx.cont else torch.zeros_like(rows)
            _send(out, r - 1, ctx.group)
        if T > 0:
            if recv is None:  # the last rank ran state_bwd first (its dL/dS goes out sooner)
                stages.bwd_state_fwd(work, x, h0c, grad_o)
            dq, dk, dv, dg, dbeta = stages.bwd_grad(work, x, h0c, grad_o)
        else:
            dq, dk, dv, dg, dbeta = (torch.zeros_like(t) for t in (q, k, v, g, beta))
        d_init = None
        if ctx.has_h0:
            d_init = dh0.clone()
            if ctx.cont:
                d_init[0 if cu is not None else slice(None)] = 0  # rows that came from rank - 1 ignore initial_state
        return dq, dk, dv, dg, dbeta, d_init, None, None, None, None, None


def _pick_schedule(schedule, family, q, v, W):
    """'auto': the relay where it is the faster schedule -- the staged kernels run (CUDA build, K, V <= 128) and
    at most _RELAY_MAX_RANKS ranks (the relay's chain of state scans grows with the ranks; from the per-kernel
    times at B1 T8192 H16 HV32 a model puts the crossover with the affine schedule at 5-6 ranks; measured: two) --
    else the affine scan."""
    if schedule != "auto":
        return schedule
    # (independent of the slice's length: every rank must pick the same schedule, and slices may be empty)
    native = _native_stages_fit(family, q, v)
    return "relay" if native and W <= _RELAY_MAX_RANKS else "affine"


# ---------------------------------------------------------------- local pieces
def _core(fwd, q, k, v, g, beta, scale, h0, cu):
    """The core op, also for zero tokens (the state passes through; native kernels never see T == 0)."""
    B, T = q.shape[:2]
    if T == 0:
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        N = B if cu is None else cu.numel() - 1
        o = v.new_zeros(B, 0, HV, V)
        final = h0 if h0 is not None else q.new_zeros(N, HV, K, V, dtype=torch.float32)
        return o, final
    return fwd(q, k, v, g, beta, scale, h0, cu)


def _transition_run(fwd, q, k, v, g, beta, scale, transition):
    """Run a slice whose incoming state is unknown. Returns (o_P [B,T,HV,K], o_Q [B,T,HV,V], P, Q).

    transition='fused': one call at value width K + V;  'split': two calls, width K (v = 0, state I) and width V
    (for kernels limited in V; same math, the K-independent intra-chunk work is done twice)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, HV, K, K)
    if T == 0:  # the identity map
        return q.new_zeros(B, 0, HV, K), v.new_zeros(B, 0, HV, V), eye.contiguous(), q.new_zeros(
            B, HV, K, V, dtype=torch.float32)
    zeros_v = v.new_zeros(B, T, HV, K)
    if transition == "fused":
        vv = torch.cat([zeros_v, v], -1)
        h0 = torch.cat([eye, q.new_zeros(B, HV, K, V, dtype=torch.float32)], -1).contiguous()
        o, F = fwd(q, k, vv, g, beta, scale, h0, None)
        return o[..., :K], o[..., K:], F[..., :K], F[..., K:]
    oP, P = fwd(q, k, zeros_v, g, beta, scale, eye.contiguous(), None)
    oQ, Q = fwd(q, k, v, g, beta, scale, None, None)
    return oP, oQ, P, Q


def _apply_state(oP, oQ, S_in, dtype):
    """o = o_Q + o_P S_in per value head, accumulated in fp32."""
    corr = torch.einsum("bthk,bhkv->bthv", oP.float(), S_in)
    return (oQ.float() + corr).to(dtype)


def _cp(op, family, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens, state_v_first,
        A_log, dt_bias, group, continues_from_prev, transition, schedule, kwargs):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"[{op}] torch.distributed is not initialized: call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    W, rank = _group_info(group)
    if transition not in _TRANSITIONS:
        raise ValueError(f"[{op}] transition must be one of {_TRANSITIONS}, got {transition!r}")
    if schedule not in _SCHEDULES:
        raise ValueError(f"[{op}] schedule must be one of {_SCHEDULES}, got {schedule!r}")
    if continues_from_prev is None:
        if cu_seqlens is not None:
            raise ValueError(f"[{op}] with cu_seqlens pass continues_from_prev=True/False explicitly: whether this "
                             f"rank's first local sequence continues the previous rank's last one (split_varlen "
                             f"computes it)")
        continues_from_prev = rank > 0
    _validate.check_bool(op, output_final_state=output_final_state, state_v_first=state_v_first,
                         continues_from_prev=continues_from_prev)
    if continues_from_prev and rank == 0:
        raise ValueError(f"[{op}] rank 0 of the group has no previous rank: continues_from_prev must be False")
    _check_kwargs(op, kwargs)
    q, k, v, g, beta, scale, (B, T, H, K, HV, V) = _prepare(
        op, family, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias, kwargs)
    N = _validate.check_cu_seqlens(op, cu_seqlens, B, T, q.device)
    if N < 1:
        raise ValueError(f"[{op}] a context-parallel slice needs at least one local sequence: an empty slice is "
                         f"cu_seqlens=[0, 0] (one zero-length piece)")
    _validate.check_state(op, "initial_state", initial_state, N, HV, K, V, state_v_first, q.device)
    cu = cu_seqlens.to(torch.long).contiguous() if cu_seqlens is not None else None
    h0 = _to_k_first(initial_state, state_v_first)
    fwd = getattr(ops, f"{family}_chunk_fwd")
    cont = continues_from_prev
    anchor = next((x for x in (q, k, v, g, beta, h0) if x is not None and x.requires_grad), None)

    if W > 1 and _pick_schedule(schedule, family, q, v, W) == "relay":
        o, final = _Relay.apply(q, k, v, g, beta, h0, scale, cu, family, group, cont)
        return o, (_from_k_first(final, state_v_first) if output_final_state else None)

    def scan(P, Q):
        return _StateScan.apply(P, Q, group, anchor if torch.is_grad_enabled() else None)

    if not cont:
        o, final = _core(fwd, q, k, v, g, beta, scale, h0, cu)
        M = B if cu is None else 1
        last = final if cu is None else final[-1:]
        P = last.new_zeros(M, HV, K, K)
        S_in = scan(P, last)
        if torch.is_grad_enabled() and S_in.requires_grad:
            o = _Tie.apply(o, S_in)
        return o, (_from_k_first(final, state_v_first) if output_final_state else None)

    if cu is None:
        # every batch row is one sequence continuing from the previous rank; initial_state is ignored
        oP, oQ, P, Q = _transition_run(fwd, q, k, v, g, beta, scale, transition)
        S_in = scan(P, Q)
        o = _apply_state(oP, oQ, S_in, q.dtype)
        final = Q + torch.matmul(P, S_in)
        return o, (_from_k_first(final, state_v_first) if output_final_state else None)

    # varlen: local sequence 0 = tokens [0, c1) continues from the previous rank; the others start here
    c1 = int(cu[1])
    sl = (slice(None), slice(0, c1))
    oP, oQ, P0, Q0 = _transition_run(fwd, q[sl], k[sl], v[sl], g[sl], beta[sl], scale, transition)
    if N == 1:
        S_in = scan(P0, Q0)
        o = _apply_state(oP, oQ, S_in, q.dtype)
        final = Q0 + torch.matmul(P0, S_in)
    else:
        rest = (slice(None), slice(c1, T))
        o_rest, f_rest = _core(fwd, q[rest], k[rest], v[rest], g[rest], beta[rest], scale,
                               h0[1:] if h0 is not None else None, cu[1:] - c1)
        S_in = scan(torch.zeros_like(P0), f_rest[-1:])
        o = torch.cat([_apply_state(oP, oQ, S_in, q.dtype), o_rest], 1)
        final = torch.cat([Q0 + torch.matmul(P0, S_in), f_rest], 0)
    return o, (_from_k_first(final, state_v_first) if output_final_state else None)


# ---------------------------------------------------------------- public API
def chunk_kda_cp(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, lower_bound=None, cu_seqlens=None, state_v_first=False, A_log=None,
                 dt_bias=None, *, group=None, continues_from_prev=None, transition="fused", schedule="auto", **kwargs):
    """chunk_kda over a sequence split along time across the ranks of `group` (None: the default group).

    Every rank of the group calls this with its own slice (same B, H, HV, K, V, dtype and options on every rank;
    rank order = time order). Returns this slice's (o, final_state|None), equal to the matching part of one
    chunk_kda call over the whole sequence; the backward is collective too (every rank must backpropagate).

    Without cu_seqlens: each of the B rows is one sequence split across the ranks at the same place;
    continues_from_prev defaults to rank > 0, and initial_state (the state before the row's first token)
    is only read on ranks that do not continue.
    With cu_seqlens (B == 1): this rank's local cu_seqlens, and continues_from_prev (required) says whether local
    sequence 0 continues the previous rank's last local sequence; initial_state row 0 is then ignored. Row n of
    final_state is the state after local sequence n's last token on this rank. `split_varlen` builds all this
    from a global cu_seqlens. A_log / dt_bias gradients cover the local tokens only: sum them over the group.
    schedule: 'relay' (the state passes rank to rank; each rank runs its slice once, the staged kernels' state-
    independent work overlapping the wait), 'affine' (every rank computes its slice's affine map at value width
    K+V, one all_gather scan; `transition` applies) or 'auto' (relay where the staged kernels run -- the CUDA build,
    K and V <= 128 -- with at most 4 ranks, else affine). docs/context_parallel.md compares them.
    transition: 'fused' (one core call at value width K+V) or 'split' (two calls, widths K and V); affine only.
    """
    return _cp("chunk_kda_cp", "kda", q, k, v, g, beta, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
               lower_bound, cu_seqlens, state_v_first, A_log, dt_bias, group, continues_from_prev, transition,
               schedule, kwargs)


def chunk_gated_delta_rule_cp(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                              cu_seqlens=None, state_v_first=False, A_log=None, dt_bias=None, *, group=None,
                              continues_from_prev=None, transition="fused", schedule="auto", **kwargs):
    """chunk_gated_delta_rule over a sequence split across the ranks of `group`; see chunk_kda_cp."""
    return _cp("chunk_gated_delta_rule_cp", "gdn", q, k, v, g, beta, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
               lower_bound, cu_seqlens, state_v_first, A_log, dt_bias, group, continues_from_prev, transition,
               schedule, kwargs)


@dataclass
class CPSlice:
    """One rank's part of a packed batch (see split_varlen)."""
    start: int                 # global token range [start, end) of this rank
    end: int
    cu_seqlens: list           # local cu_seqlens (starts at 0, ends at end - start)
    continues_from_prev: bool  # local sequence 0 continues the previous rank's last local sequence
    seq_ids: list              # global sequence index of each local sequence (-1: a placeholder, see below)
    ends_here: list            # local sequence n's last token is on this rank (its final_state row is final)


def balanced_bounds(T, world_size, transition_cost=2.0, chunk=64):
    """Token boundaries [0, b_1, ..., T] of a split across `world_size` ranks that balances their work.

    Rank 0 (no incoming state) runs the plain op, cost 1 per token; every other rank runs the transition at value
    width K + V, cost `transition_cost` per token, so rank 0 takes the share c / (c + W - 1) and the others
    1 / (c + W - 1) each. Measured on an H200 with the CUDA chunked kernels at K = V = 128 (benchmarks/cp):
    c ~ 1.5 for the forward alone, ~ 2.0 for forward + backward (the default); on two ranks that split gave
    1.42-1.48x over one GPU where an even split gave 1.0-1.3x. Boundaries are rounded to multiples of `chunk`
    tokens (the kernels' chunk length); also usable as `split_varlen(..., bounds=...)`.
    """
    if not (isinstance(T, int) and T >= 0):
        raise ValueError(f"balanced_bounds: T must be an int >= 0, got {T!r}")
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"balanced_bounds: world_size must be an int >= 1, got {world_size!r}")
    if not transition_cost >= 1.0:
        raise ValueError(f"balanced_bounds: transition_cost must be >= 1 (a transition costs at least the plain "
                         f"op), got {transition_cost!r}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"balanced_bounds: chunk must be an int >= 1, got {chunk!r}")
    W, c = world_size, float(transition_cost)
    bounds = [0]
    for r in range(1, W):
        x = (c + (r - 1)) / (c + W - 1)  # tokens before rank r: rank 0's share c, then 1 per rank
        b = int(round(x * T / chunk)) * chunk
        bounds.append(min(T, max(bounds[-1], b)))
    bounds.append(T)
    return bounds


def split_varlen(cu_seqlens, world_size=None, bounds=None):
    """Split a packed batch described by a global cu_seqlens [N+1] across ranks. Returns one CPSlice per rank.

    bounds: the ranks' global token boundaries [0 = b_0 <= b_1 <= ... <= b_W = T] (empty slices allowed);
    default: an even split into world_size slices. Rules: a sequence [s, e) continues onto rank r when
    s < b_r < e; a sequence belongs (with its first piece) to the rank with b_r <= s < b_{r+1} (zero-length
    sequences included; those at s == T go to the last rank). A rank left with no piece at all (an empty slice
    that no sequence crosses) gets one zero-length placeholder piece with seq_id -1.
    """
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"split_varlen: cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    T = cu[-1]
    if bounds is None:
        if world_size is None or world_size < 1:
            raise ValueError("split_varlen: pass world_size >= 1 or bounds")
        bounds = [(r * T) // world_size for r in range(world_size + 1)]
    bounds = [int(b) for b in bounds]
    if bounds[0] != 0 or bounds[-1] != T or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"split_varlen: bounds must go from 0 to T={T}, non-decreasing, got {bounds}")
    W = len(bounds) - 1
    seqs = list(zip(cu[:-1], cu[1:]))
    out = []
    for r in range(W):
        a, b = bounds[r], bounds[r + 1]
        pieces = []  # (global id, piece start, piece end, ends here)
        for n, (s, e) in enumerate(seqs):
            if s < a < e:  # crosses into this rank: local sequence 0
                pieces.append((n, a, min(e, b), e <= b))
        cont = bool(pieces)
        for n, (s, e) in enumerate(seqs):
            if a <= s < b or (s == T and r == W - 1):
                pieces.append((n, s, min(e, b), e <= b))
        if not pieces:
            pieces = [(-1, a, a, False)]
        local = [0] + [p[2] - a for p in pieces]
        out.append(CPSlice(a, b, local, cont, [p[0] for p in pieces], [p[3] for p in pieces]))
    return out
