"""CPU emulation of the index math of the bf16-operand scan delta_chunk_scan7_kernel<KP, UHL> (KDA_CUDA_CHUNK_SCAN=11,
the default since session 12, and 10; kernels_src/cuda/delta_chunk_scan7.cuh), lane by lane, for one chunk step:
  - the m16n8k16 A fragments made from two of the workspace's bf16 fragment tiles by byte permutes (afrag16) under
    scan7's k order (slot 2t <- 16s + t, 2t+1 <- 16s + t + 8, 2t+8 <- 16s + t + 4, 2t+9 <- 16s + t + 12);
  - h_c / U_c as row-pair words (rows r, r + 8) in shared memory, written from accumulator tiles (s7_put_tile) and
    read as B fragments (mma_tiles16);
  - u0 fp32 per element (load_u0w), w / q~ / k~^T / A~ in the workspace's bf16 fragment order (ws_put_frag);
  - UHL: U as high and low words (s7_put_tile_hl; here split 3/4 + 1/4 so that a lost or misplaced half shows),
    both used by k~^T U and A~ U;
  - U = u0 - w h (4 warps x 16 rows x 32 columns, two chains), h <- Diag(decay) h + k~^T U (ScanRec's tiles),
    o = q~ h + A~ U (4 warps, A~'s k-steps past the diagonal block skipped);
  - the shared-memory bank pattern of the B reads and the tile stores (conflict-free).
Values are carried exactly (float64; the bf16 rounding is not emulated, only where each element goes), compared
with float64 matrix products. Deliberate mutations of the index math must fail. Runs without a GPU; the CUDA code is
tested by tests/test_cuda_scan7.py on a GPU; the h_c / U_c handoff is emulated by tests/test_cuda_scan7_handoff_emu.py.
"""
import numpy as np
import pytest

C = 64
LANES = np.arange(32)
GQ, T4 = LANES >> 2, LANES & 3


def frag_index(r, c, KD):
    """frag_index<KD> (delta_chunk_fwd.cuh): element (r, c) of a row-major [R x KD] A operand in fragment order.
    (From tests/test_cuda_scan6_emu.py, removed with scan6 in session 12.)"""
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

LDW = 40  # kScan7LDW
NAN2 = (np.nan, np.nan)


def ws_bf16_frags(M, KD):
    """A row-major [R x KD] matrix as the workspace's bf16 fragment section: per (tile, lane) one uint2, here
    [n_tile_lanes, 2 words, 2 halves] with x = (a0, a1), y = (a2, a3) of the float4 fragment (ws_put_frag)."""
    F = to_frag(M, KD).reshape(-1, 4)
    return np.stack([F[:, 0:2], F[:, 2:4]], 1)


