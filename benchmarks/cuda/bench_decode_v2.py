"""Decode: the persistent bulk-copy kernel (delta_decode_bulk.cuh, KDA_CUDA_DEC_V2) against the per-column-slice
kernel (KDA_CUDA_DEC_V2=0) and flash-linear-attention 0.6.0, in one process, next to a device-to-device copy.

    OUT=/tmp/out python3 benchmarks/cuda/bench_decode_v2.py --prefix cuda_decode_session4

H=16, HV=32, K=V=128, one token, bf16 q/k/v, fp32 g and beta. Rows per (B, family, kernel variant): the core op
(fp32 initial state read, fp32 final state written to a new tensor) and the in-place serving op on fp32 / bf16
pools, K-first and V-first; CUDA graphs (triton do_bench_cudagraph, median); effective state bandwidth = state
bytes read + written / time (bf16 pools count bf16 bytes). B=256 first, so a run stopped by a time limit still has
the rows that matter. The copy is measured at the start and at the end.
"""
import argparse
import json
import os
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

from bench_cuda import DEC_ENV, mk, set_env as set_dec_env
from cuda_variant import load_cuda_variant

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
DEV = "cuda"
RES = []
META = {}
ENV = DEC_ENV + ("KDA_CUDA_DEC_V2", "KDA_CUDA_DEC_V2_HINT")


def rec(prefix, **kw):
    RES.append(kw)
    print(json.dumps(kw), flush=True)
    (OUT / f"{prefix}.json").write_text(json.dumps({"meta": META, "results": RES}, indent=1))


def variants(B):
    old = ("old", {"KDA_CUDA_DEC_V2": "0"})
    b1 = ("bulk1", {"KDA_CUDA_DEC_V2": "1", "KDA_CUDA_DEC_V2_HINT": "0"})
    b2 = ("bulk2", {"KDA_CUDA_DEC_V2": "2", "KDA_CUDA_DEC_V2_HINT": "0"})
    if B == 256:
        return [old, ("default", {}), b1, b2] + [
            (f"bulk2_hint{h}", {"KDA_CUDA_DEC_V2": "2", "KDA_CUDA_DEC_V2_HINT": str(h)}) for h in (1, 2, 3)] + [
            ("bulk1_hint2", {"KDA_CUDA_DEC_V2": "1", "KDA_CUDA_DEC_V2_HINT": "2"}), ("old_again", old[1]),
            ("bulk2_again", b2[1])]
    return [old, ("default", {}), b1, b2]


def copy_row(prefix, tag):
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    rec(prefix, name="d2d_copy_4GB_rw", when=tag, ms=round(ms, 4), TBps=round(2 * x.numel() * 2 / ms / 1e9, 3))
    # a copy of the B=256 fp32 state's size (512 MiB read + 512 MiB written), under CUDA graphs like the rows
    a = torch.empty(256 * 32 * 128 * 128, device=DEV)
    b = torch.empty_like(a)
    gr = do_bench_cudagraph(lambda: b.copy_(a), rep=50, return_mode="median")
    rec(prefix, name="d2d_copy_state_size_graph", when=tag, ms=round(gr, 5), TBps=round(2 * a.numel() * 4 / gr / 1e9, 3))
    del x, y, a, b
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", default="cuda_decode_v2")
    ap.add_argument("--batches", default="256,64,1")
    ap.add_argument("--rep", type=int, default=40)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    META.update({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    try:
        import fla
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
        META["fla"] = getattr(fla, "__version__", "?")
        have_fla = True
    except Exception as e:  # noqa: BLE001
        print("fla unavailable:", repr(e)[:300])
        have_fla = False
    import triton
    META["triton"] = triton.__version__
    print(json.dumps(META), flush=True)
    ops = load_cuda_variant("kda_cuda_bench").ops
    P = args.prefix
    copy_row(P, "start")

    H, HV, K, V = 16, 32, 128, 128
    scale = K ** -0.5
    for B in [int(b) for b in args.batches.split(",")]:
        for fam in ("kda", "gdn"):
            kda = fam == "kda"
            q, k, v, g, beta = mk(B, 1, H, HV, K, V, kda)
            beta32 = beta.float()
            h0 = torch.randn(B, HV, K, V, device=DEV)
            f32 = B * HV * K * V * 4 * 2
            idx = torch.arange(B, device=DEV)
            pools = {"fp32_pool": (h0.clone(), False, f32), "bf16_pool": (h0.to(torch.bfloat16), False, f32 // 2),
                     "fp32_pool_vfirst": (h0.transpose(-1, -2).contiguous(), True, f32),
                     "bf16_pool_vfirst": (h0.transpose(-1, -2).contiguous().to(torch.bfloat16), True, f32 // 2)}
            with torch.inference_mode():
                if have_fla:
                    f = fused_recurrent_kda if kda else fused_recurrent_gated_delta_rule
                    fn = lambda: f(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
                    fn()
                    gr = do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
                    rec(P, name=f"{fam}_decode", impl="fla_0.6.0", B=B, graph_ms=round(gr, 5),
                        graph_TBps=round(f32 / gr / 1e9, 3))
                core = getattr(ops, f"{fam}_recurrent_fwd")
                serve = getattr(ops, f"{fam}_recurrent_serve")
                for vname, env in variants(B):
                    set_dec_env(env, ENV)
                    fns = [("core_fwd", lambda: core(q, k, v, g, beta32, scale, h0, None), f32)]
                    for pname, (pool, vf, nb) in pools.items():
                        fns.append((f"serve_{pname}",
                                    lambda pool=pool, vf=vf: serve(q, k, v, g, beta32, scale, pool, idx, None, None, vf),
                                    nb))
                    for what, fn, nb in fns:
                        try:
                            fn()
                            torch.cuda.synchronize()
                            gr = do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
                            eg = do_bench(fn, warmup=10, rep=args.rep, return_mode="median") if vname == "default" \
                                else None
                        except Exception as e:  # noqa: BLE001
                            print("failed:", fam, B, vname, what, repr(e)[:300], flush=True)
                            continue
                        rec(P, name=f"{fam}_decode", impl=f"{what}:{vname}", B=B, graph_ms=round(gr, 5),
                            graph_TBps=round(nb / gr / 1e9, 3), eager_ms=None if eg is None else round(eg, 5))
                    set_dec_env({}, ENV)
            del h0, pools
            torch.cuda.empty_cache()
    copy_row(P, "end")
    table()


def table():
    fla = {(r["name"], r["B"]): r["graph_ms"] for r in RES if r.get("impl") == "fla_0.6.0"}
    print("\n| op | B | impl:variant | graph ms | TB/s | fla fp32 ms / this |")
    print("|---|---|---|---|---|---|")
    for r in RES:
        if "decode" not in r["name"]:
            print(r)
            continue
        f = fla.get((r["name"], r["B"]))
        print(f"| {r['name']} | {r['B']} | {r['impl']} | {r['graph_ms']} | {r['graph_TBps']} | "
              f"{'' if f is None else round(f / r['graph_ms'], 3)} |")


if __name__ == "__main__":
    main()
