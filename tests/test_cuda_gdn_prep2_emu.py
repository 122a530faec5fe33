"""CPU emulation of the new index math of the GDN prep kernel v2 (kernels_src/cuda/gdn_chunk_prep2.cuh,
KDA_CUDA_GDN_PREP=2).

Replays lane by lane what v2 changes against gdn_chunk_prep.cuh: S5's pairs of 8-column jobs per warp (the pair
map over w's and u0's jobs for KP 64 / 128 and V from 8 to 256 in 128-column passes, the discarded partner of an
odd last u0 job and the shared-memory columns it reads), the tf32 A fragments of T read by ldmatrix.x4 (each lane's
row address, the word each lane receives), the float2 / scalar stores of u0 (every element written once, none past
V, 8-byte alignment), the S3 / S4 scratch blocks in Ab's upper triangle (disjoint from the 20 tiles on or below the
diagonal and from each other) and the split of k~^T's items between S3 and S4, and the shared-memory layout (three
blocks per SM, v fits q's tile). Runs without a GPU; it does not test the CUDA code itself
(tests/test_cuda_gdn_prep2.py does).
"""
import numpy as np
import pytest

# v1's emulation helpers (the workspace's fragment order, the A-fragment shuffle, the 20 lower tiles), as
# test_cuda_kda_prep2_emu.py uses them
from test_cuda_gdn_prep_emu import acc_to_afrag, lower_tile, unfrag

C, SUB, LDA, LDV, VB, THREADS = 64, 16, 68, 136, 128, 256


