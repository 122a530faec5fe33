"""Interleaved A/B microbenchmark of our GDN (or --family kda) chunked prefill (CPU variant), per-thread CPU time.

    python benchmarks/cpu/ab_gdn_prefill.py --T 512 4096 --set "" "KDA_DEV_X=1 KDA_DEV_Y=2" --rounds 5
    python benchmarks/cpu/ab_gdn_prefill.py --builds old=/work/main/build new=build --rounds 20

--builds NAME=DIR ... alternates the cpu variants built into each DIR instead (loaded side by side in one process:
each build has its own op namespace); --set then applies to every one of them.

Each --set is one setting: space-separated NAME=VALUE environment variables (every other KDA_DEV_* variable is
unset while it runs; "" = none, the default path). Each round runs (after one untimed warm-up call per T) every setting, in rotated order, once per T (alternating, same process, same inputs) and records the calling
thread's CPU time (time.thread_time) of one call; the table shows the minimum over rounds in us per token.
With --threads 2 the wall time is used instead (the work runs on OpenMP threads).
Shapes as the CPU benchmark: B=1, H=HV=32, K=V=128, fp32, initial state, final state.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "cpu"))
from benchmark_cpu import load_variant, variants  # noqa: E402


def inputs(T, family="gdn", H=32, K=128, V=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn((1, T, H) if family == "gdn" else (1, T, H, K), generator=gen))
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(1, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--set", nargs="+", default=[""], help="settings to alternate (see above)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--family", choices=["gdn", "kda"], default="gdn")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--build", type=Path, default=ROOT / "build")
    ap.add_argument("--builds", nargs="+", default=None, help="NAME=DIR: cpu variants to alternate")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.builds:
        mods = {}
        for nb in a.builds:
            nm, dirname = nb.split("=", 1)
            cpu = [p for p in Path(dirname).glob("torch*-cpu-x86_64-linux") if (p / "metadata.json").exists()]
            mods[nm] = load_variant(cpu[0])
            assert mods[nm].NATIVE
    else:
        mods = {"": variants(a.build)[0]}
    vals = [(m, st) for m in mods for st in a.set]

    def label(val):
        return " ".join(x for x in val if x) or "default"

    def apply(setting):
        for key in [k for k in os.environ if k.startswith("KDA_DEV_")]:
            del os.environ[key]
        for kv in setting.split():
            key, val = kv.split("=", 1)
            os.environ[key] = val
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    data = {T: inputs(T, a.family) for T in a.T}
    api = "chunk_gated_delta_rule" if a.family == "gdn" else "chunk_kda"
    ref = {}
    best = {(T, v): float("inf") for T in a.T for v in vals}
    for r in range(a.rounds):
        for T in a.T:
            q, k, v, g, beta, h0 = data[T]
            with torch.no_grad():  # untimed warm-up: the inputs of this T back in cache for every setting alike
                getattr(mods[vals[0][0]], api)(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            for val in vals[r % len(vals):] + vals[:r % len(vals)]:  # rotated: no setting always runs first
                apply(val[1])
                fn = getattr(mods[val[0]], api)
                with torch.no_grad():
                    t0 = clock()
                    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                    dt = clock() - t0
                if r == 0:  # the settings must agree
                    if T in ref:
                        eo = (o - ref[T][0]).abs().max().item()
                        es = (s - ref[T][1]).abs().max().item()
                        print(f"T={T} [{label(val)}]: max|do| {eo:.2e} max|dS| {es:.2e} vs [{label(vals[0])}]", flush=True)
                    else:
                        ref[T] = (o, s)
                best[(T, val)] = min(best[(T, val)], dt * 1e6 / T)
        print(f"round {r}: " + "  ".join(f"T={T} {label(val)}: {best[(T, val)]:.1f}" for T in a.T for val in vals),
              flush=True)
    apply("")
    print(f"\nus/token (min of {a.rounds} interleaved rounds, {a.threads} thread(s), "
          f"{'thread CPU time' if a.threads == 1 else 'wall time'}), load {os.getloadavg()}")
    for T in a.T:
        print(f"T={T}: " + "  ".join(f"[{label(val)}]: {best[(T, val)]:.1f}" for val in vals))
    if a.json:
        a.json.write_text(json.dumps({"family": a.family, "builds": a.builds, "loadavg_end": os.getloadavg(),  "threads": a.threads, "rounds": a.rounds,
                                      "us_per_token": {f"T={T} [{label(val)}]": best[(T, val)] for T in a.T for val in vals}},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
