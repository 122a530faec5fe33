"""CPU emulation of the shared-memory layout of the BULK decode kernels (KDA_CUDA_DEC_LEAN=3,
delta_decode_kernel<..., BULK = true>, kernels_src/cuda/delta_recurrent_fwd.cuh): the bulk copies place a warp's share
of the state tile in shared memory in its global layout (K-first rows padded by BPAD bytes after each lane group's TR
rows); each lane must read back, chunk by chunk, exactly the 16 bytes that LEAN's cp.async path gives it (chunk_off),
the copies must tile the warp's region without overlap and stay inside it, and a quarter-warp's 16-byte reads must
fall into distinct banks. Pure index math (no GPU)."""
import pytest

KMAX = 128


def geo(vf, esize, cw, wk):
    e = 16 // esize
    rw = KMAX // wk
    lk = rw // e if vf else 32 // (cw // e)
    lv = 32 // lk
    tr = e if vf else rw // lk
    tc = cw // lv if vf else e
    return dict(E=e, RW=rw, LK=lk, LV=lv, TR=tr, TC=tc, NCH=tc if vf else tr)


# dec_bulk_ok: K-first fp32 cfg 2, K-first 2-byte cfg 1, V-first fp32 cfg 0 (VF, state bytes, CW, WK)
CASES = [(False, 4, 32, 4), (False, 2, 32, 2), (True, 4, 8, 1)]


@pytest.mark.parametrize("vf,esize,cw,wk", CASES)
def test_bulk_layout(vf, esize, cw, wk):
    g = geo(vf, esize, cw, wk)
    E, RW, LK, LV, TR, TC, NCH = (g[x] for x in ("E", "RW", "LK", "LV", "TR", "TC", "NCH"))
    RB = cw * esize
    BPAD = 0 if vf else ((RB - TR * RB) % 128 + 128) % 128
    assert (LK * BPAD) % (NCH * 16) == 0
    SPAD = (LK * BPAD) // (NCH * 16) + 1
    region = NCH * (32 + SPAD) * 16
    WBYTES = cw * 128 * esize if vf else RW * RB
    assert WBYTES == 4096 and WBYTES + LK * BPAD + 16 <= region
    V = K = KMAX
    for sl in range(KMAX // cw):
        for wk_ in range(wk):
            # the copies: smem byte -> global byte offset within the head's state (elements * esize)
            smem = {}
            if vf:
                src0 = sl * cw * K * esize
                for b in range(WBYTES):
                    smem[b] = src0 + b
            else:
                for r in range(RW):
                    dst = r * RB + (r // TR) * BPAD
                    src = ((wk_ * RW + r) * V + sl * cw) * esize
                    for b in range(RB):
                        assert dst + b not in smem
                        smem[dst + b] = src + b
            assert max(smem) < region - 16  # the mbarrier's 16 bytes stay free
            for c in range(NCH):
                banks = {}
                for lane in range(32):
                    kg, vg = (lane % LK, lane // LK) if vf else (lane // LV, lane % LV)
                    row0 = wk_ * RW + kg * TR
                    col0 = sl * cw + vg * TC
                    want = ((col0 + c) * K + row0) if vf else ((row0 + c) * V + col0)
                    off = (vg * TC + c) * (RW * esize) + kg * 16 if vf else (kg * TR + c) * RB + kg * BPAD + vg * 16
                    assert off % 16 == 0
                    for b in range(16):
                        assert smem[off + b] == want * esize + b
                    banks.setdefault(lane // 8, []).append(off)
                for q, offs in banks.items():  # one quarter-warp's 16-byte reads: 8 x 4 distinct banks
                    bs = [((o // 4) + i) % 32 for o in offs for i in range(4)]
                    assert len(set(bs)) == 32, (vf, esize, c, q)
