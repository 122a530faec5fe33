"""CPU emulation of the backward's state_fwd on bf16 operands (KDA_CUDA_CHUNK_BWD_STATE_FWD=8: U plain bf16, =9: U as
bf16 hi + lo, =10: U and K Eend as hi + lo; kernels_src/cuda/delta_chunk_bwd_state_fwd_bf16.cuh), in two parts:

- the index math, lane by lane: the fp32 w / K Eend tiles at their padded strides, the m16n8k16 A fragments read as
  float2 pairs and rounded to bf16 (cvt.rn.bf16x2), the row orders (accumulator row slots g, g + 8 = physical rows
  2g, 2g + 1), h and U as bf16 row-pair words written by s7_put_tile / s7_put_tile_hl and read as mma_tiles16 reads
  them, the hs / U stores; checked against the matrix form of the same rounding (float64 accumulation both) and the
  shared-memory reads for bank conflicts (8-byte reads per half warp, 4-byte reads per warp);
- the accuracy of the recurrence's rounding, matrix form, over the chunks of a KDA / GDN sequence (w, u0, K Eend,
  Gam_last from the float64 chunk math of benchmarks/cuda/scan7_accuracy_emu.py, rounded to fp32 as the backward's
  prep writes them): the relative RMS error of hs (every chunk-start state) and of U against float64, for state_fwd3's
  tf32 operands (=7), bf16 (=8), bf16 with U hi + lo (=9) and with U and K Eend hi + lo (=10), and the ratios to
  tf32. These are the state_fwd outputs
  only; the gradients' errors are measured on the GPU (tests/test_cuda_state_fwd_bf16.py).

    python tests/test_cuda_state_fwd_bf16_emu.py     # the accuracy table
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "cuda"))
from scan7_accuracy_emu import C, bf16_hl, make, rel, tf32  # noqa: E402

CH, KP, BV = 64, 128, 16
LDW = LDE = KP + 4
LDH = 40  # kScan7LDW
LANES = np.arange(32)
GQ, T4 = LANES >> 2, LANES & 3


def rb(x):
    """fp32 -> bf16, round to nearest even (as __floats2bfloat162_rn), in float64."""
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def mma16(c, a, b):
    """m16n8k16: a [32][4][2] (lo, hi halves), b [32][2][2], c [32][4] -> c + A B (float64)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for h in range(2):
        A[GQ, 2 * T4 + h], A[GQ + 8, 2 * T4 + h] = a[:, 0, h], a[:, 1, h]
        A[GQ, 2 * T4 + 8 + h], A[GQ + 8, 2 * T4 + 8 + h] = a[:, 2, h], a[:, 3, h]
        B[2 * T4 + h, GQ], B[2 * T4 + 8 + h, GQ] = b[:, 0, h], b[:, 1, h]
    D = A @ B
    out = c.copy()
    out[:, 0] += D[GQ, 2 * T4]
    out[:, 1] += D[GQ, 2 * T4 + 1]
    out[:, 2] += D[GQ + 8, 2 * T4]
    out[:, 3] += D[GQ + 8, 2 * T4 + 1]
    return out


def banks32_ok(addrs):
    """32 4-byte reads of a warp (word addresses): no two distinct words on one bank."""
    addrs = np.asarray(addrs)
    return all(len(set(addrs[(addrs % 32) == k])) <= 1 for k in range(32))


