"""CPU emulation of the index math that the backward's tensor-core prep (kernels_src/cuda/delta_chunk_bwd_prep.cuh,
prep v3) adds to the pieces it shares with the forward preps (whose index math tests/test_cuda_chunk_fwd_emu.py
replays): which thread writes which element of the row-major A_qk / A_kk (P1 diagonal blocks, P2 cross tiles, the
GDN lower tiles, the zeros above), the accumulator-to-row-major stores of w and u with the row factor beta_t, the
GDN Q Gam / K Eend loops, and the identity the kernel relies on, (I + Diag(beta) A)^-1 Diag(beta) =
Diag(beta) (I + A Diag(beta))^-1. Runs without a GPU; tests/test_cuda_chunk_bwd.py checks the CUDA code itself.
"""
import numpy as np
import pytest

C, SUB, KP, NT = 64, 16, 128, 256


def cross_tile(tile):
    a = 1 if tile < 4 else (2 if tile < 12 else 3)
    local = tile - (0 if a == 1 else (4 if a == 2 else 12))
    mat = local // (2 * a)
    return a, mat, local - mat * 2 * a


def lower_tile(job):
    a = 0 if job < 2 else (1 if job < 6 else (2 if job < 12 else 3))
    return a, job - a * (a + 1)


def store_tile(counts, r0, c0, lane):
    """prep3_store_tile: the elements lane writes of the 16x8 tile at (r0, c0)."""
    gq, t4 = lane >> 2, lane & 3
    for rr in (gq, gq + 8):
        for cc in (2 * t4, 2 * t4 + 1):
            counts[r0 + rr, c0 + cc] += 1


