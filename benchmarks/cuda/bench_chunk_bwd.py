"""Chunked forward+backward through the public API: ours (chunk_kda / chunk_gated_delta_rule of this package,
CUDA backend) side by side with flash-linear-attention 0.6.0, in one process on one GPU.

    python3 benchmarks/cuda/bench_chunk_bwd.py     # writes $OUT (or benchmarks/results) cuda_chunk_bwd.json + .png

bf16 q/k/v, fp32 g and beta, K=V=128, gates logsigmoid(randn)/8, no initial state, output_final_state=True; shapes
B1 T8192 H16 HV32, B1 T32768 H16 HV32, B4 T4096 H=HV=32, and the chunked-forward benchmark's varlen mix (16
sequences of 64..8192 tokens, H16 HV32, cu_seqlens). fwd+bwd = forward, then torch.autograd.grad of (o, final
state) against random cotangents (so .grad never accumulates); timed eager (triton do_bench, median) and under CUDA
graphs where capture works. Also: our backward core op alone (kda_chunk_bwd / gdn_chunk_bwd), and the peak of
torch.cuda.max_memory_allocated above the inputs over one fwd+bwd. fla's refusals (GDN backward on Hopper with
Triton 3.6) are recorded as they are raised.

    BENCH_NSHAPES=1 BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_GVA=1" python3 benchmarks/cuda/bench_chunk_bwd.py
adds rows "ours[KNOB=VAL,...]" (each ;-separated variant's knobs set while it is timed) beside the defaults.
BENCH_SHAPES=B4,varlen keeps the shapes whose names (B1_T8192, B1_T32768, B4_T4096, varlen) start with one
of the comma-separated prefixes. BENCH_SKIP_RECURRENT=1 leaves out the (slow, eager-only) recurrent backward rows; BENCH_PHASES sets the order
of the two sides (default "ours,fla_0.6.0").
"""
import json
import os
import sys
from pathlib import Path

import torch

from bench_chunk_fwd import VARLEN, mk as mk_inputs
from cuda_variant import knobs_set, load_cuda_variant

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
DEV = "cuda"
RES = []
# (B, T, H, HV, sequence lengths of a varlen batch or None)
SHAPES = [(1, 8192, 16, 32, None), (1, 32768, 16, 32, None), (4, 4096, 32, 32, None), (1, sum(VARLEN), 16, 32, VARLEN)]
SHAPES = SHAPES[:int(os.environ.get("BENCH_NSHAPES", len(SHAPES)))]  # the first n shapes (short device calls)


def shape_name(B, T, H, HV, lens):
    return "varlen" if lens is not None else f"B{B}_T{T}"


if os.environ.get("BENCH_SHAPES"):  # comma-separated name prefixes (short device calls)
    SHAPES = [s for s in SHAPES if any(shape_name(*s).startswith(x) for x in os.environ["BENCH_SHAPES"].split(","))]


def rec(**kw):
    RES.append(kw)
    print(json.dumps(kw), flush=True)


def load_ours():
    return load_cuda_variant("kda_cuda_bench_bwd")


def mk(B, T, H, HV, K, V, kda):
    """The chunked forward benchmark's inputs, as leaves that require grad."""
    return [x.requires_grad_(True) for x in mk_inputs(B, T, H, HV, K, V, kda)]


def timed(fn, graphs=True):
    from triton.testing import do_bench, do_bench_cudagraph  # here: --from-log needs no triton
    fn()
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=10, rep=100, return_mode="median")
    graph, why = None, None
    if graphs:
        try:
            graph = do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as e:  # noqa: BLE001
            why = repr(e)[:200]
            torch.cuda.synchronize()
    return eager, graph, why


def peak_above(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def from_log(path, gpu):
    """Rebuild the JSON and PNG from a log of this script (one JSON line per measurement): a run cut short by a
    device call's time limit still gets its JSON and plot."""
    res = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.startswith("{")]
    out = {"meta": {"gpu": gpu, "from_log": Path(path).name}, "results": res}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cuda_chunk_bwd.json").write_text(json.dumps(out, indent=1))
    plot(out)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--from-log":  # --from-log LOG GPU_NAME
        return from_log(sys.argv[2], sys.argv[3])
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
        from fla.ops.kda import chunk_kda as fla_kda
        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        print("fla unavailable:", repr(e)[:300])
        fla_gdn = fla_kda = None
    kk = load_ours()
    K = V = 128
    # ours on every shape first, then fla (whose first calls include Triton compilation and autotuning);
    # BENCH_PHASES=fla_0.6.0,ours puts fla first when its rows are the ones a short call must not lose
    for phase in os.environ.get("BENCH_PHASES", "ours,fla_0.6.0").split(","):
        bench_phase(phase, kk, fla_kda, fla_gdn, K, V)
    out = {"meta": meta, "results": RES}
    (OUT / "cuda_chunk_bwd.json").write_text(json.dumps(out, indent=1))
    try:
        plot(out)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", repr(e)[:200])


