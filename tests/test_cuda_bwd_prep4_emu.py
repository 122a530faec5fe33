"""CPU emulation of the index math of the KDA backward prep v4 (kernels_src/cuda/delta_chunk_bwd_prep4.cuh,
KDA_CUDA_CHUNK_BWD_PREP=4, with the 8x8 split of the diagonal blocks; =5, without, was retired in session 11).

Replays thread by thread (lane by lane for the tensor-core fragments) what v4 writes: a = e^g in place and the
sub-chunk gate sums (S1); per pass of 32 channels the build of the 64-row factor tables F / R (running products),
Pre and the cross factors, with Q Gam, K Eend (row-major [64][KP]) and Gam_last stored on the way; P2 over the
64-row tables; the split-8 lower-left quarter tile; the branch-free in-sub-chunk pairs (P1); the row-major A_qk /
A_kk stores (P1 per element, the quarter tile, the zeros of the upper-right quarters, the P2 tiles, the zeros
above the diagonal blocks) and A_kk Diag(beta) in shared memory; X = K Gam (S2). numpy float64, every output
element written exactly once, against float64 formulas of DESIGN.md section 3 with per-channel gates
(exponentials of direct gate sums), including gates of -20 and -1e4, K < 128 and short chunks. The blocked inverse
and w / u are prep v3's (tests/test_cuda_chunk_bwd_prep_emu.py); tests/test_cuda_chunk_bwd.py and
tests/test_cuda_stages.py check the CUDA code itself against the fp32 SIMT prep and the float64 reference.
"""
import numpy as np
import pytest

from test_cuda_kda_prep2_emu import P1Pairs, cross_tile, emu_cross_tiles

C, SUB, PASS, KP = 64, 16, 32, 128


