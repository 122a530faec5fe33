"""CPU emulation of the index math of the bulk-prefetch scan of the CUDA chunked forward
(kernels_src/cuda/delta_chunk_fwd.cuh: delta_chunk_scan3_kernel, KDA_CUDA_CHUNK_SCAN=4; BV = 32 columns per block,
or 64 with KDA_CUDA_SCAN3_BV=64).

Runs without a GPU. It models the chunk's shared workspace region (w fp32, q~ / k~^T / A~ bf16, decay fp32; byte
offsets of WsLayout<KP>(true)) at 2-byte granularity, replays the bulk copies (16-byte units, at most 16 KB per
instruction) into every block's double buffer, the mbarrier phase / parity schedule, and then the kernel block by
block, warp by warp (8 warps: row block wi = w % 4, column half wc = w / 4) and lane by lane: the float4 / uint2
fragment reads from the shared buffer, the m16n8k8 fragments, the hs / Us tiles (stride 40), u0 from the row-major
workspace section, the o and ht stores -- against the float64 recurrence.
It does not test the CUDA code itself (tests/test_cuda_chunk_fwd.py does that on a GPU).
"""
import numpy as np
import pytest

C = 64
NWARP = 8     # kScan3Threads / 32
BULK_MAX = 16384
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


def mma_row_tiles(acc, a, Bs, ld, k0):
    """acc[NT][32, 4]: one k-step against every 8-column tile of the row-major shared tile Bs (stride ld)."""
    for nt in range(len(acc)):
        mma8(acc[nt], a, Bs[(k0 + T4) * ld + nt * 8 + GQ], Bs[(k0 + T4 + 4) * ld + nt * 8 + GQ])


class Counted:
    """A flat output array that counts the writes of each element (each must be written exactly once)."""

    def __init__(self, n, init=np.nan):
        self.x = np.full(n, init)
        self.count = np.zeros(n, np.int64)

    def put(self, i, val, mask):
        i, val = np.asarray(i)[mask], np.asarray(val)[mask]
        np.add.at(self.count, i, 1)
        self.x[i] = val


