#!/usr/bin/env python3
"""CPU estimate (no GPU) of the forward's error against float64 under the operand roundings of scan6 (w, u0 fp32,
w read as tf32 at the dots, h_c / U_c tf32, q~ / k~^T / A~ bf16), of flash-linear-attention's regime (all bf16: "fla"),
of scan7 under KDA_CUDA_CHUNK_SCAN=10 (all bf16 but u0 fp32) and under 11 (U also as bf16 hi + lo), the
rest exact (float64 accumulation, the state float64 between chunks; the prep's w / u0 products on tf32 operands
as its S5, its other values exact): the relative RMS
error (DESIGN.md section 6's metric) of o (rounded to the input dtype) and of the final state, per case, against
the chunked math in float64. An estimate of the rounding the scans add -- not of the kernels (the GPU tests
tests/test_cuda_scan7.py measure those).

    python benchmarks/cuda/scan7_accuracy_emu.py            # a table of error / 0.005 per case
"""
import math
import sys

import torch
import torch.nn.functional as F

C = 64
TOL = 0.005


def bf16(x):
    return x.float().to(torch.bfloat16).double()


def tf32(x):
    b = x.float().view(torch.int32)
    b = (b + 0x1000) & ~0x1FFF  # cvt.rna.tf32.f32 (round half away from zero on the magnitude bits)
    return b.view(torch.float32).double()


def f32(x):
    return x.float().double()


def ident(x):
    return x


def bf16_hl(x):
    """bf16 hi + bf16 lo (scan7's UHL)."""
    hi = bf16(x)
    return hi + bf16(x - hi)


MODES = {
    "exact": dict(w=ident, u0=ident, qa=ident, h=ident, U=ident),
    "scan6": dict(w=lambda x: tf32(f32(x)), u0=f32, qa=bf16, h=tf32, U=tf32),
    "fla": dict(w=bf16, u0=bf16, qa=bf16, h=bf16, U=bf16),
    "scan7_10": dict(w=bf16, u0=f32, qa=bf16, h=bf16, U=bf16),
    "scan7_11": dict(w=bf16, u0=f32, qa=bf16, h=bf16, U=bf16_hl),
}


def chunked(q, k, v, g, beta, scale, h0, mode):
    """One sequence, one head: q, k [T, K], v [T, V], g [T, K] (KDA; GDN broadcast), beta [T]; float64."""
    r = MODES[mode]
    T, K = k.shape
    h = h0.clone()
    o = torch.zeros(T, v.shape[1], dtype=torch.float64)
    for c0 in range(0, T, C):
        sl = slice(c0, min(T, c0 + C))
        qc, kc, vc, gc, bc = q[sl], k[sl], v[sl], g[sl], beta[sl]
        L = kc.shape[0]
        G = gc.cumsum(0)  # [L, K]
        diff = G[:, None, :] - G[None, :, :]  # [t, j, K]: G_t - G_j
        mask_strict = torch.tril(torch.ones(L, L, dtype=torch.bool), -1)
        mask = torch.tril(torch.ones(L, L, dtype=torch.bool))
        e = torch.exp(torch.where(mask[..., None], diff, torch.full_like(diff, -math.inf)))
        Akk = torch.einsum("tc,tjc,jc->tj", kc, e, kc) * bc[None, :] * mask_strict
        Tm = torch.linalg.inv(torch.eye(L, dtype=torch.float64) + Akk)
        if mode == "exact":
            w = Tm @ (kc * torch.exp(G))
            u0 = Tm @ vc
        else:  # the preps' S5: tf32 m16n8k8 with T and K e^G rounded to tf32 (v is exact in tf32), fp32 accumulation
            w = tf32(Tm) @ tf32(kc * torch.exp(G))
            u0 = tf32(Tm) @ vc
        qg = scale * qc * torch.exp(G)
        Aqk = scale * torch.einsum("tc,tjc,jc->tj", qc, e, kc) * bc[None, :] * mask
        kgT = (bc[:, None] * kc * torch.exp(G[-1][None, :] - G)).T  # [K, L]
        dec = torch.exp(G[-1])
        hq = r["h"](h)
        U = r["u0"](u0) - r["w"](w) @ hq
        Uq = r["U"](U)
        o[sl] = r["qa"](qg) @ hq + r["qa"](Aqk) @ Uq
        h = dec[:, None] * h + r["qa"](kgT) @ Uq
    return o, h


def make(family, T, K, V, seed, gate_div=1.0, keys="normal", extreme=False, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = (F.normalize(torch.randn(T, K, generator=gen), dim=-1) * 2).to(dtype).double()
    k = torch.rand(T, K, generator=gen) if keys == "correlated" else torch.randn(T, K, generator=gen)
    k = F.normalize(k, dim=-1).to(dtype).double()
    v = torch.randn(T, V, generator=gen).to(dtype).double()
    gs = (T, K) if family == "kda" else (T, 1)
    g = F.logsigmoid(torch.randn(*gs, generator=gen)) / gate_div
    if extreme:
        rr = torch.rand(*gs, generator=gen)
        g = torch.where(rr < 0.3, torch.full(gs, -20.0), g)
        g = torch.where(rr > 0.97, torch.full(gs, -1e4), g)
    g = g.expand(T, K).double()
    beta = torch.rand(T, generator=gen).double()
    h0 = torch.randn(K, V, generator=gen).double() * 0.5
    return q, k, v, g, beta, h0


def rel(ref, out):
    return float((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


CASES = {
    "random_T2048": dict(T=2048),
    "correlated_T512": dict(T=512, keys="correlated"),
    "gate_div_0.1": dict(T=512, gate_div=0.1),
    "gate_div_10_T4096": dict(T=4096, gate_div=10.0),
    "extreme": dict(T=512, extreme=True),
    "correlated_div_10_T4096": dict(T=4096, keys="correlated", gate_div=10.0),
}


def main():
    torch.set_num_threads(1)
    only = sys.argv[1:]
    ms = ("scan6", "fla", "scan7_10", "scan7_11")
    print(f"{'case':26s} {'fam':4s} {'dt':4s} | error / {TOL}, o: " + " ".join(f"{m:>8s}" for m in ms) +
          " | state: " + " ".join(f"{m:>8s}" for m in ms))
    for name, spec in CASES.items():
        if only and name not in only:
            continue
        for family in ("kda", "gdn"):
            for dt in (torch.bfloat16, torch.float16):
                if dt == torch.float16 and not name.startswith(("random", "extreme")):
                    continue
                q, k, v, g, beta, h0 = make(family, K=128, V=128, seed=3, dtype=dt, **spec)
                ro, rh = chunked(q, k, v, g, beta, 128 ** -0.5, h0, "exact")
                res = {}
                for m in ms:
                    o, h = chunked(q, k, v, g, beta, 128 ** -0.5, h0, m)
                    res[m] = (rel(ro, o.to(dt).double()), rel(rh, h.float().double()))
                dts = "bf16" if dt == torch.bfloat16 else "fp16"
                print(f"{name:26s} {family:4s} {dts:4s} |                " +
                      " ".join(f"{res[m][0] / TOL:8.2f}" for m in ms) + " |        " +
                      " ".join(f"{res[m][1] / TOL:8.2f}" for m in ms), flush=True)


if __name__ == "__main__":
    main()
