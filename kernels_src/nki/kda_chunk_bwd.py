"""kda_chunk_bwd: exact backward of the per-channel-gated delta rule (dq, dk, dv, dg, dbeta, dh0).

Checkpointed form: kda_chunk_fwd_kernel (run with L = 64) leaves the state at the start of every chunk; this
kernel walks the chunks backwards carrying dS (the gradient of the state, K x V fp32 in SBUF). In a chunk it
first replays the forward token by token from the checkpoint, keeping the decayed states S~_t = exp(g_t) S_{t-1}
(K x L x V in SBUF), r_t = v_t - S~_t^T k_t and delta_t = beta_t r_t, and computes dq_t = scale S_t do_t; then it
walks the chunk backwards:

    dS   += scale q_t do_t^T
    ddelta = dS^T k_t ;  dbeta_t = ddelta . r_t ;  dv_t = beta_t ddelta ;  dp = -dv_t
    dk_t  = dS delta_t + S~_t dp
    dS~   = dS + k_t dp^T ;  dg_t = rowsum(dS~ * S~_t) ;  dS = exp(g_t)[:, None] * dS~

Every product contracts over the partitions on the Tensor Engine (rank-1 updates contract over one partition;
row vectors are broadcast over K with a ones-row matmul). No approximation: the per-channel gate is exact.
This is the gradient of the recurrence itself, so it serves the chunked and the recurrent ops alike; it is
token-sequential inside a chunk (not the WY-transform backward), which bounds its speed on hardware.

SPMD grid (N, HV). Inputs (torch_wrappers.py; rep = HV // H):
    q, k [N, H, Tp, K]; g [N, HV, Tp, K] fp32; hs [N, HV, Tp // L, K, V] fp32 (checkpoints)
    q_row, k_row [N, H, Tp, 1, K]; v_row, do_row [N, HV, Tp, 1, V]; beta_row [N, HV, 1, Tp] fp32; dht [N, HV, K, V]
Returns dq, dk [N, HV, Tp, K] (per value head; the wrapper sums GVA groups), dv [N, HV, Tp, 1, V],
dg [N, HV, Tp, K], dbeta [N, HV, 1, Tp], dh0 [N, HV, K, V]; all fp32.
"""
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import F32, load_f32, ps, sb, transpose


@nki.jit
def kda_chunk_bwd_kernel(q, k, g, hs, q_row, k_row, v_row, do_row, beta_row, dht, scale, rep):
    N, H, Tp, K = q.shape
    HV, NC, V = hs.shape[1], hs.shape[2], hs.shape[4]
    L = Tp // NC
    dq = nl.ndarray((N, HV, Tp, K), dtype=F32, buffer=nl.shared_hbm)
    dk = nl.ndarray((N, HV, Tp, K), dtype=F32, buffer=nl.shared_hbm)
    dv = nl.ndarray((N, HV, Tp, 1, V), dtype=F32, buffer=nl.shared_hbm)
    dg = nl.ndarray((N, HV, Tp, K), dtype=F32, buffer=nl.shared_hbm)
    dbeta = nl.ndarray((N, HV, 1, Tp), dtype=F32, buffer=nl.shared_hbm)
    dh0 = nl.ndarray((N, HV, K, V), dtype=F32, buffer=nl.shared_hbm)
    n = nl.program_id(0)
    h = nl.program_id(1)
    hq = h // rep

    ones = sb((1, K))
    nisa.memset(dst=ones, value=1.0)
    dS = sb((K, V))
    nisa.dma_copy(dst=dS, src=dht[n, h])
    for ci in nl.sequential_range(NC):
        c = NC - 1 - ci
        t0 = c * L
        gt = sb((L, K))
        nisa.dma_copy(dst=gt, src=g[n, h, t0:t0 + L, :])
        gT = transpose(gt, L, K)
        eg = sb((K, L))
        nisa.activation(dst=eg, op=nl.exp, data=gT)
        qT = transpose(load_f32(q[n, hq, t0:t0 + L, :]), L, K)
        kT = transpose(load_f32(k[n, hq, t0:t0 + L, :]), L, K)
        brow = sb((1, L))
        nisa.dma_copy(dst=brow, src=beta_row[n, h, :, t0:t0 + L])
        S = sb((K, V))
        nisa.dma_copy(dst=S, src=hs[n, h, c])

        Sd = sb((K, L, V))          # decayed states S~_t
        rst = sb((1, L * V))        # r_t = v_t - S~_t^T k_t (rows on partition 0)
        dlt = sb((1, L * V))        # delta_t = beta_t r_t
        dqT = sb((K, L))
        _replay(S, Sd, rst, dlt, dqT, eg, kT, brow, ones, k_row, v_row, do_row, n, h, hq, t0, K, L, V)
        dkT = sb((K, L))
        dgT = sb((K, L))
        dbr = sb((1, L))
        _walk_back(dS, Sd, rst, dlt, dkT, dgT, dbr, eg, kT, brow, ones, q_row, k_row, do_row, dv, n, h, hq, t0,
                   scale, K, L, V)
        nisa.tensor_scalar(dst=dqT, data=dqT, op0=nl.multiply, operand0=scale)
        for src, dst in ((dqT, dq), (dkT, dk), (dgT, dg)):
            tok = transpose(src, K, L)
            nisa.dma_copy(dst=dst[n, h, t0:t0 + L, :], src=tok)
        nisa.dma_copy(dst=dbeta[n, h, :, t0:t0 + L], src=dbr)
    nisa.dma_copy(dst=dh0[n, h], src=dS)
    return dq, dk, dv, dg, dbeta, dh0


