#!/usr/bin/env python3
"""CPU benchmark: kda-kernels' native CPU backend side by side with every CPU peer, in one run.

    .venv/bin/python benchmarks/cpu/benchmark_cpu.py            # full run (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/cpu/benchmark_cpu.py --quick    # T=512 only, fewer repetitions
    .venv/bin/python benchmarks/cpu/benchmark_cpu.py --setup-executorch   # create .venv-executorch first

Peers (B=1, H=HV=32, K=V=128, fp32; per-channel gate "kda" and per-head gate "gdn"):
  * ExecuTorch's llama::gated_delta_rule CPU op (forward only), run in its own venv .venv-executorch
    (`python3 -m venv .venv-executorch && .venv-executorch/bin/pip install executorch==1.5.1 torch==<ours>`,
    which --setup-executorch does), in a subprocess (benchmarks/cpu/executorch_worker.py) that returns JSON;
  * Transformers' own torch fallbacks: chunk_kimi_delta_attention / recurrent_kimi_delta_attention
    (models/kimi_linear) and torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (models/qwen3_next);
  * this project's pure-PyTorch path (the torch-universal variant).
Ours: the cpu variant's public chunk_kda / chunk_gated_delta_rule (prefill, fwd and fwd+bwd) and, for decode,
the serving op (`{kda,gdn}_recurrent_serve`, in place on a state pool: the like-for-like of ExecuTorch's op)
and the public fused_recurrent_* with ssm_state_indices (which adds the Python API's argument checks).
Cases: decode (T=1) and prefill T=512 and T=4096, forward and forward+backward where the peer has one, on 1 and
2 threads (torch.set_num_threads). Times are the minimum wall-clock over repetitions (a shared machine only
ever adds time), reported per token, taken over --rounds rounds that time every implementation (ExecuTorch
included, from a long-lived worker process) and both thread counts back to back, so the host's drift over the run
does not enter the ratios. A peer whose estimated call time exceeds --max-call-s is not run, and
the table says so. Results: benchmarks/results/cpu_<tag>.json and cpu_<tag>.png.
2-thread speed-up of ours: in every round ours runs at 1 and 2 threads interleaved (benchmarks/cpu/scaling.py:
alternate; at least --scaling-rounds rounds per case in all), and the speed-up printed is the median of the per-round
ratios, with the ratio of the two minima beside it. In the same rounds the machine's own ceiling is measured the same
way (scaling.py: machine_probes; an L2-resident FMA-bound matmul, an in-place stream over 2 MiB like a decode step's
state and one over 64 MiB), and the CPU that other processes and the hypervisor (steal) took during each case is
recorded: on this 2-vCPU VM one busy neighbour turns every 2-thread call into a scheduler time slice.
"""
import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import PROBES, CpuShare, alternate, machine_probes, probe_round, ratio_summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
ET_VENV = ROOT / ".venv-executorch"
H, K, V = 32, 128, 128


# ------------------------------------------------------------------------------------------------ setup
def setup_executorch():
    py = ET_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ET_VENV)], check=True)
    tv = torch.__version__.split("+")[0]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "executorch==1.5.1", f"torch=={tv}"], check=True)


def load_variant(path):
    ns = json.loads((path / "metadata.json").read_text())["id"]
    if ns in sys.modules:
        return sys.modules[ns]
    spec = importlib.util.spec_from_file_location(ns, path / "__init__.py", submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ns] = mod
    spec.loader.exec_module(mod)
    return mod


def variants(build):
    def find():
        cpu = [p for p in build.glob("torch*-cpu-x86_64-linux") if (p / "metadata.json").exists()]
        return cpu, build / "torch-universal"
    cpu, uni = find()
    if not cpu or not (uni / "metadata.json").exists():
        print(f"[bench] building the cpu and universal variants into {build} (scripts/build.py)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--backends", "cpu,universal",
                        "--out", str(build)], check=True)
        cpu, uni = find()
    ours = load_variant(cpu[0])
    assert ours.NATIVE, "the cpu variant did not load its native library"
    return ours, load_variant(uni)


