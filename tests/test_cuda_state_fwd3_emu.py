"""CPU emulation of the index math of the backward's tensor-core state_fwd3_kernel
(kernels_src/cuda/delta_chunk_bwd_state_fwd3.cuh): the padded shared-memory tiles and their double buffers (filled
when the kernel issues each copy, so that a copy issued into a buffer still in use would show), the m16n8k8 A / B
fragment reads of U = u - w S (w row-major) and of S <- Diag(gl) S + (K Eend)^T U (K Eend read transposed), the
accumulator layouts and the stores of hs and U, lane by lane in float64. Checks that the result is the recurrence
of DESIGN.md section 3 and that the fragment reads of every warp are free of shared-memory bank conflicts. Runs
without a GPU; tests/test_cuda_chunk_bwd.py checks the CUDA code itself. Both instances: the default (BV = 32 value
columns per block, double buffers) and the narrow one of KDA_CUDA_CHUNK_BWD_STATE_FWD=7 (BV = 16, NTW = 1 tile of 8
columns per warp, single buffers, w(c + 1) issued after chunk c's U, K Eend(c) at the start of chunk c); and the
wide-block one of =12 (session 13: BV = 32, double buffers, NW = 16 warps of the narrow warp tile, 4 column warps;
LDH 40). The shared-operand instance of =11 is two narrow groups (its hand-off: test_cuda_state_fwd11_emu.py).
"""
import numpy as np
import pytest

CH, KP = 64, 128
LDW, LDE = KP + 4, KP + 8
LANES = np.arange(32)
GQ, T4 = LANES >> 2, LANES & 3


