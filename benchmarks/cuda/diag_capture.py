#!/usr/bin/env python3
"""Which part of a public chunked call breaks CUDA graph capture? Each case runs in its own child process (a failed
capture poisons the process) and prints OK or the error's last lines.

    python benchmarks/cuda/diag_capture.py            # every case
    python benchmarks/cuda/diag_capture.py CASE       # one case (what the parent runs in each child)
"""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

# case: (family, what, cu_seqlens or None, B, T, H, HV)
CASES = {
    "fwd_cu_empty": ("kda", "fwd", [0, 64, 64, 200], 1, 200, 2, 4),
    "fwd_cu_full": ("kda", "fwd", [0, 64, 128, 192], 1, 192, 2, 4),
    "fwdbwd_cu_empty": ("kda", "fwdbwd", [0, 64, 64, 200], 1, 200, 2, 4),
    "fwdbwd_cu_full": ("kda", "fwdbwd", [0, 64, 128, 192], 1, 192, 2, 4),
    "fwdbwd_nocu_T200": ("kda", "fwdbwd", None, 1, 200, 2, 4),
    "fwdbwd_nocu_T192": ("kda", "fwdbwd", None, 1, 192, 2, 4),
    "fwdbwd_cu_big": ("kda", "fwdbwd", [0, 512, 1024], 1, 1024, 16, 32),
    "bwdop_cu_empty": ("kda", "bwdop", [0, 64, 64, 200], 1, 200, 2, 4),
    "bwdop_nocu_T192": ("kda", "bwdop", None, 1, 192, 2, 4),
    "gdn_fwdbwd_cu_empty": ("gdn", "fwdbwd", [0, 64, 64, 200], 1, 200, 2, 4),
    "gdn_fwdbwd_nocu_T192": ("gdn", "fwdbwd", None, 1, 192, 2, 4),
}


def run_test_function(name):
    """The test itself (tests/test_cuda_backend.py::test_public_api_captures_in_cuda_graphs) without pytest, with and
    without the warning recorder of its autouse fixture; and the diag's step on the test's make_inputs."""
    import warnings
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, os.path.join(root, "tests"))
    os.environ["KDA_TEST_CAPTURE_CHILD"] = "1"
    import test_cuda_backend as t
    family = "gdn" if "gdn" in name else "kda"
    if name.startswith("test_warn"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t.test_public_api_captures_in_cuda_graphs(family, "chunk_varlen")
        print([str(w.message)[:200] for w in caught])
    else:
        t.test_public_api_captures_in_cuda_graphs(family, "chunk_varlen")
    print("OK")


TEST_CASES = ["test_plain_kda", "test_warn_kda", "test_plain_gdn"]


def run_case(name):
    if name in TEST_CASES:
        return run_test_function(name)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
    from cuda_variant import load_cuda_variant
    kk = load_cuda_variant()
    family, what, cu, B, T, H, HV = CASES[name]
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    k = F.normalize(torch.randn(B, T, H, 128, generator=gen), dim=-1).bfloat16().to(dev)
    v = torch.randn(B, T, HV, 128, generator=gen).bfloat16().to(dev)
    g = F.logsigmoid(torch.randn(*((B, T, HV, 128) if family == "kda" else (B, T, HV)), generator=gen)).to(dev)
    beta = torch.rand(B, T, HV, generator=gen).to(dev)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.long, device=dev)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    do = torch.randn_like(v)
    fwd = kk.chunk_kda if family == "kda" else kk.chunk_gated_delta_rule
    N = B if cu is None else len(cu) - 1

    def step():
        if what == "fwd":
            with torch.no_grad():
                return fwd(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_t)
        if what == "bwdop":
            ops = kk.ops
            return getattr(ops, f"{family}_chunk_bwd")(q, k, v, g, beta, 128 ** -0.5, None, cu_t, do,
                                                       torch.ones(N, HV, 128, 128, device=dev))
        o, s = fwd(*xs, output_final_state=True, cu_seqlens=cu_t)
        return (o, s) + torch.autograd.grad((o, s), xs, (do, torch.ones_like(s)))
    step()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    print("OK")


def main():
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return
    for name in list(CASES) + TEST_CASES:
        r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=300)
        tail = (r.stdout + r.stderr).strip().splitlines()
        msg = "OK" if r.returncode == 0 else " | ".join(l for l in tail if "Error" in l or "error" in l)[-600:]
        print(f"{name:24s} {msg}", flush=True)
        if r.returncode != 0 or name.startswith("test_warn"):
            print("\n".join(tail[-60:]), flush=True)


if __name__ == "__main__":
    main()
