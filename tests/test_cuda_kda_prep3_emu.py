"""CPU emulation of the new index math of the KDA prep kernel v3 (kernels_src/cuda/kda_chunk_prep3.cuh,
KDA_CUDA_KDA_PREP=4), in the style of tests/test_cuda_kda_prep2_emu.py (whose emulation of v2 with the 8x8 split is
checked against float64 formulas there; v3 keeps v2's P1, quarter, results and inverse).

What v3 changes and is replayed here lane by lane, on FLAT shared-memory arrays with the kernel's offsets and row
strides (so a row offset or an overlap of two tables shows up):
  - ldmatrix (x4 / x2) of 8x8 b16 matrices read as 32-bit words: the lane addresses of ld_afrag32 / ld_bfrag32 give
    exactly the tf32 m16n8k8 A / B fragments;
  - the build's product tables QF = q F, KR = k R (the fb region) and KF = k F (rows 16..63 at t - 16, beside Hs in
    the A_kk region), P2 from them with the cross factor's offset: the accumulators equal v2's emulation
    (emu_cross_tiles) and the q~ / k~^T stores (W) equal v2's;
  - S5 (prep3_w_u0): T's A fragments by ldmatrix, each read once for a pair of jobs (job, job + 8), w in fragment order and u0 row-major with float2 stores (even V)
    or element stores (odd V), V > 128 in 128-column blocks: against T X and T V, every element written once;
  - S4': only the blocks on and below the diagonal of T are rounded and S5 reads no other.
numpy float64, no GPU; the CUDA kernel itself is tested by tests/test_cuda_chunk_fwd.py
(test_kda_prep3_vs_default_and_reference).
"""
import numpy as np
import pytest

from test_cuda_gdn_prep_emu import acc_to_afrag, frag_index, unfrag
from test_cuda_kda_prep2_emu import C, PASS, SUB, cross_tile, emu_cross_tiles

LDF = PASS + 4  # KdaPrep2Smem::LDF
LDA = C + 4  # kPrepLDA
LDV = 128 + 8  # kPrepLDV


def ldsm(mem, lane_addr, nmat):
    """ldmatrix.m8n8.x{nmat}.b16 on a flat float32-word array: lane 8 i + r gives the word address of row r of
    matrix i (16-byte aligned); register i of lane l = word l % 4 of row l / 4 of matrix i. Returns [32, nmat]."""
    regs = np.zeros((32, nmat))
    for i in range(nmat):
        for l in range(32):
            row = lane_addr[8 * i + (l >> 2)]
            assert row % 4 == 0, "ldmatrix row address not 16-byte aligned"
            regs[l, i] = mem[row + (l & 3)]
    return regs


def afrag_addrs(base, ld):
    """ld_afrag32: lane l addresses row (l & 7) + 8 ((l >> 3) & 1), column 4 (l >> 4)."""
    return [base + ((l & 7) + ((l >> 3) & 1) * 8) * ld + (l >> 4) * 4 for l in range(32)]


def bfrag_addrs(base, ld):
    """ld_bfrag32: lane l addresses row (l & 7), column 4 ((l >> 3) & 1) (lanes 16-31: ignored by .x2)."""
    return [base + (l & 7) * ld + ((l >> 3) & 1) * 4 for l in range(32)]


def test_ldmatrix_gives_the_tf32_fragments():
    rng = np.random.default_rng(1)
    ld = 36
    M = rng.standard_normal((16, ld))
    mem = M.ravel()
    a = ldsm(mem, afrag_addrs(8, ld), 4)  # the 16x8 block at column 8
    b = ldsm(mem, bfrag_addrs(3 * ld + 16, ld), 2)  # the 8x8 block at row 3, column 16, stored n-major
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        assert tuple(a[lane]) == (M[g, 8 + t], M[g + 8, 8 + t], M[g, 12 + t], M[g + 8, 12 + t])
        assert tuple(b[lane]) == (M[3 + g, 16 + t], M[3 + g, 20 + t])  # b0 = B[k = t][n = g], b1 = B[t + 4][g]


