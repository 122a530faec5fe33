"""CUDA chunked forward (kda_chunk_fwd / gdn_chunk_fwd) vs flash-linear-attention 0.6.0 chunk_kda /
chunk_gated_delta_rule, side by side in one process on one GPU, bf16 q/k/v, K=V=128.

    python3 benchmarks/cuda/bench_chunk_fwd.py      # writes $OUT (or benchmarks/results) cuda_chunk_fwd.{json,png}
    BENCH_SHAPES=varlen BENCH_BUDGET_S=60 python3 benchmarks/cuda/bench_chunk_fwd.py   # some shapes, a time budget
    BENCH_FAMILIES=kda BENCH_KDA_PREP=3 BENCH_NO_FLA=1 python3 benchmarks/cuda/bench_chunk_fwd.py
        # KDA only, no fla, each KDA_CUDA_KDA_PREP value in turn (BENCH_GDN_PREP: KDA_CUDA_GDN_PREP). Only the
        # defaults are left (KDA 3, GDN 2): the generic prep for 16-bit inputs (0) and the KDA v1 prep (1) were
        # retired in session 9, KDA's v3 (4, 5) in session 10, KDA's prep2 without the 8x8 split (2) and the GDN v1
        # prep (GDN 1) in session 11 -- those values raise an error; the option stays for the next candidate
    BENCH_CHUNK_SCAN=1,10,11 BENCH_NO_FLA=1 python3 benchmarks/cuda/bench_chunk_fwd.py
        # the single scan kernel (1) and scan7 (11, U as bf16 hi + lo, the default since session 12; 10, U plain
        # bf16; 0: the default choice) in one process (KDA_CUDA_CHUNK_SCAN). The bulk-prefetch scan (4), the split
        # forward (5 / 6), scan5 (7) and scan6 (8) were retired in session 12, scan6 with warp pairs (9) in session
        # 11: those values raise an error

Shapes: B1 T8192 H16 HV32; B1 T32768 H16 HV32; B4 T4096 H=HV=32; varlen 16 sequences of 64..8192 tokens (H16 HV32).
Each is timed eager (triton do_bench, median) and under CUDA graphs (do_bench_cudagraph), initial state none,
final state output, as shared/anchors/anchor_fla_graphs.py timed fla. Gates logsigmoid(randn)/8 as the anchors.
Ours gets fp32 beta (the op contract), fla bf16 beta (as in the anchors). The RMS ratio of ours vs fla's output
is printed as a sanity check. ratio = fla time / ours (above 1: ours faster).
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from cuda_variant import load_cuda_variant

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
DEV = "cuda"
RES = []
VARLEN = [64, 8192, 128, 4096, 256, 2048, 512, 1024, 100, 3000, 777, 5000, 1500, 64, 6000, 2500]


def rec(**kw):
    RES.append(kw)
    print(json.dumps(kw), flush=True)


def load_ours():
    return load_cuda_variant("kda_cuda_chunk_bench")


def mk(B, T, H, HV, K, V, kda):
    torch.manual_seed(0)
    q = torch.randn(B, T, H, K, device=DEV, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=DEV, dtype=torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, HV, K, device=DEV)) / 8) if kda else \
        (F.logsigmoid(torch.randn(B, T, HV, device=DEV)) / 8)
    beta = torch.rand(B, T, HV, device=DEV)
    return q, k, v, g.float().contiguous(), beta


def timed(fn):
    from triton.testing import do_bench, do_bench_cudagraph  # here: --from-log needs no triton
    fn()
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        graph = do_bench_cudagraph(fn, rep=100)
    except Exception as e:  # noqa: BLE001
        print("graph error", repr(e)[:200], flush=True)
        graph = None
    return eager, graph


def rms_ratio(ref, out):
    ref, out = ref.double(), out.double()
    return float((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def kernel_breakdown(fn, iters=10):
    """Per-kernel GPU time (ms per call) of fn from torch.profiler."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count >= iters:
            out[ev.key[:90]] = round(t / 1e3 / iters, 4)
    return out


