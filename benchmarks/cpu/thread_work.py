"""Where a 2-thread speed-up is lost: CPU-time accounting of ours at 1 vs 2 threads (benchmark_cpu.py's rows).

    python benchmarks/cpu/thread_work.py [--cases decode:1,prefill:512,fwd+bwd:512] [--rounds 4] [--block-s 1]

Wall time at 2 threads on this shared 2-vCPU VM mostly measures the neighbours (one busy process turns every
2-thread region into a scheduler time slice). CPU time does not count the time a thread waits to be scheduled, so
the ratio "process CPU time per call at 2 threads / at 1 thread" (work inflation) says what running the same work on
two cores costs over one, and the main thread's share of it at 2 threads says how evenly the work is split (50 % =
even; the rest of a 1/2 split is serial work or imbalance on the calling thread). Ideal: inflation 1.00, share 50 %;
then whatever 2-thread wall time loses on an idle machine is the machine's, not the code's. Runs with
OMP_WAIT_POLICY=PASSIVE (re-executing itself if unset) so idle OpenMP threads sleep instead of spinning on CPU
time; for short calls (decode, ~100 us) the futex wake-ups that this costs show up as inflation (~10-15 us a call).
1 and 2 threads alternate per round (the order flips every round); medians over rounds.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if os.environ.get("OMP_WAIT_POLICY") is None:  # must be set before the OpenMP runtime starts
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "cpu"))
import benchmark_cpu as bc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="decode:1,prefill:512,fwd+bwd:512", help="mode:T,...")
    ap.add_argument("--families", default="kda,gdn")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block-s", type=float, default=1.0, help="seconds per thread count per round (>= 1 call)")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build")
    args = ap.parse_args()
    ours, uni = bc.variants(args.build_dir.resolve())
    print(f"[thread_work] OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load {os.getloadavg()}", flush=True)
    for family in args.families.split(","):
        table = bc.impls(family, ours, uni)["ours"]
        for case in args.cases.split(","):
            mode, T = case.split(":")
            fn = table[mode](int(T))
            r = {1: [], 2: []}
            for rnd in range(args.rounds):
                for n in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                    torch.set_num_threads(n)
                    fn()
                    c0, w0, m0, calls = time.process_time(), time.perf_counter(), time.thread_time(), 0
                    while time.perf_counter() - w0 < args.block_s or calls == 0:
                        fn()
                        calls += 1
                    r[n].append(((time.process_time() - c0) / calls, (time.perf_counter() - w0) / calls,
                                 (time.thread_time() - m0) / calls))

            def med(n, i):
                return statistics.median(x[i] for x in r[n])

            infl = statistics.median(b[0] / a[0] for a, b in zip(r[1], r[2]))
            share = statistics.median(b[2] / b[0] for b in r[2])
            print(f"{family} {mode:8s} T={T:5s} CPU per call: 1 thread {med(1, 0) * 1e3:9.3f} ms, 2 threads "
                  f"{med(2, 0) * 1e3:9.3f} ms (work inflation x{infl:.3f}; calling thread's share {share * 100:.0f} %)"
                  f"   wall: {med(1, 1) * 1e3:9.3f} / {med(2, 1) * 1e3:9.3f} ms   load {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
