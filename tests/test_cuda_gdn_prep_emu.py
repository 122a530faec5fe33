"""CPU emulation of the index math of the GDN prep kernel (kernels_src/cuda/gdn_chunk_prep.cuh).

Replays lane by lane what is easy to get wrong -- the 32-bit shared-memory word reads of the m16n8k16 A/B
fragments of Q K^T and K K^T (S1), the lower-tile job map, the accumulator -> fragment-order shuffles
(acc_to_afrag), the element maps of q~ and k~^T (S2, S3), the blocked inverse (S2-S4: diagonal blocks by
substitution, T_10 / T_32, then the lower-left 32x32 in one step) and the m16n8k8 fragments of w / u0 (S5) -- with
numpy, and checks the whole workspace (through the generic kernel's frag_index) against float64 formulas of
DESIGN.md section 3. Runs without a GPU; it does not test the CUDA code itself (tests/test_cuda_chunk_fwd.py does).
"""
import numpy as np
import pytest

C, SUB = 64, 16


def frag_index(r, c, KD):
    rr, cc = r & 15, c & 7
    lane = ((rr & 7) << 2) | (cc & 3)
    slot = (rr >> 3) | ((cc >> 2) << 1)
    return ((((r >> 4) * (KD // 8) + (c >> 3)) << 5) + lane) * 4 + slot


def lower_tile(job):
    a = 0 if job < 2 else (1 if job < 6 else (2 if job < 12 else 3))
    return a, job - a * (a + 1)


def acc_to_afrag(acc):
    """acc: [32, 4] per lane (c0..c3) -> [32, 4] A-fragment slots, by the kernel's shuffle sources."""
    out = np.zeros((32, 4))
    for lane in range(32):
        s1 = (lane & ~3) | ((lane & 3) >> 1)
        s2 = s1 + 2
        odd = lane & 1
        out[lane] = (acc[s1, 1 if odd else 0], acc[s1, 3 if odd else 2], acc[s2, 1 if odd else 0],
                     acc[s2, 3 if odd else 2])
    return out


def warp_mma_k16(Ssrc_a, rows_a, Ssrc_b, rows_b, KP):
    """S1's m16n8k16 products from 16-bit tiles as 32-bit words (word w of a row = halves 2w, 2w+1); returns
    the per-lane accumulators [32, 4]."""
    D = np.zeros((16, 8))
    for s in range(KP // 16):
        o = s * 8
        A = np.full((16, 16), np.nan)
        B = np.full((16, 8), np.nan)
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3

            def word(S, row, w):
                return S[row, 2 * w], S[row, 2 * w + 1]
            A[gq, 2 * t4:2 * t4 + 2] = word(Ssrc_a, rows_a + gq, o + t4)
            A[gq + 8, 2 * t4:2 * t4 + 2] = word(Ssrc_a, rows_a + gq + 8, o + t4)
            A[gq, 2 * t4 + 8:2 * t4 + 10] = word(Ssrc_a, rows_a + gq, o + t4 + 4)
            A[gq + 8, 2 * t4 + 8:2 * t4 + 10] = word(Ssrc_a, rows_a + gq + 8, o + t4 + 4)
            B[2 * t4:2 * t4 + 2, gq] = word(Ssrc_b, rows_b + gq, o + t4)
            B[2 * t4 + 8:2 * t4 + 10, gq] = word(Ssrc_b, rows_b + gq, o + t4 + 4)
        assert not np.isnan(A).any() and not np.isnan(B).any()
        D += A @ B
    acc = np.zeros((32, 4))
    for lane in range(32):
        gq, t4 = lane >> 2, lane & 3
        acc[lane] = (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])
    return acc


def mm16(A, B):
    """warp_mm16 through its m16n8k8 fragments (A 16x16, B 16x16 views)."""
    D = np.zeros((16, 16))
    for k0 in (0, 8):
        for nt in range(2):
            At, Bt = np.zeros((16, 8)), np.zeros((8, 8))
            for lane in range(32):
                gq, t4 = lane >> 2, lane & 3
                At[gq, t4], At[gq + 8, t4] = A[gq, k0 + t4], A[gq + 8, k0 + t4]
                At[gq, t4 + 4], At[gq + 8, t4 + 4] = A[gq, k0 + t4 + 4], A[gq + 8, k0 + t4 + 4]
                Bt[t4, gq], Bt[t4 + 4, gq] = B[k0 + t4, nt * 8 + gq], B[k0 + t4 + 4, nt * 8 + gq]
            D[:, nt * 8:nt * 8 + 8] += At @ Bt
    return D


def emu_gdn_prep(q, k, v, g, beta, scale, KP, L):
    """The workspace sections (as dense float64 matrices) the kernel writes, phase by phase."""
    K, V = q.shape[1], v.shape[1]
    LDH = KP + 8
    Qs, Ks = np.zeros((C, LDH)), np.zeros((C, LDH))
    Qs[:L, :K], Ks[:L, :K] = q[:L], k[:L]
    Vs = np.zeros((C, 136))
    Vs[:L, :min(V, 128)] = v[:L, :min(V, 128)]
    # S0 (warp 0): lane pairs, inclusive scan, exclusive by shifting
    gz = np.where(np.arange(C) < L, np.pad(g, (0, C - len(g))), 0.0)
    bz = np.where(np.arange(C) < L, np.pad(beta, (0, C - len(beta))), 0.0)
    pair = gz[0::2] + gz[1::2]
    incl = np.cumsum(pair)
    ex = np.concatenate([[0.0], incl[:-1]])
    G = np.zeros(C)
    G[0::2] = ex + gz[0::2]
    G[1::2] = G[0::2] + gz[1::2]
    Gl = G[C - 1]
    Ea, Ck = np.exp(G), bz * np.exp(Gl - G)
    aqk = np.full(C * C, np.nan)
    Ab = np.full((C, C), np.nan)
    for job in range(20):
        a, nt = lower_tile(job)
        cq = warp_mma_k16(Qs, a * SUB, Ks, nt * 8, KP)
        ck = warp_mma_k16(Ks, a * SUB, Ks, nt * 8, KP)
        vq, vk = np.zeros((32, 4)), np.zeros((32, 4))
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for e in range(4):
                t, j = a * SUB + gq + (e >> 1) * 8, nt * 8 + 2 * t4 + (e & 1)
                f = np.exp(G[t] - G[j]) if j <= t else 0.0
                vq[lane, e] = scale * cq[lane, e] * f * bz[j]
                vk[lane, e] = ck[lane, e] * f * bz[j] if j < t else 0.0
                Ab[t, j] = vk[lane, e]
        fr = acc_to_afrag(vq)
        for lane in range(32):
            aqk[((a * 8 + nt) * 32 + lane) * 4:((a * 8 + nt) * 32 + lane) * 4 + 4] = fr[lane]
    for i in range(12 * 32):
        z = i >> 5
        a = 0 if z < 6 else (1 if z < 10 else 2)
        nt = 2 + z if z < 6 else (z - 2 if z < 10 else z - 4)
        idx = (a * 8 + nt) * 32 + (i & 31)
        assert np.isnan(aqk[idx * 4:idx * 4 + 4]).all(), "upper tile written twice"
        aqk[idx * 4:idx * 4 + 4] = 0.0
    # S2: diagonal blocks; q~
    T = np.full((C, C), np.nan)
    for a in range(4):
        Bd = Ab[a * SUB:(a + 1) * SUB, a * SUB:(a + 1) * SUB]
        for j in range(SUB):
            x = np.zeros(SUB)
            for i in range(SUB):
                s = 1.0 if i == j else 0.0
                for m in range(i):
                    s -= Bd[i, m] * x[m]
                x[i] = 0.0 if i < j else s
            T[a * SUB:(a + 1) * SUB, a * SUB + j] = x
    NQ = 4 * (KP // 8) * 32
    qg = np.full(NQ * 4, np.nan)
    for it in range(NQ):
        ln, tile = it & 31, it >> 5
        r0, c0 = (tile // (KP // 8)) * SUB + (ln >> 2), (tile % (KP // 8)) * 8 + (ln & 3)
        e0, e1 = scale * Ea[r0], scale * Ea[r0 + 8]
        qg[it * 4:it * 4 + 4] = (e0 * Qs[r0, c0], e1 * Qs[r0 + 8, c0], e0 * Qs[r0, c0 + 4], e1 * Qs[r0 + 8, c0 + 4])
    # S3: T_10, T_32; k~^T
    blk = lambda M, a, b: M[a * SUB:(a + 1) * SUB, b * SUB:(b + 1) * SUB]  # noqa: E731
    for a in (1, 3):
        b = a - 1
        Y = mm16(blk(Ab, a, b), blk(T, b, b))
        T[a * SUB:(a + 1) * SUB, b * SUB:(b + 1) * SUB] = -mm16(blk(T, a, a), Y)
    NK = (KP // 16) * 8 * 32
    kg = np.full(NK * 4, np.nan)
    for it in range(NK):
        ln, tile = it & 31, it >> 5
        c0, t0 = (tile // 8) * SUB + (ln >> 2), (tile % 8) * 8 + (ln & 3)
        d0, d1 = Ck[t0], Ck[t0 + 4]
        kg[it * 4:it * 4 + 4] = (d0 * Ks[t0, c0], d0 * Ks[t0, c0 + 8], d1 * Ks[t0 + 4, c0], d1 * Ks[t0 + 4, c0 + 8])
    # S4: the lower-left 32x32
    for b in (0, 1):
        Y2, Y3 = np.zeros((16, 16)), np.zeros((16, 16))
        for c in range(b, 2):
            Y2 += mm16(blk(Ab, 2, c), blk(T, c, b))
            Y3 += mm16(blk(Ab, 3, c), blk(T, c, b))
        T2 = -mm16(blk(T, 2, 2), Y2)
        T3 = -(mm16(blk(T, 3, 2), Y2) + mm16(blk(T, 3, 3), Y3))
        T[2 * SUB:3 * SUB, b * SUB:(b + 1) * SUB] = T2
        T[3 * SUB:4 * SUB, b * SUB:(b + 1) * SUB] = T3
    # S5 (first V block): w in fragment order, u0 row-major
    ntw, ntv = KP // 8, (min(V, 128) + 7) // 8
    w = np.full(C * KP, np.nan)
    u = np.full((C, V), np.nan)
    for job in range(ntw + ntv):
        isw = job < ntw
        n0 = (job if isw else job - ntw) * 8
        acc = np.zeros((4, 32, 4))
        for a in range(4):
            for s in range(2 * a + 2):
                At, Bt = np.zeros((16, 8)), np.zeros((8, 8))
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    r = a * SUB + gq
                    At[gq, t4], At[gq + 8, t4] = T[r, s * 8 + t4], T[r + 8, s * 8 + t4]
                    At[gq, t4 + 4], At[gq + 8, t4 + 4] = T[r, s * 8 + t4 + 4], T[r + 8, s * 8 + t4 + 4]
                    for hh in range(2):
                        t = s * 8 + t4 + 4 * hh
                        Bt[t4 + 4 * hh, gq] = Ks[t, n0 + gq] * Ea[t] if isw else Vs[t, n0 + gq]
                D = At @ Bt
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    acc[a, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])
        for a in range(4):
            if isw:
                fr = acc_to_afrag(acc[a])
                for lane in range(32):
                    i = (a * ntw + job) * 32 + lane
                    w[i * 4:i * 4 + 4] = fr[lane]
            else:
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    for e in range(4):
                        r, c = a * SUB + gq + (e >> 1) * 8, n0 + 2 * t4 + (e & 1)
                        if c < V:
                            u[r, c] = acc[a, lane, e]
    return dict(aqk=aqk, qg=qg, kg=kg, w=w, u=u, decay=np.exp(Gl), T=T)


def unfrag(sec, R, KD):
    out = np.zeros((R, KD))
    for r in range(R):
        for c in range(KD):
            out[r, c] = sec[frag_index(r, c, KD)]
    return out


@pytest.mark.parametrize("K,V,L,gates", [(128, 128, 64, "normal"), (64, 64, 37, "extreme"), (40, 30, 64, "normal"),
                                         (128, 80, 1, "normal"), (128, 128, 64, "extreme")])
def test_gdn_prep_workspace_against_float64(K, V, L, gates):
    rng = np.random.default_rng(K + V + L)
    KP = 64 if K <= 64 else 128
    q = rng.standard_normal((C, K)) / np.sqrt(K)
    k = rng.standard_normal((C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    v = rng.standard_normal((C, V))
    g = np.log(1 / (1 + np.exp(-rng.standard_normal(C))))
    if gates == "extreme":
        r = rng.uniform(size=C)
        g = np.where(r < 0.3, -20.0, np.where(r > 0.9, -1e4, g))
    beta = rng.uniform(size=C)
    scale = K ** -0.5
    ws = emu_gdn_prep(q, k, v, g, beta, scale, KP, L)
    for name in ("aqk", "qg", "kg", "w"):
        assert not np.isnan(ws[name]).any(), f"{name}: an element was never written"
    assert not np.isnan(ws["u"]).any()
    # float64 formulas on the valid rows (padding: zeros)
    qz, kz, vz = np.zeros((C, KP)), np.zeros((C, KP)), np.zeros((C, V))
    qz[:L, :K], kz[:L, :K], vz[:L] = q[:L], k[:L], v[:L]
    gz, bz = np.zeros(C), np.zeros(C)
    gz[:L], bz[:L] = g[:L], beta[:L]
    G = np.cumsum(gz)
    with np.errstate(over="ignore"):
        D = np.where(np.tril(np.ones((C, C), bool)), np.exp(np.minimum(G[:, None] - G[None, :], 0.0)), 0.0)
    Aqk = scale * (qz @ kz.T) * D * bz[None, :]
    Akk = np.tril((kz @ kz.T) * D, -1) * bz[None, :]
    Tref = np.linalg.inv(np.eye(C) + Akk)
    wref = Tref @ (kz * np.exp(G)[:, None])
    uref = Tref @ vz
    np.testing.assert_allclose(unfrag(ws["aqk"], C, C), Aqk, atol=1e-12, rtol=1e-9)
    np.testing.assert_allclose(unfrag(ws["qg"], C, KP), scale * qz * np.exp(G)[:, None], atol=1e-12, rtol=1e-9)
    np.testing.assert_allclose(unfrag(ws["kg"], KP, C), (kz * (bz * np.exp(G[-1] - G))[:, None]).T, atol=1e-12,
                               rtol=1e-9)
    low = np.zeros((C, C), bool)
    for a in range(4):
        low[a * SUB:(a + 1) * SUB, :(a + 1) * SUB] = True
    np.testing.assert_allclose(ws["T"][low], Tref[low], atol=1e-9, rtol=1e-7)
    np.testing.assert_allclose(unfrag(ws["w"], C, KP), wref, atol=1e-9, rtol=1e-7)
    np.testing.assert_allclose(ws["u"], uref[:, :V] if V <= 128 else uref[:, :128], atol=1e-9, rtol=1e-7)
    assert np.isclose(ws["decay"], np.exp(G[-1]))


def test_acc_to_afrag_is_the_fragment_order():
    D = np.arange(128, dtype=float).reshape(16, 8)
    acc = np.zeros((32, 4))
    for lane in range(32):
        gq, t4 = lane >> 2, lane & 3
        acc[lane] = (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])
    fr = acc_to_afrag(acc).reshape(-1)
    for r in range(16):
        for c in range(8):
            assert fr[frag_index(r, c, 8)] == D[r, c]
