#!/usr/bin/env python3
"""The pure-PyTorch variant (torch-universal) on this CPU: chunked forward and forward+backward, KDA and GDN.

    .venv/bin/python benchmarks/benchmark_universal.py [--T 8192] [--H 4] [--threads 2]

Writes benchmarks/results/universal_<host>.json and a PNG. Issue #2 asks that B=1, T=8192, H=HV=4, K=V=128,
fp32 forward+backward finish in well under a minute on a 2-core machine; this prints the figure.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _variants import ensure_built, load  # noqa: E402


def machine():
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return dict(cpu=model, cores=os.cpu_count(), torch=torch.__version__, python=platform.python_version(),
                threads=torch.get_num_threads(), loadavg_at_start=os.getloadavg())


def inputs(family, T, H, K, V, requires_grad):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=g)
    k = F.normalize(torch.rand(1, T, H, K, generator=g), dim=-1)
    v = torch.randn(1, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn((1, T, H, K) if family == "kda" else (1, T, H), generator=g))
    beta = torch.rand(1, T, H, generator=g)
    xs = [q, k, v, gate, beta]
    return [x.requires_grad_(requires_grad) for x in xs]


def timed(fn, repeat):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["KDA_KERNELS_QUIET_FALLBACK"] = "1"
    ensure_built("universal")
    mod = load("torch-universal")
    rows = []
    for family, fn in (("kda", mod.chunk_kda), ("gdn", mod.chunk_gated_delta_rule)):
        x = inputs(family, args.T, args.H, args.K, args.K, False)
        fwd = timed(lambda: fn(*x), args.repeat)
        xg = inputs(family, args.T, args.H, args.K, args.K, True)

        def fwd_bwd():
            o, _ = fn(*xg)
            o.sum().backward()
        fb = timed(fwd_bwd, args.repeat)
        rows.append(dict(family=family, B=1, T=args.T, H=args.H, HV=args.H, K=args.K, V=args.K, dtype="float32",
                         fwd_s=fwd, fwd_bwd_s=fb))
        print(f"{family}: B=1 T={args.T} H=HV={args.H} K=V={args.K} fp32  forward {fwd:6.2f} s   "
              f"forward+backward {fb:6.2f} s", flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"universal_T{args.T}_H{args.H}"
    (out / f"{stem}.json").write_text(json.dumps(dict(machine=machine(), variant=mod.VARIANT, rows=rows), indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    labels = [r["family"] for r in rows]
    ax.bar([i - 0.2 for i in range(len(rows))], [r["fwd_s"] for r in rows], 0.4, label="forward")
    ax.bar([i + 0.2 for i in range(len(rows))], [r["fwd_bwd_s"] for r in rows], 0.4, label="forward+backward")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("seconds")
    ax.set_title(f"pure PyTorch, B=1 T={args.T} H={args.H} K=V={args.K} fp32\n{machine()['cpu']}, "
                 f"{args.threads} threads", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
