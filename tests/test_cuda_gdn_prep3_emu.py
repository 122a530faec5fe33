"""CPU emulation of the new index math of the GDN prep kernel v3 (kernels_src/cuda/gdn_chunk_prep3.cuh,
KDA_CUDA_GDN_PREP=3: one block per pair of value heads of a GVA group).

Replays lane by lane what v3 changes against v2: S1's stores of both heads' A_kk Diag(beta) (head 0 into Ab's strict
lower triangle, head 1 transposed into its strict upper triangle; every address written at most once), the 4x4-block
untranspose of head 1's A after head 0's S4 (no thread reads what another writes; the result is head 1's A bit for
bit), the S3 / S4 scratch blocks in T's strictly upper blocks (disjoint from everything S2-S5 write or read in T),
the q~ items of both heads in S2, the head pairing of the grid, and the shared-memory layout. The values: both heads'
A from one shared raw product K K^T (from bf16 keys) with v2's per-element factors, over ordinary, near-zero and
very negative gates; parking and untransposing moves them without change, so T = (I + A)^-1 (float32 forward
substitution) is v2's bit for bit, and its error against float64 is v2's. Runs without a GPU; it does not test the
CUDA code itself (tests/test_cuda_gdn_prep3.py does).
"""
import numpy as np
import pytest

from test_cuda_gdn_prep_emu import lower_tile

C, SUB, LDA, LDV, THREADS = 64, 16, 68, 136, 256


def s1_stores(A0, A1, nh=2):
    """Ab (flat, NaN where unwritten) after v3's S1 stores, lane by lane, and the write count per address."""
    Ab = np.full(C * LDA, np.nan, dtype=np.float32)
    cnt = np.zeros(C * LDA, dtype=int)
    for job in range(20):
        a, nt = lower_tile(job)
        diag = nt >= 2 * a
        for lane in range(32):
            gq, t4 = lane >> 2, lane & 3
            for r in range(nh):
                A = A0 if r == 0 else A1
                vk = []
                for e in range(4):
                    t, j = a * SUB + gq + (e >> 1) * 8, nt * 8 + 2 * t4 + (e & 1)
                    vk.append(A[t, j] if j < t else np.float32(0))
                if r == 0 and not diag:  # two float2 stores
                    base = (a * SUB + gq) * LDA + nt * 8 + 2 * t4
                    for addr, x in ((base, vk[0]), (base + 1, vk[1]), (base + 8 * LDA, vk[2]),
                                    (base + 8 * LDA + 1, vk[3])):
                        Ab[addr] = x
                        cnt[addr] += 1
                else:
                    for e in range(4):
                        t, j = a * SUB + gq + (e >> 1) * 8, nt * 8 + 2 * t4 + (e & 1)
                        if j < t:
                            addr = t * LDA + j if r == 0 else j * LDA + t
                            Ab[addr] = vk[e]
                            cnt[addr] += 1
    return Ab, cnt


def untranspose(Ab, bug=False):
    """prep3_untranspose, thread by thread: returns the new Ab and per-thread read / write address sets."""
    out = Ab.copy()
    reads, writes = {}, {}
    for tid in range(THREADS):
        bt, bj = tid // (C // 4), tid % (C // 4)
        if bj > bt:
            continue
        src = [[Ab[(4 * bj + m) * LDA + 4 * bt + n] for n in range(4)] for m in range(4)]
        reads[tid] = {(4 * bj + m) * LDA + 4 * bt + n for m in range(4) for n in range(4)}
        writes[tid] = set()
        for n in range(4):  # d[n * LDA / 4] = (s[0].n, s[1].n, s[2].n, s[3].n)
            for m in range(4):
                addr = (4 * bt + n) * LDA + 4 * bj + m
                out[addr] = src[n][m] if bug else src[m][n]
                writes[tid].add(addr)
    return out, reads, writes


def strict_lower(Abflat):
    M = Abflat.reshape(C, LDA)[:, :C]
    return np.tril(M, -1)


