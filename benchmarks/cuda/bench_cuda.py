"""CUDA backend vs flash-linear-attention 0.6.0, side by side in one process on one GPU.

    python3 benchmarks/cuda/bench_cuda.py            # writes $OUT (or benchmarks/results) cuda_bench.json + PNG
    python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session2 --decode-only --sweep
        # decode only, plus every decode-kernel variant (KDA_CUDA_DEC_CFG x KDA_CUDA_DEC_STAGE, and the general
        # kernel with KDA_CUDA_DECODE=0) on fp32 / bf16 pools in both layouts, CUDA graphs only
    python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session7 --decode-only --sweep7 --rep 50
        # decode only, plus the memory-hint variants (SWEEP7 below) and elementwise copies of the state's size under
        # graphs (same-size ceilings)
    python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session8 --decode-only --sweep8 --batches 256
        # decode only, plus session 8's A/B rows in the same run (SWEEP8 below: compiled-in hints vs the kernels with
        # session 7's run-time hint tests, KDA_CUDA_DEC_FUSE=1) and the same-size copy ceilings
    python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session10 --decode-only --sweep10 --batches 256,64
        # decode only, plus session 10's A/B rows in the same run (SWEEP10 below: KDA_CUDA_DEC_LEAN=1 against the
        # default kernels, LEAN with each cfg) and the same-size copy ceilings

Decode: B in {1, 64, 256}, H=16, HV=32, K=V=128, one token, fp32 state read and written (fla: initial_state +
output_final_state, as the anchors in shared/anchors measured it). Reported in ms eager (triton do_bench, median)
and under CUDA graphs (do_bench_cudagraph), with the effective state bandwidth = bytes of state read + written / time,
next to a 4 GB device-to-device copy measured in the same run (the ceiling). Ours is timed three ways: the core op
(what a kernel-hub layer calls), the in-place serving op on fp32 and bf16 pools, and the public Python API with
fla's exact inputs. Prefill/training: recurrent fwd and fwd+bwd at B1 T8192 H16 HV32 and B8 T1024.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from cuda_variant import load_cuda_variant

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
DEV = "cuda"
RES = []
REP = [200]


META = {}
PREFIX = ["cuda_bench"]


def rec(**kw):
    RES.append(kw)
    print(json.dumps(kw), flush=True)
    # rewritten after every row, so a run stopped by a time limit still leaves its JSON
    (OUT / f"{PREFIX[0]}.json").write_text(json.dumps({"meta": META, "results": RES}, indent=1))


def load_ours():
    return load_cuda_variant("kda_cuda_bench")


def mk(B, T, H, HV, K, V, kda, req=False):
    q = torch.randn(B, T, H, K, device=DEV, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).bfloat16()
    v = torch.randn(B, T, HV, V, device=DEV, dtype=torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, HV, K, device=DEV)) / 8) if kda else \
        (F.logsigmoid(torch.randn(B, T, HV, device=DEV)) / 8)
    beta = torch.rand(B, T, HV, device=DEV).bfloat16()
    return [x.requires_grad_(req) for x in (q, k, v, g.float(), beta)]


def timed(fn, graphs=True, eager=True, rep=None):
    rep = rep or REP[0]
    fn()
    torch.cuda.synchronize()
    eager = do_bench(fn, warmup=25, rep=rep, return_mode="median") if eager else None
    graph = None
    if graphs:
        try:
            graph = do_bench_cudagraph(fn, rep=rep, return_mode="median")
        except Exception as e:  # noqa: BLE001
            print("graph failed:", repr(e)[:200])
    return eager, graph


DEC_VARIANTS = [(f"cfg{c}_stage{s}", {"KDA_CUDA_DECODE": "1", "KDA_CUDA_DEC_CFG": str(c), "KDA_CUDA_DEC_STAGE": str(s)})
                for c in range(4) for s in (0, 1, 2)] + [("general", {"KDA_CUDA_DECODE": "0"})]
DEC_ENV = ("KDA_CUDA_DECODE", "KDA_CUDA_DEC_CFG", "KDA_CUDA_DEC_STAGE", "KDA_CUDA_DEC_HINT", "KDA_CUDA_DEC_FUSE",
           "KDA_CUDA_DEC_LEAN")


def _v7(name):
    """'s1_h2_c1' -> KDA_CUDA_DEC_STAGE=1, KDA_CUDA_DEC_HINT=2, KDA_CUDA_DEC_CFG=1 (unset: the default); 'f1' ->
    KDA_CUDA_DEC_FUSE=1; 'l1' -> KDA_CUDA_DEC_LEAN=1."""
    env = {}
    for part in name.split("_"):
        key = {"s": "KDA_CUDA_DEC_STAGE", "h": "KDA_CUDA_DEC_HINT", "c": "KDA_CUDA_DEC_CFG", "f": "KDA_CUDA_DEC_FUSE",
               "l": "KDA_CUDA_DEC_LEAN"}
        env[key[part[0]]] = part[1:]
    return name, env


# session 7: the default configuration with each memory hint of KDA_CUDA_DEC_HINT (h0 none, h1 evict-first loads,
# h2 streaming stores, h8 L2::256B prefetch; unset: the default, streaming stores for bf16/fp16 states); B=256
# gets all, B=64 and B=1 the first SWEEP7_SMALL. (The session-7 run, cuda_decode_session7.json, swept a pipelined
# multi-item stage 3 too, s3_* rows: slower everywhere, removed.)
SWEEP7 = [_v7(n) for n in ("s1", "s1_h0", "s1_h2", "s1_h1", "s1_h3", "s1_h8", "s1_h11", "s2_h2")]
SWEEP7_SMALL = 4
# session 8: the hints are compiled in (no flag tests per state access); KDA_CUDA_DEC_HINT set runs the kernels that
# read them at run time with session 7's flag tests: s1_h0 has session 7's fp32 default flags, s1_h2 its bf16/fp16
# ones (each A/B against s1, the compiled-in default, in the same run). s1_f1: KDA_CUDA_DEC_FUSE=1 (o from pass 1,
# one reduction round). s1_h1: evict-first loads (session 7's best bf16 row, within noise of h2).
SWEEP8 = [_v7(n) for n in ("s1", "s1_h0", "s1_h2", "s1_f1", "s1_h1")]
# session 10: KDA_CUDA_DEC_LEAN=1 (l1: the stage-1 K = V = 128 kernels with fewer instructions per item) and =2 (l2:
# the same with more blocks per SM: fp32 10, K-first bf16 9) against the default kernels (s1), then LEAN with other
# cfgs (c0-c3: which tiling suits it; the defaults are cfg 2 / 1 / 0 / 0 for K-first fp32 / K-first bf16 / V-first
# fp32 / V-first bf16). B < 256 gets the first SWEEP7_SMALL rows.
# (LEAN=1 is the default since that run; its "s1" / "s1_c1" rows were the LEAN=0 kernels, spelled s1_l0 / s1_l0_c1 now.)
SWEEP10 = [_v7(n) for n in ("s1_l0", "s1_l1", "s1_l2", "s1_l1_c1", "s1_l2_c1", "s1_l1_c0", "s1_l1_c2", "s1_l0_c1")]


def set_env(env, knobs=DEC_ENV):
    """Clears the decode knobs `knobs`, then sets `env` (the host code reads them at every call)."""
    for k in knobs:
        os.environ.pop(k, None)
    os.environ.update(env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default="cuda_bench")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep7", action="store_true")
    ap.add_argument("--sweep8", action="store_true", help="session 8's A/B rows (SWEEP8)")
    ap.add_argument("--sweep10", action="store_true", help="session 10's A/B rows (SWEEP10: KDA_CUDA_DEC_LEAN)")
    ap.add_argument("--rep", type=int, default=200, help="ms per measurement of the main rows")
    ap.add_argument("--sweep-rep", type=int, default=20, help="ms per measurement of a sweep row")
    ap.add_argument("--batches", default="1,64,256")
    args = ap.parse_args()
    PREFIX[0] = args.prefix
    REP[0] = args.rep
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = META
    meta.update({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        meta["fla"] = getattr(fla, "__version__", "?")
        have_fla = True
    except Exception as e:  # noqa: BLE001
        print("fla unavailable:", repr(e)[:300])
        have_fla = False
    import triton
    meta["triton"] = triton.__version__
    print(json.dumps(meta))
    kk = load_ours()
    ops = kk.ops

    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    copy_tbps = 2 * x.numel() * 2 / ms / 1e9
    rec(name="d2d_copy_4GB_rw", ms=round(ms, 4), TBps=round(copy_tbps, 3))
    del x, y
    sweep_ab = SWEEP10 if args.sweep10 else SWEEP8 if args.sweep8 else SWEEP7 if args.sweep7 else None
    if sweep_ab:  # elementwise kernels over the B=256 state's bytes under graphs: same-size ceilings
        for dt, nm in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            x = torch.randn(256 * 32 * 128 * 128, device=DEV).to(dt)
            y = torch.empty_like(x)
            nb = 2 * x.numel() * x.element_size()
            _, gr = timed(lambda: torch.mul(x, 1.0, out=y), eager=False, rep=args.sweep_rep * 3)
            rec(name=f"ew_copy_state_{nm}_graph", B=256, graph_ms=round(gr, 5), graph_TBps=round(nb / gr / 1e9, 3))
            _, gr = timed(lambda: x.mul_(1.0), eager=False, rep=args.sweep_rep * 3)
            rec(name=f"ew_inplace_state_{nm}_graph", B=256, graph_ms=round(gr, 5),
                graph_TBps=round(nb / gr / 1e9, 3))
            del x, y

    H, HV, K, V = 16, 32, 128, 128
    scale = K ** -0.5
    for B in [int(b) for b in args.batches.split(",")]:
        for fam in ("kda", "gdn"):
            kda = fam == "kda"
            q, k, v, g, beta = mk(B, 1, H, HV, K, V, kda)
            beta32 = beta.float()
            h0 = torch.randn(B, HV, K, V, device=DEV)
            fp32_bytes = B * HV * K * V * 4 * 2
            bf16_bytes = fp32_bytes // 2

            def row(impl, eager, graph, nbytes):
                rec(name=f"{fam}_decode", impl=impl, B=B, H=H, HV=HV, K=K, V=V,
                    eager_ms=round(eager, 5), graph_ms=None if graph is None else round(graph, 5),
                    eager_TBps=round(nbytes / eager / 1e9, 3),
                    graph_TBps=None if graph is None else round(nbytes / graph / 1e9, 3))

            with torch.inference_mode():
                if have_fla:
                    # (keywords: fla 0.6.0's fused_recurrent_gated_delta_rule takes (q, k, v, g, gk, gv, beta, ...);
                    # beta passed 5th was read as the per-key gate gk, out of bounds: the illegal address of the
                    # session-7 run)
                    f = fused_recurrent_kda if kda else fused_recurrent_gated_delta_rule
                    e, gr = timed(lambda: f(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True))
                    row("fla_0.6.0", e, gr, fp32_bytes)
                core = getattr(ops, f"{fam}_recurrent_fwd")
                e, gr = timed(lambda: core(q, k, v, g, beta32, scale, h0, None))
                row("ours_core_fwd", e, gr, fp32_bytes)
                if not sweep_ab:
                    api = kk.fused_recurrent_kda if kda else kk.fused_recurrent_gated_delta_rule
                    e, gr = timed(lambda: api(q, k, v, g, beta=beta, initial_state=h0, output_final_state=True))
                    row("ours_public_api", e, gr, fp32_bytes)
                serve = getattr(ops, f"{fam}_recurrent_serve")
                idx = torch.arange(B, device=DEV)
                pool32 = h0.clone()
                e, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool32, idx, None, None, False))
                row("ours_serve_fp32_pool", e, gr, fp32_bytes)
                pool16 = h0.to(torch.bfloat16)
                e, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool16, idx, None, None, False))
                row("ours_serve_bf16_pool", e, gr, bf16_bytes)
                poolvf = h0.transpose(-1, -2).contiguous()
                e, gr = timed(lambda: serve(q, k, v, g, beta32, scale, poolvf, idx, None, None, True))
                row("ours_serve_fp32_pool_vfirst", e, gr, fp32_bytes)
                poolvf16 = poolvf.to(torch.bfloat16)
                e, gr = timed(lambda: serve(q, k, v, g, beta32, scale, poolvf16, idx, None, None, True))
                row("ours_serve_bf16_pool_vfirst", e, gr, bf16_bytes)
                if args.sweep:  # every decode variant, CUDA graphs only
                    pools = (("fp32_pool", pool32, False, fp32_bytes), ("bf16_pool", pool16, False, bf16_bytes),
                             ("fp32_pool_vfirst", poolvf, True, fp32_bytes),
                             ("bf16_pool_vfirst", poolvf16, True, bf16_bytes))
                    for vname, env in DEC_VARIANTS:
                        set_env(env)
                        for pname, pool, vf, nbytes in pools:
                            _, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool, idx, None, None, vf),
                                          eager=False, rep=60)
                            rec(name=f"{fam}_decode_sweep", impl=f"serve_{pname}:{vname}", B=B, graph_ms=round(gr, 5),
                                graph_TBps=round(nbytes / gr / 1e9, 3))
                        _, gr = timed(lambda: core(q, k, v, g, beta32, scale, h0, None), eager=False, rep=60)
                        rec(name=f"{fam}_decode_sweep", impl=f"core_fwd:{vname}", B=B, graph_ms=round(gr, 5),
                            graph_TBps=round(fp32_bytes / gr / 1e9, 3))
                    set_env({})
                if sweep_ab:  # session-7 / session-8 variants, CUDA graphs only
                    pools = (("fp32_pool", pool32, False, fp32_bytes), ("bf16_pool", pool16, False, bf16_bytes),
                             ("bf16_pool_vfirst", poolvf16, True, bf16_bytes),
                             ("fp32_pool_vfirst", poolvf, True, fp32_bytes))
                    variants = sweep_ab if B >= 256 else sweep_ab[:SWEEP7_SMALL]
                    for vname, env in variants:
                        set_env(env)
                        _, gr = timed(lambda: core(q, k, v, g, beta32, scale, h0, None), eager=False,
                                      rep=args.sweep_rep)
                        rec(name=f"{fam}_decode_sweep", impl=f"core_fwd:{vname}", B=B, graph_ms=round(gr, 5),
                            graph_TBps=round(fp32_bytes / gr / 1e9, 3))
                        for pname, pool, vf, nbytes in pools:
                            _, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool, idx, None, None, vf),
                                          eager=False, rep=args.sweep_rep)
                            rec(name=f"{fam}_decode_sweep", impl=f"serve_{pname}:{vname}", B=B, graph_ms=round(gr, 5),
                                graph_TBps=round(nbytes / gr / 1e9, 3))
                    set_env({})
                    # the defaults again (drift check)
                    _, gr = timed(lambda: core(q, k, v, g, beta32, scale, h0, None), eager=False, rep=args.sweep_rep)
                    rec(name=f"{fam}_decode_sweep", impl="core_fwd:default_again", B=B, graph_ms=round(gr, 5),
                        graph_TBps=round(fp32_bytes / gr / 1e9, 3))
                    _, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool16, idx, None, None, False),
                                  eager=False, rep=args.sweep_rep)
                    rec(name=f"{fam}_decode_sweep", impl="serve_bf16_pool:default_again", B=B, graph_ms=round(gr, 5),
                        graph_TBps=round(bf16_bytes / gr / 1e9, 3))
                    if args.sweep10:  # LEAN again (drift check of the A/B)
                        for lv in ("2", "1"):
                            set_env({"KDA_CUDA_DEC_LEAN": lv})
                            _, gr = timed(lambda: core(q, k, v, g, beta32, scale, h0, None), eager=False,
                                          rep=args.sweep_rep)
                            rec(name=f"{fam}_decode_sweep", impl=f"core_fwd:s1_l{lv}_again", B=B,
                                graph_ms=round(gr, 5), graph_TBps=round(fp32_bytes / gr / 1e9, 3))
                        _, gr = timed(lambda: serve(q, k, v, g, beta32, scale, pool16, idx, None, None, False),
                                      eager=False, rep=args.sweep_rep)
                        rec(name=f"{fam}_decode_sweep", impl="serve_bf16_pool:s1_l1_again", B=B,
                            graph_ms=round(gr, 5), graph_TBps=round(bf16_bytes / gr / 1e9, 3))
                        _, gr = timed(lambda: serve(q, k, v, g, beta32, scale, poolvf16, idx, None, None, True),
                                      eager=False, rep=args.sweep_rep)
                        rec(name=f"{fam}_decode_sweep", impl="serve_bf16_pool_vfirst:s1_l1_again", B=B,
                            graph_ms=round(gr, 5), graph_TBps=round(bf16_bytes / gr / 1e9, 3))
                        set_env({})
            del h0, pool32, pool16, poolvf, poolvf16
            torch.cuda.empty_cache()

    # prefill / training shapes: recurrent fwd, fwd+bwd; fla chunk for reference
    for (B, T) in (() if args.decode_only else ((1, 8192), (8, 1024))):
        for fam in ("kda", "gdn"):
            kda = fam == "kda"
            q, k, v, g, beta = mk(B, T, H, HV, K, V, kda)
            beta32 = beta.float()
            do = torch.randn_like(v)
            with torch.inference_mode():
                core = getattr(ops, f"{fam}_recurrent_fwd")
                e, gr = timed(lambda: core(q, k, v, g, beta32, scale, None, None))
                rec(name=f"{fam}_recurrent_fwd", impl="ours", B=B, T=T, eager_ms=round(e, 4),
                    graph_ms=None if gr is None else round(gr, 4))
                bwd = getattr(ops, f"{fam}_recurrent_bwd")
                e2, _ = timed(lambda: bwd(q, k, v, g, beta32, scale, None, None, do, None), graphs=False)
                rec(name=f"{fam}_recurrent_bwd", impl="ours", B=B, T=T, eager_ms=round(e2, 4),
                    bwd_over_fwd=round(e2 / e, 2))
                if have_fla:
                    fc = chunk_kda if kda else chunk_gated_delta_rule
                    e, gr = timed(lambda: fc(q, k, v, g, beta, output_final_state=True))
                    rec(name=f"{fam}_chunk_fwd", impl="fla_0.6.0", B=B, T=T, eager_ms=round(e, 4),
                        graph_ms=None if gr is None else round(gr, 4))
            torch.cuda.empty_cache()

    if args.decode_only:  # the ceiling again (drift over the run)
        x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV)
        y = torch.empty_like(x)
        ms = do_bench(lambda: y.copy_(x), return_mode="median")
        rec(name="d2d_copy_4GB_rw", when="end", ms=round(ms, 4), TBps=round(2 * x.numel() * 2 / ms / 1e9, 3))
        del x, y
    out = {"meta": meta, "results": RES}
    (OUT / f"{args.prefix}.json").write_text(json.dumps(out, indent=1))
    table(out)
    try:
        plot(out, args.prefix)
        plot_sweep(out, args.prefix)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", repr(e)[:200])


def table(out):
    res = out["results"]
    fla = {(r["name"], r["B"]): r for r in res if r.get("impl") == "fla_0.6.0" and "decode" in r["name"]}
    print("\n| op | B | impl | eager ms | graph ms | graph TB/s | x fla (graph time) |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        if "decode" not in r["name"] or "sweep" in r["name"]:
            continue
        f = fla.get((r["name"], r["B"]))
        ratio = (f["graph_ms"] / r["graph_ms"]) if f and r.get("graph_ms") and f.get("graph_ms") else None
        print(f"| {r['name']} | {r['B']} | {r['impl']} | {r['eager_ms']:.4f} | {r.get('graph_ms')} | "
              f"{r.get('graph_TBps')} | {'' if ratio is None else f'{ratio:.2f}'} |")
    print("\n| op | B | variant | graph ms | graph TB/s | x fla (graph time) |")
    print("|---|---|---|---|---|---|")
    for r in res:
        if "sweep" not in r["name"]:
            continue
        f = fla.get((r["name"].replace("_sweep", ""), r["B"]))
        ratio = (f["graph_ms"] / r["graph_ms"]) if f and r.get("graph_ms") and f.get("graph_ms") else None
        print(f"| {r['name']} | {r['B']} | {r['impl']} | {r['graph_ms']} | {r['graph_TBps']} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} |")
    print()
    for r in res:
        if "decode" not in r["name"]:
            print(r)


def plot(out, prefix="cuda_bench"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = [r for r in out["results"] if "decode" in r["name"] and "sweep" not in r["name"] and r.get("graph_TBps")]
    copy = [r for r in out["results"] if r["name"].startswith("d2d")][0]["TBps"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    impls = ["fla_0.6.0", "ours_core_fwd", "ours_serve_fp32_pool", "ours_serve_bf16_pool", "ours_serve_fp32_pool_vfirst"]
    for ax, fam in zip(axes, ("kda", "gdn")):
        for i, impl in enumerate(impls):
            rr = [r for r in res if r["name"] == f"{fam}_decode" and r["impl"] == impl]
            xs = [j + i * 0.16 for j in range(len(rr))]
            ax.bar(xs, [r["graph_TBps"] for r in rr], width=0.16, label=impl)
            ax.set_xticks([j + 0.32 for j in range(len(rr))], [f"B={r['B']}" for r in rr])
        ax.axhline(copy, color="k", ls="--", lw=1, label=f"d2d copy {copy:.2f} TB/s")
        ax.set_title(f"{fam.upper()} decode, H16 HV32 K=V=128, CUDA graphs ({out['meta']['gpu']})")
        ax.set_ylabel("state bytes read+written / time (TB/s)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / ("cuda_decode_bandwidth.png" if prefix == "cuda_bench" else f"{prefix}.png"), dpi=110)


def plot_sweep(out, prefix):
    """B=256 panel per family: the sweep rows' graph time relative to the first variant (the default), per pool,
    with the same-size elementwise-copy ceilings as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = out["results"]
    fams = [f for f in ("kda", "gdn") if any(r["name"] == f"{f}_decode_sweep" and r["B"] == 256 for r in res)]
    if not fams:
        return
    fig, axes = plt.subplots(len(fams), 1, figsize=(14, 4.5 * len(fams)), squeeze=False)
    for ax, fam in zip(axes[:, 0], fams):
        rows = [r for r in res if r["name"] == f"{fam}_decode_sweep" and r["B"] == 256]
        impls = list(dict.fromkeys(r["impl"].split(":")[0] for r in rows))
        variants = list(dict.fromkeys(r["impl"].split(":")[1] for r in rows))
        t = {tuple(r["impl"].split(":")): r["graph_ms"] for r in rows}
        w = 0.8 / len(impls)
        for i, im in enumerate(impls):
            base = t.get((im, variants[0]))
            xs = [j + i * w for j, v in enumerate(variants) if (im, v) in t]
            ax.bar(xs, [t[(im, v)] / base for v in variants if (im, v) in t], width=w, label=im)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(variants))], variants, rotation=45, fontsize=8)
        ax.set_ylabel(f"graph time / variant {variants[0]}")
        ax.set_ylim(0.8, 2.0)
        ax.set_title(f"{fam.upper()} decode B=256 H16 HV32 K=V=128, CUDA graphs, {out['meta']['gpu']}: variants")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(OUT / f"{prefix}_sweep.png", dpi=100)


if __name__ == "__main__":
    import sys
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":  # PNGs again from a JSON (a run cut short)
        p = Path(sys.argv[2])
        d = json.loads(p.read_text())
        OUT = p.parent
        table(d)
        plot(d, p.stem)
        plot_sweep(d, p.stem)
    else:
        main()