def machine():
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("Model name", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache", "Flags"):
                info[key.strip()] = val.strip() if key.strip() != "Flags" else \
                    " ".join(f for f in val.split() if f.startswith(("avx", "fma")))
    except OSError:
        pass
    import transformers
    info["transformers"] = transformers.__version__
    info["loadavg_start"] = os.getloadavg()
    return info


# ------------------------------------------------------------------------------------------------ timing
def bench(fn, min_time_s, max_reps=200):
    """Minimum wall-clock seconds of fn() over repetitions (one warm-up call first)."""
    fn()
    times, total = [], 0.0
    while (total < min_time_s or len(times) < 3) and len(times) < max_reps:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
        if dt > min_time_s and len(times) >= 1:
            break
    return min(times)


def inputs(family, T, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn((1, T, H, K) if family == "kda" else (1, T, H), generator=gen))
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(1, H, K, V, generator=gen)
    xs = [q, k, v, g, beta]
    if grad:
        xs = [x.requires_grad_(True) for x in xs]
    return xs, h0


def backward_of(out, state):
    (out.square().sum() + state.sum()).backward()


# ------------------------------------------------------------------------------------------------ peers
def tf_funcs(family):
    if family == "kda":
        from transformers.models.kimi_linear import modeling_kimi_linear as m
        return m.chunk_kimi_delta_attention, m.recurrent_kimi_delta_attention
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


def impls(family, ours, uni):
    """name -> {mode: callable(T) -> thunk or None}."""
    chunk_api = "chunk_kda" if family == "kda" else "chunk_gated_delta_rule"
    rec_api = "fused_recurrent_kda" if family == "kda" else "fused_recurrent_gated_delta_rule"
    tf_chunk, tf_rec = tf_funcs(family)

    def api_prefill(mod, grad):
        def make(T):
            (q, k, v, g, beta), h0 = inputs(family, T, grad)
            fn = getattr(mod, chunk_api)
            if not grad:
                def run():
                    with torch.no_grad():
                        fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                return run

            def run():
                o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                backward_of(o, s)
            return run
        return make

    def api_decode(mod):
        def make(T):
            (q, k, v, g, beta), h0 = inputs(family, T)
            idx = torch.zeros(1, dtype=torch.long)
            fn = getattr(mod, rec_api)

            def run():
                with torch.no_grad():
                    fn(q, k, v, g, beta=beta, initial_state=h0, ssm_state_indices=idx, inplace_final_state=True)
            return run
        return make

    def op_decode(mod):
        def make(T):
            (q, k, v, g, beta), h0 = inputs(family, T)
            idx = torch.zeros(1, dtype=torch.long)
            op = getattr(mod.ops, f"{family}_recurrent_serve")
            return lambda: op(q, k, v, g, beta, K ** -0.5, h0, idx, None, None, False)
        return make

    def tf(fn, grad):
        def make(T):
            (q, k, v, g, beta), h0 = inputs(family, T, grad)
            if not grad:
                def run():
                    with torch.no_grad():
                        fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                return run

            def run():
                o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                backward_of(o, s)
            return run
        return make

    return {
        "ours": {"decode": op_decode(ours), "prefill": api_prefill(ours, False), "fwd+bwd": api_prefill(ours, True)},
        "ours (API)": {"decode": api_decode(ours)},
        "torch-universal": {"decode": api_decode(uni), "prefill": api_prefill(uni, False),
                            "fwd+bwd": api_prefill(uni, True)},
        "transformers": {"decode": tf(tf_rec, False), "prefill": tf(tf_chunk, False), "fwd+bwd": tf(tf_chunk, True)},
    }


class ExecuTorchWorker:
    """benchmarks/cpu/executorch_worker.py --serve in .venv-executorch, kept for the whole run: each time() call
    sends one case and reads its result, so ExecuTorch is timed in the same rounds as ours."""

    def __init__(self):
        py = ET_VENV / "bin" / "python"
        self.err = "" if py.exists() else f"ExecuTorch venv missing ({ET_VENV}); run with --setup-executorch"
        self.proc = None
        if not self.err:
            self.proc = subprocess.Popen([str(py), str(ROOT / "benchmarks" / "cpu" / "executorch_worker.py"),
                                          "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)

    def time(self, family, T, threads, min_time_s):
        """us per token, or None (self.err says why)."""
        if self.proc is None:
            return None
        try:
            self.proc.stdin.write(json.dumps(dict(family=family, T=T, threads=threads, H=H, K=K, V=V,
                                                  min_time_s=min_time_s)) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            return json.loads(line)["us_per_token"]
        except (OSError, ValueError, KeyError) as e:
            self.err = f"ExecuTorch worker failed: {e!r}"
            self.proc = None
            return None

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T=512 only, shorter timing")
    ap.add_argument("--setup-executorch", action="store_true", help="create .venv-executorch and exit")
    ap.add_argument("--max-call-s", type=float, default=40.0, help="skip a peer whose call would take longer")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--families", default="kda,gdn")
    ap.add_argument("--tag", default="latest")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build", help="where the built variants are")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per case; each times every implementation and thread count back to back")
    ap.add_argument("--scaling-rounds", type=int, default=6,
                    help="interleaved 1-/2-thread rounds of ours per case, at least (spread over --rounds)")
    args = ap.parse_args(argv)
    if args.setup_executorch:
        setup_executorch()
        return 0
    warnings.filterwarnings("ignore", message="kda-kernels: no native")
    os.environ.setdefault("KDA_KERNELS_QUIET_FALLBACK", "1")
    ours, uni = variants(args.build_dir.resolve())
    info = machine()
    print(f"[bench] {info.get('Model name')} x{info.get('CPU(s)')}, torch {torch.__version__}, "
          f"load average {info['loadavg_start']}", flush=True)
    lengths = {"decode": [1], "prefill": [512] if args.quick else [512, 4096],
               "fwd+bwd": [512] if args.quick else [512, 4096]}
    min_time = 0.5 if args.quick else 1.5
    threads = [int(t) for t in args.threads.split(",")]
    families = args.families.split(",")
    rows, scaling = [], []
    probes = machine_probes() if len(threads) > 1 else {}
    probe_all = {}  # every probe round of the run: {probe: {n: [...]}}
    sub = max(1, -(-args.scaling_rounds // args.rounds))  # interleaved rounds of ours per outer round
    et = ExecuTorchWorker()
    if et.err:
        print(f"[bench] {et.err}", flush=True)
    # Each case (family, mode, T) runs ROUNDS rounds; a round times every implementation at every thread count
    # back to back (ExecuTorch in its own long-lived process), and each keeps its fastest round. This machine's
    # speed drifts by tens of percent over minutes (a shared host: the same call measured 88 and 124 us/token a
    # minute apart), so timing ours and a peer, or 1 and 2 threads, in separate phases of the run would put that
    # drift into the ratios. A peer's calls slower than 1 s run in the first round only. Ours runs its 1- and
    # 2-thread calls interleaved (scaling.alternate) at the start of every round, and the machine probes (scaling.py)
    # run at its end, so the speed-up of ours and the machine's ceiling come from the same minutes.
    for family in families:
        table = impls(family, ours, uni)
        per_token_512 = {}
        for mode, Ts in lengths.items():
            for T in Ts:
                best, thunks = {}, {}
                for name, modes in table.items():
                    if mode not in modes:
                        continue
                    est = per_token_512.get((name, mode))
                    if est is not None and est * T * 1e-6 > args.max_call_s:
                        note = (f"not run: estimated {est * T * 1e-6:.0f} s per call "
                                f"({est / 1e3:.1f} ms/token at T=512) > --max-call-s {args.max_call_s:.0f}")
                        for n in threads:
                            rows.append(dict(family=family, mode=mode, T=T, threads=n, impl=name,
                                             us_per_token=None, note=note))
                        print(f"  {family:3s} {mode:8s} T={T:5d} {name:16s} {note}", flush=True)
                        continue
                    thunks[name] = modes[mode](T)
                peers_here = list(thunks) + (["executorch"] if mode != "fwd+bwd" else [])
                share = CpuShare()
                ours_s, probe_s = {}, {}
                for rnd in range(args.rounds):
                    if "ours" in thunks:  # ours: 1 and 2 threads interleaved, `sub` rounds
                        alternate(thunks["ours"], threads, rounds=sub, block_s=min_time / args.rounds / sub,
                                  samples=ours_s, warm=rnd == 0)
                        for n in threads:
                            best[("ours", n)] = min(ours_s[n]) / T * 1e6
                    for n in threads:
                        torch.set_num_threads(n)
                        for name in peers_here:
                            if name == "ours":
                                continue
                            if rnd > 0 and best.get((name, n), 0.0) * T * 1e-6 > 1.0:
                                continue  # a slow peer: one round
                            if name == "executorch":
                                us = et.time(family, T, n, min_time / args.rounds)
                                if us is None:
                                    continue
                            else:
                                us = bench(thunks[name], min_time / args.rounds) / T * 1e6
                            best[(name, n)] = min(us, best.get((name, n), float("inf")))
                    if probes:  # the machine's ceiling, in the same rounds
                        probe_round(probes, probe_s, threads)
                for pname, ps in probe_s.items():
                    for n, xs in ps.items():
                        probe_all.setdefault(pname, {}).setdefault(n, []).extend(xs)
                for n in threads[1:]:
                    scaling.append(dict(family=family, mode=mode, T=T, threads=n,
                                        ours=ratio_summary(ours_s, threads[0], n),
                                        ceiling={p: ratio_summary(ps, threads[0], n) for p, ps in probe_s.items()},
                                        cpu_share=share.stop(), loadavg=os.getloadavg()))
                    print(case_line(scaling[-1]), flush=True)
                del thunks
                for name in peers_here:
                    for n in threads:
                        us = best.get((name, n))
                        note = "" if us is not None else et.err[:200]
                        if us is not None and T == 512 and n == threads[0]:
                            per_token_512[(name, mode)] = us
                        rows.append(dict(family=family, mode=mode, T=T, threads=n, impl=name, us_per_token=us,
                                         note=note))
                        if us is not None:
                            print(f"  {family:3s} {mode:8s} T={T:5d} thr={n} {name:16s} {us:10.1f} us/token",
                                  flush=True)
    et.close()
    info["loadavg_end"] = os.getloadavg()
    ceiling = {n: {p: ratio_summary(ps, threads[0], n) for p, ps in probe_all.items()} for n in threads[1:]}
    report(rows, info, args.tag, scaling, ceiling)
    return 0


def report(rows, info, tag, scaling=(), ceiling=None):
    def get(family, mode, T, n, impl):
        for r in rows:
            if (r["family"], r["mode"], r["T"], r["threads"], r["impl"]) == (family, mode, T, n, impl):
                return r["us_per_token"]
        return None

    peers = ["executorch", "transformers", "torch-universal"]
    keys = sorted({(r["family"], r["mode"], r["T"], r["threads"]) for r in rows},
                  key=lambda x: (x[0], ["decode", "prefill", "fwd+bwd"].index(x[1]), x[2], x[3]))
    lines = []
    hdr = (f"{'family':6s} {'case':8s} {'T':>5s} {'thr':>3s} {'ours':>9s} " +
           " ".join(f"{p:>16s}" for p in peers) + "   (us/token; ratio = peer / ours)")
    lines.append(hdr)
    summary = []
    for (family, mode, T, n) in keys:
        mine = get(family, mode, T, n, "ours")
        cells = []
        for p in peers:
            t = get(family, mode, T, n, p)
            if t is None:
                cells.append(f"{'n/a':>16s}")
            else:
                ratio = t / mine if mine else float("nan")
                cells.append(f"{t:8.1f} ({ratio:5.1f}x)")
                summary.append(dict(family=family, mode=mode, T=T, threads=n, peer=p, ratio=ratio))
        api = get(family, mode, T, n, "ours (API)")
        extra = f"   ours via public API {api:.1f}" if api else ""
        lines.append(f"{family:6s} {mode:8s} {T:5d} {n:3d} {mine if mine else float('nan'):9.1f} " +
                     " ".join(cells) + extra)
    lines.append("")
    lines += scaling_lines(scaling, ceiling, summary)
    notes = sorted({r["note"] for r in rows if r["note"]})
    if notes:
        lines.append("")
        lines.append("not run / notes:")
        lines += [f"  {r['family']} {r['mode']} T={r['T']} thr={r['threads']} {r['impl']}: {r['note']}"
                  for r in rows if r["note"]]
    text = "\n".join(lines)
    print()
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cpu_{tag}.json"
    out.write_text(json.dumps(dict(machine=info, shapes=dict(B=1, H=H, HV=H, K=K, V=V, dtype="float32"),
                                   results=rows, ratios=summary, scaling=list(scaling), probes=PROBES,
                                   ceiling=ceiling, table=text), indent=1) + "\n")
    print(f"\n[bench] wrote {out.relative_to(ROOT)}")
    try:
        plot(rows, keys, RESULTS / f"cpu_{tag}.png")
        print(f"[bench] wrote {(RESULTS / f'cpu_{tag}.png').relative_to(ROOT)}")
    except Exception as e:  # noqa: BLE001 - the JSON is the record; the plot is a convenience
        print(f"[bench] no plot: {e}")


def _x(r, key="median"):
    return f"{r[key]:4.2f}x" if r else "  n/a"


def case_line(sc):
    """One case of the speed-up block: ours, the machine probes of the same rounds, the CPU others took."""
    o, share = sc["ours"], sc["cpu_share"]
    ceil = "  ".join(f"{p} {_x(r)}" for p, r in sc["ceiling"].items())
    return (f"  {sc['family']} {sc['mode']:8s} T={sc['T']:<5d} thr={sc['threads']}: {_x(o)} [{_x(o, 'min_based')}]"
            f" ({o['rounds'] if o else 0} rounds)   machine: {ceil}   others {share['others']:.2f}"
            f" + steal {share['steal']:.2f}")


def scaling_lines(scaling, ceiling, summary):
    """The thread speed-up block of the table (appends ours' ratios to summary)."""
    if not scaling:
        return []
    lines = ["Thread speed-up of ours (1-thread time / n-thread time; 1 and n threads interleaved round by round:",
             "median of the per-round ratios [ratio of the two minima]), the machine's ceiling measured the same way",
             "in the same rounds (median; probes below), and the CPU others took meanwhile (processes + steal, cores):"]
    for sc in scaling:
        o = sc["ours"]
        if o is None:
            continue
        lines.append(case_line(sc))
        summary.append(dict(family=sc["family"], mode=sc["mode"], T=sc["T"], threads=sc["threads"],
                            peer="ours 1 thread", ratio=o["median"], ratio_min_based=o["min_based"],
                            estimator="median of interleaved per-round ratios"))
    for n, c in (ceiling or {}).items():
        if c:
            lines.append(f"  machine ceiling over the whole run, {n} threads: " +
                         "  ".join(f"{p} {_x(r)} [{_x(r, 'min_based')}] ({r['rounds'] if r else 0} rounds)"
                                   for p, r in c.items()))
    lines += [f"  probe {p}: {d}" for p, d in PROBES.items()]
    return lines


def plot(rows, keys, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    impls_ = ["ours", "executorch", "transformers", "torch-universal"]
    cases = [k for k in keys if k[3] == 1]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cases)), 5))
    width = 0.8 / len(impls_)
    for i, name in enumerate(impls_):
        ys = []
        for (family, mode, T, n) in cases:
            r = [x for x in rows if (x["family"], x["mode"], x["T"], x["threads"], x["impl"]) ==
                 (family, mode, T, n, name)]
            ys.append(r[0]["us_per_token"] if r and r[0]["us_per_token"] else 0)
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=name)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"{f}\n{m}\nT={T}" for (f, m, T, n) in cases], fontsize=8)
    ax.set_ylabel("us per token (log; lower is better)")
    ax.set_title("CPU, 1 thread, B=1 H=32 K=V=128 fp32 (missing bar: peer has no such path or was not run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
