"""kda_chunk_fwd: exact chunked delta rule with a per-channel gate (KDA); GDN uses it with its gate broadcast.

SPMD grid (N, HV); program (n, h) walks the chunks of sequence n for value head h with the K x V fp32 state S
resident in SBUF (K on partitions). A chunk has L = 128 (or 64) tokens on the partitions. With G the in-chunk
inclusive cumulative gate (a K-vector per token) and everything below per chunk:

    A[i, j]  = beta_i sum_d k_id k_jd exp(G_id - G_jd)      j < i      (per channel: inside the dot product)
    Aq[i, j] =        sum_d q_id k_jd exp(G_id - G_jd)      j <= i
    T = (I + A)^-1 ;  u = T (beta v) ;  w = T (beta k * exp(G))
    delta = u - w S ;  o = scale ((q * exp(G)) S + Aq delta)
    S <- exp(G_L)[:, None] * S + (k * exp(G_L - G))^T delta

EXACT per-channel decay, every exponent <= 0 (no scalar-mean approximation, no gate lower bound needed):
  - tokens are cut into 16-token sub-chunks; for i in sub-chunk I and j in an earlier one, exp(G_i - G_j) =
    exp(G_i - G_b) * exp(G_b - G_j) with b the last token before sub-chunk I (both factors <= 1), so the
    off-diagonal blocks are matmuls over d;
  - the 16 x 16 diagonal blocks are computed elementwise, exp(G_i - G_j) only for j <= i, then reduced over d
    with one matmul per block and a diagonal selection (affine_select);
  - all cumulative sums are taken from the nearest reference point (masked matmuls over g), so an exponent's
    rounding error scales with that exponent, not with the chunk's total decay.
T is built as Y = T^T = (I + A^T)^-1 by recursive doubling of the 1 x 1 diagonal blocks:
Y <- Y + Y (N o Off_s) Y with N = -A^T (log2 L levels; stable, no matrix powers).

Inputs (torch_wrappers.py prepares them; rep = HV // H):
    q, k [N, H, Tp, K] (float32/bfloat16/float16); v [N, HV, Tp, V]; g [N, HV, Tp, K] fp32; beta [N, HV, Tp, 1] fp32
    h0 [N, HV, K, V] fp32; consts [L, W] fp32 (see _common.chunk_layout). Tp is a multiple of L: the wrapper
    pads with g = beta = k = q = v = 0, which leaves the state unchanged.
Returns o [N, HV, Tp, V] fp32, final state [N, HV, K, V] and the state at the start of every chunk
[N, HV, Tp // L, K, V] (the backward's checkpoints).
"""
import nki
import nki.isa as nisa
import nki.language as nl

from ._common import F32, SUB, chunk_layout, exp, load_f32, mm, mul, nb_offset, ps, sb, transpose


