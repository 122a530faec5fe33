"""CPU emulation of the index math of the KDA prep kernel v2 (kernels_src/cuda/kda_chunk_prep2.cuh).

Replays thread by thread (lane by lane for the tensor-core fragments and the fragment-order stores) what differs
from v1 (retired in session 9 with its emulation): a = e^g in place and the sub-chunk gate sums (S1), the per-pass build
of the 64-row factor tables F / R (products) and of Pre / Suf / the cross factors / decay (exponentials of sums of
sub-chunk gate sums), P2 over the 64-row tables, the pass-local fragment-order stores of q~ and k~^T (W), the branch-free in-sub-chunk pairs with
running products (P1: rows outside the triangle keep f = 1 and are masked at the end), and X = k e^G from Pre and
the running product (S2). numpy float64; checked against float64 formulas of DESIGN.md section 3 with per-channel
gates (exponentials of direct gate sums), including gates of -20 and -1e4, K < 128 and short chunks. The blocked
inverse and w / u0 are shared with the GDN prep (tests/test_cuda_gdn_prep_emu.py). Runs without a GPU; the CUDA
code itself is tested by tests/test_cuda_chunk_fwd.py.
"""
import numpy as np
import pytest

from test_cuda_gdn_prep_emu import acc_to_afrag, frag_index, unfrag

C, SUB, PASS = 64, 16, 32


