"""CPU emulation of the index math of the split chunked forward (KDA_CUDA_CHUNK_SCAN=5 / 6): the state-only scan
delta_chunk_scan4_kernel (kernels_src/cuda/delta_chunk_scan4.cuh) and the parallel output kernel
delta_chunk_out_kernel (delta_chunk_out.cuh).

Runs without a GPU, in float64. It replays scan4's bulk copies (w, k~^T and decay of the chunk's workspace region,
pieces of at most 16 KB, into one double-buffer image of Scan4Smem's layout w | k~^T | decay), its warps and lanes
(8 warps: rows wi = w % 4, column half wc = w / 4 of 32 columns), the m16n8k8 fragments, the hs / Us tiles
(stride 40), and its stores of h_c and U_c to the [slot, KP, vp] / [slot, 64, vp] buffers (vp = V rounded up to 8;
each element written exactly once); then the output kernel block by block (chunk slot, 64 columns): the staging of
h_c / U_c into the stride-72 tiles (groups of 4 columns, zero past vp), the q~ / A~ fragments read from the
workspace, the two mma chains, the o stores (rows < L, columns < V, each exactly once) -- against the float64
recurrence (tests/test_cuda_scan3_emu.py's reference). It does not test the CUDA code itself
(tests/test_cuda_chunk_fwd.py: test_chunk_fwd_split, test_chunk_split_vs_scan3 do that on a GPU).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cuda_scan3_emu import (BULK_MAX, C, GQ, LANES, NWARP, T4, Counted, Region, build_region,  # noqa: E402
                                 make_problem, mma_row_tiles, reference, ws_layout)

BV = 32        # Scan4Smem::BV
LDH = BV + 8   # Scan4Smem::LDH
OUT_BV = 64    # kOutBV
LDB = OUT_BV + 8  # OutSmem::LDB


def scan4_smem(KP):
    """Scan4Smem<KP>: (w_bytes, kg_bytes, dec_bytes, region, bytes)."""
    wb, kb, db = C * KP * 4, C * KP * 2, KP * 4
    region = wb + kb + db
    return wb, kb, db, region, 2 * region + 4 * KP * LDH + 4 * C * LDH + 16


def scan4_copies(KP):
    """issue(): (dst byte offset in the buffer, src byte offset in the workspace slice, bytes)."""
    L = ws_layout(KP)
    wb, kb, db, _, _ = scan4_smem(KP)
    out = [(b, L["w"] * 4 + b, min(BULK_MAX, wb - b)) for b in range(0, wb, BULK_MAX)]
    out += [(wb + b, L["kg"] * 4 + b, min(BULK_MAX, kb - b)) for b in range(0, kb, BULK_MAX)]
    out.append((wb + kb, L["decay"] * 4, db))
    return out


def scan4_buffer(region, KP):
    wb, kb, db, RB, _ = scan4_smem(KP)
    img = Region(RB)
    written = np.zeros(RB // 2, np.int64)
    for dst, src, nb in scan4_copies(KP):
        assert dst % 16 == 0 and src % 16 == 0 and nb % 16 == 0 and 0 < nb <= BULK_MAX
        img.u[dst // 2:(dst + nb) // 2] = region.u[src // 2:(src + nb) // 2]
        written[dst // 2:(dst + nb) // 2] += 1
    assert np.all(written == 1), "buffer not covered exactly once"
    return img


def emu_split(chunks, lens, h0, KP, K, V, T_total, mutate=None):
    """scan4 then out for one value head (HV = 1). Returns o [T, V] and ht (counted)."""
    NT, MT, KS, CSK = (BV // 2) // 8, KP // 64, KP // 8, C // 8
    vp = (V + 7) // 8 * 8
    wb, kb, db, RB, _ = scan4_smem(KP)
    nslots = len(chunks)
    hc = Counted(max(nslots, 1) * KP * vp)
    uc = Counted(max(nslots, 1) * C * vp)
    o = Counted(T_total * V)
    ht = Counted(len(lens) * K * V)
    regions = [build_region(ch, KP) for ch in chunks]
    L = ws_layout(KP)
    c_first = np.concatenate([[0], np.cumsum([(ln + C - 1) // C for ln in lens])])
    # ---- scan4: grid (sequence, head, ceil(V / 32))
    for n, ln in enumerate(lens):
        nch = (ln + C - 1) // C
        for z in range((V + BV - 1) // BV):
            v0 = z * BV
            hs = np.full(KP * LDH, np.nan)
            Us = np.full(C * LDH, np.nan)
            hacc = {}
            for w in range(NWARP):
                wi, cw = w & 3, (w >> 2) * (BV // 2)
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
                    wi, cw = w & 3, (w >> 2) * (BV // 2)
                    for e in range(4):
                        r = (wi * MT + mt) * 16 + GQ + (e >> 1) * 8
                        hs[r * LDH + cw + nt * 8 + 2 * T4 + (e & 1)] = a[:, e]

            store_h()
            for ci in range(nch):
                sl = c_first[n] + ci
                buf = scan4_buffer(regions[sl], KP)
                u0 = chunks[sl]["u0"].reshape(-1)
                # h_c stores (before the chunk's products)
                for (w, mt, nt), a in hacc.items():
                    wi, cw = w & 3, (w >> 2) * (BV // 2)
                    r = (wi * MT + mt) * 16 + GQ
                    c = v0 + cw + nt * 8 + 2 * T4
                    m = c < vp
                    base = sl * KP * vp
                    hc.put(base + r * vp + c, a[:, 0], m)
                    hc.put(base + r * vp + c + 1, a[:, 1], m)
                    hc.put(base + (r + 8) * vp + c, a[:, 2], m)
                    hc.put(base + (r + 8) * vp + c + 1, a[:, 3], m)

                def wfrag(idx):  # sw[idx]: float4 at buffer offset 0
                    return np.stack([buf.f32(4 * idx + s) for s in range(4)], axis=1)

                def kfrag(idx):  # sk[idx]: uint2 at byte offset w_bytes
                    return np.stack([buf.bf16(wb // 4, 4 * idx + s) for s in range(4)], axis=1)

                newU = []
                for w in range(NWARP):
                    wi, cw = w & 3, (w >> 2) * (BV // 2)
                    wfi = wi * KS * 32 + LANES
                    a0 = [np.zeros((32, 4)) for _ in range(NT)]
                    a1 = [np.zeros((32, 4)) for _ in range(NT)]
                    for ks in range(0, KS, 2):
                        mma_row_tiles(a0, wfrag(wfi + ks * 32), hs[cw:], LDH, ks * 8)
                        mma_row_tiles(a1, wfrag(wfi + (ks + 1) * 32), hs[cw:], LDH, (ks + 1) * 8)
                    for nt in range(NT):
                        r = wi * 16 + GQ
                        cl = cw + nt * 8 + 2 * T4
                        c = v0 + cl
                        u = []
                        for e in range(4):
                            rr, ce = r + (e >> 1) * 8, c + (e & 1)
                            u0r = np.where(ce < V, u0[np.minimum(rr * V + ce, C * V - 1)], 0.0)
                            u.append(u0r - (a0[nt][:, e] + a1[nt][:, e]))
                        newU += [(r * LDH + cl, u[0]), (r * LDH + cl + 1, u[1]), ((r + 8) * LDH + cl, u[2]),
                                 ((r + 8) * LDH + cl + 1, u[3])]
                        m = c < vp
                        base = sl * C * vp
                        uc.put(base + r * vp + c, u[0], m)
                        uc.put(base + r * vp + c + 1, u[1], m)
                        uc.put(base + (r + 8) * vp + c, u[2], m)
                        uc.put(base + (r + 8) * vp + c + 1, u[3], m)
                for i, x in newU:  # then the first barrier
                    Us[i] = x
                for w in range(NWARP):
                    wi, cw = w & 3, (w >> 2) * (BV // 2)
                    kfi = wi * MT * CSK * 32 + LANES
                    for mt in range(MT):
                        d0 = buf.f32(wb // 4 + kb // 4 + (wi * MT + mt) * 16 + GQ)
                        d1 = buf.f32(wb // 4 + kb // 4 + (wi * MT + mt) * 16 + GQ + 8)
                        acc = [hacc[w, mt, nt] for nt in range(NT)]
                        for a in acc:
                            a[:, 0] *= d0
                            a[:, 1] *= d0
                            a[:, 2] *= d1
                            a[:, 3] *= d1
                        for ks in range(CSK):
                            mma_row_tiles(acc, kfrag(kfi + (mt * CSK + ks) * 32), Us[cw:], LDH, ks * 8)
                store_h()
            for (w, mt, nt), a in hacc.items():
                wi, cw = w & 3, (w >> 2) * (BV // 2)
                for e in range(4):
                    r = (wi * MT + mt) * 16 + GQ + (e >> 1) * 8
                    c = v0 + cw + nt * 8 + 2 * T4 + (e & 1)
                    m = (r < K) & (c < V)
                    ht.put(n * K * V + np.minimum(r, K - 1) * V + np.minimum(c, V - 1), a[:, e], m)
    # every h_c / U_c element of columns < vp written exactly once
    assert np.all(hc.count[:nslots * KP * vp] == 1) and np.all(uc.count[:nslots * C * vp] == 1)
    # ---- out: grid (chunk slot, head, ceil(vp / 64))
    for sl, ch in enumerate(chunks):
        Lc, tok0 = ch["L"], ch["tok0"]
        for z in range((vp + OUT_BV - 1) // OUT_BV):
            c0 = z * OUT_BV

            def stage(src, base, R):
                dst = np.full(R * LDB, np.nan)
                for i in range(R * (OUT_BV // 4)):
                    r, c4 = i // (OUT_BV // 4), (i % (OUT_BV // 4)) * 4
                    c = c0 + c4
                    if mutate == "stage" and i % 7 == 3:
                        c += 4
                    for j in range(4):
                        dst[r * LDB + c4 + j] = src.x[base + r * vp + c + j] if c < vp else 0.0
                return dst

            hs = stage(hc, sl * KP * vp, KP)
            us = stage(uc, sl * C * vp, C)
            reg = regions[sl]
            for w in range(NWARP):
                wi, cw = w & 3, (w >> 2) * 32
                qfi = wi * KS * 32 + LANES
                afi = wi * CSK * 32 + LANES
                a0 = [np.zeros((32, 4)) for _ in range(4)]
                a1 = [np.zeros((32, 4)) for _ in range(4)]
                for ks in range(KS):
                    f = np.stack([reg.bf16(L["qg"], 4 * (qfi + ks * 32) + s) for s in range(4)], axis=1)
                    mma_row_tiles(a0, f, hs[cw:], LDB, ks * 8)
                for ks in range(CSK):
                    if ks < 2 * wi + 2:
                        f = np.stack([reg.bf16(L["aqk"], 4 * (afi + ks * 32) + s) for s in range(4)], axis=1)
                        mma_row_tiles(a1, f, us[cw:], LDB, ks * 8)
                for nt in range(4):
                    for e in range(4):
                        r = wi * 16 + GQ + (e >> 1) * 8
                        c = c0 + cw + nt * 8 + 2 * T4 + (e & 1)
                        m = (r < Lc) & (c < V)
                        o.put((tok0 + r) * V + np.minimum(c, V - 1), a0[nt][:, e] + a1[nt][:, e], m)
    return o, ht


SHAPES = [  # KP, K, V, sequence lengths
    (128, 128, 128, [200]),        # the benchmark's head shape: 4 scan blocks, 2 output tiles
    (128, 128, 40, [70, 0, 130]),  # varlen with an empty sequence; vp 40: a partial output tile
    (128, 100, 37, [65]),          # K < KP, odd V (vp 40)
    (64, 64, 30, [129]),           # KP 64, vp 32
    (64, 40, 80, [64, 1]),         # 3 scan blocks, 2 output tiles
    (64, 64, 200, [70]),           # 7 scan blocks (the last 8 columns), 4 output tiles (the last 8 columns)
]


@pytest.mark.parametrize("KP,K,V,lens", SHAPES)
def test_split(KP, K, V, lens):
    rng = np.random.default_rng(KP * 1000 + K * 10 + V + 7)
    chunks = make_problem(rng, KP, K, V, lens)
    h0 = rng.standard_normal((len(lens), K, V)) * 0.5
    T_total = sum(lens)
    o, ht = emu_split(chunks, lens, h0, KP, K, V, T_total)
    o_ref, ht_ref = reference(chunks, lens, h0, K, V)
    o_full = np.zeros((T_total, V))
    for t, row in o_ref.items():
        o_full[t] = row
    assert np.all(o.count == 1), "every output element written exactly once"
    assert np.all(ht.count == 1)
    np.testing.assert_allclose(o.x.reshape(T_total, V), o_full, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ht.x.reshape(len(lens), K, V), ht_ref, rtol=1e-9, atol=1e-9)


def test_smem_and_banks():
    """Scan4Smem<128>::bytes as ptxas sees the launch (130,064 B: one block per SM), OutSmem<128> 55,296 B (four
    per SM within 228 KB); the B-fragment reads of both kernels hit 32 distinct banks."""
    assert scan4_smem(128)[4] == 130064 and scan4_smem(64)[4] <= 227 * 1024
    out128 = 4 * 128 * LDB + 4 * C * LDB
    assert out128 == 55296 and 4 * (out128 + 1024) <= 228 * 1024
    for ld, cws in ((LDH, (0, 16)), (LDB, (0, 32))):
        for cw in cws:
            assert len(set((((T4 * ld) + cw + GQ) % 32).tolist())) == 32


def test_emulator_sees_index_mutations():
    rng = np.random.default_rng(5)
    KP, K, V, lens = 128, 128, 64, [100]
    chunks = make_problem(rng, KP, K, V, lens)
    h0 = rng.standard_normal((1, K, V)) * 0.5
    o, _ = emu_split(chunks, lens, h0, KP, K, V, 100, mutate="stage")
    o_ref, _ = reference(chunks, lens, h0, K, V)
    o_full = np.stack([o_ref[t] for t in range(100)])
    assert not np.allclose(np.nan_to_num(o.x.reshape(100, V)), o_full, atol=1e-6)
