"""One decode call at B=256 (H=16, HV=32, K=V=128) for Nsight Compute, after a warm-up call:

    ncu --set full -k regex:delta_decode -s 1 -c 1 python3 benchmarks/cuda/profile_decode.py --op kda_serve_bf16

--op: {kda,gdn}_{core,serve_fp32,serve_bf16}. The decode knobs (KDA_CUDA_DEC_CFG, KDA_CUDA_DEC_STAGE,
KDA_CUDA_DEC_HINT (the kernels with session 7's run-time hint tests), KDA_CUDA_DEC_FUSE, KDA_CUDA_DEC_LEAN,
KDA_CUDA_DECODE) apply as set in the environment, e.g. old vs new (two ncu runs):

    ncu -k regex:delta_decode -s 1 -c 1 python3 benchmarks/cuda/profile_decode.py --op kda_serve_bf16 (default)
    KDA_CUDA_DEC_HINT=2 ncu ...   (bf16: session 7's default kernel; fp32: KDA_CUDA_DEC_HINT=0)
    KDA_CUDA_DEC_LEAN=1 ncu ...   (session 10's kernels with fewer instructions per item; =2: more blocks per SM)
"""
import argparse

import torch

from bench_cuda import mk
from cuda_variant import load_cuda_variant

ap = argparse.ArgumentParser()
ap.add_argument("--op", default="kda_serve_bf16")
ap.add_argument("--B", type=int, default=256)
a = ap.parse_args()
fam, what = a.op.split("_", 1)
ops = load_cuda_variant("kda_cuda_prof").ops
H, HV, K, V = 16, 32, 128, 128
q, k, v, g, beta = mk(a.B, 1, H, HV, K, V, fam == "kda")
beta = beta.float()
h0 = torch.randn(a.B, HV, K, V, device="cuda")
with torch.inference_mode():
    if what == "core":
        fn = lambda: getattr(ops, f"{fam}_recurrent_fwd")(q, k, v, g, beta, K ** -0.5, h0, None)  # noqa: E731
    else:
        pool = h0 if what == "serve_fp32" else h0.to(torch.bfloat16)
        idx = torch.arange(a.B, device="cuda")
        fn = lambda: getattr(ops, f"{fam}_recurrent_serve")(  # noqa: E731
            q, k, v, g, beta, K ** -0.5, pool, idx, None, None, False)
    fn()
    fn()
    torch.cuda.synchronize()
print("done", a.op)