def zero_upper(counts_q, counts_k):
    for tid in range(NT):
        for i in range(tid, C * C // 4, NT):
            t, j = i // (C // 4), (i % (C // 4)) * 4
            if j >= SUB * (t // SUB + 1):
                for d in range(4):
                    counts_q[t, j + d] += 1
                    counts_k[t, j + d] += 1


def test_kda_a_stores_cover_each_element_once():
    cq = np.zeros((C, C), int)
    ck = np.zeros((C, C), int)
    for tid in range(NT):  # P1 results: thread (cg, rp, a1), rows t1, t2, columns jl with jl & 7 == cg
        lane = tid & 31
        cg, rp, a1 = lane & 7, (tid >> 3) & 7, tid >> 6
        j0 = a1 * SUB
        for t in (j0 + rp, j0 + SUB - 1 - rp):
            for jl in range(SUB):
                if (jl & 7) == cg:
                    cq[t, j0 + jl] += 1
                    ck[t, j0 + jl] += 1
    for warp in range(8):  # P2 tiles: warp, warp + 8, warp + 16
        for u in range(3):
            a, mat, nt = cross_tile(warp + 8 * u)
            assert nt >> 1 < a
            for lane in range(32):
                store_tile(ck if mat else cq, a * SUB, nt * 8, lane)
    zero_upper(cq, ck)
    assert (cq == 1).all() and (ck == 1).all()


def test_gdn_a_stores_cover_each_element_once():
    cq = np.zeros((C, C), int)
    ck = np.zeros((C, C), int)
    for warp in range(8):
        for job in range(warp, 20, 8):
            a, nt = lower_tile(job)
            assert nt <= 2 * a + 1
            for lane in range(32):
                store_tile(cq, a * SUB, nt * 8, lane)
                store_tile(ck, a * SUB, nt * 8, lane)
    zero_upper(cq, ck)
    assert (cq == 1).all() and (ck == 1).all()


def test_gdn_qg_kend_loops_cover_each_pair_once():
    for first, stride in ((128, 128), (64, NT - 64)):  # S2: warps 4-7; S3: warps 2-7
        seen = np.zeros((C, KP), int)
        for tid in range(first, NT):
            for i in range(tid - first, C * KP // 2, stride):
                t, c = i // (KP // 2), (i % (KP // 2)) * 2
                seen[t, c] += 1
                seen[t, c + 1] += 1
        assert (seen == 1).all()


def emu_w_u(T, X, Vm, beta, L, K):
    """prep3_w_u: per warp job (8 columns), m16n8k8 fragments as in PTX; returns wc (padded) and u (rows < L)."""
    V = Vm.shape[1]
    wc = np.full((C, KP), np.nan)
    u = np.full((C, V), np.nan)
    ntw, ntv = KP // 8, (V + 7) // 8
    for job in range(ntw + ntv):
        isw = job < ntw
        n0 = (job if isw else job - ntw) * 8
        B = {}
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            b = np.zeros((8, 2))
            for s in range(8):
                for hh in range(2):
                    t = s * 8 + t4 + 4 * hh
                    b[s, hh] = X[t, n0 + gq] if isw else (Vm[t, n0 + gq] if n0 + gq < V else 0.0)
            B[lane] = b
        acc = np.zeros((32, 4, 4))
        for a in range(4):
            for s in range(2 * a + 2):
                At, Bt = np.zeros((16, 8)), np.zeros((8, 8))
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    r, c = a * SUB + gq, s * 8 + t4
                    At[gq, t4], At[gq + 8, t4], At[gq, t4 + 4], At[gq + 8, t4 + 4] = (
                        T[r, c], T[r + 8, c], T[r, c + 4], T[r + 8, c + 4])
                    Bt[t4, gq], Bt[t4 + 4, gq] = B[lane][s]
                D = At @ Bt
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    acc[lane, a] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4], D[gq + 8, 2 * t4 + 1])
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            c = n0 + 2 * t4
            for a in range(4):
                for hr in range(2):
                    r = a * SUB + gq + 8 * hr
                    x0, x1 = beta[r] * acc[lane, a, 2 * hr], beta[r] * acc[lane, a, 2 * hr + 1]
                    if isw:
                        wc[r, c], wc[r, c + 1] = x0, x1
                    elif r < L:
                        if c < V:
                            u[r, c] = x0
                        if c + 1 < V:
                            u[r, c + 1] = x1
    return wc, u


@pytest.mark.parametrize("L,K,V", [(64, 128, 128), (37, 40, 30), (1, 128, 100)])
def test_w_u_against_float64(L, K, V):
    rng = np.random.default_rng(L + K + V)
    k = rng.standard_normal((C, KP)) / np.sqrt(K)
    k[L:], k[:, K:] = 0, 0
    gam = np.exp(np.cumsum(-rng.uniform(0, 0.1, (C, KP)) * (np.arange(C)[:, None] < L), axis=0))
    beta = rng.uniform(0, 1, C)
    beta[L:] = 0
    Vm = rng.standard_normal((C, V))
    Vm[L:] = 0
    A = np.tril(k @ k.T, -1)  # stands for A_kk (its decays do not matter to the algebra)
    T = np.linalg.inv(np.eye(C) + A * beta[None, :])  # the kernel's T = (I + A_kk Diag(beta))^-1
    X = k * gam
    wc, u = emu_w_u(T, X, Vm, beta, L, K)
    # what prep_kernel computes: forward substitution of (I + Diag(beta) A) [u | w] = Diag(beta) [V | K Gam]
    M = np.eye(C) + beta[:, None] * A
    w_ref = np.linalg.solve(M, beta[:, None] * X)
    u_ref = np.linalg.solve(M, beta[:, None] * Vm)
    assert not np.isnan(wc).any() and not np.isnan(u[:L]).any()
    np.testing.assert_allclose(wc, w_ref, atol=1e-10, rtol=1e-9)
    np.testing.assert_allclose(u[:L], u_ref[:L], atol=1e-10, rtol=1e-9)
    assert (wc[L:] == 0).all() and (wc[:, K:] == 0).all()  # the padding the state kernels rely on
    assert np.isnan(u[L:]).all()  # rows past the chunk's tokens are not written
