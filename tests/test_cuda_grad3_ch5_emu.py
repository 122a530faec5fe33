"""CPU emulation of what grad3_ch2's F5 instance (KDA_CUDA_CHUNK_BWD_CH=5, kernels_src/cuda/
delta_chunk_bwd_grad3_ch2.cuh) changes against the default instance, in numpy:
  - the 16 rows' dRg . k sums over the 32 lanes: warp_sum per row (xor butterfly, m = 16 .. 1; lane 0 writes) against
    F5's transposed butterfly (at level m each lane keeps the rows of its lane bit m and adds its partner's partial
    sums of them; even lanes write row 8 b4 + 4 b3 + 2 b2 + b1): bit for bit equal in float32, every row written once;
  - the dA copy's (shared destination, global source) pairs per thread and step: F5's compile-time offsets against
    the default's divmod formula.
No GPU needed. The GPU test (tests/test_cuda_grad3_ch5.py) checks the whole backward bit for bit.
"""
import numpy as np
import pytest

SB, CH, BLK = 16, 64, 10


def warp_sum_rows(pr):
    """pr [32 lanes, 16 rows] float32 -> the value lane 0 writes per row (warp_sum: x += shfl_xor(x, m))."""
    x = pr.copy()
    lanes = np.arange(32)
    for m in (16, 8, 4, 2, 1):
        x = (x + x[lanes ^ m]).astype(np.float32)
    return x[0]


def transposed_rows(pr, row_of=None):
    """F5's transposed butterfly; returns (dbp [16], times each row was written)."""
    lanes = np.arange(32)
    v = [pr[:, r].copy() for r in range(SB)]  # v[j][lane]
    n = SB // 2
    while n >= 1:
        m = 2 * n
        up = (lanes & m) != 0
        nv = []
        for j in range(n):
            send = np.where(up, v[j], v[j + n])
            keep = np.where(up, v[j + n], v[j])
            nv.append((keep + send[lanes ^ m]).astype(np.float32))
        v = nv
        n //= 2
    db = (v[0] + v[0][lanes ^ 1]).astype(np.float32)
    if row_of is None:
        def row_of(l):
            return ((l >> 4) & 1) * 8 + ((l >> 3) & 1) * 4 + ((l >> 2) & 1) * 2 + ((l >> 1) & 1)
    out = np.full(SB, np.nan, dtype=np.float32)
    count = np.zeros(SB, dtype=int)
    for lane in range(0, 32, 2):
        out[row_of(lane)] = db[lane]
        count[row_of(lane)] += 1
    return out, count


def _inputs(seed):
    rng = np.random.default_rng(seed)
    # products dRg * k over many magnitudes (e^g from 1 down to ~1e-30, gradients of either sign), some exact zeros
    pr = (rng.standard_normal((32, SB)) * 10.0 ** rng.uniform(-30, 3, (32, SB))).astype(np.float32)
    pr[rng.random((32, SB)) < 0.1] = 0.0
    return pr


@pytest.mark.parametrize("seed", range(20))
def test_transposed_butterfly_is_warp_sum(seed):
    pr = _inputs(seed)
    ref = warp_sum_rows(pr)
    got, count = transposed_rows(pr)
    assert (count == 1).all()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), np.nonzero(ref != got)


def test_emulation_catches_a_wrong_row_map():
    # the check can fail: a row map with bits 1 and 2 swapped writes the sums to the wrong rows
    pr = _inputs(1)
    ref = warp_sum_rows(pr)

    def swapped(l):
        return ((l >> 4) & 1) * 8 + ((l >> 3) & 1) * 4 + ((l >> 1) & 1) * 2 + ((l >> 2) & 1)
    got, count = transposed_rows(pr, swapped)
    assert (count == 1).all() and not np.array_equal(ref, got)


def test_sequential_order_would_differ():
    # and a plain sequential sum over the lanes (another order) is not bit for bit warp_sum on these inputs: the
    # equality above is a statement about the order, not a property of any order
    pr = _inputs(2)
    ref = warp_sum_rows(pr)
    seq = np.zeros(SB, dtype=np.float32)
    for lane in range(32):
        seq = (seq + pr[lane]).astype(np.float32)
    assert not np.array_equal(ref, seq)


def _src_off(blk):
    B = int(blk >= 1) + int(blk >= 3) + int(blk >= 6)
    return SB * B * CH + SB * (blk - B * (B + 1) // 2)


def test_dA_copy_offsets():
    for tid in range(128):
        for n in range(10):
            # default: i = tid + 128 n -> (m, blk, r, q4); dst float index in S.dA[2][10][16][16], src (matrix, index)
            i = tid + n * 128
            q4, r, blk, m = i & 3, (i >> 2) & 15, (i >> 6) % BLK, i // (64 * BLK)
            B = int(blk >= 1) + int(blk >= 3) + int(blk >= 6)
            b = blk - B * (B + 1) // 2
            dst = ((m * BLK + blk) * SB + r) * SB + 4 * q4
            src = (m, (SB * B + r) * CH + SB * b + 4 * q4)
            # F5
            q4f, rf, hi = tid & 3, (tid >> 2) & 15, tid >> 6
            dstf = rf * SB + 4 * q4f + hi * SB * SB + 2 * n * SB * SB
            o0, o1 = _src_off((2 * n) % BLK), _src_off((2 * n + 1) % BLK)
            srcf = (int(2 * n >= BLK), rf * CH + 4 * q4f + o0 + hi * (o1 - o0))
            assert (dst, src) == (dstf, srcf), (tid, n)
