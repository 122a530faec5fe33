"""CPU emulation of the index math of the CUDA chunked-forward prep kernel (kernels_src/cuda/delta_chunk_fwd.cuh).

Runs without a GPU: it replays, thread by thread and lane by lane, the phases whose index math is easy to get
wrong -- the 16x16-blocked inverse of M = I + A_kk Diag(beta) (phase P4a/P4b), the m16n8k8 fragment reads of
T and of X / V and the fragment-order stores of w (phase P4c), the thread-per-pair intra-sub-chunk products
(phase P1) -- with numpy, and checks the results against plain float64 linear algebra. It does not test the
CUDA code itself (tests/test_cuda_chunk_fwd.py does that on a GPU).
"""
import numpy as np
import pytest

C, SUB = 64, 16
THREADS = 256


def frag_index(r, c, KD):
    rr, cc = r & 15, c & 7
    lane = ((rr & 7) << 2) | (cc & 3)
    slot = (rr >> 3) | ((cc >> 2) << 1)
    return ((((r >> 4) * (KD // 8) + (c >> 3)) << 5) + lane) * 4 + slot


def make_ab(rng, L=C):
    """Strictly lower A_kk Diag(beta) of a chunk with L valid tokens (rows/cols >= L zero)."""
    k = rng.standard_normal((C, 32)) / np.sqrt(32)
    k[L:] = 0
    beta = rng.uniform(0, 1, C)
    beta[L:] = 0
    A = np.tril(k @ k.T, -1) * beta[None, :]
    return A.astype(np.float32)


def emu_inverse(Ab):
    """Phase P4a/P4b of delta_chunk_prep_kernel, thread by thread (fp32)."""
    Ab = Ab.astype(np.float32)
    T = np.full((C, C), np.nan, np.float32)  # uninitialised shared memory: upper blocks are never read
    # P4a: threads [KP, KP + 64): a = (tid - KP) >> 4, j = (tid - KP) & 15
    for u in range(64):
        a, j = u >> 4, u & 15
        blk = Ab[a * SUB:(a + 1) * SUB, a * SUB:(a + 1) * SUB]
        x = np.zeros(SUB, np.float32)
        for i in range(SUB):
            s = np.float32(1.0 if i == j else 0.0)
            for m in range(i):
                s = np.float32(s - blk[i, m] * x[m])
            x[i] = 0 if i < j else s
        T[a * SUB:(a + 1) * SUB, a * SUB + j] = x
    # P4b
    Y = np.full((16, 48), np.nan, np.float32)
    for a in range(1, 4):
        ncol = a * SUB
        for tid in range(THREADS):
            for idx in range(tid, SUB * ncol, THREADS):
                i, col = idx // ncol, idx % ncol
                s0 = s1 = np.float32(0)
                for m in range((col >> 4) * SUB, a * SUB, 2):
                    s0 += Ab[a * SUB + i, m] * T[m, col]
                    s1 += Ab[a * SUB + i, m + 1] * T[m + 1, col]
                Y[i, col] = s0 + s1
        for tid in range(THREADS):
            for idx in range(tid, SUB * ncol, THREADS):
                i, col = idx // ncol, idx % ncol
                s = np.float32(0)
                for m in range(i + 1):
                    s += T[a * SUB + i, a * SUB + m] * Y[m, col]
                T[a * SUB + i, col] = -s
    return T


def emu_apply(T, X, Vm, KP):
    """Phase P4c: per warp item (8 columns), lanes' m16n8k8 fragments; returns the w workspace (fragment order)
    and u0 (row-major)."""
    V = Vm.shape[1]
    wsw = np.full(C * KP, np.nan, np.float32)
    u = np.full((C, V), np.nan, np.float32)
    ntw, ntv = KP // 8, (V + 7) // 8
    for item in range(ntw + ntv):
        isw = item < ntw
        n0 = (item if isw else item - ntw) * 8
        acc = np.zeros((32, 4, 4), np.float64)
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            b = np.zeros((8, 2))
            for ks in range(8):
                for hh in range(2):
                    t = ks * 8 + t4 + 4 * hh
                    if isw:
                        b[ks, hh] = X[t, n0 + gq]
                    else:
                        vc = n0 + gq
                        b[ks, hh] = Vm[t, vc] if vc < V else 0.0
            # stash B fragments per lane so the mma emulation below can gather them
            emu_apply.b = getattr(emu_apply, "b", {})
            emu_apply.b[lane] = b
        for a in range(4):
            for ks in range(2 * a + 2):
                # gather the 16x8 A tile and 8x8 B tile from the lanes' fragments (PTX m16n8k8 layout)
                At = np.zeros((16, 8))
                Bt = np.zeros((8, 8))
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    base_r, base_c = a * SUB + gq, ks * 8 + t4
                    af = (T[base_r, base_c], T[base_r + 8, base_c], T[base_r, base_c + 4], T[base_r + 8, base_c + 4])
                    At[gq, t4], At[gq + 8, t4], At[gq, t4 + 4], At[gq + 8, t4 + 4] = af
                    Bt[t4, gq], Bt[t4 + 4, gq] = emu_apply.b[lane][ks]
                D = At @ Bt
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    acc[lane, a] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for a in range(4):
                for e in range(4):
                    r, c = a * SUB + gq + (e >> 1) * 8, n0 + 2 * t4 + (e & 1)
                    if isw:
                        wsw[frag_index(r, c, KP)] = acc[lane, a, e]
                    elif c < V:
                        u[r, c] = acc[lane, a, e]
    return wsw, u


def unfrag(ws, R, KD):
    out = np.zeros((R, KD))
    for r in range(R):
        for c in range(KD):
            out[r, c] = ws[frag_index(r, c, KD)]
    return out


@pytest.mark.parametrize("L", [64, 37, 1])
def test_block_inverse(L):
    rng = np.random.default_rng(L)
    Ab = make_ab(rng, L)
    T = emu_inverse(Ab)
    M = np.eye(C) + Ab.astype(np.float64)
    Tref = np.linalg.inv(M)
    low = np.zeros((C, C), bool)
    for a in range(4):
        low[a * SUB:(a + 1) * SUB, :(a + 1) * SUB] = True
    assert not np.isnan(T[low]).any()
    np.testing.assert_allclose(T[low], Tref[low], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("KP,V", [(128, 128), (64, 30), (64, 80)])
def test_apply_fragments(KP, V):
    rng = np.random.default_rng(KP + V)
    Ab = make_ab(rng)
    T = emu_inverse(Ab)
    X = rng.standard_normal((C, KP)).astype(np.float32)
    Vm = rng.standard_normal((C, V)).astype(np.float32)
    wsw, u = emu_apply(T, X, Vm, KP)
    Tref = np.linalg.inv(np.eye(C) + Ab.astype(np.float64))
    assert not np.isnan(wsw).any() and not np.isnan(u).any()
    np.testing.assert_allclose(unfrag(wsw, C, KP), Tref @ X, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(u, Tref @ Vm, atol=1e-4, rtol=1e-4)


def test_frag_index_bijective():
    for KD in (64, 128):
        idx = {frag_index(r, c, KD) for r in range(C) for c in range(KD)}
        assert idx == set(range(C * KD))


def test_pair_decode_covers_each_pair_once():
    """P1: pair index pr in [0, 4 * 136) -> (t, j), j <= t, both in sub-chunk a = pr / 136."""
    seen = set()
    for pr in range(4 * 136):
        a, qq = divmod(pr, 136)
        tl = 0
        while (tl + 1) * (tl + 2) // 2 <= qq:
            tl += 1
        jl = qq - tl * (tl + 1) // 2
        assert 0 <= jl <= tl < 16
        seen.add((a * 16 + tl, a * 16 + jl))
    assert seen == {(t, j) for t in range(64) for j in range(64) if j <= t and t // 16 == j // 16}


def test_pair_bank_pattern():
    """P1: per warp, the 16-row window of P rows j read at one column hits distinct 8-byte bank pairs (stride
    KP + 1 doubles), and the k rows at most 3-way (stride KP + 4 floats)."""
    for KP in (64, 128):
        for w in range(4 * 136 // 32):  # 544 = 17 full warps
            js = []
            for pr in range(32 * w, min(32 * w + 32, 4 * 136)):
                a, qq = divmod(pr, 136)
                tl = 0
                while (tl + 1) * (tl + 2) // 2 <= qq:
                    tl += 1
                js.append(a * 16 + qq - tl * (tl + 1) // 2)
            for half in (js[:16], js[16:]):  # 64-bit loads: two half-warp passes
                banks = {}
                for j in set(half):
                    banks.setdefault((2 * j * (KP + 1)) % 32, set()).add(j)
                assert max(len(v) for v in banks.values()) == 1
            fb = {}
            for j in set(js):
                fb.setdefault((j * (KP + 4)) % 32, set()).add(j)
            assert max(len(v) for v in fb.values()) <= 3  # a warp can straddle two sub-chunks


def emu_prep_kda(q, k, g, beta):
    """The prep kernel's math for one KDA chunk (float32 where the kernel is float32, float64 where it uses
    double), vectorised over channels: returns A_kk Diag(beta) (strictly lower), the X = K e^G it builds from the
    scaled k and ea, and w, u0 via the blocked inverse."""
    Cn, KP = k.shape
    f32 = np.float32
    gs = g.astype(f32)
    G = np.cumsum(gs.astype(np.float64), axis=0)  # P0a chunk prefix (double)
    P = np.zeros_like(G)
    for a in range(4):
        P[a * 16:(a + 1) * 16] = np.cumsum(gs[a * 16:(a + 1) * 16].astype(np.float64), axis=0)
    ea = np.ones((4, KP), f32)
    for a in range(1, 4):
        ea[a] = np.exp(G[16 * a - 1].astype(f32))
    A = np.zeros((Cn, Cn), f32)
    # P1 intra
    Phi = P.astype(f32)
    Plo = (P - Phi.astype(np.float64)).astype(f32)
    for t in range(Cn):
        for j in range(t // 16 * 16, t):
            e = np.exp((Phi[t] - Phi[j]) + (Plo[t] - Plo[j]))  # hi_lo_diff in float32
            A[t, j] = np.sum(k[t] * (k[j] * e))
    # P0b: R factors (suffix sums from r = 16a - 1) and left factors (prefix within the sub-chunk)
    ks = k.copy()
    R = {}
    for a in range(1, 4):
        S = np.zeros(KP)
        Ra = np.zeros((16 * a, KP), f32)
        for j in range(16 * a - 1, -1, -1):
            Ra[j] = k[j] * np.exp(S.astype(f32))
            S = S + gs[j]
        R[a] = Ra
    Pl = np.zeros(KP)
    for t in range(Cn):
        if t % 16 == 0:
            Pl = np.zeros(KP)
        Pl = Pl + gs[t]
        ks[t] = k[t] * np.exp(Pl.astype(f32))
    for a in range(1, 4):
        A[16 * a:16 * a + 16, :16 * a] = ks[16 * a:16 * a + 16] @ R[a].T
    Ab = (A * beta[None, :]).astype(f32)
    X = np.empty_like(ks)
    for t in range(Cn):
        X[t] = ks[t] * ea[t >> 4]
    T = emu_inverse(Ab)
    return Ab, X, T


@pytest.mark.parametrize("gate_scale", [0.1, 1.0, 10.0, "adversarial"])
def test_prep_kda_against_float64(gate_scale):
    rng = np.random.default_rng(7)
    KP = 64
    q = rng.standard_normal((C, KP)).astype(np.float32)
    k = (rng.standard_normal((C, KP)) / 8).astype(np.float32)
    beta = rng.uniform(0, 1, C).astype(np.float32)
    if gate_scale == "adversarial":
        g = -np.abs(rng.standard_normal((C, KP))) * 0.1
        g[rng.uniform(size=g.shape) < 0.3] = -20.0
        g[rng.uniform(size=g.shape) < 0.03] = -1e4
    else:
        g = -np.logaddexp(0, -rng.standard_normal((C, KP))) / gate_scale  # logsigmoid(randn) / scale
    g = g.astype(np.float32)
    Ab, X, T = emu_prep_kda(q, k, g, beta)
    # float64 definition
    G = np.cumsum(g.astype(np.float64), axis=0)
    A = np.zeros((C, C))
    for t in range(C):
        for j in range(t):
            A[t, j] = np.sum(k[t] * k[j] * np.exp(G[t] - G[j]))
    Abr = A * beta[None, :].astype(np.float64)
    Xr = k * np.exp(G)
    np.testing.assert_allclose(Ab, Abr, atol=1e-6, rtol=1e-4)
    np.testing.assert_allclose(X, Xr, atol=1e-7, rtol=1e-5)
    w = T.astype(np.float64) @ X
    wr = np.linalg.solve(np.eye(C) + Abr, Xr)
    low = np.tril(np.ones((4, 4), bool)).repeat(16, 0).repeat(16, 1)
    assert not np.isnan(T[low]).any()
    w = np.where(low, T, 0.0).astype(np.float64) @ X
    assert np.sqrt(np.mean((w - wr) ** 2)) <= 1e-5 * np.sqrt(np.mean(wr ** 2)) + 1e-30


def test_hi_lo_prefix_difference():
    """P0a stores the double prefix sums of a 16-token sub-chunk as (hi, lo) floats; P1 and GDN's P3 take
    e^{(hi_t - hi_j) + (lo_t - lo_j)} in float arithmetic. Check it against the double difference for mixed,
    huge and tiny gates (the exponent's absolute error must stay far below 1e-6 where e^d is not negligible)."""
    rng = np.random.default_rng(3)
    f32 = np.float32
    worst = 0.0
    for trial in range(200):
        g = (-np.abs(rng.standard_normal(16)) * rng.choice([1e-6, 1e-2, 1.0, 20.0])).astype(f32)
        g[rng.uniform(size=16) < 0.2] = f32(-1e4)
        if trial % 3 == 0:
            g = (rng.standard_normal(16) * 50).astype(f32)  # unbounded, positive too
        P = np.cumsum(g.astype(np.float64))
        hi = P.astype(f32)
        lo = (P - hi.astype(np.float64)).astype(f32)
        for t in range(16):
            for j in range(t + 1):
                d = (hi[t] - hi[j]) + (lo[t] - lo[j])  # float32 arithmetic
                assert d.dtype == np.float32
                ref = P[t] - P[j]
                if ref > -80:  # below that e^d underflows in float anyway
                    worst = max(worst, abs(float(d) - ref) / max(1.0, abs(ref)))
    assert worst < 2e-7, worst
