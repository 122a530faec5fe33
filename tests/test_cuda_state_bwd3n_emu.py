"""CPU index-level emulation of state_bwd3n_kernel, the narrow state_bwd3 (KDA_CUDA_CHUNK_BWD_STATE_BWD=7 / 8;
kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh): one block of 8 warps x 32 lanes, 16 value columns, over four
chunks (the last one partial), in exact float64 against the plain recurrence dU = A_qk^T dO + Kend dS1,
dS0 = Gam_last dS1 + (Q Gam)^T dO - w^T dU. Every shared-memory address and padded row stride, the mma fragment
mapping (m16n8k8: A (g, t), (g+8, t), (g, t+4), (g+8, t+4); B (t, g), (t+4, g); C (g, 2t), (g, 2t+1), (g+8, ...)),
the A_qk diagonal mask and -- what the narrow kernel adds -- the rotation of the Q Gam / K Eend / w tiles through two
buffers and the cp.async group accounting, as written in the kernel: a tile's destination is poisoned with NaN when
its copy is issued and filled only at the cpa_wait that covers its group (wait<N>: all but the newest N groups), so
a read before the wait, a read of a buffer that a later copy overwrites, or a wrong group count fails. Consumed
single buffers (dO, dU, the dS copy) are poisoned when the kernel overwrites them. Needs no GPU (the tf32 rounding
is not emulated: the GPU tests in test_cuda_chunk_bwd_state_bwd_narrow.py cover the precision).
"""
import numpy as np

CH, KP, BV = 64, 128, 16
LdKe, LdT, LdA, LdB = KP + 4, KP + 8, CH + 8, BV + 8


