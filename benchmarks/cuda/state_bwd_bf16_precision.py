"""CPU estimate (no GPU) of what bf16 tensor-core operands cost in the chunked backward's dh scan (state_bwd3_bf16,
KDA_CUDA_CHUNK_BWD_STATE_BWD=9 / 10) against tf32 operands (the default state_bwd3): the recurrence
    dU = scale A_qk^T dO + Kend dS1,   dS0 = Gam_last dS1 + scale (Q Gam)^T dO - w^T dU
over nc chunks of 64 tokens (K = V = 128) with the chunk operands built from random inputs the way the prep builds
them (normalized keys, queries * 2, beta in (0, 1), gates logsigmoid(randn) / gate_div per channel (KDA) or per head
(GDN); A_qk = tril((q Gam)(k / Gam)^T), w = (I + L)^-1 diag(beta) (k Gam), Kend = k Gam_last / Gam), in float64, once
exact and once with every operand of every product rounded to nearest even to bf16 (7 mantissa bits) or tf32 (10)
-- A_qk, Kend, Q Gam, w, the dS operand copy, dU, and dO (exact for bf16 inputs; for fp16 inputs, dtype fp16, dO is
fp16 data rounded again to bf16) -- while dS itself is carried unrounded, as the kernels do. Products are summed in
float64 (the mma's fp32 accumulation adds less than the operand rounding). Prints relative RMS errors of dh0 and of
all chunks' dU.

    python3 benchmarks/cuda/state_bwd_bf16_precision.py

Session 12 (branch sbwd12) result: bf16 ~1.5e-3 .. 2e-3 on dh0 and dU at 16 and 64 chunks, every gate scale, KDA
and GDN (tf32: ~2e-4, as the session-6 GPU measurement of tf32 against state_bwd2), no growth with the chunk count;
DESIGN.md section 6 allows 0.008 for dq, dk, dv, dh0 (0.02 for dg, dbeta) against float64, where the other kernels'
errors add (the GPU tests, tests/test_cuda_state_bwd_bf16.py, decide).
"""
import torch

C, K, V = 64, 128, 128


def rnd_bits(x, bits):
    """fp64 -> fp32 -> `bits` mantissa bits, round to nearest even (bf16: 7, tf32: 10, fp16-like mantissa: 10)"""
    f = x.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    drop = 23 - bits
    r = (f + (1 << (drop - 1)) - 1 + ((f >> drop) & 1)) & ~((1 << drop) - 1) & 0xFFFFFFFF
    return torch.where(r >= 2 ** 31, r - 2 ** 32, r).int().view(torch.float32).double()


def run(nc, gate_div, bits, kda=True, fp16_do=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = torch.nn.functional.normalize(rn(nc, C, K), dim=-1) * 2
    k = torch.nn.functional.normalize(rn(nc, C, K), dim=-1)
    beta = torch.rand(nc, C, generator=gen, dtype=torch.float64)
    g = (torch.nn.functional.logsigmoid(rn(nc, C, K if kda else 1)) / gate_div).expand(nc, C, K)
    gam = torch.exp(torch.cumsum(g, 1))
    scale = K ** -0.5
    ops = []
    for c in range(nc):
        G, qc, kc, bc = gam[c], q[c], k[c], beta[c]
        aqk = torch.tril((qc * G) @ (kc / G).T)
        L = torch.tril((bc[:, None] * kc * G) @ (kc / G).T, -1)
        w = torch.linalg.solve(torch.eye(C, dtype=torch.float64) + L, bc[:, None] * kc * G)
        ops.append((aqk, kc * (G[-1] / G), qc * G, w, G[-1]))
    do = rn(nc, C, V)
    do = (do.half().double() if fp16_do else rnd_bits(do, 7))  # the input dtype's values
    dht = rn(K, V)

    def rec(r):
        S = dht.clone()
        dus = []
        for c in range(nc - 1, -1, -1):
            aqk, kend, qg, w, gl = ops[c]
            dO = r(do[c])
            dU = scale * (r(aqk).T @ dO) + r(kend) @ r(S)
            S = gl[:, None] * S + scale * (r(qg).T @ dO) - r(w).T @ r(dU)
            dus.append(dU)
        return S, torch.stack(dus)

    S0, U0 = rec(lambda x: x)
    S1, U1 = rec(lambda x: rnd_bits(x, bits))
    e = lambda a, b: ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
    return e(S1, S0), e(U1, U0)


def main():
    for kda in (True, False):
        for fp16_do in (False, True):
            for gd in (0.1, 1.0, 10.0):
                for nc in (16, 64):
                    b = run(nc, gd, 7, kda, fp16_do)
                    t = run(nc, gd, 10, kda, fp16_do)
                    print(f"{'kda' if kda else 'gdn'} {'fp16' if fp16_do else 'bf16'} gates/{gd} chunks {nc}: "
                          f"bf16 operands dh0 {b[0]:.2e} dU {b[1]:.2e} | tf32 operands dh0 {t[0]:.2e} dU {t[1]:.2e}",
                          flush=True)


if __name__ == "__main__":
    main()
