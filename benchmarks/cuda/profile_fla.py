"""Per-kernel times of flash-linear-attention 0.6.0's chunked forward (and forward+backward) at one shape, with the
same inputs as bench_chunk_fwd.py, beside ours in the same process (torch.profiler; the kernels' own device times,
mean of 5 calls after a warm-up). Where fla spends its 0.48 ms (GDN) / 0.96 ms (KDA) tells which of our stages is
out of line.

    OUT=/tmp/o python3 benchmarks/cuda/profile_fla.py            # B1 T8192 H16 HV32, both families, forward only
    PROFILE_FLA_BWD=1 ...                                         # also forward+backward

Writes $OUT/fla_kernel_times.json.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_chunk_fwd import load_ours, mk  # noqa: E402
from profile_chunk import kernel_times  # noqa: E402


def main():
    from fla.ops.kda import chunk_kda
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    ours = load_ours()
    B, T, H, HV, K = 1, 8192, 16, 32, 128
    res = {"gpu": torch.cuda.get_device_name(), "shape": f"B{B}_T{T}_H{H}_HV{HV}_K{K}"}
    for fam, ffn in (("kda", chunk_kda), ("gdn", chunk_gated_delta_rule)):
        q, k, v, g, beta = mk(B, T, H, HV, K, K, fam == "kda")
        bb = beta.bfloat16()
        with torch.inference_mode():
            res[f"{fam}_fla_fwd"] = kernel_times(lambda: ffn(q, k, v, g, bb, scale=K ** -0.5, output_final_state=True))
            op = getattr(ours.ops, f"{fam}_chunk_fwd")
            res[f"{fam}_ours_fwd"] = kernel_times(lambda: op(q, k, v, g, beta, K ** -0.5, None, None))
        for key in (f"{fam}_fla_fwd", f"{fam}_ours_fwd"):
            print(key, f"sum {sum(res[key].values()):.4f} ms", flush=True)
            for name, ms in res[key].items():
                print(f"  {ms:8.4f}  {name}", flush=True)
        if os.environ.get("PROFILE_FLA_BWD") == "1" and fam == "kda":  # fla refuses GDN backward on Hopper/Triton 3.6
            xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g)] + [bb.detach().clone().requires_grad_(True)]
            do = torch.randn_like(v)

            def fb():
                o, _ = ffn(*xs, scale=K ** -0.5, output_final_state=True)
                o.backward(do)
            res[f"{fam}_fla_fwdbwd"] = kernel_times(fb)
            print(f"{fam}_fla_fwdbwd sum {sum(res[f'{fam}_fla_fwdbwd'].values()):.4f} ms", flush=True)
            for name, ms in res[f"{fam}_fla_fwdbwd"].items():
                print(f"  {ms:8.4f}  {name}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fla_kernel_times.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