class P1Pairs:
    """P1 of the KDA preps (kda_chunk_prep2.cuh, delta_chunk_bwd_prep4.cuh share it): the in-sub-chunk pairs (t, j)
    of each diagonal block (NB = 8: the 8x8 split) with running products, thread tid's map, its partial
    sums per pass (branch-free: f stays 1 outside the triangle), warp_sum_below<8> and the triangle's results."""

    def __init__(self):
        self.NB = NB = 8
        self.NH = NH = NB // 2
        self.q1, self.k1 = np.zeros((256, NH)), np.zeros((256, NH))
        self.q2, self.k2 = np.zeros((256, NB)), np.zeros((256, NB))

    def map(self, tid):
        cg, a1 = tid & 7, tid >> 6
        rp = (tid & 31) >> 3
        j0 = a1 * SUB + ((tid >> 5) & 1) * self.NB
        return cg, rp, j0, j0 + rp, j0 + self.NB - 1 - rp

    def accumulate(self, Qs, Ks, Gx, cp0):
        NB, NH = self.NB, self.NH
        for tid in range(256):
            cg, rp, j0, t1, t2 = self.map(tid)
            for ci in range(PASS // 16):
                c = cp0 + 2 * (ci * 8 + cg)
                cc = [c, c + 1]
                f1, f2 = np.ones(2), np.ones(2)
                for jl in range(NB - 1, -1, -1):
                    j = j0 + jl
                    aj, kj = Gx[j, cc], Ks[j, cc]
                    x = kj * f2
                    self.q2[tid, jl] += Qs[t2, cc] @ x
                    self.k2[tid, jl] += Ks[t2, cc] @ x
                    if jl <= NB - 1 - rp:
                        f2 = f2 * aj
                    if jl < NH:
                        x = kj * f1
                        self.q1[tid, jl] += Qs[t1, cc] @ x
                        self.k1[tid, jl] += Ks[t1, cc] @ x
                        if jl <= rp:
                            f1 = f1 * aj

    def results(self):
        """(t1, t2, j, q.k and k.k of (t1, j) and of (t2, j)) for every pair a thread writes, after the warp sums
        (xor 1, 2, 4 inside each group of 8 lanes); 0 outside the triangle (the diagonal kept for q, not for k)."""
        def sum8(x):
            y = x.copy()
            for m in (1, 2, 4):
                y = y + y[np.arange(256) ^ m]
            return y
        NB, NH = self.NB, self.NH
        q1, k1, q2, k2 = sum8(self.q1), sum8(self.k1), sum8(self.q2), sum8(self.k2)
        for tid in range(256):
            cg, rp, j0, t1, t2 = self.map(tid)
            for jl in range(NB):
                if (jl & 7) != cg:
                    continue
                vq1 = q1[tid, jl % NH] if (jl < NH and jl <= rp) else 0.0
                vk1 = k1[tid, jl % NH] if (jl < NH and jl < rp) else 0.0
                vq2 = q2[tid, jl] if jl <= NB - 1 - rp else 0.0
                vk2 = k2[tid, jl] if jl < NB - 1 - rp else 0.0
                yield t1, t2, j0 + jl, vq1, vk1, vq2, vk2


def cross_tile(tile):
    """Cross-sub-chunk tile number (0..23) -> row block a (1..3), matrix (0: q, 1: k), 8-column tile nt (< 2a), as
    cross_tile of kda_chunk_prep2.cuh (moved here with it from the retired v1 emulation, test_cuda_kda_prep_emu.py)."""
    a = 1 if tile < 4 else (2 if tile < 12 else 3)
    local = tile - (0 if a == 1 else (4 if a == 2 else 12))
    mat = local // (2 * a)
    return a, mat, local - mat * 2 * a


def emu_kda_prep2(q, k, g, beta, scale, KP, L):
    K = q.shape[1]
    NP = KP // PASS
    Qs, Ks, Gx = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, KP))
    Qs[:L, :K], Ks[:L, :K], Gx[:L, :K] = q[:L], k[:L], g[:L]
    Bs = np.zeros(C)
    Bs[:L] = beta[:L]
    ws_qg, ws_kg = np.full(C * KP, np.nan), np.full(KP * C, np.nan)
    ws_aqk, decay = np.full(C * C, np.nan), np.full(KP, np.nan)
    Ab = np.full((C, C), np.nan)

    def put(sec, i, x):
        assert np.isnan(sec[i]), "element written twice"
        sec[i] = x

    # S1: a = e^g in place, Tot_b = the gate sum of sub-chunk b (tree order is irrelevant in float64)
    Tot = np.full((4, KP), np.nan)
    for i in range(4 * KP):
        c, b = i % KP, i // KP
        Tot[b, c] = np.sum(Gx[b * SUB:(b + 1) * SUB, c])
        Gx[b * SUB:(b + 1) * SUB, c] = np.exp(Gx[b * SUB:(b + 1) * SUB, c])
    Pre, Suf, Ex = np.full((4, KP), np.nan), np.full((4, KP), np.nan), np.full((3, KP), np.nan)
    p1 = P1Pairs()
    acc2 = np.zeros((8, 3, 32, 4))
    accq = np.zeros((4, 32, 4))  # the lower-left 8x8 quarters, warps 0-3

    for ps in range(NP):
        cp0 = ps * PASS
        Fs, Rf, Hs = np.full((C, PASS), np.nan), np.full((C, PASS), np.nan), np.full((C, PASS), np.nan)
        for tid in range(256):  # build
            bcl, ba, bdir = tid & 31, (tid >> 5) & 3, tid >> 7
            c = cp0 + bcl
            tb = Tot[:, c]
            if bdir == 0:
                spre = 0.0
                for b in range(3):
                    if b < ba:
                        spre += tb[b]
                Pre[ba, c] = np.exp(spre)
                P, P8 = 1.0, 1.0
                for i in range(SUB):
                    t = ba * SUB + i
                    P *= Gx[t, c]
                    Fs[t, bcl] = P
                    if i >= 8:
                        P8 *= Gx[t, c]
                        Hs[t, bcl] = P8
                if ba == 3:
                    decay[c] = np.exp(spre + tb[3])
            else:
                ssuf = 0.0
                for b in range(1, 4):
                    if b > ba:
                        ssuf += tb[b]
                Suf[ba, c] = np.exp(ssuf)
                S, S8 = 1.0, 1.0
                for i in range(SUB - 1, -1, -1):
                    t = ba * SUB + i
                    Rf[t, bcl] = S
                    S *= Gx[t, c]
                    if i < 8:
                        Hs[t, bcl] = S8
                        S8 *= Gx[t, c]
                if ba == 0:
                    Ex[0, c], Ex[1, c], Ex[2, c] = np.exp(tb[1]), np.exp(tb[2]), np.exp(tb[1] + tb[2])
        emu_cross_tiles(Qs, Ks, Fs, Rf, Hs, Ex, cp0, acc2, accq)
        for tid in range(256):  # W
            for r in range(4):
                it = tid + r * 256
                ln, z = it & 31, it >> 5
                if z < 16:
                    a, ct = z >> 2, z & 3
                    r0, cl = a * SUB + (ln >> 2), ct * 8 + (ln & 3)
                    c0 = cp0 + cl
                    e0, e1 = scale * Pre[a, c0], scale * Pre[a, c0 + 4]
                    x = (e0 * (Qs[r0, c0] * Fs[r0, cl]), e0 * (Qs[r0 + 8, c0] * Fs[r0 + 8, cl]),
                         e1 * (Qs[r0, c0 + 4] * Fs[r0, cl + 4]), e1 * (Qs[r0 + 8, c0 + 4] * Fs[r0 + 8, cl + 4]))
                    i = (a * (KP // 8) + cp0 // 8 + ct) * 32 + ln
                    for e in range(4):
                        put(ws_qg, i * 4 + e, x[e])
                else:
                    zz = z - 16
                    rb, ct = zz >> 3, zz & 7
                    cl, t0 = rb * 16 + (ln >> 2), ct * 8 + (ln & 3)
                    c0, a = cp0 + cl, ct >> 1
                    s0, s1 = Suf[a, c0], Suf[a, c0 + 8]
                    d0, d1 = Bs[t0], Bs[t0 + 4]
                    x = (d0 * (Ks[t0, c0] * (Rf[t0, cl] * s0)), d0 * (Ks[t0, c0 + 8] * (Rf[t0, cl + 8] * s1)),
                         d1 * (Ks[t0 + 4, c0] * (Rf[t0 + 4, cl] * s0)),
                         d1 * (Ks[t0 + 4, c0 + 8] * (Rf[t0 + 4, cl + 8] * s1)))
                    i = ((cp0 // 16 + rb) * (C // 8) + ct) * 32 + ln
                    for e in range(4):
                        put(ws_kg, i * 4 + e, x[e])
        p1.accumulate(Qs, Ks, Gx, cp0)
    for t1, t2, j, vq1, vk1, vq2, vk2 in p1.results():  # results (as v1)
        bj = Bs[j]
        put(ws_aqk, frag_index(t1, j, C), scale * vq1 * bj)
        put(ws_aqk, frag_index(t2, j, C), scale * vq2 * bj)
        assert np.isnan(Ab[t1, j]) and np.isnan(Ab[t2, j])
        Ab[t1, j], Ab[t2, j] = vk1 * bj, vk2 * bj
    for tid in range(256):  # the upper-right quarter of each diagonal block of A~: zero
        a, r, cc = tid >> 6, (tid >> 3) & 7, tid & 7
        put(ws_aqk, frag_index(a * SUB + r, a * SUB + 8 + cc, C), 0.0)
    for warp in range(4):  # the lower-left quarter
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            t, j = warp * SUB + 8 + gq, warp * SUB + 2 * t4
            b0, b1 = Bs[j], Bs[j + 1]
            put(ws_aqk, frag_index(t, j, C), scale * (accq[warp, lane, 0] * b0))
            put(ws_aqk, frag_index(t, j + 1, C), scale * (accq[warp, lane, 1] * b1))
            assert np.isnan(Ab[t, j]) and np.isnan(Ab[t, j + 1])
            Ab[t, j], Ab[t, j + 1] = accq[warp, lane, 2] * b0, accq[warp, lane, 3] * b1
    for warp in range(8):
        for u in range(3):
            a, mat, nt = cross_tile(warp + 8 * u)
            vals = np.zeros((32, 4))
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                b0, b1 = Bs[nt * 8 + 2 * t4], Bs[nt * 8 + 2 * t4 + 1]
                vals[lane] = acc2[warp, u, lane] * (b0, b1, b0, b1)
            if mat == 0:
                fr = acc_to_afrag(scale * vals)
                for lane in range(32):
                    i = (a * 8 + nt) * 32 + lane
                    for e in range(4):
                        put(ws_aqk, i * 4 + e, fr[lane, e])
            else:
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    for e in range(4):
                        r, cc = a * SUB + gq + (e >> 1) * 8, nt * 8 + 2 * t4 + (e & 1)
                        assert np.isnan(Ab[r, cc])
                        Ab[r, cc] = vals[lane, e]
    for i in range(12 * 32):
        z = i >> 5
        a = 0 if z < 6 else (1 if z < 10 else 2)
        nt = 2 + z if z < 6 else (z - 2 if z < 10 else z - 4)
        idx = (a * 8 + nt) * 32 + (i & 31)
        for e in range(4):
            put(ws_aqk, idx * 4 + e, 0.0)
    # S2 (warps 4-7): X = k e^G = k Pre_b prod(a) in place of a
    X = Gx.copy()
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
    return dict(qg=ws_qg, kg=ws_kg, aqk=ws_aqk, decay=decay, Ab=Ab, X=X)


def emu_cross_tiles(Qs, Ks, Fs, Rf, Hs, Ex, cp0, acc2, accq):
    """One 32-channel pass of P2 (the cross-sub-chunk tiles of A_qk / A_kk over the pass's 64-row factor tables F /
    R and the cross factors Ex) and of the lower-left 8x8 quarter of each diagonal block (tables H),
    lane by lane into the mma accumulators acc2 [8 warps, 3, 32 lanes, 4] and accq [4, 32, 4]. The forward prep v2
    and the backward prep v4 (tests/test_cuda_bwd_prep4_emu.py) run the same code here."""
    for warp in range(8):  # P2
        for u in range(3):
            a, mat, nt = cross_tile(warp + 8 * u)
            b = nt >> 1
            E = None if b == a - 1 else Ex[0 if a == 2 else (1 if b == 1 else 2)]
            Xs = Ks if mat else Qs
            for s in range(PASS // 8):
                At, Bt = np.full((16, 8), np.nan), np.full((8, 8), np.nan)
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    ra, jb = a * SUB + gq, nt * 8 + gq
                    cl = s * 8 + t4
                    c = cp0 + cl
                    At[gq, t4] = Xs[ra, c] * Fs[ra, cl]
                    At[gq + 8, t4] = Xs[ra + 8, c] * Fs[ra + 8, cl]
                    At[gq, t4 + 4] = Xs[ra, c + 4] * Fs[ra, cl + 4]
                    At[gq + 8, t4 + 4] = Xs[ra + 8, c + 4] * Fs[ra + 8, cl + 4]
                    b0, b1 = Ks[jb, c] * Rf[jb, cl], Ks[jb, c + 4] * Rf[jb, cl + 4]
                    if E is not None:
                        b0, b1 = b0 * E[c], b1 * E[c + 4]
                    Bt[t4, gq], Bt[t4 + 4, gq] = b0, b1
                assert not np.isnan(At).any() and not np.isnan(Bt).any(), "unset table entry read"
                D = At @ Bt
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    acc2[warp, u, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4],
                                            D[gq + 8, 2 * t4 + 1])
    for warp in range(4):  # the lower-left 8x8 quarter of sub-chunk `warp`
        for s in range(PASS // 8):
            At, Bt = np.full((16, 8), np.nan), np.full((8, 8), np.nan)
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                r, jb = warp * SUB + 8 + gq, warp * SUB + gq
                cl = s * 8 + t4
                c = cp0 + cl
                At[gq, t4], At[gq + 8, t4] = Qs[r, c] * Hs[r, cl], Ks[r, c] * Hs[r, cl]
                At[gq, t4 + 4], At[gq + 8, t4 + 4] = Qs[r, c + 4] * Hs[r, cl + 4], Ks[r, c + 4] * Hs[r, cl + 4]
                Bt[t4, gq], Bt[t4 + 4, gq] = Ks[jb, c] * Hs[jb, cl], Ks[jb, c + 4] * Hs[jb, cl + 4]
            assert not np.isnan(At).any() and not np.isnan(Bt).any(), "unset table entry read"
            D = At @ Bt
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                accq[warp, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])


@pytest.mark.parametrize("K,L,gates", [(128, 64, "normal"), (128, 64, "extreme"), (64, 37, "extreme"),
                                       (40, 64, "div10"), (128, 1, "normal"), (96, 50, "div0.1")])
def test_kda_prep2_against_float64(K, L, gates):
    rng = np.random.default_rng(K + L + len(gates))
    KP = 64 if K <= 64 else 128
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
    scale = K ** -0.5
    with np.errstate(under="ignore"):
        ws = emu_kda_prep2(q, k, g, beta, scale, KP, L)
    for name in ("qg", "kg", "aqk", "decay"):
        assert not np.isnan(ws[name]).any(), f"{name}: an element was never written"
        assert np.isfinite(ws[name]).all(), f"{name}: inf"
    qz, kz, gz = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, KP))
    qz[:L, :K], kz[:L, :K], gz[:L, :K] = q[:L], k[:L], g[:L]
    bz = np.zeros(C)
    bz[:L] = beta[:L]
    G = np.cumsum(gz, axis=0)  # [C, KP]
    Dc = np.zeros((C, C, KP))  # pair decay per channel, exp of the direct sum of the gates in between (j <= t)
    with np.errstate(under="ignore"):
        for t in range(C):
            for j in range(t + 1):
                Dc[t, j] = np.exp(gz[j + 1:t + 1].sum(axis=0))
        Aqk = scale * np.einsum("tc,jc,tjc->tj", qz, kz, Dc) * bz[None, :]
        Akk = np.tril(np.einsum("tc,jc,tjc->tj", kz, kz, Dc), -1) * bz[None, :]
        suffix = np.exp(np.cumsum(gz[::-1], axis=0)[::-1] - gz)  # e^{sum of the gates after t}, direct sums
        low = np.zeros((C, C), bool)
        for a in range(4):
            low[a * SUB:(a + 1) * SUB, :(a + 1) * SUB] = True
        np.testing.assert_allclose(unfrag(ws["aqk"], C, C), Aqk, atol=1e-12, rtol=1e-9)
        # the upper-right quarter of a diagonal block of A_kk is never written (nor read: the inverse reads the
        low &= np.tri(C, C, -1, dtype=bool)  # strictly lower triangle)
        np.testing.assert_allclose(ws["Ab"][low], Akk[low], atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(unfrag(ws["qg"], C, KP), scale * qz * np.exp(G), atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(unfrag(ws["kg"], KP, C), (kz * bz[:, None] * suffix).T, atol=1e-12, rtol=1e-9)
        np.testing.assert_allclose(ws["decay"], np.exp(G[-1]), atol=1e-300, rtol=1e-9)
        np.testing.assert_allclose(ws["X"], kz * np.exp(G), atol=1e-12, rtol=1e-9)



def test_float32_gate_factors_are_exact_enough():
    """The v2 factors in float32 as the kernel forms them: products of at most 16 a_i = e^{g_i} within a sub-chunk
    (F, R, the in-sub-chunk pairs) and exponentials of float tree sums of whole sub-chunks' gates (Pre, Suf, the
    cross factors, the decay). Against float64 exponentials of the direct gate sums: relative error far below
    tf32 / bf16 rounding for ordinary and adversarial gates (-1e4 gives exactly 0, never inf/NaN, no factor above
    1), and the chunk decay, which compounds over the chunks of a sequence, stays within a few ulp even for gates
    near 0 (long memory), where a product of 64 factors would be ~1e-6 off per chunk."""
    rng = np.random.default_rng(5)
    worst_sub, worst_decay = 0.0, 0.0
    for scale in (1e-4, 0.01, 0.1, 1.0, 10.0):
        g = (np.log(1 / (1 + np.exp(-rng.standard_normal((2048, 64))))) * scale).astype(np.float32)
        if scale >= 0.1:
            r = rng.uniform(size=g.shape)
            g = np.where(r < 0.02, np.float32(-1e4), np.where(r > 0.95, np.float32(-20.0), g)).astype(np.float32)
        with np.errstate(under="ignore"):
            a = np.exp(g).astype(np.float32)
            for b in range(4):  # within a sub-chunk: running products
                p32 = np.ones(g.shape[0], np.float32)
                s64 = np.zeros(g.shape[0])
                for i in range(16 * b, 16 * b + 16):
                    p32 = (p32 * a[:, i]).astype(np.float32)
                    s64 = s64 + g[:, i].astype(np.float64)
                    e64 = np.exp(s64)
                    assert np.isfinite(p32).all() and (p32 <= 1).all()
                    assert (p32[e64 == 0] == 0).all()
                    ok = e64 > 1e-30
                    worst_sub = max(worst_sub, float(np.max(np.abs(p32[ok] - e64[ok]) / e64[ok], initial=0.0)))
            sums = g.reshape(-1, 4, 16)  # float32 pairwise tree per sub-chunk, then the sub-chunk sums in order
            for w in (8, 4, 2, 1):
                sums = (sums[..., :w] + sums[..., w:2 * w]).astype(np.float32)
            tot = sums[..., 0]
            d32 = np.exp(((tot[:, 0] + tot[:, 1]).astype(np.float32) + tot[:, 2]).astype(np.float32) + tot[:, 3])
            d32 = d32.astype(np.float32)
            d64 = np.exp(g.astype(np.float64).sum(axis=1))
            assert np.isfinite(d32).all() and (d32 <= 1).all() and (d32[d64 == 0] == 0).all()
            ok = d64 > 1e-30
            err = float(np.max(np.abs(d32[ok] - d64[ok]) / d64[ok], initial=0.0))
            if scale <= 0.01:  # gates near 0: a few ulp (float32 ulp 6e-8)
                assert err < 3e-7, (scale, err)
            worst_decay = max(worst_decay, err)
    assert worst_sub < 5e-6, worst_sub
    assert worst_decay < 2e-5, worst_decay