def _replay(S, Sd, rst, dlt, dqT, eg, kT, brow, ones, k_row, v_row, do_row, n, h, hq, t0, K, L, V):
    """Forward replay of one chunk from its checkpoint S (updated in place); dq_t / scale = S_t do_t."""
    p_pred = ps((1, V))
    p_upd = ps((K, V))
    p_bc = ps((K, V))
    for t in nl.sequential_range(L):
        row = slice(t * V, (t + 1) * V)
        nisa.tensor_scalar(dst=Sd[:, t, :], data=S, op0=nl.multiply, operand0=eg[:, t:t + 1])
        nisa.nc_matmul(dst=p_pred, stationary=kT[:, t:t + 1], moving=Sd[:, t, :], accumulate=False)
        vr = load_f32(v_row[n, h, t0 + t])
        nisa.tensor_tensor(dst=rst[:, row], data1=vr, data2=p_pred, op=nl.subtract)
        nisa.tensor_scalar(dst=dlt[:, row], data=rst[:, row], op0=nl.multiply, operand0=brow[:, t:t + 1])
        kr = load_f32(k_row[n, hq, t0 + t])
        nisa.nc_matmul(dst=p_upd, stationary=kr, moving=dlt[:, row], accumulate=False)
        nisa.tensor_tensor(dst=S, data1=Sd[:, t, :], data2=p_upd, op=nl.add)
        dor = load_f32(do_row[n, h, t0 + t])
        nisa.nc_matmul(dst=p_bc, stationary=ones, moving=dor, accumulate=False)    # do_t broadcast over K
        tmp = sb((K, V))
        nisa.tensor_tensor(dst=tmp, data1=S, data2=p_bc, op=nl.multiply)
        nisa.tensor_reduce(dst=dqT[:, t:t + 1], op=nl.add, data=tmp, axis=1)


def _walk_back(dS, Sd, rst, dlt, dkT, dgT, dbr, eg, kT, brow, ones, q_row, k_row, do_row, dv, n, h, hq, t0, scale,
               K, L, V):
    """Backward through one chunk, token L-1 down to 0; dS (grad of the state) is updated in place."""
    p_kv = ps((K, V))
    p_row = ps((1, V))
    p_b1 = ps((K, V))
    p_b2 = ps((K, V))
    for ti in nl.sequential_range(L):
        t = L - 1 - ti
        row = slice(t * V, (t + 1) * V)
        qr = load_f32(q_row[n, hq, t0 + t])
        kr = load_f32(k_row[n, hq, t0 + t])
        dor = load_f32(do_row[n, h, t0 + t])
        # dS += scale q_t do_t^T
        nisa.nc_matmul(dst=p_kv, stationary=qr, moving=dor, accumulate=False)
        nisa.scalar_tensor_tensor(dst=dS, data=p_kv, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=dS)
        # ddelta = dS^T k_t
        nisa.nc_matmul(dst=p_row, stationary=kT[:, t:t + 1], moving=dS, accumulate=False)
        dd = sb((1, V))
        nisa.tensor_copy(dst=dd, src=p_row)
        prod = sb((1, V))
        nisa.tensor_tensor(dst=prod, data1=dd, data2=rst[:, row], op=nl.multiply)
        nisa.tensor_reduce(dst=dbr[:, t:t + 1], op=nl.add, data=prod, axis=1)
        dvr = sb((1, V))
        nisa.tensor_scalar(dst=dvr, data=dd, op0=nl.multiply, operand0=brow[:, t:t + 1])
        nisa.dma_copy(dst=dv[n, h, t0 + t], src=dvr)
        dp = sb((1, V))
        nisa.tensor_scalar(dst=dp, data=dvr, op0=nl.multiply, operand0=-1.0)
        # dk_t = dS delta_t + S~_t dp   (row vectors broadcast over the K partitions by a ones-row matmul)
        nisa.nc_matmul(dst=p_b1, stationary=ones, moving=dlt[:, row], accumulate=False)
        nisa.nc_matmul(dst=p_b2, stationary=ones, moving=dp, accumulate=False)
        t1 = sb((K, V))
        nisa.tensor_tensor(dst=t1, data1=dS, data2=p_b1, op=nl.multiply)
        t2 = sb((K, V))
        nisa.tensor_tensor(dst=t2, data1=Sd[:, t, :], data2=p_b2, op=nl.multiply)
        nisa.tensor_tensor(dst=t1, data1=t1, data2=t2, op=nl.add)
        nisa.tensor_reduce(dst=dkT[:, t:t + 1], op=nl.add, data=t1, axis=1)
        # dS~ = dS + k_t dp^T ; dg_t = rowsum(dS~ * S~_t) ; dS = exp(g_t) dS~
        nisa.nc_matmul(dst=p_kv, stationary=kr, moving=dp, accumulate=False)
        nisa.tensor_tensor(dst=dS, data1=dS, data2=p_kv, op=nl.add)
        t3 = sb((K, V))
        nisa.tensor_tensor(dst=t3, data1=dS, data2=Sd[:, t, :], op=nl.multiply)
        nisa.tensor_reduce(dst=dgT[:, t:t + 1], op=nl.add, data=t3, axis=1)
        nisa.tensor_scalar(dst=dS, data=dS, op0=nl.multiply, operand0=eg[:, t:t + 1])
