"""CPU emulation of the lane -> element mapping of delta_decode_kf16_kernel (KDA_CUDA_DEC_KF16=1|2,
kernels_src/cuda/delta_decode_kf16.cuh): K-first 2-byte state pools, K = V = 128, one token per sequence.

Emulated per block (a (sequence, value head) pair's column half: 128 rows x 64 columns, 4 warps):
- the cooperative copy: thread (warp w, lane l), copy j moves global row 32 w + 4 j + l / 8, 16-byte column group
  l % 8 into tile slot [row][cg ^ 2 (j / 2)]; checks: every (row, group) of the block copied exactly once, each
  warp-wide copy covers 4 whole 128-byte rows, and 2 (j / 2) equals kf16_sw(row) = ((row >> 3) << 1) & 7;
- the compute mapping: lane = 2 kg + vg of warp w holds rows 8 kg + c (c = 0..7), columns 8 (2 w + vg) .. + 7,
  read from slot [8 kg + c][(2 w + vg) ^ kf16_sw(8 kg)]: checks it reads back exactly the global chunk, and that the
  8 lanes of every quarter warp hit 8 different 16-byte bank groups (conflict-free LDS.128);
- the math of one warp with its shuffles: p over the 16 kg lanes (xor 2, 4, 8, 16; KF16=3/4: reduce-scattered, then
  gathered through psum[warp][8 vg + own]), the update, o by dec_rs_sum over
  xor 2, 4, 8, 16 and the o store of lanes 0..15 at column 16 w + 8 vg + own; the whole pool row and o against a
  float64 reference of one step of the delta rule (DESIGN.md section 1), every column written exactly once;
- the whole-row stores of KF16=2 (the copy's mapping read back from the tile) cover the block exactly once.
Each deliberate mutation of the mapping (listed in MUTATIONS) must make a check fail.
Runs without a GPU; the CUDA kernel itself is tested by tests/test_cuda_backend.py::test_decode_kf16*.
"""
import pytest
import torch

K = V = 128


def kf16_sw(r):
    return ((r >> 3) << 1) & 7


def copy_map(warp, lane, j, mut=None):
    """(global row, global 16-byte group within the block, tile row, tile slot) of copy j of a thread."""
    row = 32 * warp + 4 * j + (lane >> 3)
    ccg = lane & 7
    sw = 2 * (j >> 1)
    if mut == "copy_swizzle":
        sw = j & 7
    if mut == "copy_rows":
        row = 32 * warp + j + 8 * (lane >> 3)
    return row, ccg, row, ccg ^ sw


def compute_map(warp, lane, c, mut=None):
    """(global row, group within the block, tile row, tile slot) of chunk c of a lane in the compute mapping."""
    kg, vg = lane >> 1, lane & 1
    cg = 2 * warp + vg if mut != "cg_order" else warp + 4 * vg
    row = 8 * kg + c
    sw = kf16_sw(8 * kg) if mut != "no_swizzle" else 0
    return row, cg, row, cg ^ sw


def rs_sum16(ov, mut=None):
    """dec_rs_sum<false, LV=2, LK=16, TC=8> over the 32 lanes: (values, own); lanes l and l ^ 16 agree."""
    own = [0] * 32
    cnt = 8
    for m in [2, 4, 8, 16]:
        if cnt > 1:
            hf = cnt // 2
            new = []
            for lane in range(32):
                b = (lane & m) != 0
                p = lane ^ m
                pb = (p & m) != 0
                vals = []
                for j in range(hf):
                    keep = ov[lane][j + hf] if b else ov[lane][j]
                    # the partner sends the half this lane keeps
                    send = ov[p][j] if pb else ov[p][j + hf]
                    if mut == "rs_swap":
                        send = ov[p][j + hf] if pb else ov[p][j]
                    vals.append(keep + send)
                new.append(vals)
            for lane in range(32):
                own[lane] += hf if (lane & m) else 0
            ov = new
            cnt = hf
        else:
            ov = [[ov[lane][0] + ov[lane ^ m][0]] for lane in range(32)]
    return ov, own


