"""CPU index-level emulation of state_bwd3_bf16_kernel (kernels_src/cuda/delta_chunk_bwd_state_bwd3_bf16.cuh,
KDA_CUDA_CHUNK_BWD_STATE_BWD=10): one block of 8 warps x 32 lanes over three chunks (the last one partial), every
shared-memory address and padded row stride (SbbSmem: K Eend rows KP + 16, the dS copy's VS + 10), the dS row
permutation (srow), the 16-byte A reads of Q Gam / w and K Eend, the mma.sync m16n8k16 bf16 fragment mapping
(A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..2t+9), a3 (g+8, 2t+8..); B: b0 (2t..2t+1, g), b1 (2t+8..2t+9,
g); C (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1); the low half of a register is the lower k slot), the kernel's k
permutations (slots 2t, 2t+1, 2t+8, 2t+9 of lane (g, t) = physical k t, t+4, t+8, t+12 of the k16 step over tokens,
4t .. 4t+3 over K in K Eend dS1), the shared
dO fragments of the two dO products, the A_qk diagonal mask and its k16 step skip (ks < wi), the subtracted w^T dU
and the double-buffer parity, as written in the kernel, in exact float64, against the plain recurrence
dU = A_qk^T dO + Kend dS1, dS0 = Gam_last dS1 + (Q Gam)^T dO - w^T dU. Consumed buffers are poisoned with NaN and
A_qk holds garbage above its diagonal, so a wrong address or a read of a stale buffer fails; each deliberate
mutation of the index math (test_emulator_sees_mutations) must fail. With bf16=True the operands are rounded to
bf16 (round to nearest even from fp32) as the kernel's cvt.rn.bf16x2.f32 does (the accumulation order inside an
mma is not emulated): an estimate of the rounding error, printed. Needs no GPU. (Until session 12 it also emulated
=9, the variant with state_bwd3's layout and 4-byte fragment reads: retired.)
"""
import numpy as np
import pytest

CH, KP, VS = 64, 128, 32
LdKe, LdD, LdT, LdA, LdB = KP + 16, VS + 10, KP + 8, CH + 8, VS + 8
G = np.arange(32) >> 2   # lane -> g
T4 = np.arange(32) & 3   # lane -> t