def ldsm_x4(flat, lane_addr):
    """ldmatrix.x4 of 32-bit words: lanes 8 i .. 8 i + 7 give the row addresses (in floats) of matrix i; lane l
    receives word l % 4 of row l / 4 of each matrix."""
    out = np.zeros((32, 4))
    for lane in range(32):
        for i in range(4):
            addr = lane_addr[8 * i + lane // 4]
            assert addr % 4 == 0, "ldmatrix rows must be 16-byte aligned"
            out[lane, i] = flat[addr + lane % 4]
    return out


def emu_s5_v2(T, X, Vm, KP):
    """S5 of gdn_chunk_prep2_kernel: every warp's pair jobs, lane by lane. T [64, 64] (lower), X = K e^G [64, KP],
    Vm [64, V]. Returns w (fragment order, flat) and u0 [64, V] (NaN where never written) and the write counts."""
    V = Vm.shape[1]
    Ts = np.zeros(C * LDA)
    for r in range(C):
        Ts[r * LDA:r * LDA + C] = T[r]
    ntw = KP // 8
    w = np.full(C * KP, np.nan)
    u = np.full((C, V), np.nan)
    wcount = np.zeros(C * KP, dtype=int)
    ucount = np.zeros((C, V), dtype=int)
    lane_row = [(lane & 7) + 8 * ((lane >> 3) & 1) for lane in range(32)]
    lane_col = [4 * (lane >> 4) for lane in range(32)]
    for v0 in range(0, V, VB):
        ncol = min(V - v0, VB)
        Vs = np.zeros((C, LDV))  # staged: columns [0, 128) (zero past ncol), padding 128..135 never written
        Vs[:, ncol:] = np.nan
        Vs[:, :ncol] = Vm[:, v0:v0 + ncol]
        Vs[:, ncol:VB] = 0.0
        ntv = (ncol + 7) // 8
        nw = ntw if v0 == 0 else 0
        njob = nw + ntv
        for warp in range(THREADS // 32):
            pj = warp
            while 2 * pj < njob:
                j0 = 2 * pj
                two = j0 + 1 < njob
                isw = j0 < nw
                if isw:
                    assert two, "w jobs come in pairs"
                n0 = (j0 if isw else j0 - nw) * 8
                B = np.zeros((2, 8, 2, 32))  # b[jj][s][hh] per lane
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    for jj in range(2):
                        for s in range(8):
                            for hh in range(2):
                                t, c = s * 8 + t4 + 4 * hh, n0 + 8 * jj + gq
                                if isw:
                                    assert c < KP
                                    B[jj, s, hh, lane] = X[t, c]
                                else:
                                    assert c < VB, "the partner reads staged columns only (never the padding)"
                                    B[jj, s, hh, lane] = Vs[t, c]
                for a in range(4):
                    acc = np.zeros((2, 32, 4))
                    for s in range(2 * a + 2):
                        addrs = [a * SUB * LDA + s * 8 + lane_row[l] * LDA + lane_col[l] for l in range(32)]
                        fr = ldsm_x4(Ts, addrs)
                        At = np.full((16, 8), np.nan)
                        for lane in range(32):
                            gq, t4 = lane >> 2, lane & 3
                            At[gq, t4], At[gq + 8, t4], At[gq, t4 + 4], At[gq + 8, t4 + 4] = fr[lane]
                        assert not np.isnan(At).any()
                        for jj in range(2):
                            Bt = np.full((8, 8), np.nan)
                            for lane in range(32):
                                gq, t4 = lane >> 2, lane & 3
                                Bt[t4, gq], Bt[t4 + 4, gq] = B[jj, s, 0, lane], B[jj, s, 1, lane]
                            D = At @ Bt
                            for lane in range(32):
                                gq, t4 = lane >> 2, lane & 3
                                acc[jj, lane] += (D[gq, 2 * t4], D[gq, 2 * t4 + 1], D[gq + 8, 2 * t4],
                                                  D[gq + 8, 2 * t4 + 1])
                    if isw:
                        for jj in range(2):
                            fr = acc_to_afrag(acc[jj])
                            for lane in range(32):
                                i = (a * ntw + j0 + jj) * 32 + lane
                                w[4 * i:4 * i + 4] = fr[lane]
                                wcount[4 * i:4 * i + 4] += 1
                    else:
                        for jj in range(2):
                            if jj == 1 and not two:
                                break
                            for lane in range(32):
                                gq, t4 = lane >> 2, lane & 3
                                c = v0 + n0 + 8 * jj + 2 * t4
                                for hr in range(2):
                                    r = a * SUB + gq + 8 * hr
                                    x0, x1 = acc[jj, lane, 2 * hr], acc[jj, lane, 2 * hr + 1]
                                    if V % 2 == 0:
                                        if c < V:
                                            assert (r * V + c) % 2 == 0, "float2 store 8-byte aligned"
                                            assert c + 1 < V
                                            u[r, c], u[r, c + 1] = x0, x1
                                            ucount[r, c] += 1
                                            ucount[r, c + 1] += 1
                                    else:
                                        if c < V:
                                            u[r, c] = x0
                                            ucount[r, c] += 1
                                        if c + 1 < V:
                                            u[r, c + 1] = x1
                                            ucount[r, c + 1] += 1
                pj += THREADS // 32
    return w, u, wcount, ucount


@pytest.mark.parametrize("KP,V", [(128, 128), (64, 64), (64, 30), (64, 37), (128, 80), (128, 200), (128, 256),
                                  (128, 8)])
def test_s5_pairs_give_w_and_u0(KP, V):
    rng = np.random.default_rng(KP * 1000 + V)
    T = np.tril(rng.standard_normal((C, C)))
    X = rng.standard_normal((C, KP))
    Vm = rng.standard_normal((C, V))
    w, u, wcount, ucount = emu_s5_v2(T, X, Vm, KP)
    assert (wcount == 1).all(), "every w element written exactly once"
    assert (ucount == 1).all(), "every u0 element written exactly once (none past V)"
    np.testing.assert_allclose(unfrag(w, C, KP), T @ X, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(u, T @ Vm, rtol=1e-12, atol=1e-10)


def test_ldmatrix_rows_are_conflict_free_and_aligned():
    """The eight row addresses of each ldmatrix matrix (row stride LDA = 68 floats) fall in eight distinct groups of
    four banks, and every row is 16-byte aligned."""
    for a in range(4):
        for s in range(8):
            for i in range(4):
                addrs = []
                for l8 in range(8):
                    lane = 8 * i + l8
                    addrs.append(a * SUB * LDA + s * 8 + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LDA + 4 * (lane >> 4))
                assert all(x % 4 == 0 for x in addrs)
                banks = sorted({(x % 32) // 4 for x in addrs})
                assert banks == list(range(8))


def prep2_scr(i):
    rb, cb = (0, i + 1) if i < 3 else (1, 2)
    return rb * SUB, cb * SUB


def test_scratch_blocks_in_ab_upper_triangle():
    """The four 16x16 scratch blocks: disjoint from each other, from S1's 20 tiles on or below the diagonal (the
    only parts of Ab that are written by S1 and read by S2-S4), and inside the 64 real columns of Ab's rows."""
    used = np.zeros((C, LDA), dtype=int)
    for job in range(20):
        a, nt = lower_tile(job)
        used[a * SUB:(a + 1) * SUB, nt * 8:nt * 8 + 8] += 1
    # S2-S4 read Ab's diagonal blocks (strictly lower part) and the blocks (a, b < a): all in the 20 tiles
    for a in range(4):
        for b in range(a + 1):
            assert (used[a * SUB:(a + 1) * SUB, b * SUB:(b + 1) * SUB] == 1).all()
    for i in range(4):
        r0, c0 = prep2_scr(i)
        assert c0 + SUB <= C
        used[r0:r0 + SUB, c0:c0 + SUB] += 1
    assert used.max() == 1


@pytest.mark.parametrize("KP", [64, 128])
def test_kg_split_covers_every_item_once(KP):
    NK = (KP // 16) * (C // 8) * 32
    count = np.zeros(NK, dtype=int)
    for i0, i1 in ((0, NK // 2), (NK // 2, NK)):
        for tid in range(64, THREADS):  # warps 2-7
            it = i0 + tid - 64
            while it < i1:
                count[it] += 1
                it += THREADS - 64
    assert (count == 1).all()


@pytest.mark.parametrize("KP", [64, 128])
def test_shared_memory_layout(KP):
    LDH = KP + 8
    qv_bytes = max(2 * C * LDH, 2 * C * LDV)
    ks = qv_bytes
    ab = ks + 2 * C * LDH
    ts = ab + 4 * C * LDA
    gh = ts + 4 * C * LDA
    nbytes = gh + 8 * C + 3 * 4 * C
    assert 2 * C * LDV <= qv_bytes and 2 * C * LDH <= qv_bytes  # q (S0-S2), then v (S3-S5)
    assert all(x % 16 == 0 for x in (ks, ab, ts, gh))
    assert 3 * (nbytes + 1024) <= 228 * 1024  # three blocks per SM on sm_90
    assert (LDA * 4) % 16 == 0  # ldmatrix rows of T 16-byte aligned


def to_tf32_fast(x32):
    """The kernel's to_tf32_fast on float32 bit patterns: (bits + 0x1000) & 0xffffe000."""
    b = x32.view(np.uint32).astype(np.uint64)
    return (((b + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def rna_tf32_reference(x):
    """Round a float32 to the nearest tf32 value (10 stored mantissa bits, fp32's exponent range, subnormals kept),
    ties away from zero, in float64: the two tf32 neighbours of |x| and a comparison of the distances."""
    out = np.empty_like(x)
    for i, v in enumerate(x.astype(np.float64)):
        if np.isinf(v) or v == 0:
            out[i] = v
            continue
        a = abs(v)
        e = max(np.floor(np.log2(a)), -126)  # subnormals: the fixed spacing of the smallest normal binade
        ulp = 2.0 ** (e - 10)
        lo = np.floor(a / ulp) * ulp
        if lo > a:  # log2 rounding at a binade edge
            e -= 1
            ulp = 2.0 ** (e - 10)
            lo = np.floor(a / ulp) * ulp
        hi = lo + ulp
        r = hi if (a - lo) >= (hi - a) else lo
        out[i] = np.float32(np.copysign(r, v)) if r < 2.0 ** 128 else np.copysign(np.inf, v)
    return out


def test_to_tf32_fast_is_round_to_nearest_ties_away():
    """to_tf32_fast (the kernel's B-operand and T rounding) equals round-to-nearest-ties-away to tf32 -- the
    rounding of cvt.rna.tf32.f32 that gdn_chunk_prep_kernel uses -- for normal, subnormal, tie, huge, negative and
    infinite inputs, so v2's tf32 operands are v1's."""
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(2000).astype(np.float32),
          (rng.standard_normal(500) * 1e-40).astype(np.float32),  # subnormals
          (rng.standard_normal(500) * 1e37).astype(np.float32),
          np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 1e-45], np.float32)]
    ties = (rng.integers(0, 1 << 10, 300, dtype=np.uint64) << 13 | 0x1000 | (rng.integers(1, 200, 300,
            dtype=np.uint64) << 23)).astype(np.uint32).view(np.float32)
    xs.append(ties)
    xs.append(-ties)
    x = np.concatenate(xs)
    got = to_tf32_fast(x)
    ref = rna_tf32_reference(x)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | ((got == 0) & (ref == 0))
    assert same.all(), x[~same][:5]


def test_round_t_covers_every_element_s5_reads():
    """prep2_round_t (groups of 4 columns, predicate c < (r / 16 + 1) * 16) rounds exactly once exactly the
    elements of T that S5's ldmatrix reads (row block a, k-blocks s < 2a + 2)."""
    rounded = np.zeros((C, C), dtype=int)
    for tid in range(THREADS):
        for i in range(tid, C * (C // 4), THREADS):
            r, c = i // (C // 4), (i % (C // 4)) * 4
            assert (r * LDA + c) % 4 == 0  # 16-byte accesses
            if c < (r // SUB + 1) * SUB:
                assert c + 4 <= (r // SUB + 1) * SUB  # a group never straddles a block
                rounded[r, c:c + 4] += 1
    assert rounded.max() == 1
    rounded = rounded == 1
    read = np.zeros((C, C), dtype=bool)
    for a in range(4):
        for s in range(2 * a + 2):
            for lane in range(32):
                r = a * SUB + (lane & 7) + 8 * ((lane >> 3) & 1)
                c0 = s * 8 + 4 * (lane >> 4)
                read[r, c0:c0 + 4] = True
    assert (rounded == read).all()


def ldsm_x4_b16(word_at, lane_addr_halfs):
    """ldmatrix.x4 (b16): lanes 8 i .. 8 i + 7 give the row addresses (in halfs, 16-byte aligned) of matrix i;
    lane l receives the 32-bit word holding halfs 2 (l % 4), 2 (l % 4) + 1 of row l / 4 of each matrix.
    word_at(half address) names the 32-bit word there."""
    out = [[None] * 4 for _ in range(32)]
    for lane in range(32):
        for i in range(4):
            addr = lane_addr_halfs[8 * i + lane // 4]
            assert addr % 8 == 0, "ldmatrix rows must be 16-byte aligned"
            out[lane][i] = word_at(addr + 2 * (lane % 4))
    return out


@pytest.mark.parametrize("KP", [64, 128])
def test_s1_ldmatrix_fragments_are_v1s_word_reads(KP):
    """S1's ldmatrix addressing (A: one x4 per k-step from q / k rows 16a.., B: one x4 per two k-steps from k rows
    8nt..) gives every lane, for every lower tile and k-step, the 32-bit words v1 reads: A (row g, word t),
    (g + 8, t), (g, t + 4), (g + 8, t + 4) of the k-step, B (row 8 nt + g, word t), (8 nt + g, t + 4). Shared
    rows conflict-free (row stride KP + 8 halfs)."""
    LDH = KP + 8

    def word_at(h):  # (row, word within the row)
        assert h % 2 == 0
        return divmod(h, LDH)[0], (h % LDH) // 2

    for job in range(20):
        a, nt = lower_tile(job)
        arow = [(((l & 7) + 8 * ((l >> 3) & 1)) * LDH + 8 * (l >> 4)) for l in range(32)]
        brow = [((l & 7) * LDH + 8 * (l >> 3)) for l in range(32)]
        for s2 in range(KP // 32):
            bw = ldsm_x4_b16(word_at, [nt * 8 * LDH + 32 * s2 + x for x in brow])
            for h in range(2):
                s = 2 * s2 + h
                aw = ldsm_x4_b16(word_at, [a * SUB * LDH + 16 * s + x for x in arow])
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    r, o = a * SUB + gq, s * 8
                    assert aw[lane] == [(r, o + t4), (r + 8, o + t4), (r, o + t4 + 4), (r + 8, o + t4 + 4)]
                    assert bw[lane][2 * h] == (nt * 8 + gq, o + t4)
                    assert bw[lane][2 * h + 1] == (nt * 8 + gq, o + t4 + 4)
    # each matrix's eight 16-byte rows: distinct bank groups
    for rows in ([(l & 7) for l in range(8)],):
        banks = sorted({((r * LDH) // 2 % 32) // 4 for r in rows})
        assert banks == list(range(8))