def head_A(P, g, beta):
    """v2's S1 factors for one head, float32: A[t, j] = P[t, j] * (e^{G_t - G_j} beta_j), j < t (G: double prefix,
    the exponent as the hi / lo float difference)."""
    G = np.cumsum(g.astype(np.float64))
    hi = G.astype(np.float32)
    lo = (G - hi.astype(np.float64)).astype(np.float32)
    A = np.zeros((C, C), dtype=np.float32)
    for t in range(C):
        for j in range(t):
            d = np.float32((hi[t] - hi[j]) + (lo[t] - lo[j]))
            fb = np.float32(np.exp(d, dtype=np.float32)) * np.float32(beta[j])
            A[t, j] = np.float32(P[t, j] * fb)
    return A


def inverse_f32(A):
    """T = (I + A)^-1 by forward substitution in float32 (the diagonal blocks' algorithm, over the whole chunk)."""
    T = np.zeros((C, C), dtype=np.float32)
    for j in range(C):
        x = np.zeros(C, dtype=np.float32)
        for i in range(j, C):
            s = np.float32(1.0 if i == j else 0.0)
            for m in range(j, i):
                s = np.float32(s - A[i, m] * x[m])
            x[i] = s
        T[:, j] = x
    return T


def gates(kind, rng):
    if kind == "ordinary":
        return np.log(1 / (1 + np.exp(-rng.standard_normal(C))))
    if kind == "near_0":
        return np.log(1 / (1 + np.exp(-rng.standard_normal(C)))) / 1e4
    g = np.log(1 / (1 + np.exp(-rng.standard_normal(C))))
    r = rng.random(C)
    return np.where(r < 0.3, -20.0, np.where(r > 0.9, -1e4, g))


