"""Accuracy of the chunked backward's precision choices with bf16 inputs: relative RMS error (DESIGN.md section 6:
dq, dk, dv, dh0 <= 0.008; dg, dbeta <= 0.02) of every gradient against autograd through the float64 reference
(tests/ref_delta.py), for the default kernels and for each variant of host knobs, one JSON line per (family, case,
variant), then the worst error per variant over the cases. Needs a CUDA GPU and the built CUDA variant (as
tests/test_cuda_chunk_bwd.py).

    python3 benchmarks/cuda/bwd_accuracy.py "KDA_CUDA_CHUNK_BWD_STATE_BWD=4" "KDA_CUDA_CHUNK_BWD_STATE_BWD=4,KDA_CUDA_CHUNK_BWD_VC=3"

(each argument one variant: comma-separated NAME=VALUE knobs; the knobs are read at every call.)
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cuda_variant import knobs_set  # noqa: E402
from ref_delta import ref_delta_rule, rel_err  # noqa: E402
from test_cuda_backend import DEV, OPS, make_inputs  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
BOUND = dict(dq=0.008, dk=0.008, dv=0.008, dh0=0.008, dg=0.02, dbeta=0.02)
CASES = {
    "T200_correlated": dict(B=1, T=200, H=1, HV=2, keys="correlated"),
    "extreme_gates": dict(B=1, T=200, H=1, HV=2, extreme=True, gate_div=0.1),
    "extreme_gates_mild_T1000": dict(B=1, T=1000, H=1, HV=2, extreme=True),
    "gate_div_10_T1000": dict(B=1, T=1000, H=1, HV=1, gate_div=10.0),
    "T2048_gva": dict(B=1, T=2048, H=1, HV=2),
}


def case_inputs(family, spec):
    """bf16 inputs of one case (make_inputs, seed 3), h0 / dht / cotangent (seed 9), the scale, and every gradient of
    (o . do + final state . dht) through the float64 reference: (q, k, v, g, beta, h0, dht, do, scale, ref)."""
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
    return q, k, v, g, beta, h0, dht, do, scale, torch.autograd.grad(loss, xs + [h0r])


def main(variants):
    worst = {}
    for family in ("kda", "gdn"):
        for case, spec in CASES.items():
            q, k, v, g, beta, h0, dht, do, scale, ref = case_inputs(family, spec)
            for variant in ["default"] + variants:
                knobs = {} if variant == "default" else dict(kv.split("=") for kv in variant.split(","))
                with knobs_set(knobs):
                    out = [x.cpu() for x in getattr(OPS, f"{family}_chunk_bwd")(q, k, v, g, beta, scale, h0, None,
                                                                              do, dht)]
                errs = {n: float("%.3g" % rel_err(r, o)) for n, r, o in zip(NAMES, ref, out)}
                print(json.dumps({"family": family, "case": case, "variant": variant, "vs_ref": errs}), flush=True)
                w = worst.setdefault(variant, {})
                for n, e in errs.items():
                    w[n] = max(w.get(n, 0.0), e)
    for variant, w in worst.items():
        ok = all(e <= BOUND[n] for n, e in w.items())
        print(json.dumps({"variant": variant, "worst_vs_ref": w, "within_design_6": ok}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
