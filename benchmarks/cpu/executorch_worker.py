"""Times ExecuTorch's llama::gated_delta_rule CPU op; run by benchmark_cpu.py inside .venv-executorch.

    .venv-executorch/bin/python benchmarks/cpu/executorch_worker.py '<json list of cases>'   # one shot
    .venv-executorch/bin/python benchmarks/cpu/executorch_worker.py --serve   # one JSON case per stdin line

Each case: {"family": "kda"|"gdn", "T": int, "threads": int, "H": 32, "K": 128, "V": 128, "min_time_s": float}.
ExecuTorch's layout is [B, H, T, K] (head-major), its decay is already exponentiated (per channel [B,H,T,K] or
per head [B,H,T]) and it applies no scale, so q is pre-scaled here as its own model code does. One shot: prints
one JSON list with us_per_token for each case; --serve: answers each line with one JSON object (so the benchmark
can time ExecuTorch and ours in alternating rounds from one long-lived process). Forward only: the op has no
backward.
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers torch.ops.llama.*)

OP = torch.ops.llama.gated_delta_rule.default


def bench(fn, min_time_s):
    fn()
    times, total = [], 0.0
    while total < min_time_s or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
        if len(times) >= 200:
            break
    return min(times)


_INPUTS = {}


def time_case(c):
    torch.set_num_threads(c["threads"])
    key = (c["family"], c["T"], c["H"], c["K"], c["V"])
    if key not in _INPUTS:  # the same inputs for every round of a case
        torch.manual_seed(0)
        B, H, T, K, V = 1, c["H"], c["T"], c["K"], c["V"]
        q = torch.randn(B, H, T, K) * K ** -0.5
        k = F.normalize(torch.randn(B, H, T, K), dim=-1)
        v = torch.randn(B, H, T, V)
        g = F.logsigmoid(torch.randn((B, H, T, K) if c["family"] == "kda" else (B, H, T)))
        decay = g.exp()
        beta = torch.rand(B, H, T)
        state = torch.randn(B, H, K, V)
        _INPUTS.clear()
        _INPUTS[key] = (q, k, v, decay, beta, state)
    t = bench(lambda: OP(*_INPUTS[key]), c["min_time_s"])
    return dict(c, us_per_token=t / c["T"] * 1e6, executorch=__import__("executorch").version.__version__
                if hasattr(__import__("executorch"), "version") else "unknown")


def main():
    if sys.argv[1:] == ["--serve"]:
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(time_case(json.loads(line))), flush=True)
        return
    print(json.dumps([time_case(c) for c in json.loads(sys.argv[1])]))


if __name__ == "__main__":
    main()