def emu_bwd_prep4(q, k, g, beta, L):
    K = q.shape[1]
    NP = KP // PASS
    Qs, Ks, Gx = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, KP))
    Qs[:L, :K], Ks[:L, :K], Gx[:L, :K] = q[:L], k[:L], g[:L]
    Bs = np.zeros(C)
    Bs[:L] = beta[:L]
    qgc, kendc, glc = np.full(C * KP, np.nan), np.full(C * KP, np.nan), np.full(KP, np.nan)
    aqk, akk = np.full(C * C, np.nan), np.full(C * C, np.nan)
    Ab = np.full((C, C), np.nan)

    def put(sec, i, x):
        assert np.isnan(sec[i]), "element written twice"
        sec[i] = x

    # S1: a = e^g in place, Tot_b = the gate sum of sub-chunk b
    Tot = np.full((4, KP), np.nan)
    for i in range(4 * KP):
        c, b = i % KP, i // KP
        Tot[b, c] = np.sum(Gx[b * SUB:(b + 1) * SUB, c])
        Gx[b * SUB:(b + 1) * SUB, c] = np.exp(Gx[b * SUB:(b + 1) * SUB, c])
    Pre, Ex = np.full((4, KP), np.nan), np.full((3, KP), np.nan)
    p1 = P1Pairs()
    acc2 = np.zeros((8, 3, 32, 4))
    accq = np.zeros((4, 32, 4))

    for ps in range(NP):
        cp0 = ps * PASS
        Fs, Rf, Hs = np.full((C, PASS), np.nan), np.full((C, PASS), np.nan), np.full((C, PASS), np.nan)
        for tid in range(256):  # build
            bcl, ba, bdir = tid & 31, (tid >> 5) & 3, tid >> 7
            c = cp0 + bcl
            tb = Tot[:, c]
            if bdir == 0:
                spre = sum(tb[b] for b in range(3) if b < ba)
                epre = np.exp(spre)
                Pre[ba, c] = epre
                P, P8 = 1.0, 1.0
                for i in range(SUB):
                    t = ba * SUB + i
                    P *= Gx[t, c]
                    Fs[t, bcl] = P
                    if i >= 8:
                        P8 *= Gx[t, c]
                        Hs[t, bcl] = P8
                    put(qgc, t * KP + c, Qs[t, c] * (epre * P))
                if ba == 3:
                    put(glc, c, np.exp(spre + tb[3]))
            else:
                esuf = np.exp(sum(tb[b] for b in range(1, 4) if b > ba))
                S, S8 = 1.0, 1.0
                for i in range(SUB - 1, -1, -1):
                    t = ba * SUB + i
                    Rf[t, bcl] = S
                    put(kendc, t * KP + c, Ks[t, c] * (esuf * S))
                    S *= Gx[t, c]
                    if i < 8:
                        Hs[t, bcl] = S8
                        S8 *= Gx[t, c]
                if ba == 0:
                    Ex[0, c], Ex[1, c], Ex[2, c] = np.exp(tb[1]), np.exp(tb[2]), np.exp(tb[1] + tb[2])
        emu_cross_tiles(Qs, Ks, Fs, Rf, Hs, Ex, cp0, acc2, accq)
        p1.accumulate(Qs, Ks, Gx, cp0)

    for t1, t2, j, vq1, vk1, vq2, vk2 in p1.results():  # results: P1
        bj = Bs[j]
        put(aqk, t1 * C + j, vq1)
        put(aqk, t2 * C + j, vq2)
        put(akk, t1 * C + j, vk1)
        put(akk, t2 * C + j, vk2)
        assert np.isnan(Ab[t1, j]) and np.isnan(Ab[t2, j])
        Ab[t1, j], Ab[t2, j] = vk1 * bj, vk2 * bj
    for tid in range(256):  # upper-right quarters: zeros
        a, r, cc = tid >> 6, (tid >> 3) & 7, tid & 7
        t, j = a * SUB + r, a * SUB + 8 + cc
        put(aqk, t * C + j, 0.0)
        put(akk, t * C + j, 0.0)
        assert np.isnan(Ab[t, j])
        Ab[t, j] = 0.0
    for warp in range(4):  # the lower-left quarters from accq
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            t, j = warp * SUB + 8 + gq, warp * SUB + 2 * t4
            put(aqk, t * C + j, accq[warp, lane, 0])
            put(aqk, t * C + j + 1, accq[warp, lane, 1])
            put(akk, t * C + j, accq[warp, lane, 2])
            put(akk, t * C + j + 1, accq[warp, lane, 3])
            assert np.isnan(Ab[t, j]) and np.isnan(Ab[t, j + 1])
            Ab[t, j], Ab[t, j + 1] = accq[warp, lane, 2] * Bs[j], accq[warp, lane, 3] * Bs[j + 1]
    for warp in range(8):  # P2 tiles: prep3_store_tile
        for u in range(3):
            a, mat, nt = cross_tile(warp + 8 * u)
            r0, c0 = a * SUB, nt * 8
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                cv = acc2[warp, u, lane]
                s0, s1 = Bs[c0 + 2 * t4], Bs[c0 + 2 * t4 + 1]
                for e in range(4):
                    r, cc = r0 + gq + 8 * (e >> 1), c0 + 2 * t4 + (e & 1)
                    put(akk if mat else aqk, r * C + cc, cv[e])
                    if mat:
                        assert np.isnan(Ab[r, cc])
                        Ab[r, cc] = cv[e] * (s0, s1)[e & 1]
    for tid in range(256):  # prep3_zero_upper
        for i in range(tid, C * C // 4, 256):
            t, j = i // (C // 4), (i % (C // 4)) * 4
            if j >= SUB * (t // SUB + 1):
                for e in range(4):
                    put(aqk, t * C + j + e, 0.0)
                    put(akk, t * C + j + e, 0.0)
    X = Gx.copy()  # S2 (warps 4-7): X = K Gam = k Pre_b prod(a) in place of a
    seen = np.zeros((C, KP), bool)
    for tid in range(128, 256):
        for i in range(tid - 128, 4 * KP, 128):
            c, b = i % KP, i // KP
            e = Pre[b, c]
            for u in range(SUB):
                t = b * SUB + u
                e *= Gx[t, c]
                assert not seen[t, c]
                seen[t, c] = True
                X[t, c] = Ks[t, c] * e
    assert seen.all()
    return dict(aqk=aqk.reshape(C, C), akk=akk.reshape(C, C), qgc=qgc.reshape(C, KP), kendc=kendc.reshape(C, KP),
                glc=glc, Ab=Ab, X=X)


@pytest.mark.parametrize("K,L,gates", [(128, 64, "normal"), (128, 64, "extreme"), (64, 37, "extreme"),
                                       (40, 64, "div10"), (128, 1, "normal"), (96, 50, "div0.1")])
def test_bwd_prep4_against_float64(K, L, gates):
    rng = np.random.default_rng(K + 3 * L + len(gates))
    q = rng.standard_normal((C, K)) / np.sqrt(K)
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((C, K)))))
    if gates == "extreme":
        r = rng.uniform(size=(C, K))
        g = np.where(r < 0.3, -20.0, np.where(r > 0.97, -1e4, g))
    elif gates == "div10":
        g = g / 10
    elif gates == "div0.1":
        g = g / 0.1
    beta = rng.uniform(size=C)
    with np.errstate(under="ignore"):
        out = emu_bwd_prep4(q, k, g, beta, L)
    for name in ("aqk", "akk", "qgc", "kendc", "glc"):
        assert not np.isnan(out[name]).any(), f"{name}: an element was never written"
        assert np.isfinite(out[name]).all(), f"{name}: inf"
    qz, kz, gz = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, KP))
    qz[:L, :K], kz[:L, :K], gz[:L, :K] = q[:L], k[:L], g[:L]
    bz = np.zeros(C)
    bz[:L] = beta[:L]
    G = np.cumsum(gz, axis=0)
    Dc = np.zeros((C, C, KP))  # pair decay per channel: exp of the direct sum of the gates in between (j <= t)
    with np.errstate(under="ignore"):
        for t in range(C):
            for j in range(t + 1):
                Dc[t, j] = np.exp(gz[j + 1:t + 1].sum(axis=0))
        Aqk = np.einsum("tc,jc,tjc->tj", qz, kz, Dc)  # zeros above the diagonal (Dc = 0 there)
        Akk = np.tril(np.einsum("tc,jc,tjc->tj", kz, kz, Dc), -1)
        suffix = np.exp(np.cumsum(gz[::-1], axis=0)[::-1] - gz)  # e^{sum of the gates after t}, direct sums
        np.testing.assert_allclose(out["aqk"], Aqk, atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(out["akk"], Akk, atol=1e-12, rtol=1e-9)
        low = np.zeros((C, C), bool)  # what the inverse reads: strictly lower, within the block-lower part
        for a in range(4):
            low[a * SUB:(a + 1) * SUB, :(a + 1) * SUB] = True
        low &= np.tri(C, C, -1, dtype=bool)
        np.testing.assert_allclose(out["Ab"][low], (Akk * bz[None, :])[low], atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(out["qgc"], qz * np.exp(G), atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(out["kendc"], kz * suffix, atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(out["glc"], np.exp(G[-1]), atol=1e-300, rtol=1e-9)
        assert (out["glc"][K:] == 1).all()  # Gam_last is 1 past K
        np.testing.assert_allclose(out["X"], kz * np.exp(G), atol=1e-12, rtol=1e-9)