def build_tables(Qs, Ks, Gx, cp0):
    """The build of one pass as the kernel writes it: flat fb = [QF | KR] (64 rows each, stride LDF) and flat
    A_kk region = [Hs (64 rows) | KF (48 rows, row t - 16)], NaN where never written; plus v2's F / R / H tables."""
    fb = np.full(2 * C * LDF, np.nan)
    ab = np.full(C * LDA, np.nan)
    QF, KR, HS, KF = 0, C * LDF, 0, C * LDF
    assert KF + 48 * LDF <= C * LDA, "Hs and KF overflow the A_kk region"
    Fs, Rf, Hs = np.full((C, PASS), np.nan), np.full((C, PASS), np.nan), np.full((C, PASS), np.nan)

    def put(mem, i, x):
        assert np.isnan(mem[i]), "table entry written twice in one pass"
        mem[i] = x

    for tid in range(256):
        bcl, ba, bdir = tid & 31, (tid >> 5) & 3, tid >> 7
        c = cp0 + bcl
        if bdir == 0:
            P, P8 = 1.0, 1.0
            for i in range(SUB):
                t = ba * SUB + i
                P *= Gx[t, c]
                Fs[t, bcl] = P
                put(fb, QF + t * LDF + bcl, Qs[t, c] * P)
                if ba > 0:
                    put(ab, KF + (t - SUB) * LDF + bcl, Ks[t, c] * P)
                if i >= 8:
                    P8 *= Gx[t, c]
                    Hs[t, bcl] = P8
                    put(ab, HS + t * LDF + bcl, P8)
        else:
            S, S8 = 1.0, 1.0
            for i in range(SUB - 1, -1, -1):
                t = ba * SUB + i
                Rf[t, bcl] = S
                put(fb, KR + t * LDF + bcl, Ks[t, c] * S)
                S *= Gx[t, c]
                if i < 8:
                    Hs[t, bcl] = S8
                    put(ab, HS + t * LDF + bcl, S8)
                    S8 *= Gx[t, c]
    return fb, ab, Fs, Rf, Hs


def p2_from_tables(fb, ab, Ex, cp0, KP, acc2):
    """P2 of v3: A by ld_afrag32 from QF (mat 0) or KF (mat 1, row t - 16), B by ld_bfrag32 from KR, times the
    cross factor (offset Ex + idx KP + cp0, index s 8 + t4 / + 4) where b < a - 1; lane-level m16n8k8."""
    Exf = Ex.ravel()
    for warp in range(8):
        for u in range(3):
            a, mat, nt = cross_tile(warp + 8 * u)
            b = nt >> 1
            eoff = None if b == a - 1 else (0 if a == 2 else (1 if b == 1 else 2)) * KP + cp0
            mem_a = ab if mat else fb
            xa = (C * LDF + (a - 1) * SUB * LDF) if mat else a * SUB * LDF
            xb = C * LDF + nt * 8 * LDF
            for s in range(PASS // 8):
                af = ldsm(mem_a, afrag_addrs(xa + s * 8, LDF), 4)
                bf = ldsm(fb, bfrag_addrs(xb + s * 8, LDF), 2)
                assert not np.isnan(af).any() and not np.isnan(bf).any(), "unset table entry read"
                At, Bt = np.zeros((16, 8)), np.zeros((8, 8))
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    b0, b1 = bf[lane]
                    if eoff is not None:
                        b0, b1 = b0 * Exf[eoff + s * 8 + t4], b1 * Exf[eoff + s * 8 + t4 + 4]
                    At[gq, t4], At[gq + 8, t4], At[gq, t4 + 4], At[gq + 8, t4 + 4] = af[lane]
                    Bt[t4, gq], Bt[t4 + 4, gq] = b0, b1
                D = At @ Bt
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    acc2[warp, u, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4],
                                            D[gq + 8, 2 * t4 + 1])