def banks64_ok(addrs):
    """32 8-byte reads (word addresses, even): each half warp one wavefront (16 distinct bank pairs or equal words)."""
    addrs = np.asarray(addrs)
    assert (addrs % 2 == 0).all()
    for h in (slice(0, 16), slice(16, 32)):
        x = addrs[h]
        if any(len(set(x[((x // 2) % 16) == k])) > 1 for k in range(16)):
            return False
    return True


def emulate(w, kend, gl, u, h0, uhl, bug=None, ehl=False):
    """Lane-level model of one block (16 value columns): w, kend [nc][CH][KP] (fp32 values), gl [nc][KP],
    u [nc][CH][BV], h0 [KP][BV] -> hs [nc][KP][BV], U [nc][CH][BV] (float64 accumulation)."""
    nc = w.shape[0]
    wsm = np.full(CH * LDW, np.nan)
    esm = np.full(CH * LDE, np.nan)
    gsm = np.full(KP, np.nan)
    hw = np.full((KP // 2 * LDH, 2), np.nan)  # bf16 word: (lo, hi)
    us_lo = CH // 2 * LDH
    uw = np.full(((2 if uhl else 1) * us_lo, 2), np.nan)

    def ktile(dst, src, ld):
        for t in range(CH):
            dst[t * ld:t * ld + KP] = src[t]

    def put_tile(M, r0, c0, c, base=0, vals=None):
        i = base + (r0 // 2 + GQ) * LDH + c0 + 2 * T4
        M[i, 0], M[i, 1] = rb(c[:, 0]), rb(c[:, 2])
        M[i + 1, 0], M[i + 1, 1] = rb(c[:, 1]), rb(c[:, 3])

    def put_tile_hl(M, r0, c0, c):
        put_tile(M, r0, c0, c)
        put_tile(M, r0, c0, c - np.stack([rb(c[:, e]) for e in range(4)], 1), base=us_lo)

    def ld2(buf, addr):  # float2 at word addresses addr (32 lanes)
        assert banks64_ok(addr)
        return buf[addr], buf[addr + 1]

    # hacc[(wi, wc, mt)] [32][4]: row 32 wi + 16 mt + 2 gq + (e >> 1), column 8 wc + 2 t4 + (e & 1)
    rows = lambda wi, mt, e: 32 * wi + 16 * mt + 2 * GQ + (e >> 1)
    cols = lambda wc, e: 8 * wc + 2 * T4 + (e & 1)
    hacc = {(wi, wc, mt): np.stack([h0[rows(wi, mt, e), cols(wc, e)] for e in range(4)], 1)
            for wi in range(4) for wc in range(2) for mt in range(2)}

    def put_h():
        for (wi, wc, mt), x in hacc.items():
            put_tile(hw, 32 * wi + 16 * mt, 8 * wc, x)

    put_h()
    hs = np.zeros((nc, KP, BV))
    U = np.zeros((nc, CH, BV))
    if nc > 0:
        ktile(wsm, w[0], LDW)
    for c in range(nc):
        ktile(esm, kend[c], LDE)
        gsm[:] = gl[c]
        for (wi, wc, mt), x in hacc.items():
            for e in range(4):
                hs[c, rows(wi, mt, e), cols(wc, e)] = x[:, e]
        for warp in range(8):  # U = u - w S
            wi, wc = warp & 3, warp >> 2
            cw = 8 * wc
            acc = [np.zeros((32, 4)), np.zeros((32, 4))]
            w0 = (16 * wi + 2 * GQ) * LDW + 2 * T4
            for s in range(KP // 16):
                xs = [ld2(wsm, w0 + 16 * s), ld2(wsm, w0 + LDW + 16 * s), ld2(wsm, w0 + 16 * s + 8),
                      ld2(wsm, w0 + LDW + 16 * s + 8)]
                if bug == "w_rows":
                    xs[0], xs[1] = xs[1], xs[0]
                a = np.stack([np.stack([rb(x0), rb(x1)], 1) for x0, x1 in xs], 1)
                bi = (8 * s + T4) * LDH + cw + GQ
                assert banks32_ok(bi) and banks32_ok(bi + 4 * LDH)
                b = np.stack([hw[bi], hw[bi + 4 * LDH]], 1)
                acc[s & 1] = mma16(acc[s & 1], a, b)
            x = np.zeros((32, 4))
            for e in range(4):
                t = 16 * wi + 2 * GQ + (e >> 1)
                x[:, e] = u[c, t, cw + 2 * T4 + (e & 1)] - (acc[0][:, e] + acc[1][:, e])
                U[c, t, cw + 2 * T4 + (e & 1)] = x[:, e]
            (put_tile_hl if uhl else put_tile)(uw, 16 * wi, cw, x)
        if c + 1 < nc:
            ktile(wsm, w[c + 1], LDW)
        for warp in range(8):  # S <- Diag(gl) S + (K Eend)^T U
            wi, wc = warp & 3, warp >> 2
            cw = 8 * wc
            for mt in range(2):
                d0, d1 = ld2(gsm, 32 * wi + 16 * mt + 2 * GQ)
                x = hacc[(wi, wc, mt)]
                x[:, 0:2] *= d0[:, None]
                x[:, 2:4] *= d1[:, None]
            er = 2 * T4 * LDE + 32 * wi + 2 * GQ
            for s in range(CH // 16):
                bi = (8 * s + T4) * LDH + cw + GQ
                assert banks32_ok(bi) and banks32_ok(bi + 4 * LDH)
                b = np.stack([uw[bi], uw[bi + 4 * LDH]], 1)
                bl = np.stack([uw[us_lo + bi], uw[us_lo + bi + 4 * LDH]], 1) if uhl else None
                ek = er + 16 * s * LDE
                for mt in range(2):
                    x0, x1, x2, x3 = (ld2(esm, ek + j * LDE + 16 * mt) for j in (0, 1, 8, 9))
                    if bug == "e_order":
                        x1, x2 = x2, x1
                    a = np.stack([np.stack([rb(x0[0]), rb(x1[0])], 1), np.stack([rb(x0[1]), rb(x1[1])], 1),
                                  np.stack([rb(x2[0]), rb(x3[0])], 1), np.stack([rb(x2[1]), rb(x3[1])], 1)], 1)
                    hacc[(wi, wc, mt)] = mma16(hacc[(wi, wc, mt)], a, b)
                    if uhl:
                        hacc[(wi, wc, mt)] = mma16(hacc[(wi, wc, mt)], a, bl)
                    if ehl:  # the low parts of K Eend: x - bf16(x), rounded (lo x lo dropped)
                        xs = [(x0[0], x1[0]), (x0[1], x1[1]), (x2[0], x3[0]), (x2[1], x3[1])]
                        al = np.stack([np.stack([rb(p - rb(p)), rb(q - rb(q))], 1) for p, q in xs], 1)
                        hacc[(wi, wc, mt)] = mma16(hacc[(wi, wc, mt)], al, b)
        put_h()
    return hs, U


def recurrence(w, kend, gl, u, h0, mode):
    """Matrix form: mode 'exact' (float64), 'tf32' (state_fwd3: tf32 operands), 'bf16' (=8), 'bf16hl' (=9),
    'bf16ehl' (=10); the state and U kept in float64 (fp32 rounding of the accumulators is not modelled here)."""
    hl = lambda x: bf16_hl(torch.from_numpy(x)).numpy()
    rw = dict(exact=lambda x: x, tf32=lambda x: tf32(torch.from_numpy(x)).numpy(), bf16=rb, bf16hl=rb,
              bf16ehl=rb)[mode]
    rU = dict(exact=lambda x: x, tf32=rw, bf16=rb, bf16hl=hl, bf16ehl=hl)[mode]
    rE = hl if mode == "bf16ehl" else rw
    if mode == "bf16ehl":  # hi x hi + hi x lo + lo x hi: (hi + lo) x (hi + lo) less lo x lo
        lo = lambda x: rb(x - rb(x))
        prodE = lambda E, Uc: rE(E).T @ rU(Uc) - lo(E).T @ lo(Uc)
    else:
        prodE = lambda E, Uc: rE(E).T @ rU(Uc)
    S = h0.copy()
    hs, Us = [], []
    for c in range(w.shape[0]):
        hs.append(S.copy())
        Uc = u[c] - rw(w[c]) @ rw(S)
        Us.append(Uc)
        S = gl[c][:, None] * S + prodE(kend[c], Uc)
    return np.array(hs).reshape(-1, *h0.shape), np.array(Us).reshape(-1, CH, h0.shape[1])


@pytest.mark.parametrize("uhl,ehl", [(False, False), (True, False), (True, True)], ids=["8", "9", "10"])
@pytest.mark.parametrize("nc", [0, 1, 3])
def test_state_fwd_bf16_index_math(nc, uhl, ehl):
    rng = np.random.default_rng(10 + nc)
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(np.float64)
    w, kend = f(nc, CH, KP) * 0.1, f(nc, CH, KP) * 0.1
    gl = rng.uniform(0.5, 1.0, (nc, KP)).astype(np.float32).astype(np.float64)
    u, h0 = f(nc, CH, BV), f(KP, BV)
    hs, U = emulate(w, kend, gl, u, h0, uhl, ehl=ehl)
    rhs, rU = recurrence(w, kend, gl, u, h0, "bf16ehl" if ehl else "bf16hl" if uhl else "bf16")
    assert np.allclose(hs, rhs, rtol=1e-9, atol=1e-9) and np.allclose(U, rU, rtol=1e-9, atol=1e-9)
    if nc:  # and the bf16 rounding is really there: not the exact recurrence
        ehs, eU = recurrence(w, kend, gl, u, h0, "exact")
        assert not np.allclose(U, eU, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bug", ["w_rows", "e_order"])
def test_state_fwd_bf16_emulation_catches_a_wrong_fragment(bug):
    # the index check can fail: a swapped pair of A rows (U) or of K Eend tokens (state update) must show
    rng = np.random.default_rng(5)
    f = lambda *s: rng.standard_normal(s).astype(np.float32).astype(np.float64)
    w, kend, u, h0 = f(2, CH, KP) * 0.1, f(2, CH, KP) * 0.1, f(2, CH, BV), f(KP, BV)
    gl = np.full((2, KP), 0.9)
    hs, U = emulate(w, kend, gl, u, h0, True, bug=bug)
    rhs, rU = recurrence(w, kend, gl, u, h0, "bf16hl")
    assert not (np.allclose(hs, rhs, rtol=1e-6, atol=1e-6) and np.allclose(U, rU, rtol=1e-6, atol=1e-6))


def chunk_inputs(family, T, seed, **spec):
    """One sequence / head, K = 128, V = 16: the backward prep's per-chunk w, K Eend (beta k e^(G_last - G)),
    Gam_last, u0 (float64), from the chunk math of scan7_accuracy_emu.chunked."""
    q, k, v, g, beta, h0 = make(family, T, KP, BV, seed, **spec)
    ws, ks, gls, us = [], [], [], []
    for c0 in range(0, T, C):
        sl = slice(c0, min(T, c0 + C))
        kc, vc, gc, bc = k[sl], v[sl], g[sl], beta[sl]
        L = kc.shape[0]
        G = gc.cumsum(0)
        diff = G[:, None, :] - G[None, :, :]
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool))
        e = torch.exp(torch.where(mask[..., None], diff, torch.full_like(diff, -math.inf)))
        Akk = torch.einsum("tc,tjc,jc->tj", kc, e, kc) * bc[None, :] * torch.tril(torch.ones(L, L), -1).bool()
        Tm = torch.linalg.inv(torch.eye(L, dtype=torch.float64) + Akk)
        pad = lambda x: torch.cat([x, x.new_zeros(CH - L, x.shape[1])]) if L < CH else x
        ws.append(pad(Tm @ (kc * torch.exp(G))))
        us.append(pad(Tm @ vc))
        ks.append(pad(bc[:, None] * kc * torch.exp(G[-1][None, :] - G)))
        gls.append(torch.exp(G[-1]))
    st = lambda xs: torch.stack(xs).numpy()
    return st(ws), st(ks), st(gls), st(us), h0.numpy()


ACC_CASES = {
    "kda_random_T1024": ("kda", dict(T=1024)),
    "kda_correlated_T512": ("kda", dict(T=512, keys="correlated")),
    "kda_div10_T2048": ("kda", dict(T=2048, gate_div=10.0)),
    "kda_corr_div10_T2048": ("kda", dict(T=2048, keys="correlated", gate_div=10.0)),
    "kda_extreme_T512": ("kda", dict(T=512, extreme=True)),
    "gdn_random_T1024": ("gdn", dict(T=1024)),
    "gdn_corr_div10_T2048": ("gdn", dict(T=2048, keys="correlated", gate_div=10.0)),
}


def accuracy(case):
    family, spec = ACC_CASES[case]
    spec = dict(spec)
    T = spec.pop("T")
    w, kend, gl, u, h0 = chunk_inputs(family, T, seed=3, **spec)
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # the prep's fp32 buffers
    ref = recurrence(w, kend, gl, u, h0, "exact")
    out = {}
    for m in ("tf32", "bf16", "bf16hl", "bf16ehl"):
        hs, U = recurrence(f32(w), f32(kend), f32(gl), f32(u), h0, m)
        out[m] = (rel(torch.from_numpy(ref[0]), torch.from_numpy(hs)), rel(torch.from_numpy(ref[1]), torch.from_numpy(U)))
    return out


# Measured by this emulation (relative RMS against float64; docs/cuda.md "state_fwd on bf16 operands"): hs =8 / =9
# ~8x / ~5.6x tf32's (K Eend's rounding dominates), =10 below tf32's; U ~2-9x tf32's for all three (h and w bf16).
# Bounds with margin: =8 / =9 hs <= 12x / 8x tf32's, =10 hs <= tf32's; U <= 12x tf32's; all below 1e-2.
@pytest.mark.parametrize("case", list(ACC_CASES))
def test_state_fwd_bf16_accuracy(case):
    out = accuracy(case)
    (ht, ut), (h8, u8), (h9, u9), (h10, u10) = out["tf32"], out["bf16"], out["bf16hl"], out["bf16ehl"]
    print(f"\n[state_fwd bf16 emu] {case}: hs tf32 {ht:.2e} =8 {h8 / ht:.2f}x =9 {h9 / ht:.2f}x =10 {h10 / ht:.2f}x | "
          f"U tf32 {ut:.2e} =8 {u8 / ut:.2f}x =9 {u9 / ut:.2f}x =10 {u10 / ut:.2f}x")
    assert max(h8, u8, h9, u9, h10, u10) < 1e-2
    assert h8 <= 12 * ht and h9 <= 8 * ht and h10 <= ht
    assert u8 <= 12 * ut and u9 <= 12 * ut and u10 <= 12 * ut


if __name__ == "__main__":
    torch.set_num_threads(1)
    for case in ACC_CASES:
        out = accuracy(case)
        (ht, ut) = out["tf32"]
        print(f"{case:24s} hs: " + " ".join(f"{m} {out[m][0]:.2e} ({out[m][0] / ht:.2f}x)" for m in out)
              + " | U: " + " ".join(f"{m} {out[m][1]:.2e} ({out[m][1] / ut:.2f}x)" for m in out), flush=True)