@pytest.mark.parametrize("g1kind", ["ordinary", "near_0", "very_negative"])
@pytest.mark.parametrize("g0kind", ["ordinary", "near_0", "very_negative"])
def test_pair_of_heads_gets_v2s_A_and_T(g0kind, g1kind):
    rng = np.random.default_rng(7)
    k = rng.standard_normal((C, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    kb = k.astype(np.float32)  # (bf16 keys: any float32 matrix stands in; the product is shared, its bits too)
    P = (kb @ kb.T).astype(np.float32)
    A0 = head_A(P, gates(g0kind, rng), rng.random(C))
    A1 = head_A(P, gates(g1kind, rng), rng.random(C))
    Ab, cnt = s1_stores(A0, A1)
    assert cnt.max() == 1
    assert np.array_equal(strict_lower(Ab), A0)  # head 0: v2's A, read by S2-S4 (strict lower only)
    Ab2, reads, writes = untranspose(Ab)
    for t1 in writes:  # no thread writes what another reads
        for t2 in reads:
            if t1 != t2:
                assert not (writes[t1] & reads[t2])
    assert np.array_equal(strict_lower(Ab2), A1)  # head 1: v2's A bit for bit
    T1 = inverse_f32(strict_lower(Ab2))
    assert np.array_equal(T1, inverse_f32(A1))  # hence v2's T
    T64 = np.linalg.inv(np.eye(C) + A1.astype(np.float64))
    err = np.abs(T1 - T64).max() / max(np.abs(T64).max(), 1e-30)
    assert np.isfinite(T1).all() and err < 1e-4, err


def test_untranspose_emulation_catches_a_wrong_index():
    """The check above can fail: untranspose with the 4x4 block not transposed loses head 1's A."""
    rng = np.random.default_rng(1)
    A0 = np.tril(rng.standard_normal((C, C)).astype(np.float32), -1)
    A1 = np.tril(rng.standard_normal((C, C)).astype(np.float32), -1)
    Ab, _ = s1_stores(A0, A1)
    bad, _, _ = untranspose(Ab, bug=True)
    assert not np.array_equal(strict_lower(bad), A1)


def test_group_of_one_stores_only_head_0():
    rng = np.random.default_rng(2)
    A0 = np.tril(rng.standard_normal((C, C)).astype(np.float32), -1)
    Ab, cnt = s1_stores(A0, None, nh=1)
    assert cnt.max() == 1 and np.array_equal(strict_lower(Ab), A0)
    assert (cnt.reshape(C, LDA)[np.triu_indices(C)] == 0).all()


def prep3_scr(i):
    rb, cb = (0, i + 1) if i < 3 else (1, 2)
    return rb * SUB, cb * SUB


def test_scratch_blocks_in_t_upper_blocks():
    """S3 / S4's four scratch blocks in T: disjoint from each other and from everything S2-S5 write or read in T
    (the 10 blocks on or below the diagonal: diagonal inverse, T_10, T_32, the lower-left 32x32, the tf32 rounding,
    S5's ldmatrix reads of row block a over columns < 16 (a + 1))."""
    used = np.zeros((C, LDA), dtype=int)
    for a in range(4):
        for b in range(a + 1):
            used[a * SUB:(a + 1) * SUB, b * SUB:(b + 1) * SUB] += 1
    for r in range(C):  # prep2_round_t and S5's ldmatrix: columns < 16 (r / 16 + 1)
        assert (used[r, : (r // SUB + 1) * SUB] == 1).all()
    for i in range(4):
        r0, c0 = prep3_scr(i)
        assert c0 + SUB <= C
        used[r0:r0 + SUB, c0:c0 + SUB] += 1
    assert used.max() == 1


@pytest.mark.parametrize("KP", [64, 128])
def test_qg_items_of_both_heads_in_s2(KP):
    NQ = 4 * (KP // 8) * 32
    for tids in (range(128, 256), range(0, 128)):  # head 0: warps 4-7 (tid - 128); head 1: warps 0-3 (tid)
        count = np.zeros(NQ, dtype=int)
        for tid in tids:
            it = tid - tids.start
            while it < NQ:
                count[it] += 1
                it += 128
        assert (count == 1).all()


@pytest.mark.parametrize("H,HV", [(16, 32), (2, 4), (2, 2), (1, 3), (1, 4), (3, 6), (4, 4), (2, 6)])
def test_head_pairs_cover_every_head_once_within_a_group(H, HV):
    R = HV // H
    nh = 2 if R % 2 == 0 else 1
    seen = np.zeros(HV, dtype=int)
    for y in range(HV // nh):
        hv0 = y * nh
        h = hv0 // R
        for r in range(nh):
            seen[hv0 + r] += 1
            assert (hv0 + r) // R == h  # the pair shares q / k
    assert (seen == 1).all()


@pytest.mark.parametrize("KP", [64, 128])
def test_shared_memory_layout(KP):
    LDH = KP + 8
    qv_bytes = max(2 * C * LDH, 2 * C * LDV)
    gates_off = qv_bytes + 2 * C * LDH + 2 * 4 * C * LDA
    gate_bytes = 20 * C
    nbytes = gates_off + 2 * gate_bytes
    assert gates_off % 16 == 0 and gate_bytes % 16 == 0
    assert 3 * (nbytes + 1024) <= 228 * 1024  # three blocks per SM on sm_90
    assert (LDA * 4) % 16 == 0  # the untranspose's 16-byte rows


@pytest.mark.parametrize("r", [0, 1])
@pytest.mark.parametrize("KP", [64, 128])
def test_kg_items_over_s2_s3_s4_cover_every_item_once(KP, r):
    """k~^T's items: head 0 v2's halves over S3 / S4 (warps 2-7); head 1 its first quarter in S2 (warps 4-7), the
    rest halved over S3 / S4."""
    NK = (KP // 16) * (C // 8) * 32
    k0 = 0 if r == 0 else NK // 4
    k1 = (k0 + NK) // 2
    count = np.zeros(NK, dtype=int)
    phases = [(0, k0, range(128, 256))] if r else []
    phases += [(k0, k1, range(64, 256)), (k1, NK, range(64, 256))]
    for i0, i1, tids in phases:
        for tid in tids:
            it = i0 + tid - tids.start
            while it < i1:
                count[it] += 1
                it += len(tids)
    assert (count == 1).all()
