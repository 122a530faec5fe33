"""CPU emulation of the index math of the scan delta_chunk_scan6_kernel (KDA_CUDA_CHUNK_SCAN=8, the default since
session 11; kernels_src/cuda/delta_chunk_scan6.cuh): the new warp tiles of one chunk step, lane by lane, with the
m16n8k8 fragment layouts (mma8, frag_index; kept here from tests/test_cuda_scan3_emu.py, removed in session 12 with
the bulk-prefetch scan it emulated):
  - U = u0 - w h: 4 warps of 16 rows x 32 columns;
  - the h update with the U fragments loaded once per k-step for both row tiles of a warp;
  - o = q~ h + A~ U: 4 warps of 16 rows x 32 columns.
(The variant with warp pairs, KDA_CUDA_CHUNK_SCAN=9, and its handoff emulation were removed with it in session 11.)
Checks against float64 matrix products, and that every accumulator sees scan5's sequence of k-steps (the claim
that o and the final state are bit-identical to those of scan5, retired in session 12): U chains a0 = even, a1 = odd
k-steps in order, h the decay then k-steps 0..7, o chains q~ h = 0 .. KP/8 - 1 and A~ U = 0 .. 2 rt + 1 for row
tile rt. A mutated index (wrong
row tile) must fail. Runs without a GPU; the CUDA code is tested by
tests/test_cuda_scan6.py on a GPU.
"""
import numpy as np
import pytest

C = 64
LDH = 40  # Scan6Smem::LDH (32 + 8)
LANES = np.arange(32)
GQ, T4 = LANES >> 2, LANES & 3