def from_log(path):
    """Rebuild the JSON and PNG from a log of this script (one JSON line per measurement): a run cut short by a
    device call's time limit still gets its table and plot."""
    lines = Path(path).read_text().splitlines()
    res = [json.loads(ln) for ln in lines if ln.startswith("{")]
    head = next((ln for ln in lines if ln.startswith("GPU: ")), "GPU: ?; torch ?; fla None")
    gpu, fla_ver = head[5:].split(";")[0], head.rsplit("fla ", 1)[-1]
    report(gpu, None if fla_ver == "None" else fla_ver, res)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--from-log":
        return from_log(sys.argv[2])
    ours = load_ours()
    try:
        if os.environ.get("BENCH_NO_FLA"):
            raise ImportError("BENCH_NO_FLA set")
        from fla.ops.kda import chunk_kda
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        import fla
        fla_ver = fla.__version__
    except Exception as e:  # noqa: BLE001
        print("fla unavailable:", repr(e)[:200])
        chunk_kda = chunk_gated_delta_rule = None
        fla_ver = None
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; torch {torch.__version__}; fla {fla_ver}", flush=True)
    shapes = [("B1_T8192_H16_HV32", 1, 8192, 16, 32, None),
              ("B1_T32768_H16_HV32", 1, 32768, 16, 32, None),
              ("B4_T4096_H32_HV32", 4, 4096, 32, 32, None),
              ("varlen16_64-8192_H16_HV32", 1, sum(VARLEN), 16, 32, VARLEN)]
    only = os.environ.get("BENCH_SHAPES")  # comma-separated name prefixes, e.g. "varlen" (short device calls)
    if only:
        shapes = [s for s in shapes if any(s[0].startswith(x) for x in only.split(","))]
    budget = float(os.environ.get("BENCH_BUDGET_S", "1e9"))
    t_start = time.time()
    families = os.environ.get("BENCH_FAMILIES", "kda,gdn").split(",")
    preps = {"gdn": os.environ.get("BENCH_GDN_PREP"),  # KDA_CUDA_GDN_PREP values in turn (2: v2, the default)
             "kda": os.environ.get("BENCH_KDA_PREP")}  # the same for KDA_CUDA_KDA_PREP (3: the default)
    runs = [(f, x) for f in families for x in (preps.get(f).split(",") if preps.get(f) else [None])]
    # e.g. "1,11": KDA_CUDA_CHUNK_SCAN values (0 the default choice, 1 single, 10 / 11 scan7)
    scans = os.environ.get("BENCH_CHUNK_SCAN")
    runs = [(f, x, sc) for f, x in runs for sc in (scans.split(",") if scans else [None])]
    for name, B, T, H, HV, lens in shapes:
        for fam, gdn_prep, scan in runs:
            if gdn_prep is not None:
                os.environ[f"KDA_CUDA_{fam.upper()}_PREP"] = gdn_prep  # read by the host code at every call
            if scan is not None:
                os.environ["KDA_CUDA_CHUNK_SCAN"] = scan
            if time.time() - t_start > budget:
                print("time budget reached; stopping", flush=True)
                break
            q, k, v, g, beta = mk(B, T, H, HV, 128, 128, fam == "kda")
            cu = None
            if lens is not None:
                cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long, device=DEV)
            scale = 128 ** -0.5
            op = getattr(ours.ops, f"{fam}_chunk_fwd")
            with torch.inference_mode():
                f_ours = lambda: op(q, k, v, g, beta, scale, None, cu)  # noqa: E731
                oe, og = timed(f_ours)
                row = dict(shape=name, family=fam, tokens=B * T, ours_eager_ms=round(oe, 4),
                           ours_graph_ms=None if og is None else round(og, 4))
                if gdn_prep is not None:
                    row["gdn_prep" if fam == "gdn" else "kda_prep"] = gdn_prep
                if scan is not None:
                    row["chunk_scan"] = scan
                ffn = chunk_kda if fam == "kda" else chunk_gated_delta_rule
                if ffn is not None:
                    bb = beta.bfloat16()
                    kw = dict(output_final_state=True)
                    if cu is not None:
                        kw["cu_seqlens"] = cu
                    f_fla = lambda: ffn(q, k, v, g, bb, scale=scale, **kw)  # noqa: E731
                    try:
                        fe, fg = timed(f_fla)
                        row.update(fla_eager_ms=round(fe, 4), fla_graph_ms=None if fg is None else round(fg, 4))
                        if og and fg:
                            row["ratio_graph"] = round(fg / og, 3)
                        row["ratio_eager"] = round(fe / oe, 3)
                        o1, s1 = f_ours()
                        o2, s2 = f_fla()
                        row["rms_vs_fla_o"] = round(rms_ratio(o2.float(), o1.float()), 6)
                        row["rms_vs_fla_state"] = round(rms_ratio(s2.float(), s1.float()), 6)
                    except Exception as e:  # noqa: BLE001
                        row["fla_error"] = repr(e)[:200]
                if name.startswith("B1_T8192"):
                    try:
                        row["ours_kernels_ms"] = kernel_breakdown(f_ours)
                    except Exception as e:  # noqa: BLE001
                        row["ours_kernels_error"] = repr(e)[:200]
                if og:
                    row["ours_ns_per_token_graph"] = round(og * 1e6 / (B * T), 3)
            rec(**row)
            q = k = v = g = beta = None  # free before the next row (the lambdas above hold names, not values)
            torch.cuda.empty_cache()
    report(gpu, fla_ver, RES)