def emulate_block(S, q, k, g, v, beta, half, mut=None, prs=False):
    """One block: S [K, V] float64 state of the head; returns (new state cols of this half, o of this half)."""
    # copy into the tile
    tile = {}
    for w in range(4):
        for lane in range(32):
            for j in range(8):
                row, ccg, trow, slot = copy_map(w, lane, j, mut)
                assert (trow, slot) not in tile, "tile slot written twice"
                c0 = 64 * half + 8 * ccg
                tile[(trow, slot)] = S[row, c0:c0 + 8].clone()
    assert len(tile) == 128 * 8
    d = torch.exp(g)
    newS = torch.full((K, 64), float("nan"), dtype=torch.float64)
    o = torch.full((64,), float("nan"), dtype=torch.float64)
    for w in range(4):
        # per lane registers
        x = [[None] * 8 for _ in range(32)]
        for lane in range(32):
            for c in range(8):
                row, cg, trow, slot = compute_map(w, lane, c, mut)
                x[lane][c] = tile[(trow, slot)]
        pr = []
        for lane in range(32):
            kg = lane >> 1
            acc = torch.zeros(8, dtype=torch.float64)
            for c in range(8):
                r = 8 * kg + c
                acc = acc + x[lane][c] * (k[r] * d[r])
            pr.append(acc)
        if prs:  # KF16=3/4: reduce-scatter, lanes 0..15 write psum[8 vg + own], every lane reads psum[8 vg ..]
            vals, pown = rs_sum16([list(x) for x in pr], mut)
            psum = [None] * 16
            for lane in range(16):
                vg = lane & 1
                slot = 8 * vg + pown[lane] if mut != "prs_slot" else 8 * vg + (lane >> 1)
                assert psum[slot] is None or psum[slot] == vals[lane][0]
                psum[slot] = vals[lane][0]
            pr = [torch.stack([psum[8 * (lane & 1) + j] for j in range(8)]) for lane in range(32)]
        else:
            masks = [2, 4, 8, 16] if mut != "p_masks" else [1, 2, 4, 8]
            for m in masks:  # butterfly all-reduce
                pr = [pr[lane] + pr[lane ^ m] for lane in range(32)]
        ov = []
        for lane in range(32):
            kg, vg = lane >> 1, lane & 1
            cg = 2 * w + vg
            col = 64 * half + 8 * cg
            dl = beta * (v[col:col + 8] - pr[lane])
            acc = torch.zeros(8, dtype=torch.float64)
            for c in range(8):
                r = 8 * kg + c
                xn = x[lane][c] * d[r] + k[r] * dl
                row, cgm, _, _ = compute_map(w, lane, c, mut)
                newS[row, 8 * cgm:8 * cgm + 8] = xn
                acc = acc + xn * q[r]
            ov.append(list(acc))
        ov, own = rs_sum16(ov, mut)
        written = set()
        for lane in range(16 if mut != "o_lanes" else 8):
            vg = lane & 1
            col = 16 * w + 8 * vg + own[lane]
            if col in written:
                assert o[col] == ov[lane][0]
            written.add(col)
            o[col] = ov[lane][0]
    return newS, o


def reference(S, q, k, g, v, beta):
    d = torch.exp(g)
    Sd = S * d[:, None]
    p = Sd.t() @ k
    Sn = Sd + torch.outer(k, beta * (v - p))
    return Sn, Sn.t() @ q


def check_maps(mut=None):
    # copy: each warp-wide copy covers 4 whole rows of the block's 128 contiguous bytes; swizzle is kf16_sw
    for w in range(4):
        for j in range(8):
            rows = {}
            for lane in range(32):
                row, ccg, trow, slot = copy_map(w, lane, j, mut)
                rows.setdefault(row, set()).add(ccg)
                assert slot == ccg ^ kf16_sw(trow), "copy swizzle differs from kf16_sw"
            assert len(rows) == 4 and all(s == set(range(8)) for s in rows.values()), "copy not whole rows"
    # compute: conflict-free quarter warps, reads the right chunk
    for w in range(4):
        for c in range(8):
            for qw in range(4):
                slots = {compute_map(w, lane, c, mut)[3] for lane in range(8 * qw, 8 * qw + 8)}
                assert len(slots) == 8, "bank conflict in a quarter warp"
            for lane in range(32):
                row, cg, trow, slot = compute_map(w, lane, c, mut)
                assert slot == cg ^ kf16_sw(trow)
    # compute mapping covers the block once
    seen = set()
    for w in range(4):
        for lane in range(32):
            for c in range(8):
                row, cg, _, _ = compute_map(w, lane, c, mut)
                assert (row, cg) not in seen
                seen.add((row, cg))
    assert len(seen) == 128 * 8