def frag_index(r, c, KD):
    """frag_index<KD> (delta_chunk_fwd.cuh): element (r, c) of a row-major [R x KD] A operand in fragment order."""
    rr, cc = r & 15, c & 7
    lane = ((rr & 7) << 2) | (cc & 3)
    slot = (rr >> 3) | ((cc >> 2) << 1)
    return ((((r >> 4) * (KD // 8) + (c >> 3)) << 5) + lane) * 4 + slot


def to_frag(M, KD):
    """A row-major [R x KD] matrix in fragment order (the workspace sections w, q~, k~^T, A~)."""
    R = M.shape[0]
    out = np.full(R * KD, np.nan)
    for r in range(R):
        for c in range(KD):
            out[frag_index(r, c, KD)] = M[r, c]
    return out


def mma8(acc, a, b0, b1):
    """acc[32, 4] += A B for one m16n8k8 tile: a[32, 4] the A fragment {(g, t), (g+8, t), (g, t+4), (g+8, t+4)},
    b0 / b1 [32] the B fragment {(t, g), (t+4, g)}, acc {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}."""
    A = np.zeros((16, 8))
    B = np.zeros((8, 8))
    A[GQ, T4], A[GQ + 8, T4], A[GQ, T4 + 4], A[GQ + 8, T4 + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    B[T4, GQ], B[T4 + 4, GQ] = b0, b1
    Cm = A @ B
    acc[:, 0] += Cm[GQ, 2 * T4]
    acc[:, 1] += Cm[GQ, 2 * T4 + 1]
    acc[:, 2] += Cm[GQ + 8, 2 * T4]
    acc[:, 3] += Cm[GQ + 8, 2 * T4 + 1]


class Acc:
    """An m16n8 accumulator tile of one warp ([32, 4] per lane) that records its k-steps (tag, ks) in order."""

    def __init__(self):
        self.v = np.zeros((32, 4))
        self.trace = []

    def mma(self, a, b0, b1, tag, ks):
        mma8(self.v, a, b0, b1)
        self.trace.append((tag, ks))


def a_frag_ws(F, KD, rt, ks):
    """The [32, 4] A fragment (row tile rt, k-step ks) of a fragment-ordered section F of a [R x KD] matrix, as the
    kernel reads it: float4 / uint2 at (rt * (KD / 8) + ks) * 32 + lane."""
    base = (rt * (KD // 8) + ks) * 32
    return np.stack([F[(base + lane) * 4: (base + lane) * 4 + 4] for lane in range(32)])


def b_frags(Bs, col0, ks, nt):
    """b0 / b1 of a row-major shared tile Bs (stride LDH) at columns col0 + 8 nt, k-step ks."""
    return Bs[(ks * 8 + T4) * LDH + col0 + nt * 8 + GQ], Bs[(ks * 8 + T4 + 4) * LDH + col0 + nt * 8 + GQ]


def tile_put(Ms, acc, r0, c0):
    """acc's [16 x 8] tile into the row-major shared array Ms (stride LDH) at row r0, column c0."""
    for e in range(4):
        Ms[(r0 + GQ + (e >> 1) * 8) * LDH + c0 + 2 * T4 + (e & 1)] = acc[:, e]


def tile_get(Ms, r0, c0):
    out = np.zeros((32, 4))
    for e in range(4):
        out[:, e] = Ms[(r0 + GQ + (e >> 1) * 8) * LDH + c0 + 2 * T4 + (e & 1)]
    return out


def emu_u(KP, Wf, hs, u0, mutate=None):
    """U = u0 - w h into Us (row-major, stride LDH) and the accumulators' traces {(rt, ct): [chain traces]}."""
    Us = np.full(C * LDH, np.nan)
    traces = {}
    for wi in range(4):
        rt = wi if mutate != "u_row_tile" else wi ^ 1  # the w row block this warp reads
        a0 = [Acc() for _ in range(4)]
        a1 = [Acc() for _ in range(4)]
        for ks in range(0, KP // 8, 2):
            for j, acc in ((ks, a0), (ks + 1, a1)):
                a = a_frag_ws(Wf, KP, rt, j)
                for nt in range(4):
                    acc[nt].mma(a, *b_frags(hs, 0, j, nt), "w", j)
        for nt in range(4):
            u = u0[wi * 16:(wi + 1) * 16, nt * 8:(nt + 1) * 8]
            uf = np.stack([u[GQ, 2 * T4], u[GQ, 2 * T4 + 1], u[GQ + 8, 2 * T4], u[GQ + 8, 2 * T4 + 1]], 1)
            tile_put(Us, uf - (a0[nt].v + a1[nt].v), wi * 16, nt * 8)
            traces[(wi, nt)] = (a0[nt].trace, a1[nt].trace)
    return Us, traces


def emu_h(KP, Kf, dec, H, Us):
    """h <- Diag(dec) h + k~^T U with ScanRec6's tiles (8 warps: wi rows [wi KP/4, ..), cw = 16 wc); returns h and
    the traces per (row tile, column tile)."""
    MT = KP // 64
    out = np.zeros_like(H)
    traces = {}
    for w in range(8):
        wi, cw = w & 3, (w >> 2) * 16
        hacc = [[Acc() for _ in range(2)] for _ in range(MT)]
        for mt in range(MT):
            rt = wi * MT + mt
            for nt in range(2):
                blk = H[rt * 16:(rt + 1) * 16, cw + nt * 8: cw + nt * 8 + 8]
                hacc[mt][nt].v = np.stack([blk[GQ, 2 * T4], blk[GQ, 2 * T4 + 1], blk[GQ + 8, 2 * T4],
                                           blk[GQ + 8, 2 * T4 + 1]], 1)
                d0, d1 = dec[rt * 16 + GQ], dec[rt * 16 + GQ + 8]
                hacc[mt][nt].v *= np.stack([d0, d0, d1, d1], 1)
                hacc[mt][nt].trace.append(("decay", -1))
        for ks in range(C // 8):
            bs = [b_frags(Us, cw, ks, nt) for nt in range(2)]
            for mt in range(MT):
                a = a_frag_ws(Kf, C, wi * MT + mt, ks)
                for nt in range(2):
                    hacc[mt][nt].mma(a, *bs[nt], "k", ks)
        for mt in range(MT):
            for nt in range(2):
                rt = wi * MT + mt
                for e in range(4):
                    out[rt * 16 + GQ + (e >> 1) * 8, cw + nt * 8 + 2 * T4 + (e & 1)] = hacc[mt][nt].v[:, e]
                traces[(rt, cw // 8 + nt)] = hacc[mt][nt].trace
    return out, traces


def emu_o(KP, Qf, Af, hs, Us, mutate=None):
    """o [64 x 32] and the traces {(rt, ct): (q~ h chain, A~ U chain)}."""
    o = np.full((C, 32), np.nan)
    traces = {}
    for wi in range(4):
        rt = wi if mutate != "o_row_tile" else wi ^ 1  # the q~ / A~ row block this warp loads
        a0 = [Acc() for _ in range(4)]
        a1 = [Acc() for _ in range(4)]
        for ks in range(KP // 8):
            for nt in range(4):
                a0[nt].mma(a_frag_ws(Qf, KP, rt, ks), *b_frags(hs, 0, ks, nt), "q", ks)
        for ks in range(C // 8):
            if ks < 2 * wi + 2:
                for nt in range(4):
                    a1[nt].mma(a_frag_ws(Af, C, rt, ks), *b_frags(Us, 0, ks, nt), "a", ks)
        for nt in range(4):
            s = a0[nt].v + a1[nt].v
            for e in range(4):
                o[wi * 16 + GQ + (e >> 1) * 8, nt * 8 + 2 * T4 + (e & 1)] = s[:, e]
            traces[(wi, nt)] = (a0[nt].trace, a1[nt].trace)
    return o, traces


def problem(KP, seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((C, KP))
    Q = rng.standard_normal((C, KP))
    Kt = rng.standard_normal((KP, C))
    A = np.tril(rng.standard_normal((C, C)))
    H = rng.standard_normal((KP, 32))
    u0 = rng.standard_normal((C, 32))
    dec = rng.uniform(0.1, 1.0, KP)
    hs = np.full(KP * LDH, np.nan)
    for r in range(KP):
        hs[r * LDH: r * LDH + 32] = H[r]
    return W, Q, Kt, A, H, u0, dec, hs


@pytest.mark.parametrize("KP", [64, 128])
def test_scan6_chunk_step(KP):
    W, Q, Kt, A, H, u0, dec, hs = problem(KP, 1 + KP)
    Us, ut = emu_u(KP, to_frag(W, KP), hs, u0)
    U = np.stack([Us[r * LDH: r * LDH + 32] for r in range(C)])
    np.testing.assert_allclose(U, u0 - W @ H, rtol=1e-12, atol=1e-10)
    for (rt, ct), (c0, c1) in ut.items():  # scan5's U chains: even / odd k-steps in order
        assert [k for _, k in c0] == list(range(0, KP // 8, 2)) and [k for _, k in c1] == list(range(1, KP // 8, 2))
    assert len(ut) == 16
    Hn, ht = emu_h(KP, to_frag(Kt, C), dec, H, Us)
    np.testing.assert_allclose(Hn, dec[:, None] * H + Kt @ U, rtol=1e-12, atol=1e-10)
    for tr in ht.values():
        assert tr == [("decay", -1)] + [("k", ks) for ks in range(8)]
    assert len(ht) == (KP // 16) * 4
    o, ot = emu_o(KP, to_frag(Q, KP), to_frag(A, C), hs, Us)
    np.testing.assert_allclose(o, Q @ H + A @ U, rtol=1e-12, atol=1e-10)
    for (rt, ct), (c0, c1) in ot.items():
        assert [k for _, k in c0] == list(range(KP // 8)) and [k for _, k in c1] == list(range(2 * rt + 2))
    assert len(ot) == 16


@pytest.mark.parametrize("mutate", ["u_row_tile", "o_row_tile"])
def test_emulator_sees_index_mutations(mutate):
    KP = 128
    W, Q, Kt, A, H, u0, dec, hs = problem(KP, 5)
    Us, _ = emu_u(KP, to_frag(W, KP), hs, u0, mutate=mutate)
    U = np.stack([Us[r * LDH: r * LDH + 32] for r in range(C)])
    o, _ = emu_o(KP, to_frag(Q, KP), to_frag(A, C), hs, Us, mutate=mutate)
    ok_u = np.allclose(U, u0 - W @ H, rtol=1e-12, atol=1e-10)
    ok_o = np.allclose(o, Q @ H + A @ U, rtol=1e-12, atol=1e-10)
    assert not (ok_u and ok_o)
