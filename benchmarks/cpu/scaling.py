"""Thread-scaling measurement shared by the CPU benchmarks (benchmark_cpu.py, ab_decode.py).

* alternate(): 1- and 2-thread calls of one function interleaved, round by round (the order flips every round), so a
  slow phase of this shared VM lands on both thread counts instead of biasing one; the speed-up is then read as the
  median of the per-round ratios, next to the ratio of the two minima.
* machine_probes(): the machine's own ceiling for thread scaling, measured the same way in the same rounds: an
  FMA-bound matmul that sits in L2 and an in-place stream over 2 MiB (a decode step's H=32 K=V=128 fp32 state: read
  and written once per call) and over 64 MiB (beyond the 48 MB L3: main memory). Plain torch ops through the same
  OpenMP pool as ours, so they see the same wake-up cost, core sharing and memory system; nothing to build.
* CpuShare: how much CPU the rest of the machine took during a stretch of the run (other processes, and the
  hypervisor's steal time), from /proc/stat and /proc/self/stat; 0 where those are not readable.
"""
import os
import statistics
import time

import torch


def alternate(fn, threads=(1, 2), rounds=5, block_s=0.02, samples=None, warm=False):
    """Times fn() at each thread count, interleaved: `rounds` rounds, each running every thread count (in reverse
    order on odd rounds) for about block_s (at least one timed call, after one untimed call when a call is shorter
    than 20 ms: the first region after a thread-count change pays for it). A round's value for a thread count is
    its fastest call there. warm: one untimed call first (a case's first call pays for page faults and scratch
    growth; longer calls get no untimed call per round). Returns {n: [seconds per round]}, appended to `samples`
    if given."""
    samples = samples if samples is not None else {}
    for n in threads:
        samples.setdefault(n, [])
    prev = torch.get_num_threads()
    try:
        if warm:
            torch.set_num_threads(threads[0])
            fn()
        for rnd in range(rounds):
            for n in (threads if rnd % 2 == 0 else tuple(reversed(threads))):
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                fn()
                first = time.perf_counter() - t0
                best, total = (first, first) if first >= 0.02 else (float("inf"), 0.0)
                while total < block_s or best == float("inf"):
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    best, total = min(best, dt), total + dt
                samples[n].append(best)
    finally:
        torch.set_num_threads(prev)
    return samples


def ratio_summary(samples, base=1, other=2):
    """Speed-up of `other` threads over `base`: median of the per-round ratios, and the ratio of the minima."""
    a, b = samples.get(base, []), samples.get(other, [])
    if not a or not b:
        return None
    per_round = [x / y for x, y in zip(a, b)]
    return dict(median=statistics.median(per_round), min_based=min(a) / min(b), rounds=len(per_round),
                per_round=[round(r, 3) for r in per_round])


PROBES = {  # name -> description (printed once with the results)
    "fma": "torch.mm 256x256x256 fp32 (MKL; 768 KiB, L2-resident: FMA-bound)",
    "stream2M": "x.mul_(-1) over 2 MiB in place (one decode step's H=32 state: read + write)",
    "stream64M": "x.mul_(-1) over 64 MiB in place (beyond L3: main memory)",
}


def machine_probes():
    """name -> thunk for each PROBES entry (the tensors are allocated and touched here, once)."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen), torch.empty(256, 256)
    x2 = torch.randn(512 * 1024, generator=gen)
    x64 = torch.randn(16 * 1024 * 1024, generator=gen)
    return {"fma": lambda: torch.mm(a, b, out=c), "stream2M": lambda: x2.mul_(-1.0),
            "stream64M": lambda: x64.mul_(-1.0)}


def probe_round(probes, samples, threads=(1, 2), block_s=0.01):
    """One interleaved round of every probe; samples: {name: {n: [...]}} (filled in)."""
    for name, fn in probes.items():
        alternate(fn, threads, rounds=1, block_s=block_s, samples=samples.setdefault(name, {}))


class CpuShare:
    """Cores' worth of CPU that others took between start() and stop(): other processes (busy time of the whole
    machine minus this process's own) and steal (the hypervisor running someone else on our vCPUs)."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                s = f.read().rsplit(")", 1)[1].split()
            busy = sum(v[:8]) - v[3] - v[4]  # user nice system idle iowait irq softirq steal: all but idle/iowait
            steal = v[7] if len(v) > 7 else 0
            return busy - steal, steal, int(s[11]) + int(s[12])  # utime + stime of every thread of ours
        except (OSError, ValueError, IndexError):
            return None

    def start(self):
        self.t0, self.r0 = time.perf_counter(), self._read()

    def stop(self):
        """{'others': cores, 'steal': cores} since start(), or zeros where /proc is unreadable."""
        r1, dt = self._read(), time.perf_counter() - self.t0
        if r1 is None or self.r0 is None or dt <= 0:
            return dict(others=0.0, steal=0.0)
        busy, steal, mine = (x - y for x, y in zip(r1, self.r0))
        return dict(others=round(max(0.0, (busy - mine) / self.hz / dt), 2), steal=round(steal / self.hz / dt, 2))
