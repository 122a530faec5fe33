"""Accuracy of the backward's state_fwd kernels (KDA_CUDA_CHUNK_BWD_STATE_FWD = 2 fp32 SIMT, 3 tensor cores 3xTF32,
4 tensor cores tf32) with bf16 inputs: relative RMS error (DESIGN.md section 6) of every gradient against autograd
through the float64 reference (tests/ref_delta.py), and of modes 3 / 4 against mode 2, one JSON line per (family,
case, mode). Needs a CUDA GPU and the built CUDA variant (as tests/test_cuda_chunk_bwd.py)."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from ref_delta import ref_delta_rule, rel_err  # noqa: E402
from test_cuda_backend import DEV, OPS, make_inputs  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
CASES = {
    "T200_correlated": dict(B=1, T=200, H=1, HV=2, keys="correlated"),
    "extreme_gates": dict(B=1, T=200, H=1, HV=2, extreme=True, gate_div=0.1),
    "extreme_gates_mild_T1000": dict(B=1, T=1000, H=1, HV=2, extreme=True),
    "gate_div_10_T1000": dict(B=1, T=1000, H=1, HV=1, gate_div=10.0),
}


def main():
    for family in ("kda", "gdn"):
        for case, spec in CASES.items():
            q, k, v, g, beta = make_inputs(family, dtype=torch.bfloat16, seed=3, **spec)
            N, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
            gen = torch.Generator().manual_seed(9)
            h0 = (torch.randn(N, HV, K, V, generator=gen) * 0.5).to(DEV)
            dht = torch.randn(N, HV, K, V, generator=gen).to(DEV)
            do = torch.randn(*v.shape, generator=gen).to(DEV).to(torch.bfloat16)
            scale = K ** -0.5
            xs = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v, g, beta)]
            h0r = h0.cpu().double().requires_grad_(True)
            ro, rs = ref_delta_rule(*xs, scale=scale, initial_state=h0r)
            loss = (ro * do.cpu().double()).sum() + (rs * dht.cpu().double()).sum()
            ref = torch.autograd.grad(loss, xs + [h0r])
            outs = {}
            for mode in ("2", "3", "4"):
                os.environ["KDA_CUDA_CHUNK_BWD_STATE_FWD"] = mode
                outs[mode] = [x.cpu() for x in getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, scale, h0, None,
                                                                                    do, dht)]
                row = {"family": family, "case": case, "mode": int(mode),
                       "vs_ref": {n: float("%.3g" % rel_err(r, o)) for n, r, o in zip(NAMES, ref, outs[mode])}}
                if mode != "2":
                    row["vs_mode2"] = {n: float("%.3g" % rel_err(a.double(), b.double()))
                                       for n, a, b in zip(NAMES, outs["2"], outs[mode])}
                print(json.dumps(row), flush=True)
    os.environ.pop("KDA_CUDA_CHUNK_BWD_STATE_FWD", None)


if __name__ == "__main__":
    main()