def tile_lanes(Wb, KD, rt, j):
    """The 32 lanes' uint2 (x, y) of tile (row tile rt, 8-column tile j): [32, 2, 2]."""
    base = (rt * (KD // 8) + j) * 32
    return Wb[base:base + 32]


def byte_perm(x, y, sel):
    """__byte_perm on bf16 pairs [.., 2] (lo, hi): 0x5410 -> (x.lo, y.lo), 0x7632 -> (x.hi, y.hi)."""
    if sel == 0x5410:
        return np.stack([x[..., 0], y[..., 0]], -1)
    if sel == 0x7632:
        return np.stack([x[..., 1], y[..., 1]], -1)
    raise ValueError(sel)


def afrag16(u, v, mutate=None):
    """[32, 4, 2]: a0..a3 of each lane from the tiles u (2 s) and v (2 s + 1), [32, 2, 2] each."""
    s0, s1 = (0x5410, 0x7632) if mutate != "prmt" else (0x7632, 0x5410)
    return np.stack([byte_perm(u[:, 0], v[:, 0], s0), byte_perm(u[:, 0], v[:, 0], s1),
                     byte_perm(u[:, 1], v[:, 1], s0), byte_perm(u[:, 1], v[:, 1], s1)], 1)


def mma16(acc, a, b0, b1):
    """acc[32, 4] += A B for one m16n8k16 tile, PTX's fragment layout: a[32, 4, 2] with a0 = A[g][2t, 2t+1],
    a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]; b0 / b1 [32, 2] = B[2t, 2t+1][g],
    B[2t+8, 2t+9][g]; acc (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    for j in range(2):
        A[GQ, 2 * T4 + j] = a[:, 0, j]
        A[GQ + 8, 2 * T4 + j] = a[:, 1, j]
        A[GQ, 2 * T4 + 8 + j] = a[:, 2, j]
        A[GQ + 8, 2 * T4 + 8 + j] = a[:, 3, j]
        B[2 * T4 + j, GQ] = b0[:, j]
        B[2 * T4 + 8 + j, GQ] = b1[:, j]
    Cm = A @ B
    acc[:, 0] += Cm[GQ, 2 * T4]
    acc[:, 1] += Cm[GQ, 2 * T4 + 1]
    acc[:, 2] += Cm[GQ + 8, 2 * T4]
    acc[:, 3] += Cm[GQ + 8, 2 * T4 + 1]


def new_words(rows):
    return np.full((rows // 2 * LDW, 2), np.nan)


def put_tile(Mw, r0, c0, c, mutate=None):
    """s7_put_tile: words (r0 / 2 + g, c0 + 2t) = (c0, c2), (.., c0 + 2t + 1) = (c1, c3)."""
    idx = (r0 // 2 + GQ) * LDW + c0 + 2 * T4
    if mutate == "put_pair":
        Mw[idx] = np.stack([c[:, 0], c[:, 1]], 1)
        Mw[idx + 1] = np.stack([c[:, 2], c[:, 3]], 1)
    else:
        Mw[idx] = np.stack([c[:, 0], c[:, 2]], 1)
        Mw[idx + 1] = np.stack([c[:, 1], c[:, 3]], 1)


def b_words(Bw, c0, s, nt, mutate=None):
    """mma_tiles16's b0 / b1: words (8 s + t, c0 + 8 nt + g) and (8 s + 4 + t, ..)."""
    off = 4 if mutate != "b1_offset" else 2
    return (Bw[(8 * s + T4) * LDW + c0 + nt * 8 + GQ], Bw[(8 * s + off + T4) * LDW + c0 + nt * 8 + GQ])


def words_to_matrix(Mw, rows, cols):
    """The row-major [rows x cols] matrix held in row-pair words."""
    M = np.full((rows, cols), np.nan)
    for r in range(rows):
        P = 8 * (r >> 4) + (r & 7)
        M[r] = Mw[P * LDW: P * LDW + cols, (r >> 3) & 1]
    return M


def acc_tile(M, r0, c0):
    blk = M[r0:r0 + 16, c0:c0 + 8]
    return np.stack([blk[GQ, 2 * T4], blk[GQ, 2 * T4 + 1], blk[GQ + 8, 2 * T4], blk[GQ + 8, 2 * T4 + 1]], 1)


def load_u0w(u0, wi, mutate=None):
    """load_u0w: u0w[nt][e] = u0[r][c], r = 16 wi + g + 8 (e >> 1), c = 8 nt + 2t + (e & 1): [4, 32, 4]."""
    out = np.zeros((4, 32, 4))
    for nt in range(4):
        for e in range(4):
            r = wi * 16 + GQ + (e >> 1) * (8 if mutate != "u0_row" else 4)
            out[nt, :, e] = u0[r, nt * 8 + 2 * T4 + (e & 1)]
    return out


def emu_u(KP, Wb, hw, u0, uhl, mutate=None):
    """U = u0 - w h by warps 0..3 (rows 16 wi .., 32 columns), stored into row-pair words: [hi] or [hi, lo]."""
    Uw = [new_words(C) for _ in range(2 if uhl else 1)]
    for wi in range(4):
        a0 = [np.zeros((32, 4)) for _ in range(4)]
        a1 = [np.zeros((32, 4)) for _ in range(4)]
        for s in range(0, KP // 16, 2):
            for ss, acc in ((s, a0), (s + 1, a1)):
                jt = (2 * ss, 2 * ss + 1) if mutate != "tile_pair" else (ss, ss + KP // 16)
                a = afrag16(tile_lanes(Wb, KP, wi, jt[0]), tile_lanes(Wb, KP, wi, jt[1]), mutate)
                for nt in range(4):
                    mma16(acc[nt], a, *b_words(hw, 0, ss, nt, mutate))
        u0w = load_u0w(u0, wi, mutate)
        for nt in range(4):
            u = u0w[nt] - (a0[nt] + a1[nt])
            if uhl:
                hi = 0.75 * u
                put_tile(Uw[0], wi * 16, nt * 8, hi, mutate)
                put_tile(Uw[1], wi * 16, nt * 8, u - hi if mutate != "lo_lost" else 0 * u, mutate)
            else:
                put_tile(Uw[0], wi * 16, nt * 8, u, mutate)
    return Uw


def emu_h(KP, Kb, dec, H, Uw, mutate=None):
    """h <- Diag(dec) h + k~^T U with ScanRec's tiles (warp w: rows [wi KP/4, ..), columns 16 wc ..)."""
    MT = KP // 64
    out = np.full_like(H, np.nan)
    for w in range(8):
        wi, cw = w & 3, (w >> 2) * 16
        hacc = [[acc_tile(H, (wi * MT + mt) * 16, cw + nt * 8) for nt in range(2)] for mt in range(MT)]
        for mt in range(MT):
            rt = wi * MT + mt
            d0, d1 = dec[rt * 16 + GQ], dec[rt * 16 + GQ + 8]
            for nt in range(2):
                hacc[mt][nt] = hacc[mt][nt] * np.stack([d0, d0, d1, d1], 1)
        for s in range(C // 16):
            bs = [[b_words(Ux, cw, s, nt, mutate) for nt in range(2)] for Ux in Uw]
            for mt in range(MT):
                a = afrag16(tile_lanes(Kb, C, wi * MT + mt, 2 * s), tile_lanes(Kb, C, wi * MT + mt, 2 * s + 1),
                            mutate)
                for nt in range(2):
                    for bx in bs:  # hi, then lo (UHL)
                        mma16(hacc[mt][nt], a, *bx[nt])
        for mt in range(MT):
            for nt in range(2):
                r0, c0 = (wi * MT + mt) * 16, cw + nt * 8
                for e in range(4):
                    out[r0 + GQ + (e >> 1) * 8, c0 + 2 * T4 + (e & 1)] = hacc[mt][nt][:, e]
    return out


def emu_o(KP, Qb, Ab, hw, Uw, mutate=None):
    o = np.full((C, 32), np.nan)
    for wi in range(4):
        a0 = [np.zeros((32, 4)) for _ in range(4)]
        a1 = [np.zeros((32, 4)) for _ in range(4)]
        for s in range(KP // 16):
            a = afrag16(tile_lanes(Qb, KP, wi, 2 * s), tile_lanes(Qb, KP, wi, 2 * s + 1), mutate)
            for nt in range(4):
                mma16(a0[nt], a, *b_words(hw, 0, s, nt, mutate))
        for s in range(C // 16):
            if s <= wi or mutate == "causal_all":
                if mutate == "causal_short" and s == wi:
                    continue
                a = afrag16(tile_lanes(Ab, C, wi, 2 * s), tile_lanes(Ab, C, wi, 2 * s + 1), mutate)
                for nt in range(4):
                    for Ux in (Uw if mutate != "o_lo_skipped" else Uw[:1]):
                        mma16(a1[nt], a, *b_words(Ux, 0, s, nt, mutate))
        for nt in range(4):
            sm = a0[nt] + a1[nt]
            for e in range(4):
                o[wi * 16 + GQ + (e >> 1) * 8, nt * 8 + 2 * T4 + (e & 1)] = sm[:, e]
    return o


def store_h(KP, H, mutate=None):
    """store_h of all 8 warps (bf16(h) into row-pair words)."""
    MT = KP // 64
    hw = new_words(KP)
    for w in range(8):
        wi, cw = w & 3, (w >> 2) * 16
        for mt in range(MT):
            for nt in range(2):
                put_tile(hw, (wi * MT + mt) * 16, cw + nt * 8, acc_tile(H, (wi * MT + mt) * 16, cw + nt * 8), mutate)
    return hw


def run_step(KP, seed=0, mutate=None, uhl=False):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((C, KP))
    H = rng.standard_normal((KP, 32))
    u0 = rng.standard_normal((C, 32))
    KT = rng.standard_normal((KP, C))
    dec = rng.uniform(0.2, 1.0, KP)
    Q = rng.standard_normal((C, KP))
    A = np.tril(rng.standard_normal((C, C)))  # A~: lower triangular (the 16 x 16 blocks above the diagonal are zero)
    Wb, Kb, Qb, Ab = ws_bf16_frags(W, KP), ws_bf16_frags(KT, C), ws_bf16_frags(Q, KP), ws_bf16_frags(A, C)
    hw = store_h(KP, H, mutate)
    Uw = emu_u(KP, Wb, hw, u0, uhl, mutate)
    U = sum(words_to_matrix(Ux, C, 32) for Ux in Uw)
    Hn = emu_h(KP, Kb, dec, H, Uw, mutate)
    o = emu_o(KP, Qb, Ab, hw, Uw, mutate)
    U_ref = u0 - W @ H
    return (U, U_ref), (Hn, dec[:, None] * H + KT @ U_ref), (o, Q @ H + A @ U_ref), hw


def _ok(pair):
    x, ref = pair
    return bool(np.isfinite(x).all() and np.allclose(x, ref, rtol=1e-10, atol=1e-9))


@pytest.mark.parametrize("uhl", [False, True], ids=["uhl0", "uhl1"])
@pytest.mark.parametrize("KP", [64, 128])
def test_scan7_step_matches_float64(KP, uhl):
    (u, h, o, hw) = run_step(KP, uhl=uhl)
    assert _ok(u), "U = u0 - w h"
    assert _ok(h), "h <- Diag(decay) h + k~^T U"
    assert _ok(o), "o = q~ h + A~ U"
    assert np.array_equal(words_to_matrix(hw, KP, 32), words_to_matrix(hw, KP, 32))


@pytest.mark.parametrize("mutate", ["prmt", "put_pair", "b1_offset", "u0_row", "tile_pair", "causal_short",
                                    "causal_all", "lo_lost", "o_lo_skipped"])
def test_scan7_mutations_fail(mutate):
    """Each deliberate index mutation breaks at least one product (causal_all: reads A~'s zero blocks past the
    diagonal, exact -- it must NOT fail: the skip is only an optimisation). Run with UHL (the low words in use)."""
    u, h, o, _ = run_step(128, seed=1, mutate=mutate, uhl=True)
    ok = _ok(u) and _ok(h) and _ok(o)
    if mutate == "causal_all":
        assert ok, "A~'s upper blocks are zero: reading them changes nothing"
    else:
        assert not ok, f"mutation {mutate} went unnoticed"


def test_scan7_k_order_is_a_permutation():
    """The k order of a k-step (slot -> k) is a bijection of 0..15, and the A side (afrag16 of the workspace tiles)
    and the B side (row-pair words) use the same one."""
    slots = {}
    for t in range(4):
        slots[2 * t], slots[2 * t + 1], slots[2 * t + 8], slots[2 * t + 9] = t, t + 8, t + 4, t + 12
    assert sorted(slots.values()) == list(range(16))
    # B side: b0 = word (8 s + t) holds rows (16 s + t, 16 s + t + 8), b1 = word (8 s + 4 + t) rows (+4, +12)
    for t in range(4):
        P0, P1 = t, 4 + t
        assert (16 * (P0 >> 3) + (P0 & 7), 16 * (P0 >> 3) + (P0 & 7) + 8) == (slots[2 * t], slots[2 * t + 1])
        assert (16 * (P1 >> 3) + (P1 & 7), 16 * (P1 >> 3) + (P1 & 7) + 8) == (slots[2 * t + 8], slots[2 * t + 9])


def test_scan7_bank_conflicts():
    """B reads (one 32-bit word per lane): 32 distinct banks; tile stores (8 bytes per lane): each half warp's 16
    lanes hit 16 distinct 8-byte bank pairs."""
    for s in range(8):
        for nt in range(4):
            for off in (0, 4):
                banks = ((8 * s + off + T4) * LDW + nt * 8 + GQ) % 32
                assert len(set(banks.tolist())) == 32
    for r0 in range(0, 128, 16):
        for c0 in range(0, 32, 8):
            w = (r0 // 2 + GQ) * LDW + c0 + 2 * T4  # even word index: 8-byte slot w / 2
            for half in (slice(0, 16), slice(16, 32)):
                assert len(set(((w[half] // 2) % 16).tolist())) == 16
