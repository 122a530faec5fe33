"""CPU emulation of what the FAST instance of the KDA forward prep (kda_chunk_prep2_kernel<..., FAST = true>,
KDA_CUDA_KDA_PREP=6; kernels_src/cuda/kda_chunk_prep2.cuh) changes against the default (=3): it must hand the tensor
cores the same tf32 operands in the same order, so that every output is bit-identical.

- to_tf32_fast ((bits + 0x1000) & 0xffffe000, gdn_chunk_prep2.cuh) against round-to-nearest-ties-away to tf32 (the
  PTX semantics of cvt.rna.tf32.f32, which mma8<false> uses) for every mantissa of 20 exponents (subnormal, the
  smallest normals, around 1, the overflow edge, infinities) with both signs, and 2^22 random bit patterns; and
  against the form ptxas gives cvt.rna on sm_90 (bits + 0x1000 unless |x| is inf / NaN, the mma ignoring the 13
  low bits). NaN inputs are outside the claim (to_tf32_fast may turn a NaN into an infinity or -0).
- S5: the default's prep_w_u0 (one 8-column job at a time, T's A fragments by scalar loads, cvt.rna per use) and
  FAST's prep2_w_u0_x (jobs in pairs, T rounded in place by prep2_round_t and read by ldmatrix.x4, B by
  to_tf32_fast) issue, for every output tile (job, row block), the same sequence of mma operands (per lane, bit for
  bit) -- so the same accumulation order -- for KP 64 / 128 and V 8 .. 256 (several 128-column passes, an odd
  last u0 job); and every w / u0 element is stored once with the same accumulator value.
Runs without a GPU; it does not test the CUDA code itself (tests/test_cuda_kda_prep_fast.py does).
"""
import numpy as np
import pytest

from test_cuda_gdn_prep2_emu import ldsm_x4, to_tf32_fast

C, SUB, LDA, VB, WARPS = 64, 16, 68, 128, 8


def rna_tf32_bits(x):
    """Round-to-nearest, ties away from zero, of float32 values to tf32 (10 stored mantissa bits, fp32's exponent
    range with subnormals), vectorized in float64 (exact: 24-bit values, power-of-two scalings). Returns uint32
    bits. NaN inputs are not handled (excluded by the callers)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    fin = np.isfinite(a) & (a > 0)
    _, E = np.frexp(np.where(fin, a, 1.0))
    e = np.maximum(E - 1, -126)  # subnormals: the smallest normal binade's spacing
    ulp = np.ldexp(1.0, e - 10)
    lo = np.floor(a / np.where(fin, ulp, 1.0)) * ulp
    hi = lo + ulp
    with np.errstate(invalid="ignore"):  # (inf lanes, replaced below)
        r = np.where(a - lo >= hi - a, hi, lo)
    r = np.where(fin, r, a)
    with np.errstate(over="ignore"):
        out = np.copysign(r, x.astype(np.float64)).astype(np.float32)  # >= 2^128 -> inf
    return out.view(np.uint32)


def cvt_rna_sass_bits(x):
    """cvt.rna.tf32.f32 as ptxas emits it on sm_90a (the SASS of kda_chunk_prep2_kernel: FSETP.GEU |x|, +INF;
    @!P IADD x, 0x1000) followed by the mma's use of bits 31..13 only."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    special = ~np.isfinite(np.asarray(x, np.float32))
    return (np.where(special, b, b + 0x1000) & 0xFFFFE000).astype(np.uint32)


def fast_bits(x):
    return to_tf32_fast(np.asarray(x, np.float32)).view(np.uint32)


EXPONENTS = [0, 1, 2, 3, 10, 100, 112, 113, 126, 127, 128, 129, 150, 200, 250, 252, 253, 254]


@pytest.mark.parametrize("sign", [0, 1])
def test_to_tf32_fast_every_mantissa(sign):
    """Every one of the 2^23 mantissas of 18 exponents (biased 0 = subnormals, 254 = the largest binade, where the
    rounding overflows to inf), plus +-0 and +-inf: to_tf32_fast = rna = cvt.rna's SASS form."""
    m = np.arange(1 << 23, dtype=np.uint64)
    for e in EXPONENTS:
        bits = ((sign << 31) | (e << 23) | m).astype(np.uint32)
        x = bits.view(np.float32)
        got = fast_bits(x)
        assert np.array_equal(got, rna_tf32_bits(x)), f"exponent {e}, sign {sign}"
        assert np.array_equal(got, cvt_rna_sass_bits(x)), f"exponent {e}, sign {sign}"
    x = np.array([0.0, np.inf], np.float32) * (-1.0 if sign else 1.0)
    assert np.array_equal(fast_bits(x), rna_tf32_bits(x)) and np.array_equal(fast_bits(x), cvt_rna_sass_bits(x))


