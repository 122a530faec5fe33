"""Compile flash-linear-attention 0.6.0's kernels without timing anything: one chunked forward + backward of KDA and
GDN at the benchmark's shapes, so a benchmark started later in the same device call finds them in Triton's disk cache
(TRITON_CACHE_DIR). Run it in the background while the CUDA variant builds; it does not need our build.

    TRITON_CACHE_DIR=/tmp/triton_cache python3 benchmarks/cuda/fla_warm.py [B1_T8192,...]

Leave TRITON_CACHE_AUTOTUNING unset: then the benchmark's own process autotunes again (a few seconds) on a GPU that
nothing else uses, and the warm-up's autotuning, which may overlap other GPU work, decides nothing.
"""
import sys
import time

import torch

from bench_chunk_fwd import mk as mk_inputs

SHAPES = {"B1_T8192": (1, 8192, 16, 32), "B1_T32768": (1, 32768, 16, 32), "B4_T4096": (4, 4096, 32, 32)}


def main():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["B1_T8192"]
    for name in names:
        B, T, H, HV = SHAPES[name]
        for fam, fn in (("kda", fla_kda), ("gdn", fla_gdn)):
            t0 = time.time()
            xs = [x.requires_grad_(True) for x in mk_inputs(B, T, H, HV, 128, 128, fam == "kda")]
            try:
                o, s = fn(*xs, scale=128 ** -0.5, output_final_state=True)
                torch.autograd.grad((o, s), xs, (torch.randn_like(o), torch.randn_like(s)))
                torch.cuda.synchronize()
                what = "fwd+bwd"
            except Exception as e:  # noqa: BLE001  (fla refuses GDN's backward on Hopper with Triton 3.6)
                torch.cuda.synchronize()
                what = f"fwd only, backward refused: {repr(e)[:120]}"
            print(f"fla warm {name} {fam}: {what} in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