@nki.jit
def kda_chunk_fwd_kernel(q, k, v, g, beta, h0, consts, scale, rep):
    N, H, Tp, K = q.shape
    HV, V = v.shape[1], v.shape[3]
    L = consts.shape[0]
    NC = Tp // L
    NB = L // SUB
    lay = chunk_layout(L)
    o = nl.ndarray((N, HV, Tp, V), dtype=F32, buffer=nl.shared_hbm)
    ht = nl.ndarray((N, HV, K, V), dtype=F32, buffer=nl.shared_hbm)
    hs = nl.ndarray((N, HV, NC, K, V), dtype=F32, buffer=nl.shared_hbm)
    n = nl.program_id(0)
    h = nl.program_id(1)
    hq = h // rep

    C = sb((L, lay["W"]))
    nisa.dma_copy(dst=C, src=consts)
    S = sb((K, V))
    nisa.dma_copy(dst=S, src=h0[n, h])

    for c in nl.sequential_range(NC):
        t0 = c * L
        # ---- loads (token-major: tokens on partitions)
        qt = load_f32(q[n, hq, t0:t0 + L, :])
        kt = load_f32(k[n, hq, t0:t0 + L, :])
        vt = load_f32(v[n, h, t0:t0 + L, :])
        gt = sb((L, K))
        nisa.dma_copy(dst=gt, src=g[n, h, t0:t0 + L, :])
        bt = sb((L, 1))
        nisa.dma_copy(dst=bt, src=beta[n, h, t0:t0 + L, :])
        bk = sb((L, K))
        nisa.tensor_scalar(dst=bk, data=kt, op0=nl.multiply, operand0=bt)
        # ---- d-major copies (d on partitions)
        qT = transpose(qt, L, K)
        kT = transpose(kt, L, K)
        bkT = transpose(bk, L, K)
        # ---- cumulative gates, each from its reference point (masked matmuls contracting over tokens)
        GT = mm(gt, C[:, lay["INCL"]:lay["INCL"] + L], (K, L))     # G_i            [d, i]
        PT = mm(gt, C[:, lay["LOC"]:lay["LOC"] + L], (K, L))       # G_i - G_b(i)   [d, i]
        Gtok = mm(C[:, lay["INCL"]:lay["INCL"] + L], gt, (L, K))   # G_i            [i, d]
        Ztok = mm(C[:, lay["SU"]:lay["SU"] + L], gt, (L, K))       # G_L - G_j      [j, d]
        eP = exp(PT, (K, L))
        negPT = sb((K, L))
        nisa.tensor_scalar(dst=negPT, data=PT, op0=nl.multiply, operand0=-1.0)
        eGT = exp(GT, (K, L))
        gL = sb((K, 1))
        nisa.activation(dst=gL, op=nl.exp, data=GT[:, L - 1:L])
        # aT[:, 0, i] = beta_i k_i exp(G_i - G_b(i)),  aT[:, 1, i] = q_i exp(G_i - G_b(i))
        aT = sb((K, 2, L))
        nisa.tensor_tensor(dst=aT[:, 0, :], data1=bkT, data2=eP, op=nl.multiply)
        nisa.tensor_tensor(dst=aT[:, 1, :], data1=qT, data2=eP, op=nl.multiply)

        AT = _decayed_products(C, lay, gt, kT, bkT, qT, PT, negPT, aT, K, L, NB)
        Yi = _unit_upper_inverse(C, lay, AT, L)

        # ---- u | w = T [beta v | beta k exp(G)]
        Rhs = sb((L, V + K))
        nisa.tensor_scalar(dst=Rhs[:, 0:V], data=vt, op0=nl.multiply, operand0=bt)
        eG = exp(Gtok, (L, K))
        nisa.tensor_tensor(dst=Rhs[:, V:V + K], data1=bk, data2=eG, op=nl.multiply)
        UW = mm(Yi, Rhs, (L, V + K))
        wT = transpose(UW[:, V:V + K], L, K)
        qgT = mul(qT, eGT, (K, L))
        eZ = exp(Ztok, (L, K))
        kz = mul(kt, eZ, (L, K))

        # ---- the sequential part: the state enters here
        nisa.dma_copy(dst=hs[n, h, c], src=S)
        _chunk_state_step(S, UW, wT, qgT, AT, kz, gL, o[n, h, t0:t0 + L, :], scale, K, L, V)
    nisa.dma_copy(dst=ht[n, h], src=S)
    return o, ht, hs


def _decayed_products(C, lay, gt, kT, bkT, qT, PT, negPT, aT, K, L, NB):
    """A^T and Aq^T as AT[:, 0] and AT[:, 1] ([j, i], j on partitions); every exponent <= 0."""
    AT = sb((L, 2, L))
    nisa.memset(dst=AT, value=0.0)
    if NB > 1:
        # off-diagonal sub-chunk blocks: exp(G_i - G_j) = exp(G_i - G_b) exp(G_b - G_j)
        w_nb = lay["OFF"] - lay["NB"]
        pNB = ps((K, w_nb))
        nisa.nc_matmul(dst=pNB, stationary=gt, moving=C[:, lay["NB"]:lay["OFF"]], accumulate=False)
        eNB = sb((K, w_nb))                                    # exp(G_b(I) - G_j) <= 1
        nisa.activation(dst=eNB, op=nl.exp, data=pNB)
        pOff = ps((L, 2, L))
        for I in nl.static_range(1, NB):
            w = SUB * I
            off = nb_offset(I)
            kN = mul(kT[:, 0:w], eNB[:, off:off + w], (K, w))
            nisa.nc_matmul(dst=pOff[0:w, :, w:w + SUB], stationary=kN, moving=aT[:, :, w:w + SUB],
                           accumulate=False)
            nisa.tensor_copy(dst=AT[0:w, :, w:w + SUB], src=pOff[0:w, :, w:w + SUB])
    for I in nl.static_range(NB):
        _diagonal_block(AT, kT, bkT, qT, PT, negPT, SUB * I, K, L)
    return AT


