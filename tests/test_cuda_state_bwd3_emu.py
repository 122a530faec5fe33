"""CPU index-level emulation of state_bwd3_kernel (kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh): one block of
8 warps x 32 lanes over three chunks (the last one partial), every shared-memory address, padded row stride,
mma fragment mapping (m16n8k8: A (g, t), (g+8, t), (g, t+4), (g+8, t+4); B (t, g), (t+4, g); C (g, 2t), (g, 2t+1),
(g+8, ...)), the double-buffer parity and the A_qk diagonal mask as written in the kernel, in exact float64, against
the plain recurrence dU = A_qk^T dO + Kend dS1, dS0 = Gam_last dS1 + (Q Gam)^T dO - w^T dU. Consumed buffers are
poisoned with NaN and A_qk holds garbage above its diagonal, so a wrong address or a read of a stale buffer fails.
Needs no GPU (the tf32 rounding is not emulated: the GPU tests cover the precision).
"""
import numpy as np


def test_state_bwd3_index_emulation():
    rng = np.random.default_rng(0)
    CH, KP, VS = 64, 128, 32
    LdKe, LdT, LdA, LdB = KP + 4, KP + 8, CH + 8, VS + 8
    K, V = 128, 32
    nc = 3
    Cc_last = 50
    scale = 0.3
    aqk = np.tril(rng.standard_normal((nc, CH, CH)))        # aqk[c][t][j], j <= t
    kend = rng.standard_normal((nc, CH, KP))
    qg = rng.standard_normal((nc, CH, KP))
    w = rng.standard_normal((nc, CH, KP))
    gl = rng.uniform(0.5, 1, (nc, KP))
    # padded rows of the last chunk are zero in kend/qg/w; dO zero there
    for x in (kend, qg, w): x[nc - 1, Cc_last:] = 0
    dO = rng.standard_normal((nc, CH, V)); dO[nc - 1, Cc_last:] = 0
    dht = rng.standard_normal((K, V))
    # reference
    S = dht.copy(); ref_dhs = [None] * nc; ref_dU = [None] * nc
    for c in range(nc - 1, -1, -1):
        ref_dhs[c] = S.copy()
        dU = aqk[c].T @ (scale * dO[c]) + kend[c] @ S
        ref_dU[c] = dU
        S = gl[c][:, None] * S + qg[c].T @ (scale * dO[c]) - w[c].T @ dU
    ref_dh0 = S

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

    ke_s = np.full((2, CH * LdKe), np.nan); w_s = np.full((2, CH * LdT), np.nan); qg_s = np.full(CH * LdT, np.nan)
    aq_s = np.full(CH * LdA, np.nan)
    gl_s = np.full(KP, np.nan)
    ds_s = np.full(KP * LdB, np.nan)
    ou_s = np.full(CH * LdB, np.nan)
    def g1(c, b):
        for t in range(CH):
            ke_s[b, t * LdKe:t * LdKe + KP] = kend[c, t]; w_s[b, t * LdT:t * LdT + KP] = w[c, t]
    def g2(c):
        aq = aqk[c].copy(); aq[np.triu_indices(CH, 1)] = 7.0  # garbage above the diagonal: the kernel masks it
        for t in range(CH):
            aq_s[t * LdA:t * LdA + CH] = aq[t]; qg_s[t * LdT:t * LdT + KP] = qg[c, t]
        gl_s[:] = gl[c]
    # registers: ds[warp][lane][mt][nt][e]
    ds = np.zeros((8, 32, 2, 2, 4))
    def lanes():
        for warp in range(8):
            for lane in range(32):
                yield warp, lane, warp & 3, warp >> 2, lane >> 2, lane & 3
    for warp, lane, wi, wc, gq, t4 in lanes():
        cw, r0 = 16 * wc, 32 * wi + gq
        for mt in range(2):
            for nt in range(2):
                for e in range(4):
                    ds[warp, lane, mt, nt, e] = dht[r0 + 16 * mt + 8 * (e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)]
    def put_ds():
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, r0 = 16 * wc, 32 * wi + gq
            for mt in range(2):
                for nt in range(2):
                    d = (r0 + 16 * mt) * LdB + cw + 8 * nt + 2 * t4
                    ds_s[d:d + 2] = ds[warp, lane, mt, nt, :2]
                    ds_s[d + 8 * LdB:d + 8 * LdB + 2] = ds[warp, lane, mt, nt, 2:]
    def put_do(c):
        for tid in range(256):
            d = (tid >> 2) * LdB + 8 * (tid & 3)
            ou_s[d:d + 8] = dO[c, tid >> 2, 8 * (tid & 3):8 * (tid & 3) + 8]
    dhs = [None] * nc; dUo = [None] * nc
    put_ds(); g1(nc - 1, 0); g2(nc - 1); g1(nc - 2, 1); put_do(nc - 1)
    def store_ds():
        out = np.zeros((K, V))
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, r0 = 16 * wc, 32 * wi + gq
            for mt in range(2):
                for nt in range(2):
                    for e in range(4):
                        out[r0 + 16 * mt + 8 * (e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)] = ds[warp, lane, mt, nt, e]
        return out
    for s in range(nc):
        c = nc - 1 - s; b = s & 1
        dhs[c] = store_ds()
        du = np.zeros((8, 32, 2, 4))
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 16 * wc
            xm = np.zeros((2, 32, 4)); ym = np.zeros((2, 2, 32, 4))
            for ks in range(8):
                if ks >= 2 * wi:
                    af = []; bf = [[], []]
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; u0 = 16 * wi + gq; j0 = 8 * ks + t4
                        af.append([aq_s[j0 * LdA + u0] if j0 >= u0 else 0,
                                   aq_s[j0 * LdA + u0 + 8] if j0 >= u0 + 8 else 0,
                                   aq_s[(j0 + 4) * LdA + u0] if j0 + 4 >= u0 else 0,
                                   aq_s[(j0 + 4) * LdA + u0 + 8] if j0 + 4 >= u0 + 8 else 0])
                        for nt in range(2):
                            bf[nt].append([ou_s[j0 * LdB + cw + 8 * nt + gq], ou_s[(j0 + 4) * LdB + cw + 8 * nt + gq]])
                    for nt in range(2): mma(xm[nt], af, bf[nt])
                bv = [[], []]
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4
                    for nt in range(2):
                        bv[nt].append([ou_s[t0 * LdB + cw + 8 * nt + gq], ou_s[(t0 + 4) * LdB + cw + 8 * nt + gq]])
                for mt in range(2):
                    af = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4; i0 = 32 * wi + gq + 16 * mt
                        af.append([qg_s[t0 * LdT + i0], qg_s[t0 * LdT + i0 + 8],
                                   qg_s[(t0 + 4) * LdT + i0], qg_s[(t0 + 4) * LdT + i0 + 8]])
                    for nt in range(2): mma(ym[mt, nt], af, bv[nt])
            for lane in range(32):
                gq = lane >> 2; r0 = 32 * wi + gq
                for nt in range(2): du[warp, lane, nt] = scale * xm[nt, lane]
                for mt in range(2):
                    g0, g1_ = gl_s[r0 + 16 * mt], gl_s[r0 + 16 * mt + 8]
                    for nt in range(2):
                        for e in range(4):
                            ds[warp, lane, mt, nt, e] = (
                                scale * ym[mt, nt, lane, e] + (g0 if e < 2 else g1_) * ds[warp, lane, mt, nt, e])
        if c > 0: g2(c - 1)
        dUc = np.zeros((CH, V))
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 16 * wc
            am = np.zeros((2, 32, 4))
            for ks in range(16):
                af = []; bf = [[], []]
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; u0 = 16 * wi + gq; k0 = 8 * ks + t4
                    ke = ke_s[b]
                    af.append([ke[u0 * LdKe + k0], ke[(u0 + 8) * LdKe + k0],
                               ke[u0 * LdKe + k0 + 4], ke[(u0 + 8) * LdKe + k0 + 4]])
                    for nt in range(2):
                        bf[nt].append([ds_s[k0 * LdB + cw + 8 * nt + gq], ds_s[(k0 + 4) * LdB + cw + 8 * nt + gq]])
                for nt in range(2): mma(am[nt], af, bf[nt])
            du[warp] += am.transpose(1, 0, 2)
        ou_s[:] = np.nan  # dO consumed
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, u0 = 16 * wc, 16 * wi + gq
            for nt in range(2):
                d = u0 * LdB + cw + 8 * nt + 2 * t4
                ou_s[d:d + 2] = du[warp, lane, nt, :2]; ou_s[d + 8 * LdB:d + 8 * LdB + 2] = du[warp, lane, nt, 2:]
                for e in range(4):
                    dUc[u0 + 8 * (e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)] = du[warp, lane, nt, e]
        dUo[c] = dUc
        ds_s[:] = np.nan
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2; cw = 16 * wc
            zm = np.zeros((2, 2, 32, 4))
            for ks in range(8):
                bh = [[], []]
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4
                    for nt in range(2):
                        bh[nt].append([ou_s[t0 * LdB + cw + 8 * nt + gq], ou_s[(t0 + 4) * LdB + cw + 8 * nt + gq]])
                for mt in range(2):
                    af = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3; t0 = 8 * ks + t4; i0 = 32 * wi + gq + 16 * mt
                        ww = w_s[b]
                        af.append([-ww[t0 * LdT + i0], -ww[t0 * LdT + i0 + 8],
                                   -ww[(t0 + 4) * LdT + i0], -ww[(t0 + 4) * LdT + i0 + 8]])
                    for nt in range(2): mma(zm[mt, nt], af, bh[nt])
            for lane in range(32):
                ds[warp, lane] += zm[:, :, lane]
        put_ds()
        if c > 1: g1(c - 2, b)
        if c > 0: put_do(c - 1)
    dh0 = store_ds()
    err = lambda a, b: np.abs(a - b).max() / np.abs(b).max()
    assert err(dh0, ref_dh0) < 1e-12
    for c in range(nc):
        assert err(dhs[c], ref_dhs[c]) < 1e-12, c
        assert err(dUo[c], ref_dU[c]) < 1e-12, c