def mma(c, a, b):
    """m16n8k8: a [32][4], b [32][2], c [32][4] per lane -> c + A B."""
    A = np.zeros((16, 8))
    B = np.zeros((8, 8))
    A[GQ, T4], A[GQ + 8, T4], A[GQ, T4 + 4], A[GQ + 8, T4 + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    B[T4, GQ], B[T4 + 4, GQ] = b[:, 0], b[:, 1]
    D = A @ B
    out = c.copy()
    out[:, 0] += D[GQ, 2 * T4]
    out[:, 1] += D[GQ, 2 * T4 + 1]
    out[:, 2] += D[GQ + 8, 2 * T4]
    out[:, 3] += D[GQ + 8, 2 * T4 + 1]
    return out


def banks_ok(addrs):
    """32 scalar shared-memory reads of a warp: no two distinct addresses on one bank."""
    addrs = np.asarray(addrs)
    return all(len(set(addrs[(addrs % 32) == b])) <= 1 for b in range(32))


def emulate(w, kend, gl, u, h0, BV=32, DB=True, NW=8):
    """w, kend [nc][CH][KP], gl [nc][KP], u [nc][CH][BV], h0 [KP][BV] -> hs [nc][KP][BV], U [nc][CH][BV]. NW = 16:
    the wide-block instance of KDA_CUDA_CHUNK_BWD_STATE_FWD=12 (16 warps, 4 column warps of 8 columns)."""
    WC = NW // 4
    VS, LDH, NTW, NB = BV, BV + 8, BV // (8 * WC), 2 if DB else 1
    nc = w.shape[0]
    wsm = np.full((NB, CH * LDW), np.nan)
    esm = np.full((NB, CH * LDE), np.nan)
    gsm = np.full((NB, KP), np.nan)
    sel = (lambda c: c & 1) if DB else (lambda c: 0)
    hsm = np.zeros(KP * LDH)
    usm = np.full(CH * LDH, np.nan)

    def ktile(dst, src, ld):
        for t in range(CH):
            dst[t * ld:t * ld + KP] = src[t]

    def issue_w(c):
        ktile(wsm[sel(c)], w[c], LDW)

    def issue_e(c):
        ktile(esm[sel(c)], kend[c], LDE)
        gsm[sel(c)] = gl[c]

    # hacc[warp][mt][nt] [32][4]: row 32 wi + 16 mt + gq + 8 (e >> 1), column 16 wc + 8 nt + 2 t4 + (e & 1)
    rows = lambda wi, mt, e: 32 * wi + 16 * mt + GQ + 8 * (e >> 1)
    cols = lambda wc, nt, e: 8 * NTW * wc + 8 * nt + 2 * T4 + (e & 1)
    hacc = {(wi, wc, mt, nt): np.stack([h0[rows(wi, mt, e), cols(wc, nt, e)] for e in range(4)], 1)
            for wi in range(4) for wc in range(WC) for mt in range(2) for nt in range(NTW)}

    def put_h():
        for (wi, wc, mt, nt), x in hacc.items():
            for e in range(4):
                hsm[rows(wi, mt, e) * LDH + cols(wc, nt, e)] = x[:, e]

    put_h()
    hs = np.zeros((nc, KP, VS))
    U = np.zeros((nc, CH, VS))
    if nc > 0:
        issue_w(0)
        if DB:
            issue_e(0)
    if nc > 1 and DB:
        issue_w(1)
    for c in range(nc):
        wb, eb, gb = wsm[sel(c)], esm[sel(c)], gsm[sel(c)]
        if not DB:
            issue_e(c)
        elif c + 1 < nc:
            issue_e(c + 1)
        for (wi, wc, mt, nt), x in hacc.items():
            for e in range(4):
                hs[c, rows(wi, mt, e), cols(wc, nt, e)] = x[:, e]
        for warp in range(NW):  # U = u - w S
            wi, wc = warp & 3, warp >> 2
            cw = 8 * NTW * wc
            acc = [np.zeros((32, 4)) for _ in range(NTW)]
            for ks in range(KP // 8):
                base = (16 * wi + GQ) * LDW + T4 + 8 * ks
                idx = [base, base + 8 * LDW, base + 4, base + 8 * LDW + 4]
                assert all(banks_ok(i) for i in idx)
                a = np.stack([wb[i] for i in idx], 1)
                for nt in range(NTW):
                    hb = (8 * ks + T4) * LDH + cw + GQ + 8 * nt
                    assert banks_ok(hb) and banks_ok(hb + 4 * LDH)
                    b = np.stack([hsm[hb], hsm[hb + 4 * LDH]], 1)
                    acc[nt] = mma(acc[nt], a, b)
            for nt in range(NTW):
                for e in range(4):
                    t = 16 * wi + GQ + 8 * (e >> 1)
                    col = cw + 8 * nt + 2 * T4 + (e & 1)
                    x = u[c, t, col] - acc[nt][:, e]
                    usm[t * LDH + col] = x
                    U[c, t, col] = x
        if DB and c + 2 < nc:
            issue_w(c + 2)
        if not DB and c + 1 < nc:
            issue_w(c + 1)
        for warp in range(NW):  # S <- Diag(gl) S + (K Eend)^T U
            wi, wc = warp & 3, warp >> 2
            cw = 8 * NTW * wc
            for mt in range(2):
                for nt in range(NTW):
                    x = hacc[(wi, wc, mt, nt)]
                    x[:, 0:2] *= gb[32 * wi + 16 * mt + GQ][:, None]
                    x[:, 2:4] *= gb[32 * wi + 16 * mt + GQ + 8][:, None]
            for ks in range(CH // 8):
                b = []
                for nt in range(NTW):
                    i0 = (8 * ks + T4) * LDH + cw + 8 * nt + GQ
                    assert banks_ok(i0) and banks_ok(i0 + 4 * LDH)
                    b.append(np.stack([usm[i0], usm[i0 + 4 * LDH]], 1))
                er = T4 * LDE + 32 * wi + GQ + 8 * ks * LDE
                for mt in range(2):
                    idx = [er + 16 * mt, er + 16 * mt + 8, er + 4 * LDE + 16 * mt, er + 4 * LDE + 16 * mt + 8]
                    assert all(banks_ok(i) for i in idx)
                    a = np.stack([eb[i] for i in idx], 1)
                    for nt in range(NTW):
                        hacc[(wi, wc, mt, nt)] = mma(hacc[(wi, wc, mt, nt)], a, b[nt])
        put_h()
    return hs, U


@pytest.mark.parametrize("BV,DB,NW", [(32, True, 8), (16, False, 8), (32, True, 16)], ids=["default", "narrow", "wide"])
@pytest.mark.parametrize("nc", [0, 1, 2, 5])
def test_state_fwd3_index_math(nc, BV, DB, NW):
    VS = BV
    rng = np.random.default_rng(nc)
    w = rng.standard_normal((nc, CH, KP)) * 0.1
    kend = rng.standard_normal((nc, CH, KP)) * 0.1
    gl = rng.uniform(0.5, 1.0, (nc, KP))
    u = rng.standard_normal((nc, CH, VS))
    h0 = rng.standard_normal((KP, VS))
    hs, U = emulate(w, kend, gl, u, h0, BV, DB, NW)
    S = h0.copy()
    for c in range(nc):
        assert np.allclose(hs[c], S, atol=1e-12), c
        Uc = u[c] - w[c] @ S
        assert np.allclose(U[c], Uc, atol=1e-12), c
        S = gl[c][:, None] * S + kend[c].T @ Uc
