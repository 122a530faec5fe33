"""Accuracy of the backward's state_fwd kernels (KDA_CUDA_CHUNK_BWD_STATE_FWD = 2 fp32 SIMT, 3 tensor cores 3xTF32,
7 tensor cores tf32 with 16 columns per block, the default; 4, tf32 with 32 columns, was retired in session 11) with
bf16 inputs: relative RMS error (DESIGN.md section 6) of every gradient against autograd through the float64
reference (tests/ref_delta.py), and of modes 3 / 7 against mode 2, one JSON line per (family,
case, mode). Needs a CUDA GPU and the built CUDA variant (as tests/test_cuda_chunk_bwd.py)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from bwd_accuracy import NAMES, case_inputs  # noqa: E402
from ref_delta import rel_err  # noqa: E402
from test_cuda_backend import OPS  # noqa: E402

CASES = {
    "T200_correlated": dict(B=1, T=200, H=1, HV=2, keys="correlated"),
    "extreme_gates": dict(B=1, T=200, H=1, HV=2, extreme=True, gate_div=0.1),
    "extreme_gates_mild_T1000": dict(B=1, T=1000, H=1, HV=2, extreme=True),
    "gate_div_10_T1000": dict(B=1, T=1000, H=1, HV=1, gate_div=10.0),
}


def main():
    for family in ("kda", "gdn"):
        for case, spec in CASES.items():
            q, k, v, g, beta, h0, dht, do, scale, ref = case_inputs(family, spec)
            outs = {}
            for mode in ("2", "3", "7"):
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