def w_from_tables(fb, Pre, Suf, Bs, scale, cp0, KP, ws_qg, ws_kg):
    """W of v3: q~ = scale Pre QF, k~^T = beta (KR Suf) from the flat tables, fragment order."""
    QF, KR = 0, C * LDF
    for tid in range(256):
        for r in range(4):
            it = tid + r * 256
            ln, z = it & 31, it >> 5
            if z < 16:
                a, ct = z >> 2, z & 3
                r0, cl = a * SUB + (ln >> 2), ct * 8 + (ln & 3)
                c0 = cp0 + cl
                e0, e1 = scale * Pre[a, c0], scale * Pre[a, c0 + 4]
                x = (e0 * fb[QF + r0 * LDF + cl], e0 * fb[QF + (r0 + 8) * LDF + cl], e1 * fb[QF + r0 * LDF + cl + 4],
                     e1 * fb[QF + (r0 + 8) * LDF + cl + 4])
                i = (a * (KP // 8) + cp0 // 8 + ct) * 32 + ln
                sec = ws_qg
            else:
                zz = z - 16
                rb, ct = zz >> 3, zz & 7
                cl, t0 = rb * 16 + (ln >> 2), ct * 8 + (ln & 3)
                c0, a = cp0 + cl, ct >> 1
                s0, s1 = Suf[a, c0], Suf[a, c0 + 8]
                d0, d1 = Bs[t0], Bs[t0 + 4]
                x = (d0 * (fb[KR + t0 * LDF + cl] * s0), d0 * (fb[KR + t0 * LDF + cl + 8] * s1),
                     d1 * (fb[KR + (t0 + 4) * LDF + cl] * s0), d1 * (fb[KR + (t0 + 4) * LDF + cl + 8] * s1))
                i = ((cp0 // 16 + rb) * (C // 8) + ct) * 32 + ln
                sec = ws_kg
            for e in range(4):
                assert np.isnan(sec[i * 4 + e]), "written twice"
                sec[i * 4 + e] = x[e]


@pytest.mark.parametrize("K,L,gates", [(128, 64, "normal"), (128, 64, "extreme"), (64, 37, "extreme"),
                                       (96, 50, "div0.1")])
def test_prep3_tables_p2_w_match_v2(K, L, gates):
    """v3's build / P2 / W over the flat tables against v2's emulation (emu_cross_tiles, W over F / R), which
    test_cuda_kda_prep2_emu.py checks against float64: same accumulators, same q~ / k~^T, every element once."""
    rng = np.random.default_rng(K + L)
    KP = 64 if K <= 64 else 128
    Qs, Ks, Gx = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, KP))
    Qs[:L, :K] = rng.standard_normal((L, K)) / np.sqrt(K)
    Ks[:L, :K] = rng.standard_normal((L, K)) / np.sqrt(K)
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((L, K)))))
    if gates == "extreme":
        r = rng.uniform(size=g.shape)
        g = np.where(r < 0.3, -20.0, np.where(r > 0.97, -1e4, g))
    elif gates == "div0.1":
        g = g / 0.1
    Gx[:L, :K] = g
    Tot = Gx.reshape(4, SUB, KP).sum(axis=1)
    with np.errstate(under="ignore"):
        Gx = np.exp(Gx)
        Ex = np.stack([np.exp(Tot[1]), np.exp(Tot[2]), np.exp(Tot[1] + Tot[2])])
        Pre = np.exp(np.stack([Tot[:a].sum(axis=0) for a in range(4)]))
        Suf = np.exp(np.stack([Tot[a + 1:].sum(axis=0) for a in range(4)]))
    Bs = np.zeros(C)
    Bs[:L] = rng.uniform(size=L)
    scale = K ** -0.5
    acc_v2, acc_v3 = np.zeros((8, 3, 32, 4)), np.zeros((8, 3, 32, 4))
    accq = np.zeros((4, 32, 4))
    qg3, kg3 = np.full(C * KP, np.nan), np.full(KP * C, np.nan)
    for ps in range(KP // PASS):
        cp0 = ps * PASS
        with np.errstate(under="ignore"):
            fb, ab, Fs, Rf, Hs = build_tables(Qs, Ks, Gx, cp0)
            emu_cross_tiles(Qs, Ks, Fs, Rf, Hs, Ex, cp0, True, acc_v2, accq)
            p2_from_tables(fb, ab, Ex, cp0, KP, acc_v3)
            w_from_tables(fb, Pre, Suf, Bs, scale, cp0, KP, qg3, kg3)
    np.testing.assert_allclose(acc_v3, acc_v2, rtol=1e-12, atol=1e-300)
    assert not np.isnan(qg3).any() and not np.isnan(kg3).any(), "a q~ / k~^T element was never written"
    G = np.cumsum(np.log(np.maximum(Gx, 1e-300)), axis=0)
    with np.errstate(under="ignore"):
        np.testing.assert_allclose(unfrag(qg3, C, KP), scale * Qs * np.exp(G), atol=1e-12, rtol=1e-9)
        suffix = np.exp(G[-1][None, :] - G)
        np.testing.assert_allclose(unfrag(kg3, KP, C), (Ks * Bs[:, None] * suffix).T, atol=1e-12, rtol=1e-9)


def emu_prep3_w_u0(T, X, Vfull, KP):
    """prep3_w_u0 lane by lane: Ts flat with row stride LDA (only the blocks on and below the diagonal set, the
    rest NaN: S4' rounds no other and S5 must read no other), X flat (stride ldx = KP + 8), V staged per 128
    columns (stride LDV); w in fragment order, u0 row-major (float2 where V is even and c + 1 < V)."""
    V = Vfull.shape[1]
    Ts = np.full(C * LDA, np.nan)
    for r in range(C):
        for c in range(C):
            if (c >> 4) <= (r >> 4):
                Ts[r * LDA + c] = T[r, c]
    ldx = KP + 8
    Xs = np.full(C * ldx, np.nan)
    for t in range(C):
        Xs[t * ldx:t * ldx + KP] = X[t]
    w = np.full(C * KP, np.nan)
    u = np.full(C * V, np.nan)
    ntw = KP // 8
    even = V % 2 == 0
    for v0 in range(0, V, 128):
        Vs = np.zeros(C * LDV)
        for t in range(C):
            n = min(V - v0, 128)
            Vs[t * LDV:t * LDV + n] = Vfull[t, v0:v0 + n]
        ntv = (min(V - v0, 128) + 7) // 8
        nw = ntw if v0 == 0 else 0
        njob = nw + ntv
        for warp in range(8):
            for job0 in range(warp, njob, 16):  # the warp's jobs in pairs (job0, job0 + 8): one T read for both
                jobs = [job0] + ([job0 + 8] if job0 + 8 < njob else [])
                bfr = np.zeros((len(jobs), 32, 8, 2))
                for x, job in enumerate(jobs):
                    isw = job < nw
                    n0 = (job if isw else job - nw) * 8
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3
                        for s in range(8):
                            for hh in range(2):
                                t = s * 8 + t4 + 4 * hh
                                bfr[x, lane, s, hh] = Xs[t * ldx + n0 + gq] if isw else Vs[t * LDV + n0 + gq]
                for a in range(4):
                    acc = np.zeros((len(jobs), 32, 4))
                    for s in range(8):
                        if s < 2 * a + 2:
                            af = ldsm(Ts, afrag_addrs(a * SUB * LDA + s * 8, LDA), 4)
                            assert not np.isnan(af).any(), "S5 read a T entry outside the rounded blocks"
                            At = np.zeros((16, 8))
                            for lane in range(32):
                                gq, t4 = lane >> 2, lane & 3
                                At[gq, t4], At[gq + 8, t4], At[gq, t4 + 4], At[gq + 8, t4 + 4] = af[lane]
                            for x in range(len(jobs)):
                                Bt = np.zeros((8, 8))
                                for lane in range(32):
                                    gq, t4 = lane >> 2, lane & 3
                                    Bt[t4, gq], Bt[t4 + 4, gq] = bfr[x, lane, s]
                                D = At @ Bt
                                for lane in range(32):
                                    gq, t4 = lane >> 2, lane & 3
                                    acc[x, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4],
                                                     D[gq + 8, 2 * t4 + 1])
                    for x, job in enumerate(jobs):
                        if job < nw:
                            fr = acc_to_afrag(acc[x])
                            for lane in range(32):
                                i = (a * ntw + job) * 32 + lane
                                assert np.isnan(w[i * 4:i * 4 + 4]).all(), "w element written twice"
                                w[i * 4:i * 4 + 4] = fr[lane]
                        else:
                            n0 = (job - nw) * 8
                            for lane in range(32):
                                gq, t4 = lane >> 2, lane & 3
                                for hh in range(2):
                                    r, c = a * SUB + gq + hh * 8, v0 + n0 + 2 * t4
                                    vals = (acc[x, lane, 2 * hh], acc[x, lane, 2 * hh + 1])
                                    if even and c + 1 < V:
                                        assert (r * V + c) % 2 == 0, "float2 store not 8-byte aligned"
                                        idx = [r * V + c, r * V + c + 1]
                                    else:
                                        idx = [r * V + c + e for e in range(2) if c + e < V]
                                    for e, i in enumerate(idx):
                                        assert np.isnan(u[i]), "u0 element written twice"
                                        u[i] = vals[e]
    return w, u


@pytest.mark.parametrize("KP,V", [(128, 128), (64, 64), (128, 37), (128, 256), (64, 200), (64, 30), (128, 80)])
def test_prep3_w_u0_by_ldmatrix(KP, V):
    rng = np.random.default_rng(KP + V)
    # T block lower triangular (diagonal blocks lower triangular), as the blocked inverse leaves it
    T = np.tril(rng.standard_normal((C, C)))
    X = rng.standard_normal((C, KP))
    Vm = rng.standard_normal((C, V))
    w, u = emu_prep3_w_u0(T, X, Vm, KP)
    assert not np.isnan(w).any() and not np.isnan(u).any(), "an element of w / u0 was never written"
    np.testing.assert_allclose(unfrag(w, C, KP), T @ X, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(u.reshape(C, V), T @ Vm, rtol=1e-12, atol=1e-12)