def test_to_tf32_fast_random_bit_patterns():
    """2^22 random non-NaN bit patterns over the whole range."""
    rng = np.random.default_rng(13)
    bits = rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    got = fast_bits(x)
    assert np.array_equal(got, rna_tf32_bits(x))
    assert np.array_equal(got, cvt_rna_sass_bits(x))


def test_to_tf32_fast_nan_is_outside_the_claim():
    """The documented limit: a NaN need not stay NaN (the canonical 0x7fffffff, what a NaN product gives, becomes
    -0), where cvt.rna keeps it NaN. Bit-identity of =6 and =3 is claimed for inputs without NaN."""
    x = np.array([0x7FFFFFFF], np.uint32).view(np.float32)
    assert fast_bits(x)[0] == 0x80000000
    assert np.isnan(cvt_rna_sass_bits(x).view(np.float32)).all()


def jobs_of(V, KP):
    """(v0, nw, njob) per 128-column pass of v (prep_w_u0 / prep2_w_u0_x): w's KP / 8 jobs in the first pass."""
    out = []
    for v0 in range(0, V, VB):
        ntv = (min(V - v0, VB) + 7) // 8
        nw = KP // 8 if v0 == 0 else 0
        out.append((v0, nw, nw + ntv))
    return out


def b_value(X, Vs, isw, t, c):
    return X[t, c] if isw else Vs[t, c]


def default_s5(T, X, Vm, KP):
    """prep_w_u0 (gdn_chunk_prep.cuh): {(pass, job, a): [per mma: (A bits [32, 4], B bits [32, 2])]}, and the
    stores {(kind, index): (tile key, lane, register)}."""
    seqs, stores = {}, {}
    V = Vm.shape[1]
    for v0, nw, njob in jobs_of(V, KP):
        Vs = np.zeros((C, VB), np.float32)
        Vs[:, :min(V - v0, VB)] = Vm[:, v0:v0 + VB]
        for warp in range(WARPS):
            for job in range(warp, njob, WARPS):
                isw = job < nw
                n0 = (job if isw else job - nw) * 8
                for a in range(4):
                    seq = []
                    for s in range(2 * a + 2):
                        A = np.zeros((32, 4), np.uint32)
                        B = np.zeros((32, 2), np.uint32)
                        for lane in range(32):
                            gq, t4 = lane >> 2, lane & 3
                            r = a * SUB + gq
                            A[lane] = cvt_rna_sass_bits(np.array([T[r, s * 8 + t4], T[r + 8, s * 8 + t4],
                                                                  T[r, s * 8 + t4 + 4], T[r + 8, s * 8 + t4 + 4]],
                                                                 np.float32))
                            B[lane] = cvt_rna_sass_bits(np.array(
                                [b_value(X, Vs, isw, s * 8 + t4 + 4 * hh, n0 + gq) for hh in range(2)], np.float32))
                        seq.append((A, B))
                    key = (v0, job, a)
                    seqs[key] = seq
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3
                        for e in range(4):
                            if isw:
                                stores[("w", a, job, lane, e)] = (key, lane, e)  # via acc_to_afrag: same in both
                            else:
                                r, c = a * SUB + gq + (e >> 1) * 8, v0 + n0 + 2 * t4 + (e & 1)
                                if c < V:
                                    assert ("u", r, c) not in stores
                                    stores[("u", r, c)] = (key, lane, e)
    return seqs, stores