def report(gpu, fla_ver, res):
    """Table on stdout, JSON and PNG under OUT."""
    print(f"\nGPU: {gpu}")
    def label(r):  # family, then the prep / scan knob values the row was timed with, if any
        knobs = r.get("gdn_prep", r.get("kda_prep", ""))
        return r["family"] + knobs + (f" scan{r['chunk_scan']}" if "chunk_scan" in r else "")

    print(f"{'shape':28s} {'fam':10s} {'fla eager':>10s} {'fla graph':>10s} {'ours eager':>10s} {'ours graph':>10s}"
          f" {'x fla (graph)':>13s} {'x fla (eager)':>13s}")
    for r in res:
        print(f"{r['shape']:28s} {label(r):10s} {r.get('fla_eager_ms', float('nan')):10.4f} "
              f"{r.get('fla_graph_ms') or float('nan'):10.4f} {r['ours_eager_ms']:10.4f} "
              f"{r['ours_graph_ms'] or float('nan'):10.4f} {r.get('ratio_graph', float('nan')):13.3f} "
              f"{r.get('ratio_eager', float('nan')):13.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    json.dump({"gpu": gpu, "torch": torch.__version__, "fla": fla_ver, "results": res},
              open(OUT / "cuda_chunk_fwd.json", "w"), indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, fam in zip(axes, ("kda", "gdn")):
            rows = [r for r in res if r["family"] == fam]
            xs = range(len(rows))
            w = 0.2
            for i, (key, lab) in enumerate((("fla_eager_ms", "fla eager"), ("fla_graph_ms", "fla graphs"),
                                            ("ours_eager_ms", "ours eager"), ("ours_graph_ms", "ours graphs"))):
                ax.bar([x + (i - 1.5) * w for x in xs], [r.get(key) or 0 for r in rows], w, label=lab)
            ax.set_xticks(list(xs))
            ax.set_xticklabels([r["shape"].replace("_", "\n", 1) + ("\nscan " + r["chunk_scan"] if "chunk_scan" in r
                                else "") for r in rows], fontsize=7)
            ax.set_ylabel("ms")
            ax.set_title(f"{fam.upper()} chunked forward, bf16, K=V=128 ({gpu})", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(OUT / "cuda_chunk_fwd.png", dpi=110)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", repr(e)[:200])

if __name__ == "__main__":
    main()