def mma(C, afr, bfr):  # afr[lane][4], bfr[lane][2] -> C[lane][4] += A B
    A = np.zeros((16, 8)); B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = afr[lane]
        B[t, g], B[t + 4, g] = bfr[lane]
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        C[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def lanes():
    for warp in range(8):
        for lane in range(32):
            yield warp, lane, warp & 3, warp >> 2, lane >> 2, lane & 3


def run(nc, Cc_last, K, V, seed):
    rng = np.random.default_rng(seed)
    scale = 0.3
    aqk = np.tril(rng.standard_normal((nc, CH, CH)))        # aqk[c][t][j], j <= t
    kend = rng.standard_normal((nc, CH, KP)); qg = rng.standard_normal((nc, CH, KP)); w = rng.standard_normal((nc, CH, KP))
    for x in (kend, qg, w): x[:, :, K:] = 0                 # padded columns (k >= K) are zero in the prep's tiles
    gl = rng.uniform(0.5, 1, (nc, KP))
    for x in (kend, qg, w): x[nc - 1, Cc_last:] = 0
    dO = np.zeros((nc, CH, BV)); dO[:, :, :V] = rng.standard_normal((nc, CH, V)); dO[nc - 1, Cc_last:] = 0
    dht = rng.standard_normal((K, V))
    S = np.zeros((KP, BV)); S[:K, :V] = dht
    ref_dhs = [None] * nc; ref_dU = [None] * nc
    for c in range(nc - 1, -1, -1):
        ref_dhs[c] = S.copy()
        dU = aqk[c].T @ (scale * dO[c]) + kend[c] @ S
        ref_dU[c] = dU
        S = gl[c][:, None] * S + qg[c].T @ (scale * dO[c]) - w[c].T @ dU
    ref_dh0 = S

    # shared memory (Sb3nSmem), one flat array; offsets as in the kernel
    buf0 = 0; aqo = buf0 + 2 * CH * LdT; glo = aqo + CH * LdA; dso = glo + KP; duo = dso + KP * LdB; doo = duo + CH * LdB
    total = doo + CH * LdB
    assert total * 4 == 113152
    sm = np.full(total, np.nan)
    groups = []   # committed groups, oldest first: lists of (offset, values)
    pending = []  # copies issued since the last commit

    def ktile(dst, ld, src):  # src [CH][KP]
        for t in range(CH):
            sm[dst + t * ld:dst + t * ld + KP] = np.nan
            pending.append((dst + t * ld, src[t].copy()))

    def issue_aq(c):
        aq = aqk[c].copy(); aq[np.triu_indices(CH, 1)] = 7.0  # garbage above the diagonal: the kernel masks it
        for t in range(CH):
            sm[aqo + t * LdA:aqo + t * LdA + CH] = np.nan
            for c0 in range(0, CH, 4):  # only the 16-byte pieces with c0 <= t (the rest stays NaN: reads masked)
                if c0 <= t:
                    pending.append((aqo + t * LdA + c0, aq[t, c0:c0 + 4]))
        sm[glo:glo + KP] = np.nan
        pending.append((glo, gl[c].copy()))

    def commit():
        groups.append(list(pending)); pending.clear()

    def wait(n):
        while len(groups) > n:
            for o, x in groups.pop(0):
                sm[o:o + len(x)] = x

    def bufp(i): return buf0 + i * CH * LdT

    ds = np.zeros((8, 32, 2, 4))
    for warp, lane, wi, wc, gq, t4 in lanes():
        cw, r0 = 8 * wc, 32 * wi + gq
        for mt in range(2):
            for e in range(4):
                r, col = r0 + 16 * mt + 8 * (e >> 1), cw + 2 * t4 + (e & 1)
                ds[warp, lane, mt, e] = dht[r, col] if (r < K and col < V) else 0.0

    def put_ds():
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, r0 = 8 * wc, 32 * wi + gq
            for mt in range(2):
                d = dso + (r0 + 16 * mt) * LdB + cw + 2 * t4
                sm[d:d + 2] = ds[warp, lane, mt, :2]
                sm[d + 8 * LdB:d + 8 * LdB + 2] = ds[warp, lane, mt, 2:]

    def store_ds():
        out = np.zeros((KP, BV))
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, r0 = 8 * wc, 32 * wi + gq
            for mt in range(2):
                for e in range(4):
                    out[r0 + 16 * mt + 8 * (e >> 1), cw + 2 * t4 + (e & 1)] = ds[warp, lane, mt, e]
        return out

    def put_do(c):
        for tid in range(256):
            d = doo + (tid >> 2) * LdB + 4 * (tid & 3)
            sm[d:d + 4] = dO[c, tid >> 2, 4 * (tid & 3):4 * (tid & 3) + 4]

    dhs = [None] * nc; dUo = [None] * nc
    put_ds()
    ktile(bufp(0), LdT, qg[nc - 1]); issue_aq(nc - 1); put_do(nc - 1)
    commit()
    for s in range(nc):
        c = nc - 1 - s; bq = s & 1; bk = bq ^ 1
        dhs[c] = store_ds()
        wait(0)  # B1
        ktile(bufp(bk), LdKe, kend[c]); commit()
        du = np.zeros((8, 32, 4))
        qgs = bufp(bq)
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 8 * wc
            xm = np.zeros((32, 4)); ym = np.zeros((2, 32, 4))
            for ks in range(8):
                if ks >= 2 * wi:
                    af = []; bf = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; u0 = 16 * wi + gq; j0 = 8 * ks + t4
                        af.append([sm[aqo + j0 * LdA + u0] if j0 >= u0 else 0,
                                   sm[aqo + j0 * LdA + u0 + 8] if j0 >= u0 + 8 else 0,
                                   sm[aqo + (j0 + 4) * LdA + u0] if j0 + 4 >= u0 else 0,
                                   sm[aqo + (j0 + 4) * LdA + u0 + 8] if j0 + 4 >= u0 + 8 else 0])
                        bf.append([sm[doo + j0 * LdB + cw + gq], sm[doo + (j0 + 4) * LdB + cw + gq]])
                    mma(xm, af, bf)
                bv = []
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4
                    bv.append([sm[doo + t0 * LdB + cw + gq], sm[doo + (t0 + 4) * LdB + cw + gq]])
                for mt in range(2):
                    af = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4; i0 = 32 * wi + gq + 16 * mt
                        af.append([sm[qgs + t0 * LdT + i0], sm[qgs + t0 * LdT + i0 + 8],
                                   sm[qgs + (t0 + 4) * LdT + i0], sm[qgs + (t0 + 4) * LdT + i0 + 8]])
                    mma(ym[mt], af, bv)
            for lane in range(32):
                gq = lane >> 2; r0 = 32 * wi + gq
                du[warp, lane] = scale * xm[lane]
                for mt in range(2):
                    g0, g1 = sm[glo + r0 + 16 * mt], sm[glo + r0 + 16 * mt + 8]
                    for e in range(4):
                        ds[warp, lane, mt, e] = scale * ym[mt, lane, e] + (g0 if e < 2 else g1) * ds[warp, lane, mt, e]
        wait(0)  # B2
        ktile(bufp(bq), LdT, w[c]); commit()
        sm[doo:doo + CH * LdB] = np.nan  # dO of chunk c consumed
        if c > 0:
            issue_aq(c - 1); put_do(c - 1)
        commit()
        ke = bufp(bk)
        sm[duo:duo + CH * LdB] = np.nan  # the previous dU consumed
        dUc = np.zeros((CH, BV))
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 8 * wc
            am = np.zeros((32, 4))
            for ks in range(16):
                af = []; bf = []
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; u0 = 16 * wi + gq; k0 = 8 * ks + t4
                    af.append([sm[ke + u0 * LdKe + k0], sm[ke + (u0 + 8) * LdKe + k0],
                               sm[ke + u0 * LdKe + k0 + 4], sm[ke + (u0 + 8) * LdKe + k0 + 4]])
                    bf.append([sm[dso + k0 * LdB + cw + gq], sm[dso + (k0 + 4) * LdB + cw + gq]])
                mma(am, af, bf)
            du[warp] += am
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, u0 = 8 * wc, 16 * wi + gq
            d = duo + u0 * LdB + cw + 2 * t4
            sm[d:d + 2] = du[warp, lane, :2]; sm[d + 8 * LdB:d + 8 * LdB + 2] = du[warp, lane, 2:]
            for e in range(4):
                dUc[u0 + 8 * (e >> 1), cw + 2 * t4 + (e & 1)] = du[warp, lane, e]
        dUo[c] = dUc
        wait(1)  # B3
        if c > 0: ktile(bufp(bk), LdT, qg[c - 1])
        commit()
        sm[dso:dso + KP * LdB] = np.nan  # the dS1 copy consumed
        ww = bufp(bq)
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 8 * wc
            zm = np.zeros((2, 32, 4))
            for ks in range(8):
                bh = []
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4
                    bh.append([sm[duo + t0 * LdB + cw + gq], sm[duo + (t0 + 4) * LdB + cw + gq]])
                for mt in range(2):
                    af = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4; i0 = 32 * wi + gq + 16 * mt
                        af.append([-sm[ww + t0 * LdT + i0], -sm[ww + t0 * LdT + i0 + 8],
                                   -sm[ww + (t0 + 4) * LdT + i0], -sm[ww + (t0 + 4) * LdT + i0 + 8]])
                    mma(zm[mt], af, bh)
            for lane in range(32):
                ds[warp, lane] += zm[:, lane]
        put_ds()
    dh0 = store_ds()
    err = lambda a, b: np.abs(a - b).max() / np.abs(b).max()
    assert err(dh0, ref_dh0) < 1e-12
    for c in range(nc):
        assert err(dhs[c], ref_dhs[c]) < 1e-12, c
        assert err(dUo[c], ref_dU[c]) < 1e-12, c


def test_state_bwd3n_index_emulation():
    # four chunks: both buffer parities twice, the single A_qk / dO buffers refilled three times
    run(nc=4, Cc_last=50, K=128, V=16, seed=0)


def test_state_bwd3n_index_emulation_partial():
    # K < 128 (zero rows of the state past K), a partial column block (V = 14 of 16), one chunk
    run(nc=1, Cc_last=37, K=100, V=14, seed=1)
