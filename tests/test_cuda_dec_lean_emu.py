"""CPU emulation of the index math that is new in the LEAN decode kernels (KDA_CUDA_DEC_LEAN=1,
delta_decode_kernel<..., LEAN = true> in kernels_src/cuda/delta_recurrent_fwd.cuh), for every configuration
(dec_cw / dec_wk: 4 per state layout and storage width):

- dec_rs_sum: the recursive-halving reduce-scatter of o's partial sums over the LK lanes that share a lane's columns
  (xor masks 1 .. LK/2 for V-first, LV .. 16 for K-first; each round a lane keeps the upper half of its values when
  its mask bit is set and adds its partner's copy of that half; once one value is left the remaining rounds add
  plainly). Checks: every lane ends with FC = max(1, TC / LK) values, the whole-group sums of columns own .. own +
  FC - 1 of its own column slice, and the lanes together cover all CW columns of the item (the o stores of warp 0).
  The same emulation with the keep/send halves swapped fails (the checks can fail).
- the gate exchange: a warp's RW = 128 / WK rows, RW / 32 gate exps per lane, and each lane's TR rows kg * TR ..
  kg * TR + TR - 1 lie inside the warp's rows (4-aligned for the LDS.128 reads when TR % 4 == 0).
- the 32-bit item decode (item -> slice, value head, sequence with a compile-time slice count) against the 64-bit one.
Runs without a GPU; the CUDA code itself is tested by tests/test_cuda_backend.py (test_decode_lean_vs_default and the
_l1 variants of the decode tests).
"""
import random

import pytest

CFGS = {  # (V-first, state element size) -> [(CW, WK)] for cfg 0..3, as dec_cw / dec_wk
    (False, 4): [(8, 1), (16, 2), (32, 4), (8, 4)],
    (False, 2): [(16, 1), (32, 2), (64, 4), (16, 4)],
    (True, 4): [(8, 1), (16, 2), (32, 4), (4, 4)],
    (True, 2): [(16, 1), (16, 2), (32, 2), (4, 2)],
}
CASES = [(vf, es, cw, wk) for (vf, es), lst in CFGS.items() for cw, wk in lst]


def geo(vf, esize, cw, wk):
    """DecGeo<VF, S, CW, WK, 128>: LK, LV, TR, TC, RW."""
    e = 16 // esize
    rw = 128 // wk
    lk = rw // e if vf else 32 // (cw // e)
    lv = 32 // lk
    tr = e if vf else rw // lk
    tc = cw // lv if vf else e
    assert lk * lv == 32 and tr * lk == rw and tc * lv == cw
    return lk, lv, tr, tc, rw


def lane_k(vf, lk, lv, lane):
    return lane % lk if vf else lane // lv


def lane_v(vf, lk, lv, lane):
    return lane // lk if vf else lane % lv


def rs_sum(vf, lv, lk, tc, x, swap=False):
    """dec_rs_sum over all 32 lanes at once; x[lane][j]. Returns (values, own, count)."""
    x = [list(r) for r in x]
    own = [0] * 32
    cnt, r = tc, 0
    while (1 << r) < lk:
        m = (1 << r) if vf else (lv << r)
        if cnt > 1:
            half = cnt // 2
            sent = []
            for lane in range(32):
                b = ((lane & m) != 0) != swap
                sent.append([x[lane][j] if b else x[lane][j + half] for j in range(half)])
            new = []
            for lane in range(32):
                b = ((lane & m) != 0) != swap
                keep = [x[lane][j + half] if b else x[lane][j] for j in range(half)]
                new.append([keep[j] + sent[lane ^ m][j] for j in range(half)])
                own[lane] += half if (lane & m) != 0 else 0
            x, cnt = new, half
        else:
            x = [[x[lane][0] + x[lane ^ m][0]] for lane in range(32)]
        r += 1
    return x, own, cnt


def check_rs(vf, esize, cw, wk, swap=False):
    lk, lv, tr, tc, rw = geo(vf, esize, cw, wk)
    rnd = random.Random(cw * 131 + wk * 7 + esize + vf)
    x = [[rnd.randint(0, 10 ** 6) for _ in range(tc)] for _ in range(32)]
    y, own, cnt = rs_sum(vf, lv, lk, tc, x, swap)
    fc = tc // lk if tc >= lk else 1
    assert cnt == fc
    covered = set()
    for lane in range(32):
        vg = lane_v(vf, lk, lv, lane)
        for t in range(fc):
            j = own[lane] + t
            assert 0 <= j < tc
            want = sum(x[m][j] for m in range(32) if lane_v(vf, lk, lv, m) == vg)
            assert y[lane][t] == want, f"lane {lane} column {vg * tc + j}"
            covered.add(vg * tc + j)
    assert covered == set(range(cw))


@pytest.mark.parametrize("vf,esize,cw,wk", CASES)
def test_rs_sum(vf, esize, cw, wk):
    check_rs(vf, esize, cw, wk)


@pytest.mark.parametrize("vf,esize,cw,wk", [c for c in CASES if geo(*c)[3] > 1])
def test_rs_sum_can_fail(vf, esize, cw, wk):
    with pytest.raises(AssertionError):
        check_rs(vf, esize, cw, wk, swap=True)


@pytest.mark.parametrize("vf,esize,cw,wk", CASES)
def test_gate_rows(vf, esize, cw, wk):
    lk, lv, tr, tc, rw = geo(vf, esize, cw, wk)
    gpl = rw // 32
    assert gpl in (1, 2, 4) and gpl * 32 == rw
    written = sorted(lane * gpl + t for lane in range(32) for t in range(gpl))
    assert written == list(range(rw))  # every row's exp written once
    for lane in range(32):
        kg = lane_k(vf, lk, lv, lane)
        assert kg * tr + tr <= rw  # the lane's rows inside the warp's rows
        if tr % 4 == 0:  # read with LDS.128 (16-byte aligned); TR = 2 (K-first cfg 3) reads scalars
            assert kg * tr % 4 == 0


@pytest.mark.parametrize("cw", [4, 8, 16, 32, 64])
@pytest.mark.parametrize("hv", [1, 4, 6, 32, 48])
def test_item_decode(cw, hv):
    sl_count = 128 // cw
    n_seq = 37
    total = n_seq * hv * sl_count
    for item in list(range(0, total, max(1, total // 997))) + [total - 1]:
        # 64-bit form (the default kernel): % slices, / slices, % HV, / HV
        sl, nh = item % sl_count, item // sl_count
        hv64, n64 = nh % hv, nh // hv
        # 32-bit form (LEAN): compile-time slice count, n = nh / HV, hv = nh - n * HV
        it32 = item & 0xFFFFFFFF
        nh32 = it32 // sl_count
        n32 = nh32 // hv
        assert (it32 % sl_count, n32, nh32 - n32 * hv) == (sl, n64, hv64)
