"""Decode (T=1 serving step) microbenchmark of the cpu variant: public-API overhead and 1 vs 2 threads.

    python benchmarks/cpu/ab_decode.py api [--rounds 30]            # public API vs the bare op, 1 thread
    python benchmarks/cpu/ab_decode.py threads [--H 4 8 32]         # the op at 1 and 2 threads, by head count

`api`: per round, fused_recurrent_kda / fused_recurrent_gated_delta_rule (ssm_state_indices=[0], in place, under
torch.no_grad, as benchmark_cpu.py's "ours via public API") and the bare *_recurrent_serve op (also under no_grad)
alternate, 20 calls each; the calling thread's CPU time (time.thread_time_ns) of one call, minimum over all.
`threads`: the bare op at 1 and 2 threads interleaved round by round (scaling.alternate: per round, each thread count
for ~20 calls, its fastest call), wall time (the work runs on OpenMP threads); the speed-up is the median of the
per-round ratios [the ratio of the two minima]; H heads of a 128 x 128 fp32 state (64 KiB each; H=32 is the
benchmark's 2 MiB). In the same rounds the machine probes of scaling.py run the same way (an L2-resident matmul, an
in-place stream over 2 MiB, one over 64 MiB), and the CPU other processes / the hypervisor took is printed.
This VM drifts 20-40 % and its two cores are shared: read ratios of the same rounds, run a few times.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "cpu"))
from benchmark_cpu import variants  # noqa: E402
from scaling import CpuShare, alternate, machine_probes, probe_round, ratio_summary  # noqa: E402

K = V = 128


def inputs(family, H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, H, K, generator=gen)
    k = F.normalize(torch.randn(1, 1, H, K, generator=gen), dim=-1)
    v = torch.randn(1, 1, H, V, generator=gen)
    g = F.logsigmoid(torch.randn((1, 1, H, K) if family == "kda" else (1, 1, H), generator=gen))
    beta = torch.rand(1, 1, H, generator=gen)
    pool = torch.randn(1, H, K, V, generator=gen) * 0.01
    return q, k, v, g, beta, pool, torch.zeros(1, dtype=torch.long)


def api_overhead(mod, family, rounds):
    q, k, v, g, beta, pool, idx = inputs(family, 32)
    fn = mod.fused_recurrent_kda if family == "kda" else mod.fused_recurrent_gated_delta_rule
    op = getattr(mod.ops, f"{family}_recurrent_serve")

    def api():
        with torch.no_grad():
            fn(q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)

    def bare():
        with torch.no_grad():
            op(q, k, v, g, beta, K ** -0.5, pool, idx, None, None, False)

    torch.set_num_threads(1)
    best = {"api": float("inf"), "op": float("inf")}
    for _ in range(rounds):
        for name, f in (("api", api), ("op", bare)):
            f()
            for _ in range(20):
                t0 = time.thread_time_ns()
                f()
                best[name] = min(best[name], time.thread_time_ns() - t0)
    print(f"{family}: public API {best['api'] / 1e3:7.1f} us   bare op {best['op'] / 1e3:7.1f} us   "
          f"API overhead {(best['api'] - best['op']) / 1e3:5.1f} us", flush=True)


def thread_scaling(mod, family, H, rounds, probes):
    q, k, v, g, beta, pool, idx = inputs(family, H)
    op = getattr(mod.ops, f"{family}_recurrent_serve").default
    samples, probe_s, share = {}, {}, CpuShare()
    for _ in range(rounds):
        alternate(lambda: op(q, k, v, g, beta, K ** -0.5, pool, idx, None, None, False), (1, 2), rounds=1,
                  block_s=0.002, samples=samples)
        probe_round(probes, probe_s, (1, 2), block_s=0.004)
    r = ratio_summary(samples)
    one, two = min(samples[1]), min(samples[2])
    m1, m2 = statistics.median(samples[1]), statistics.median(samples[2])
    ceil = "  ".join(f"{p} x{ratio_summary(ps)['median']:.2f}" for p, ps in probe_s.items())
    sh = share.stop()
    print(f"{family} H={H:3d} (state {H * 64:5d} KiB): 1 thread min {one * 1e6:7.1f} / median {m1 * 1e6:7.1f} us"
          f" ({one * 1e6 / H:.2f} us/head)   2 threads min {two * 1e6:7.1f} / median {m2 * 1e6:7.1f} us"
          f"   x{r['median']:.2f} median of {r['rounds']} per-round ratios [x{r['min_based']:.2f} by min]"
          f"   machine, same rounds: {ceil}   others {sh['others']:.2f} + steal {sh['steal']:.2f} cores", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["api", "threads"])
    ap.add_argument("--families", default="kda,gdn")
    ap.add_argument("--H", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build")
    args = ap.parse_args()
    mod, _ = variants(args.build_dir.resolve())
    probes = machine_probes() if args.what == "threads" else None
    for family in args.families.split(","):
        if args.what == "api":
            api_overhead(mod, family, args.rounds)
        else:
            for H in args.H:
                thread_scaling(mod, family, H, args.rounds, probes)


if __name__ == "__main__":
    main()