def run_all(mut=None, seed=0, prs=False):
    check_maps(mut)
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(K, V, generator=gen, dtype=torch.float64) * 0.5
    q = torch.randn(K, generator=gen, dtype=torch.float64) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(K, generator=gen, dtype=torch.float64), dim=0)
    g = -torch.rand(K, generator=gen, dtype=torch.float64) * 0.5
    v = torch.randn(V, generator=gen, dtype=torch.float64)
    beta = 0.7
    Sn, o = reference(S, q, k, g, v, beta)
    for half in (0, 1):
        newS, oh = emulate_block(S, q, k, g, v, beta, half, mut, prs)
        assert not torch.isnan(newS).any() and not torch.isnan(oh).any(), "element not written"
        torch.testing.assert_close(newS, Sn[:, 64 * half:64 * half + 64], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(oh, o[64 * half:64 * half + 64], rtol=1e-12, atol=1e-12)
    # KF16=2 whole-row stores: the copy mapping read back covers the block exactly once
    stored = set()
    for w in range(4):
        for lane in range(32):
            for j in range(8):
                row, ccg, trow, slot = copy_map(w, lane, j, mut)
                assert (row, ccg) not in stored
                stored.add((row, ccg))
    assert len(stored) == 128 * 8


def kernel_offsets(n, hv, half, warp, lane, HV, in_row, out_row, mut=None):
    """The kernel's global element offsets (pool [P, HV, K, V] flattened; o [N, 1, HV, V]) for one thread, written as
    in delta_decode_kf16_kernel: copy sources, KF16=1 chunk stores, KF16=2 row stores, the o column."""
    head_elems, row_elems = K * V, K * V * HV
    crow, ccg = 32 * warp + (lane >> 3), lane & 7
    coff = hv * head_elems + crow * V + 64 * half + 8 * ccg
    src = [in_row * row_elems + coff + 4 * j * V for j in range(8)]
    kg, vg = lane >> 1, lane & 1
    cg = 2 * warp + vg
    row0, col0 = 8 * kg, 64 * half + 8 * cg
    dst = out_row * row_elems + hv * head_elems
    dl = [dst + row0 * V + col0 + c * V for c in range(8)]
    d = (dst if mut == "cst_double_head" else out_row * row_elems) + coff
    cst = [d + 4 * j * V for j in range(8)]
    o_base = (n * HV + hv) * V + 64 * half + 16 * warp
    return src, dl, cst, o_base


def check_offsets(mut=None):
    HV, P = 3, 5
    pool = torch.arange(P * HV * K * V, dtype=torch.int64).view(P, HV, K, V)
    flat = pool.view(-1)
    for n, hv, in_row, out_row in ((0, 0, 2, 2), (1, 2, 4, 1), (3, 1, 0, 3)):
        for half in (0, 1):
            for warp in range(4):
                for lane in range(32):
                    src, dl, cst, o_base = kernel_offsets(n, hv, half, warp, lane, HV, in_row, out_row, mut)
                    for j in range(8):
                        row, ccg, _, _ = copy_map(warp, lane, j)
                        c0 = 64 * half + 8 * ccg
                        assert flat[src[j]] == pool[in_row, hv, row, c0], "copy source"
                        assert flat[cst[j]] == pool[out_row, hv, row, c0], "KF16=2 row store"
                    for c in range(8):
                        row, cg, _, _ = compute_map(warp, lane, c)
                        assert flat[dl[c]] == pool[out_row, hv, row, 64 * half + 8 * cg], "KF16=1 chunk store"
                    assert o_base == (n * HV + hv) * V + 64 * half + 16 * warp


def test_kf16_offsets():
    check_offsets()
    with pytest.raises(AssertionError):
        check_offsets("cst_double_head")


@pytest.mark.parametrize("prs", [False, True], ids=["butterfly_p", "rs_p"])
def test_kf16_mapping(prs):
    run_all(prs=prs)
    run_all(seed=3, prs=prs)


MUTATIONS = ["copy_swizzle", "copy_rows", "cg_order", "no_swizzle", "p_masks", "rs_swap", "o_lanes"]


@pytest.mark.parametrize("mut", MUTATIONS)
def test_kf16_mutation_fails(mut):
    with pytest.raises(AssertionError):
        run_all(mut)


@pytest.mark.parametrize("mut", ["prs_slot", "rs_swap"])
def test_kf16_prs_mutation_fails(mut):
    with pytest.raises(AssertionError):
        run_all(mut, prs=True)