def bench_phase(phase, kk, fla_kda, fla_gdn, K, V):
    for (B, T, H, HV, lens) in SHAPES:
        for fam in ("kda", "gdn"):
            kda = fam == "kda"
            xs = mk(B, T, H, HV, K, V, kda)
            N = B if lens is None else len(lens)
            cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long,
                                                        device=DEV)
            extra = {} if cu is None else {"cu_seqlens": cu}
            do = torch.randn(B, T, HV, V, device=DEV, dtype=torch.bfloat16)
            dht = torch.randn(N, HV, K, V, device=DEV)
            scale = K ** -0.5
            impls = []  # (name, function, host knobs set while it is timed)
            if phase == "ours":
                for variant in [""] + [x for x in os.environ.get("BENCH_OURS_VARIANTS", "").split(";") if x]:
                    impls.append((f"ours[{variant}]" if variant else "ours",
                                  kk.chunk_kda if kda else kk.chunk_gated_delta_rule,
                                  dict(kv.split("=") for kv in variant.split(",")) if variant else {}))
            elif fla_kda is not None:
                impls.append(("fla_0.6.0", fla_kda if kda else fla_gdn, {}))
            for impl, fn, knobs in impls:
                shape = dict(B=B, T=T, H=H, HV=HV, K=K, V=V, **({} if lens is None else {"varlen": len(lens)}))

                def fwd():
                    with torch.no_grad():
                        return fn(*xs, scale=scale, output_final_state=True, **extra)

                def fwdbwd():
                    o, s = fn(*xs, scale=scale, output_final_state=True, **extra)
                    return torch.autograd.grad((o, s), xs, (do, dht))

                try:
                    with knobs_set(knobs):
                        ef, gf, _ = timed(fwd)
                        e, gr, why = timed(fwdbwd)
                        mem = peak_above(fwdbwd)
                    rec(name=f"{fam}_chunk_fwdbwd", impl=impl, **shape, fwd_eager_ms=round(ef, 4),
                        fwd_graph_ms=None if gf is None else round(gf, 4), eager_ms=round(e, 4),
                        graph_ms=None if gr is None else round(gr, 4), graph_error=why,
                        peak_mb_above_inputs=round(mem, 1))
                except Exception as ex:  # noqa: BLE001
                    torch.cuda.synchronize()
                    rec(name=f"{fam}_chunk_fwdbwd", impl=impl, **shape, error=repr(ex)[:400])
                torch.cuda.empty_cache()
            # our backward core op alone (what chunk_*'s autograd backward calls)
            with torch.no_grad():
                if phase != "ours":
                    continue
                q, k, v, g, beta = [x.detach() for x in xs]
                op = getattr(kk.ops, f"{fam}_chunk_bwd")
                e, gr, why = timed(lambda: op(q, k, v, g, beta, scale, None, cu, do, dht))
                mem = peak_above(lambda: op(q, k, v, g, beta, scale, None, cu, do, dht))
                rec(name=f"{fam}_chunk_bwd_core", impl="ours", **shape, eager_ms=round(e, 4),
                    graph_ms=None if gr is None else round(gr, 4), graph_error=why,
                    peak_mb_above_inputs=round(mem, 1))
                if (B, T, lens) == (1, 8192, None) and not os.environ.get("BENCH_SKIP_RECURRENT"):
                    rop = getattr(kk.ops, f"{fam}_recurrent_bwd")
                    e, _, _ = timed(lambda: rop(q, k, v, g, beta, scale, None, None, do, dht), graphs=False)
                    rec(name=f"{fam}_recurrent_bwd_core", impl="ours", B=B, T=T, H=H, HV=HV, K=K, V=V,
                        eager_ms=round(e, 4))
            xs = do = dht = cu = None  # free before the next shape (closures above hold the names, not the values)
            torch.cuda.empty_cache()


def plot(out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in out["results"] if r["name"].endswith("fwdbwd")]
    labels, ours, fla = [], [], []
    for fam in ("kda", "gdn"):
        for (B, T, H, HV, lens) in SHAPES:
            key = dict(B=B, T=T, H=H, HV=HV)
            def get(impl):
                for r in rows:
                    if r["name"] == f"{fam}_chunk_fwdbwd" and r["impl"] == impl and all(r[a] == b for a, b in key.items()):
                        return r.get("graph_ms") or r.get("eager_ms") or 0.0
                return 0.0
            labels.append(f"{fam.upper()}\n" + (f"varlen {len(lens)} seqs" if lens else f"B{B} T{T}") + f"\nH{H} HV{HV}")
            ours.append(get("ours"))
            fla.append(get("fla_0.6.0"))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="ours (CUDA)")
    ax.bar([x + 0.2 for x in xs], fla, 0.4, label="fla 0.6.0 (0 = refused / unavailable)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("fwd+bwd ms (CUDA graph where captured, else eager)")
    ax.set_title(f"chunked fwd+bwd, bf16, K=V=128, {out['meta']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "cuda_chunk_bwd.png", dpi=120)


if __name__ == "__main__":
    main()