def _diagonal_block(AT, kT, bkT, qT, PT, negPT, i0, K, L):
    """Adds the exact 16 x 16 diagonal block starting at token i0 into AT."""
    # Y[d, x, i, jl] = a_x[d, i] exp(G_id - G_jd) for j = i0 + jl <= i (x = 0, beta k: j < i), else 0
    Y = sb((K, 2, SUB, SUB))
    nisa.memset(dst=Y, value=0.0)
    for jl in nl.static_range(SUB):
        j = i0 + jl
        E = sb((K, SUB))
        nisa.activation(dst=E[:, 0:SUB - jl], op=nl.exp, data=PT[:, j:i0 + SUB], bias=negPT[:, j:j + 1], scale=1.0)
        nisa.tensor_tensor(dst=Y[:, 1, jl:SUB, jl], data1=qT[:, j:i0 + SUB], data2=E[:, 0:SUB - jl],
                           op=nl.multiply)
        if jl < SUB - 1:
            nisa.tensor_tensor(dst=Y[:, 0, jl + 1:SUB, jl], data1=bkT[:, j + 1:i0 + SUB], data2=E[:, 1:SUB - jl],
                               op=nl.multiply)
    # R[j', x, i, jl] = sum_d k_j'd Y[d, x, i, jl]; keep j' == i0 + jl, then sum over jl
    pR = ps((L, 2, SUB, SUB))
    nisa.nc_matmul(dst=pR, stationary=kT, moving=Y, accumulate=False)
    R = sb((L, 2, SUB, SUB))
    nisa.tensor_copy(dst=R, src=pR)
    nisa.affine_select(dst=R, pattern=[[0, 2], [0, SUB], [-1, SUB]], offset=-i0, channel_multiplier=1,
                       on_true_tile=R, on_false_value=0.0, cmp_op=nl.equal)
    D = sb((L, 2, SUB))
    nisa.tensor_reduce(dst=D, op=nl.add, data=R, axis=3)
    nisa.tensor_tensor(dst=AT[:, :, i0:i0 + SUB], data1=AT[:, :, i0:i0 + SUB], data2=D, op=nl.add)


def _unit_upper_inverse(C, lay, AT, L):
    """Y = (I + A^T)^-1 by recursive doubling of diagonal blocks: Y <- Y + Y (N o Off_s) Y, N = -A^T."""
    NT = sb((L, L))                                   # N^T = -A
    pA = ps((L, L))
    nisa.nc_transpose(dst=pA, data=AT[:, 0, :])
    nisa.tensor_scalar(dst=NT, data=pA, op0=nl.multiply, operand0=-1.0)
    Yi = sb((L, L))
    nisa.tensor_copy(dst=Yi, src=C[:, lay["I"]:lay["I"] + L])
    for lvl in nl.static_range(lay["levels"]):
        o0 = lay["OFF"] + lvl * L
        Mt = mul(NT, C[:, o0:o0 + L], (L, L))          # (N o Off_s)^T
        Z1 = mm(Mt, Yi, (L, L))                       # (N o Off_s) Y
        YT = transpose(Yi, L, L)
        pZ = ps((L, L))
        nisa.nc_matmul(dst=pZ, stationary=YT, moving=Z1, accumulate=False)   # Y (N o Off_s) Y
        Yn = sb((L, L))
        nisa.tensor_tensor(dst=Yn, data1=Yi, data2=pZ, op=nl.add)
        Yi = Yn
    return Yi


def _chunk_state_step(S, UW, wT, qgT, AT, kz, gL, o_dst, scale, K, L, V):
    """delta = u - w S; o = scale (qg S + Aq delta); S <- gL * S + kz^T delta (S updated in place)."""
    pWS = ps((L, V))
    nisa.nc_matmul(dst=pWS, stationary=wT, moving=S, accumulate=False)
    dlt = sb((L, V))
    nisa.tensor_tensor(dst=dlt, data1=UW[:, 0:V], data2=pWS, op=nl.subtract)
    pO = ps((L, V))
    nisa.nc_matmul(dst=pO, stationary=qgT, moving=S, accumulate=False)
    nisa.nc_matmul(dst=pO, stationary=AT[:, 1, :], moving=dlt, accumulate=True)
    ot = sb((L, V))
    nisa.activation(dst=ot, op=nl.copy, data=pO, scale=scale)
    nisa.dma_copy(dst=o_dst, src=ot)
    pU = ps((K, V))
    nisa.nc_matmul(dst=pU, stationary=kz, moving=dlt, accumulate=False)
    nisa.tensor_scalar(dst=S, data=S, op0=nl.multiply, operand0=gL)
    nisa.tensor_tensor(dst=S, data1=S, data2=pU, op=nl.add)
