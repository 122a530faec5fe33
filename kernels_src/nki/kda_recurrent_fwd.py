"""kda_recurrent_fwd: token-by-token delta rule with a per-channel (per-K) gate; the decode kernel.

SPMD grid (N, HV): program (n, h) owns sequence n and value head h; its K x V fp32 state stays in SBUF
(K on partitions) for all T tokens. Per token, with the state S:

    S <- S * exp(g_t)[:, None]        per-partition scale: the gate decays the K ROWS (not the V columns)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = scale * S^T q_t

GDN runs the same kernel with its per-head gate broadcast over K by the torch wrapper.
HBM layouts (prepared by torch_wrappers.py; `rep` = HV // H, value head h reads q/k head h // rep):
    q_col, k_col [N, H, T, K, 1]; k_row [N, H, T, 1, K]   (any float dtype)
    v_row [N, HV, T, 1, V]; g_col [N, HV, T, K, 1] fp32; beta [N, HV, T, 1, 1] fp32; h0 [N, HV, K, V] fp32
Returns o [N, HV, T, 1, V] fp32, final state [N, HV, K, V] fp32 and, when store_states, every state
after each token [N, HV, T, K, V] (speculative decoding writes them back to a state pool).
"""
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import F32, load_f32, ps, sb


@nki.jit
def kda_recurrent_fwd_kernel(q_col, k_col, k_row, v_row, g_col, beta, h0, scale, rep, store_states=False):
    N, H, T, K, _ = q_col.shape
    HV, V = v_row.shape[1], v_row.shape[4]
    o = nl.ndarray((N, HV, T, 1, V), dtype=F32, buffer=nl.shared_hbm)
    ht = nl.ndarray((N, HV, K, V), dtype=F32, buffer=nl.shared_hbm)
    hall = nl.ndarray((N, HV, T, K, V), dtype=F32, buffer=nl.shared_hbm) if store_states else None
    n = nl.program_id(0)
    h = nl.program_id(1)
    hq = h // rep

    S = sb((K, V))
    nisa.dma_copy(dst=S, src=h0[n, h])
    p_pred = ps((1, V))
    p_upd = ps((K, V))
    p_out = ps((1, V))
    for t in nl.sequential_range(T):
        kc = load_f32(k_col[n, hq, t])          # [K, 1]
        kr = load_f32(k_row[n, hq, t])          # [1, K]
        qc = load_f32(q_col[n, hq, t])          # [K, 1]
        vr = load_f32(v_row[n, h, t])           # [1, V]
        gc = sb((K, 1))
        nisa.dma_copy(dst=gc, src=g_col[n, h, t])
        bt = sb((1, 1))
        nisa.dma_copy(dst=bt, src=beta[n, h, t])
        eg = sb((K, 1))
        nisa.activation(dst=eg, op=nl.exp, data=gc)
        # decay the K rows: one per-partition scalar per row
        nisa.tensor_scalar(dst=S, data=S, op0=nl.multiply, operand0=eg)
        # delta = beta * (v - S^T k): contraction over K (the partitions)
        nisa.nc_matmul(dst=p_pred, stationary=kc, moving=S, accumulate=False)
        d = sb((1, V))
        nisa.tensor_tensor(dst=d, data1=vr, data2=p_pred, op=nl.subtract)
        nisa.tensor_scalar(dst=d, data=d, op0=nl.multiply, operand0=bt)
        # S += k delta^T: a rank-1 matmul contracting over one partition
        nisa.nc_matmul(dst=p_upd, stationary=kr, moving=d, accumulate=False)
        nisa.tensor_tensor(dst=S, data1=S, data2=p_upd, op=nl.add)
        # o = scale * S^T q
        nisa.nc_matmul(dst=p_out, stationary=qc, moving=S, accumulate=False)
        ot = sb((1, V))
        nisa.activation(dst=ot, op=nl.copy, data=p_out, scale=scale)
        nisa.dma_copy(dst=o[n, h, t], src=ot)
        if store_states:
            nisa.dma_copy(dst=hall[n, h, t], src=S)
    nisa.dma_copy(dst=ht[n, h], src=S)
    if store_states:
        return o, ht, hall
    return o, ht