def round_t(T):
    """prep2_round_t: T's blocks (row block a, columns < 16 (a + 1)) to tf32 in place, groups of 4 columns."""
    Ts = np.zeros((C, LDA), np.float32)
    Ts[:, :C] = T
    for i in range(C * (C // 4)):
        r, c = i // (C // 4), (i % (C // 4)) * 4
        if c < (r // SUB + 1) * SUB:
            Ts[r, c:c + 4] = fast_bits(Ts[r, c:c + 4]).view(np.float32)
    return Ts


def fast_s5(T, X, Vm, KP):
    """prep2_w_u0_x (gdn_chunk_prep2.cuh) on T rounded by prep2_round_t: the same records as default_s5, keyed by
    the job each of a pair's accumulators belongs to."""
    seqs, stores = {}, {}
    V = Vm.shape[1]
    flat = round_t(T).reshape(-1)
    lane_addr = [((lane & 7) + 8 * ((lane >> 3) & 1)) * LDA + 4 * (lane >> 4) for lane in range(32)]
    for v0, nw, njob in jobs_of(V, KP):
        Vs = np.zeros((C, VB), np.float32)
        Vs[:, :min(V - v0, VB)] = Vm[:, v0:v0 + VB]
        for warp in range(WARPS):
            for pj in range(warp, (njob + 1) // 2, WARPS):
                j0 = 2 * pj
                two = j0 + 1 < njob
                isw = j0 < nw
                n0 = (j0 if isw else j0 - nw) * 8
                B = np.zeros((2, 8, 32, 2), np.uint32)
                for jj in range(2):
                    for s in range(8):
                        for lane in range(32):
                            gq, t4 = lane >> 2, lane & 3
                            c = n0 + 8 * jj + gq
                            assert c < (KP if isw else VB), "reads only staged columns"
                            B[jj, s, lane] = fast_bits(np.array(
                                [b_value(X, Vs, isw, s * 8 + t4 + 4 * hh, c) for hh in range(2)], np.float32))
                for a in range(4):
                    seq = [[], []]
                    for s in range(2 * a + 2):
                        fr = ldsm_x4(flat, [a * SUB * LDA + s * 8 + x for x in lane_addr])
                        A = fr.astype(np.float32).view(np.uint32)  # (the words as loaded: already tf32)
                        for jj in range(2):
                            seq[jj].append((A, B[jj, s]))
                    for jj in range(2):
                        job = j0 + jj
                        key = (v0, job, a)
                        if isw or jj == 0 or two:
                            seqs[key] = seq[jj]
                        for lane in range(32):
                            gq, t4 = lane >> 2, lane & 3
                            for e in range(4):
                                if isw:
                                    stores[("w", a, job, lane, e)] = (key, lane, e)
                                elif jj == 0 or two:
                                    r, c = a * SUB + gq + 8 * (e >> 1), v0 + n0 + 8 * jj + 2 * t4 + (e & 1)
                                    if c < V:  # V even: float2 (c even, c + 1 < V); odd: element stores
                                        assert ("u", r, c) not in stores
                                        stores[("u", r, c)] = (key, lane, e)
    return seqs, stores


@pytest.mark.parametrize("KP,V", [(128, 128), (64, 64), (128, 37), (64, 30), (128, 200), (128, 256), (128, 8)])
def test_fast_s5_issues_the_default_mma_sequence(KP, V):
    rng = np.random.default_rng(KP + V)
    T = np.tril(rng.standard_normal((C, C))).astype(np.float32)
    X = rng.standard_normal((C, KP)).astype(np.float32)
    Vm = rng.standard_normal((C, V)).astype(np.float32)
    sd, st_d = default_s5(T, X, Vm, KP)
    sf, st_f = fast_s5(T, X, Vm, KP)
    assert sd.keys() == sf.keys()
    for key in sd:
        assert len(sd[key]) == len(sf[key]), key
        for (a1, b1), (a2, b2) in zip(sd[key], sf[key]):
            assert np.array_equal(a1, a2), ("A operand", key)
            assert np.array_equal(b1, b2), ("B operand", key)
    assert st_d == st_f  # every element from the same accumulator register, once
    assert len([k for k in st_d if k[0] == "u"]) == C * V


def cross_tile(tile):
    """kda_chunk_prep2.cuh's cross_tile: tile 0..23 -> (a, mat, nt)."""
    a = 1 if tile < 4 else (2 if tile < 12 else 3)
    local = tile - (0 if a == 1 else (4 if a == 2 else 12))
    mat = local // (2 * a)
    return a, mat, local - mat * 2 * a


def cross_tile_fast(warp, u):
    """kda_chunk_prep2.cuh's cross_tile_fast (FAST's P2 tiles)."""
    if warp < 4:
        return 3, warp >> 1, 3 * (warp & 1) + u
    if warp < 6 or u == 0:
        return 2, warp & 1, (u if warp < 6 else 3)
    return 1, warp & 1, u - 1


def test_cross_tile_fast_is_a_permutation_sharing_a():
    """FAST's P2 computes exactly the default's 24 tiles (each once; the results phase places each by its (a, mat,
    nt), so which warp holds it does not matter), and the A operand is re-formed only where it changes: at u = 0,
    and at u = 1 on warps 6-7 (the kernel's condition)."""
    default = sorted(cross_tile(w + 8 * u) for w in range(WARPS) for u in range(3))
    fast = sorted(cross_tile_fast(w, u) for w in range(WARPS) for u in range(3))
    assert default == fast and len(set(fast)) == 24
    assert all(nt < 2 * a for a, _, nt in fast)
    for w in range(WARPS):
        for u in range(1, 3):
            same = cross_tile_fast(w, u)[:2] == cross_tile_fast(w, u - 1)[:2]
            assert same == (not (u == 1 and w >= 6)), (w, u)
