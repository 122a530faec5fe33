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