def bf16r(x):
    """fp32 -> bf16 round to nearest even (the kernel's __floats2bfloat162_rn), as float64"""
    x = np.asarray(x, dtype=np.float32)
    f = np.atleast_1d(x).copy().view(np.uint32).astype(np.uint64)
    r = ((f + 0x7FFF + ((f >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return r.view(np.float32).astype(np.float64).reshape(x.shape)


def mma16(C, a, b):
    """C[32][4] += A B for one m16n8k16: a[32][4][2] (register, half: low = lower k slot), b[32][2][2]"""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    na, nb = np.zeros((16, 16), int), np.zeros((16, 8), int)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for h in range(2):
            for (r, k), x in zip(((g, 2 * t + h), (g + 8, 2 * t + h), (g, 2 * t + 8 + h), (g + 8, 2 * t + 8 + h)),
                                 (a[lane][0][h], a[lane][1][h], a[lane][2][h], a[lane][3][h])):
                A[r, k] = x
                na[r, k] += 1
            for k, x in ((2 * t + h, b[lane][0][h]), (2 * t + 8 + h, b[lane][1][h])):
                B[k, g] = x
                nb[k, g] += 1
    assert (na == 1).all() and (nb == 1).all()  # the fragment layout covers every slot once
    D = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        C[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def emulate(mutate=None, bf16=False, seed=0):
    """K Eend rows padded to KP + 16, the dS copy's to VS + 10, dS rows permuted (srow), 16-byte A reads of Q Gam / w
    (rows 32 wi + 4 g .. + 3) and K Eend (k 4 t .. 4 t + 3)"""
    rng = np.random.default_rng(seed)
    K, V = 128, 32
    nc = 3
    Cc_last = 50
    scale = 0.3
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # the prep buffers are fp32
    aqk = f32(np.tril(rng.standard_normal((nc, CH, CH))))   # aqk[c][t][j], j <= t
    kend = f32(rng.standard_normal((nc, CH, KP)))
    qg = f32(rng.standard_normal((nc, CH, KP)))
    w = f32(rng.standard_normal((nc, CH, KP)) * 0.1)
    gl = f32(rng.uniform(0.5, 1, (nc, KP)))
    for x in (kend, qg, w):
        x[nc - 1, Cc_last:] = 0
    dO = bf16r(rng.standard_normal((nc, CH, V)))  # bf16 inputs: exact in bf16
    dO[nc - 1, Cc_last:] = 0
    dht = f32(rng.standard_normal((K, V)))
    S = dht.copy()
    ref_dhs, ref_dU = [None] * nc, [None] * nc
    for c in range(nc - 1, -1, -1):
        ref_dhs[c] = S.copy()
        dU = aqk[c].T @ (scale * dO[c]) + kend[c] @ S
        ref_dU[c] = dU
        S = gl[c][:, None] * S + qg[c].T @ (scale * dO[c]) - w[c].T @ dU
    rnd = bf16r if bf16 else (lambda x: x)

    def pack(lo, hi):
        if mutate == "pack_order":
            lo, hi = hi, lo
        return (rnd(lo), rnd(hi))

    def bpack(lo, hi):
        return (rnd(lo), rnd(hi))

    ke_s = np.full((2, CH * LdKe), np.nan)
    w_s = np.full((2, CH * LdT), np.nan)
    qg_s = np.full(CH * LdT, np.nan)
    aq_s = np.full(CH * LdA, np.nan)
    gl_s = np.full(KP, np.nan)
    ds_s = np.full(KP * LdD, np.nan)
    ou_s = np.full(CH * LdB, np.nan)

    def g1(c, b):
        for t in range(CH):
            ke_s[b, t * LdKe:t * LdKe + KP] = kend[c, t]
            w_s[b, t * LdT:t * LdT + KP] = w[c, t]

    def g2(c):
        aq = aqk[c].copy()
        aq[np.triu_indices(CH, 1)] = 7.0  # garbage above the diagonal: the kernel masks it
        for t in range(CH):
            aq_s[t * LdA:t * LdA + CH] = aq[t]
            qg_s[t * LdT:t * LdT + KP] = qg[c, t]
        gl_s[:] = gl[c]

    ds = np.zeros((8, 32, 2, 2, 4))  # ds[warp][lane][mt][nt][e]

    def srow(wi, gq, mt, h):  # the kernel's srow: the dS row of accumulator row g + 8 h of tile mt
        return 32 * wi + 4 * gq + 2 * mt + (1 - h if mutate == "srow" else h)

    def afrag_t(x, t0, wi, gq, mt):  # A(i, t) = x[t][i] of row tile mt at k16 base t0 (the kernel's afrag_t)
        v = [x[(t0 + 4 * m) * LdT + 32 * wi + 4 * gq:(t0 + 4 * m) * LdT + 32 * wi + 4 * gq + 4] for m in range(4)]
        return [pack(v[0][2 * mt], v[1][2 * mt]), pack(v[0][2 * mt + 1], v[1][2 * mt + 1]),
                pack(v[2][2 * mt], v[3][2 * mt]), pack(v[2][2 * mt + 1], v[3][2 * mt + 1])]

    def lanes():
        for warp in range(8):
            for lane in range(32):
                yield warp, lane, warp & 3, warp >> 2, lane >> 2, lane & 3

    for warp, lane, wi, wc, gq, t4 in lanes():
        cw = 16 * wc
        for mt in range(2):
            for nt in range(2):
                for e in range(4):
                    ds[warp, lane, mt, nt, e] = dht[srow(wi, gq, mt, e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)]

    def put_ds():
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw = 16 * wc
            for mt in range(2):
                for nt in range(2):
                    for h in range(2):
                        d = srow(wi, gq, mt, h) * LdD + cw + 8 * nt + 2 * t4
                        ds_s[d:d + 2] = ds[warp, lane, mt, nt, 2 * h:2 * h + 2]

    def put_do(c):
        for tid in range(256):
            d = (tid >> 2) * LdB + 8 * (tid & 3)
            ou_s[d:d + 8] = dO[c, tid >> 2, 8 * (tid & 3):8 * (tid & 3) + 8]

    def store_ds():
        out = np.zeros((K, V))
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw = 16 * wc
            for mt in range(2):
                for nt in range(2):
                    for e in range(4):
                        out[srow(wi, gq, mt, e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)] = ds[warp, lane, mt, nt, e]
        return out

    def bfrag(buf, k0, col):  # the kernel's bfrag: b0 = (k0, k0 + 4), b1 = (k0 + 8, k0 + 12) at column col
        r1, r2 = (k0 + 12, k0 + 8) if mutate == "b_perm" else (k0 + 8, k0 + 12)
        return (bpack(buf[k0 * LdB + col], buf[(k0 + 4) * LdB + col]),
                bpack(buf[r1 * LdB + col], buf[r2 * LdB + col]))

    dp = 1 if mutate == "a_perm" else 4  # A's second physical k of a register: t + 4 (mutated: t + 1)
    dhs, dUo = [None] * nc, [None] * nc
    put_ds()
    g1(nc - 1, 0)
    g2(nc - 1)
    g1(nc - 2, 1)
    put_do(nc - 1)
    for s in range(nc):
        c = nc - 1 - s
        b = s & 1
        dhs[c] = store_ds()
        du = np.zeros((8, 32, 2, 4))
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2
            cw = 16 * wc
            xm = np.zeros((2, 32, 4))
            ym = np.zeros((2, 2, 32, 4))
            for ks in range(CH // 16):
                bv = [[bfrag(ou_s, 16 * ks + (l & 3), cw + 8 * nt + (l >> 2)) for l in range(32)] for nt in range(2)]
                skip = ks < (2 * wi if mutate == "aqk_skip" else wi)
                if not skip:
                    af = []
                    for lane in range(32):
                        gq, t4 = lane >> 2, lane & 3
                        u0, t0 = 16 * wi + gq, 16 * ks + t4

                        def av(j, t):
                            keep = (j > t) if mutate == "aqk_mask" else (j >= t)
                            return aq_s[j * LdA + t] if keep else 0.0

                        af.append([pack(av(t0, u0), av(t0 + dp, u0)), pack(av(t0, u0 + 8), av(t0 + dp, u0 + 8)),
                                   pack(av(t0 + 8, u0), av(t0 + 8 + dp, u0)),
                                   pack(av(t0 + 8, u0 + 8), av(t0 + 8 + dp, u0 + 8))])
                    for nt in range(2):
                        mma16(xm[nt], af, bv[nt])
                for mt in range(2):
                    af = [afrag_t(qg_s, 16 * ks + (lane & 3), wi, lane >> 2, mt) for lane in range(32)]
                    for nt in range(2):
                        mma16(ym[mt, nt], af, bv[nt])
            for lane in range(32):
                gq = lane >> 2
                for nt in range(2):
                    du[warp, lane, nt] = scale * xm[nt, lane]
                for mt in range(2):
                    ga, gb = gl_s[srow(wi, gq, mt, 0)], gl_s[srow(wi, gq, mt, 1)]
                    for nt in range(2):
                        for e in range(4):
                            ds[warp, lane, mt, nt, e] = (scale * ym[mt, nt, lane, e]
                                                         + (ga if e < 2 else gb) * ds[warp, lane, mt, nt, e])
        # barrier: A_qk, Q Gam, Gam_last, dO consumed
        aq_s[:] = np.nan
        qg_s[:] = np.nan
        gl_s[:] = np.nan
        if c > 0:
            g2(c - 1)
        dUc = np.zeros((CH, V))
        kb = b ^ 1 if mutate == "parity" else b
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2
            cw = 16 * wc
            am = np.zeros((2, 2, 32, 4))
            for ks in range(KP // 16):
                af = []
                bf = [[], []]
                for lane in range(32):
                    gq, t4 = lane >> 2, lane & 3
                    u0 = 16 * wi + gq
                    ke = ke_s[kb]
                    # physical k 4 t .. 4 t + 3: float4 reads of rows u0, u0 + 8; B rows k0 .. k0 + 3
                    k0 = 16 * ks + 4 * t4
                    x1 = ke[u0 * LdKe + k0:u0 * LdKe + k0 + 4]
                    x2 = ke[(u0 + 8) * LdKe + k0:(u0 + 8) * LdKe + k0 + 4]
                    j = 2 if mutate == "kvec_slot" else 1
                    af.append([pack(x1[0], x1[j]), pack(x2[0], x2[j]), pack(x1[2], x1[3]), pack(x2[2], x2[3])])
                    for nt in range(2):
                        col = cw + 8 * nt + gq
                        d = lambda r: ds_s[(k0 + r) * LdD + col]
                        bf[nt].append((bpack(d(0), d(1)), bpack(d(2), d(3))))
                for nt in range(2):
                    mma16(am[ks & 1, nt], af, bf[nt])
            du[warp] += (am[0] + am[1]).transpose(1, 0, 2)
        ou_s[:] = np.nan  # dO consumed
        for warp, lane, wi, wc, gq, t4 in lanes():
            cw, u0 = 16 * wc, 16 * wi + gq
            for nt in range(2):
                d = u0 * LdB + cw + 8 * nt + 2 * t4
                ou_s[d:d + 2] = du[warp, lane, nt, :2]
                ou_s[d + 8 * LdB:d + 8 * LdB + 2] = du[warp, lane, nt, 2:]
                for e in range(4):
                    dUc[u0 + 8 * (e >> 1), cw + 8 * nt + 2 * t4 + (e & 1)] = du[warp, lane, nt, e]
        dUo[c] = dUc
        ds_s[:] = np.nan  # the dS1 copy consumed
        for warp in range(8):
            wi, wc = warp & 3, warp >> 2
            cw = 16 * wc
            zm = np.zeros((2, 2, 32, 4))
            for ks in range(CH // 16):
                bh = [[bfrag(ou_s, 16 * ks + (l & 3), cw + 8 * nt + (l >> 2)) for l in range(32)] for nt in range(2)]
                for mt in range(2):
                    af = [afrag_t(w_s[kb], 16 * ks + (lane & 3), wi, lane >> 2, mt) for lane in range(32)]
                    for nt in range(2):
                        mma16(zm[mt, nt], af, bh[nt])
            for lane in range(32):
                if mutate == "w_sign":
                    ds[warp, lane] += zm[:, :, lane]
                else:
                    ds[warp, lane] -= zm[:, :, lane]
        put_ds()
        # barrier: dU, K Eend and w of buffer b consumed
        ke_s[b] = np.nan
        w_s[b] = np.nan
        if c > 1:
            g1(c - 2, b)
        if c > 0:
            put_do(c - 1)
    dh0 = store_ds()
    err = lambda a, r: np.sqrt(np.mean((a - r) ** 2) / np.mean(r ** 2))
    errs = {"dh0": err(dh0, S)}
    for c in range(nc):
        errs[f"dhs{c}"] = err(dhs[c], ref_dhs[c])
        errs[f"dU{c}"] = err(dUo[c], ref_dU[c])
    return errs


def _worst(errs):
    return max(np.nan_to_num(e, nan=np.inf) for e in errs.values())


def test_state_bwd_bf16_index_emulation():
    errs = emulate()
    assert _worst(errs) < 1e-12, errs


def test_state_bwd_bf16_rounding_estimate():
    # operands rounded to bf16 as the kernel does: relative RMS error of order 2^-9 per product, well inside
    # DESIGN.md section 6's 0.008 for three chunks of random (not gate-shaped) operands; printed for the report
    errs = emulate(bf16=True)
    print("bf16 operand rounding, relative RMS vs float64:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert 1e-4 < _worst(errs) < 0.02, errs


@pytest.mark.parametrize("mutate", ["a_perm", "b_perm", "pack_order", "aqk_skip", "aqk_mask", "w_sign", "parity",
                                    "srow", "kvec_slot"])
def test_emulator_sees_mutations(mutate):
    errs = emulate(mutate=mutate)
    assert _worst(errs) > 1e-6, (mutate, errs)