def make_problem(rng, KP, K, V, lens, decay_min=0.3):
    """Random per-chunk operands of a batch of sequences (global chunks in order), as the prep kernel leaves them
    (padding rows/columns past K and past the chunk's L zero)."""
    chunks = []
    for n, ln in enumerate(lens):
        for i in range((ln + C - 1) // C):
            L = min(C, ln - i * C)
            w = np.zeros((C, KP)); w[:L, :K] = rng.standard_normal((L, K)) * 0.1
            qg = np.zeros((C, KP)); qg[:L, :K] = rng.standard_normal((L, K)) * 0.1
            kgT = np.zeros((KP, C)); kgT[:K, :L] = rng.standard_normal((K, L)) * 0.1
            aqk = np.tril(rng.standard_normal((C, C)) * 0.1); aqk[L:] = 0; aqk[:, L:] = 0
            dec = np.ones(KP); dec[:K] = rng.uniform(decay_min, 1.0, K)
            u0 = np.zeros((C, V)); u0[:L] = rng.standard_normal((L, V))
            chunks.append(dict(n=n, i=i, L=L, tok0=sum(lens[:n]) + i * C, w=w, qg=qg, kgT=kgT, aqk=aqk, dec=dec,
                               u0=u0))
    return chunks


def reference(chunks, lens, h0, K, V):
    """float64: per chunk U = u0 - w h, o = q~ h + A~ U, h <- Diag(dec) h + k~^T U. Returns o {token: row}, ht."""
    o, ht = {}, h0.copy()
    cid = 0
    for n, ln in enumerate(lens):
        KP = chunks[0]["w"].shape[1] if chunks else K
        hp = np.zeros((KP, V)); hp[:K] = h0[n]
        for _ in range((ln + C - 1) // C):
            ch = chunks[cid]
            u = ch["u0"] - ch["w"] @ hp
            oo = ch["qg"] @ hp + ch["aqk"] @ u
            for r in range(ch["L"]):
                o[ch["tok0"] + r] = oo[r]
            hp = ch["dec"][:, None] * hp + ch["kgT"] @ u
            cid += 1
        ht[n] = hp[:K]
    return o, ht


def ws_layout(KP):
    """WsLayout<KP>(true), offsets in floats (bf16 sections: half the floats)."""
    w = 0
    qg = w + C * KP
    kg = qg + C * KP // 2
    aqk = kg + C * KP // 2
    decay = aqk + C * C // 2
    u = decay + KP
    return dict(w=w, qg=qg, kg=kg, aqk=aqk, decay=decay, u=u)


def region_bytes(KP):
    """Scan3Smem<KP>::region."""
    return (129 * KP + C * C // 2) * 4


class Region:
    """A byte range modelled in 2-byte units: an fp32 element at float offset f occupies units 2f (value) and
    2f + 1 (marker); a bf16 element i of a section at float offset s occupies unit 2s + i."""

    def __init__(self, nbytes):
        assert nbytes % 2 == 0
        self.u = np.full(nbytes // 2, np.nan)

    def put_f32(self, f, vals):
        f = np.asarray(f)
        self.u[2 * f] = vals
        self.u[2 * f + 1] = -7.0  # marker

    def put_bf16(self, s, i, vals):
        self.u[2 * s + np.asarray(i)] = vals

    def f32(self, f):
        assert np.all(self.u[2 * np.asarray(f) + 1] == -7.0), "fp32 read misaligned or not copied"
        return self.u[2 * np.asarray(f)]

    def bf16(self, s, i):
        return self.u[2 * s + np.asarray(i)]


def build_region(ch, KP):
    L = ws_layout(KP)
    R = Region(region_bytes(KP))
    assert L["u"] * 4 == region_bytes(KP)
    R.put_f32(L["w"] + np.arange(C * KP), to_frag(ch["w"], KP))
    R.put_bf16(L["qg"], np.arange(C * KP), to_frag(ch["qg"], KP))
    R.put_bf16(L["kg"], np.arange(KP * C), to_frag(ch["kgT"], C))
    R.put_bf16(L["aqk"], np.arange(C * C), to_frag(ch["aqk"], C))
    R.put_f32(L["decay"] + np.arange(KP), ch["dec"])
    assert not np.isnan(R.u).any()
    return R


def copies(RB):
    """The kernel's bulk copies of the region (byte offset, bytes): issue()'s loop."""
    return [(b, min(BULK_MAX, RB - b)) for b in range(0, RB, BULK_MAX)]


def emu_scan3(chunks, lens, h0, KP, K, V, T_total, mutate=None, BV=32):
    """delta_chunk_scan3_kernel<KP, BV> for one value head (HV = 1), every sequence. Returns o [T, V] and ht
    (counted)."""
    LDH = BV + 8  # Scan3Smem::LDH
    WC = BV // 2  # columns per warp
    NT = WC // 8
    L = ws_layout(KP)
    RB = region_bytes(KP)
    MT, KS, CSK = KP // 64, KP // 8, C // 8
    assert V <= 256  # kScan3MaxV
    ncta = (V + BV - 1) // BV
    o = Counted(T_total * V)
    ht = Counted(len(lens) * K * V)
    regions = [build_region(ch, KP) for ch in chunks]
    c_first = np.concatenate([[0], np.cumsum([(ln + C - 1) // C for ln in lens])])
    cw_of = (lambda wc: wc * (WC // 2)) if mutate == "cw" else (lambda wc: wc * WC)
    for n, ln in enumerate(lens):
        nch = (ln + C - 1) // C
        bos = sum(lens[:n])
        # the copies: every block's buffer image of every chunk (each byte written once by exactly one copy)
        bufs = {}
        for ci in range(nch):
            for dst in range(ncta):
                img = Region(RB)
                written = np.zeros(RB // 2, np.int64)
                for b, nb in copies(RB):
                    assert b % 16 == 0 and nb % 16 == 0 and 0 < nb <= BULK_MAX
                    img.u[b // 2:(b + nb) // 2] = regions[c_first[n] + ci].u[b // 2:(b + nb) // 2]
                    written[b // 2:(b + nb) // 2] += 1
                assert np.all(written == 1), "region not covered exactly once"
                bufs[ci, dst] = img
        # mbarrier schedule: chunk ci uses buffer ci & 1, its (ci >> 1)-th phase; issued at the start (ci < 2) or
        # after the block finished chunk ci - 2, the last reader of that buffer
        phase = [0, 0]
        for ci in range(nch):
            b = ci & 1
            assert (ci >> 1) & 1 == phase[b] & 1
            phase[b] += 1
            assert ci < 2 or (ci - 2) & 1 == b
        for z in range(ncta):
            v0 = z * BV
            hs = np.full(KP * LDH, np.nan)
            Us = np.full(C * LDH, np.nan)
            hacc = {}
            for w in range(NWARP):
                wi, wc = w & 3, w >> 2
                cw = cw_of(wc)
                for mt in range(MT):
                    for nt in range(NT):
                        a = np.zeros((32, 4))
                        for e in range(4):
                            r = (wi * MT + mt) * 16 + GQ + (e >> 1) * 8
                            c = v0 + cw + nt * 8 + 2 * T4 + (e & 1)
                            ok = (r < K) & (c < V)
                            a[:, e] = np.where(ok, h0[n][np.minimum(r, K - 1), np.minimum(c, V - 1)], 0.0)
                        hacc[w, mt, nt] = a

            def store_h():
                for (w, mt, nt), a in hacc.items():
                    wi, cw = w & 3, cw_of(w >> 2)
                    for e in range(4):
                        r = (wi * MT + mt) * 16 + GQ + (e >> 1) * 8
                        hs[r * LDH + cw + nt * 8 + 2 * T4 + (e & 1)] = a[:, e]

            store_h()

            def u0_of(ci, w):
                wi, cw = w & 3, cw_of(w >> 2)
                u = chunks[c_first[n] + ci]["u0"].reshape(-1)
                out = np.zeros((NT, 32, 4))
                for nt in range(NT):
                    for e in range(4):
                        r = wi * 16 + GQ + (e >> 1) * 8
                        c = v0 + cw + nt * 8 + 2 * T4 + (e & 1)
                        out[nt][:, e] = np.where(c < V, u[np.minimum(r * V + c, C * V - 1)], 0.0)
                return out

            u0r = {w: u0_of(0, w) for w in range(NWARP)} if nch > 0 else {}
            for ci in range(nch):
                Lc = min(C, ln - ci * C)
                buf = bufs[ci, z]

                def wfrag(idx):  # sw[idx]: float4 of the w section
                    return np.stack([buf.f32(L["w"] + 4 * idx + s) for s in range(4)], axis=1)

                def hfrag(sec, idx):  # s?[idx]: uint2 of a bf16 section, unpacked
                    return np.stack([buf.bf16(L[sec], 4 * idx + s) for s in range(4)], axis=1)

                # U = u0 - w h (two chains)
                newU = []
                for w in range(NWARP):
                    wi, cw = w & 3, cw_of(w >> 2)
                    wfi = wi * KS * 32 + LANES
                    a0 = [np.zeros((32, 4)) for _ in range(NT)]
                    a1 = [np.zeros((32, 4)) for _ in range(NT)]
                    for ks in range(0, KS, 2):
                        mma_row_tiles(a0, wfrag(wfi + ks * 32), hs[cw:], LDH, ks * 8)
                        mma_row_tiles(a1, wfrag(wfi + (ks + 1) * 32), hs[cw:], LDH, (ks + 1) * 8)
                    for nt in range(NT):
                        for e in range(4):
                            r = wi * 16 + GQ + (e >> 1) * 8
                            newU.append((r * LDH + cw + nt * 8 + 2 * T4 + (e & 1),
                                         u0r[w][nt][:, e] - (a0[nt][:, e] + a1[nt][:, e])))
                for i, x in newU:  # every warp's stores, then the barrier
                    Us[i] = x
                if ci + 1 < nch:
                    u0r = {w: u0_of(ci + 1, w) for w in range(NWARP)}
                # o = q~ h + A~ U
                for w in range(NWARP):
                    wi, cw = w & 3, cw_of(w >> 2)
                    wfi = wi * KS * 32 + LANES
                    afi = wi * CSK * 32 + LANES
                    a0 = [np.zeros((32, 4)) for _ in range(NT)]
                    a1 = [np.zeros((32, 4)) for _ in range(NT)]
                    for ks in range(KS):
                        mma_row_tiles(a0, hfrag("qg", wfi + ks * 32), hs[cw:], LDH, ks * 8)
                    for ks in range(CSK):
                        if ks < 2 * wi + 2:
                            mma_row_tiles(a1, hfrag("aqk", afi + ks * 32), Us[cw:], LDH, ks * 8)
                    for nt in range(NT):
                        for e in range(4):
                            r = wi * 16 + GQ + (e >> 1) * 8
                            c = v0 + cw + nt * 8 + 2 * T4 + (e & 1)
                            m = (r < Lc) & (c < V)
                            o.put((bos + ci * C + r) * V + c, a0[nt][:, e] + a1[nt][:, e], m)
                # h <- Diag(decay) h + k~^T U
                for w in range(NWARP):
                    wi, cw = w & 3, cw_of(w >> 2)
                    kfi = wi * MT * CSK * 32 + LANES
                    for mt in range(MT):
                        d0 = buf.f32(L["decay"] + (wi * MT + mt) * 16 + GQ)
                        d1 = buf.f32(L["decay"] + (wi * MT + mt) * 16 + GQ + 8)
                        acc = [hacc[w, mt, nt] for nt in range(NT)]
                        for a in acc:
                            a[:, 0] *= d0
                            a[:, 1] *= d0
                            a[:, 2] *= d1
                            a[:, 3] *= d1
                        for ks in range(CSK):
                            mma_row_tiles(acc, hfrag("kg", kfi + (mt * CSK + ks) * 32), Us[cw:], LDH, ks * 8)
                store_h()
            sbase = n * K * V
            for (w, mt, nt), a in hacc.items():
                wi, cw = w & 3, cw_of(w >> 2)
                for e in range(4):
                    r = (wi * MT + mt) * 16 + GQ + (e >> 1) * 8
                    c = v0 + cw + nt * 8 + 2 * T4 + (e & 1)
                    m = (r < K) & (c < V)
                    ht.put(sbase + np.minimum(r, K - 1) * V + np.minimum(c, V - 1), a[:, e], m)
    return o, ht


SHAPES = [  # KP, K, V (column blocks of 32), sequence lengths
    (128, 128, 128, [200]),        # the benchmark's head shape: 4 column blocks
    (128, 128, 40, [70, 0, 130]),  # varlen with an empty sequence, a partial second block
    (128, 100, 37, [65]),          # K < KP, odd V
    (64, 64, 30, [129]),           # KP 64, one column block
    (64, 40, 80, [64, 1]),         # 3 column blocks
    (64, 64, 256, [70]),           # 8 column blocks (V = kScan3MaxV)
]


@pytest.mark.parametrize("BV", [32, 64])
@pytest.mark.parametrize("KP,K,V,lens", SHAPES)
def test_scan3(KP, K, V, lens, BV):
    rng = np.random.default_rng(KP * 1000 + K * 10 + V)
    chunks = make_problem(rng, KP, K, V, lens)
    h0 = rng.standard_normal((len(lens), K, V)) * 0.5
    T_total = sum(lens)
    o, ht = emu_scan3(chunks, lens, h0, KP, K, V, T_total, BV=BV)
    o_ref, ht_ref = reference(chunks, lens, h0, K, V)
    o_full = np.zeros((T_total, V))
    for t, row in o_ref.items():
        o_full[t] = row
    assert np.all(o.count == 1), "every output element written exactly once"
    assert np.all(ht.count == 1)
    np.testing.assert_allclose(o.x.reshape(T_total, V), o_full, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ht.x.reshape(len(lens), K, V), ht_ref, rtol=1e-9, atol=1e-9)


def test_copies_cover_region():
    for KP in (64, 128):
        RB = region_bytes(KP)
        assert RB % 16 == 0
        cover = np.zeros(RB // 16, np.int64)
        for b, nb in copies(RB):
            assert 0 < nb <= BULK_MAX and nb % 16 == 0
            cover[b // 16:(b + nb) // 16] += 1
        assert np.all(cover == 1)


def test_smem_budget():
    """Scan3Smem<KP, BV>::bytes within the 227 KB per block of sm_90 (two region buffers, hs, Us, two mbarriers)."""
    for BV in (32, 64):
        LDH = BV + 8
        for KP in (64, 128):
            nbytes = 2 * region_bytes(KP) + 4 * KP * LDH + 4 * C * LDH + 16
            assert nbytes <= 227 * 1024
    assert 2 * region_bytes(128) + 4 * 128 * 40 + 4 * C * 40 + 16 == 179216


def test_bank_conflict_free_b_reads():
    """B-fragment reads hs[(k0 + t4) * LDH + cw + nt * 8 + gq]: 32 distinct banks per warp."""
    for BV in (32, 64):
        for cw in (0, BV // 2):
            banks = ((T4 * (BV + 8)) + cw + GQ) % 32
            assert len(set(banks.tolist())) == 32


def test_emulator_sees_index_mutations():
    rng = np.random.default_rng(5)
    KP, K, V, lens = 128, 128, 64, [100]
    chunks = make_problem(rng, KP, K, V, lens)
    h0 = rng.standard_normal((1, K, V)) * 0.5
    o, ht = emu_scan3(chunks, lens, h0, KP, K, V, 100, mutate="cw")
    o_ref, ht_ref = reference(chunks, lens, h0, K, V)
    o_full = np.stack([o_ref[t] for t in range(100)])
    bad = (not np.all(o.count == 1)) or not np.allclose(np.nan_to_num(o.x.reshape(100, V)), o_full, atol=1e-6)
    assert bad
