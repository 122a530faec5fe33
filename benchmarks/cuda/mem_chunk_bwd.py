"""Peak memory (and time) of the CUDA chunked backward per variant, beside tests/cuda_mem_model.py's prediction.

    python3 benchmarks/cuda/mem_chunk_bwd.py     # writes $OUT (or benchmarks/results) cuda_chunk_bwd_mem.json

For each family (KDA, GDN), shape (MEM_SHAPES, default "1,8192,16,32;4,4096,32,32;1,32768,16,32"; B,T,H,HV with
K=V=128, bf16 q/k/v as bench_chunk_bwd.py) and variant (MEM_VARIANTS, ;-separated knob lists, each a ,-separated
list of NAME=VALUE; default: no windows "KDA_TRAIN_WINDOW=0", the C++ backward's windows
"KDA_TRAIN_WINDOW=0,KDA_CUDA_CHUNK_BWD_WINDOW=-1" (the window-start states recomputed by a forward inside the
backward) and the public API's autograd-level windows "KDA_TRAIN_WINDOW=-1" (the forward runs window by window and
autograd keeps each window's start state; docs/ops.md); "KDA_CUDA_CHUNK_BWD_FREE=0" is the session-7 allocation):
the peak of torch.cuda.max_memory_allocated above the inputs over the forward alone, the backward core op alone
and one public forward + backward (autograd, output_final_state=True), the model's prediction of the last, and the
fwd+bwd time (CUDA events, eager, median of MEM_REPS=20 after 3 warm-ups). One JSON line per row on stdout. Per
stage: the model's parts (work at grad3_vc, at grad3_ch, finish; forward; autograd windows: forward, backward,
concatenation) are in each row's "model" field. fla 0.6.0's anchor: 1800 MB (KDA, T8192), 7194 MB (T32768),
measured in session 8.
"""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from bench_chunk_fwd import mk as mk_inputs  # noqa: E402
from cuda_mem_model import MiB, fwdbwd_peak, train_window_peak  # noqa: E402
from cuda_variant import knobs_set, load_cuda_variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
FLA_ANCHOR_MB = {("kda", 1, 8192, 16, 32): 1800, ("kda", 1, 32768, 16, 32): 7194}


def peak_above(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MiB


def time_ms(fn, reps):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main():
    kk = load_cuda_variant()
    shapes = [tuple(int(x) for x in s.split(",")) for s in
              os.environ.get("MEM_SHAPES", "1,8192,16,32;4,4096,32,32;1,32768,16,32").split(";") if s]
    variants = os.environ.get("MEM_VARIANTS", "KDA_TRAIN_WINDOW=0;KDA_TRAIN_WINDOW=0,KDA_CUDA_CHUNK_BWD_WINDOW=-1;"
                              "KDA_TRAIN_WINDOW=-1").split(";")
    reps = int(os.environ.get("MEM_REPS", "20"))
    K = V = 128
    rows = []
    OUT.mkdir(parents=True, exist_ok=True)
    for (B, T, H, HV) in shapes:
        for fam in ("kda", "gdn"):
            kda = fam == "kda"
            xs = [x.requires_grad_(True) for x in mk_inputs(B, T, H, HV, K, V, kda)]
            do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
            dht = torch.randn(B, HV, K, V, device="cuda")
            fn = kk.chunk_kda if kda else kk.chunk_gated_delta_rule
            op = getattr(kk.ops, f"{fam}_chunk_bwd")
            scale = K ** -0.5

            def fwd():
                with torch.no_grad():
                    return fn(*xs, scale=scale, output_final_state=True)

            def fwdbwd():
                o, s = fn(*xs, scale=scale, output_final_state=True)
                return torch.autograd.grad((o, s), xs, (do, dht))

            def core():
                with torch.no_grad():
                    return op(*[x.detach() for x in xs], scale, None, None, do, dht)

            for variant in variants:
                knobs = dict(kv.split("=") for kv in variant.split(",")) if variant else {}
                row = dict(family=fam, B=B, T=T, H=H, HV=HV, K=K, V=V, variant=variant or "default")
                try:
                    with knobs_set(knobs):
                        row["peak_fwd_mib"] = round(peak_above(fwd), 1)
                        row["peak_bwd_core_mib"] = round(peak_above(core), 1)
                        row["peak_fwdbwd_mib"] = round(peak_above(fwdbwd), 1)
                        row["fwdbwd_ms"] = round(time_ms(fwdbwd, reps), 3)
                    win = knobs.get("KDA_CUDA_CHUNK_BWD_WINDOW")
                    free = knobs.get("KDA_CUDA_CHUNK_BWD_FREE", "1") != "0"
                    train = int(knobs.get("KDA_TRAIN_WINDOW", kk.api.TRAIN_WINDOW_DEFAULT))
                    row["train_windows"] = len(kk.api.train_windows(B, T, HV, "cuda", knob=train))
                    pw = train_window_peak(fam, B, T, H, HV, K, V, knob=train, free=free)
                    if pw is not None:  # (the C++ windows inside an autograd window: not modelled)
                        pred, parts = pw
                    else:
                        pred, parts = fwdbwd_peak(fam, B, T, H, HV, K, V, window=None if win is None else int(win),
                                                  free=free)
                    row["model_fwdbwd_mib"] = round(pred / MiB, 1)
                    row["model"] = {k: (round(v / MiB, 1) if k not in ("window", "windows", "window_seqs") else v)
                                    for k, v in parts.items()}
                    anchor = FLA_ANCHOR_MB.get((fam, B, T, H, HV))
                    if anchor:
                        row["fla_anchor_mb"] = anchor
                        row["ratio_to_fla"] = round(row["peak_fwdbwd_mib"] / anchor, 3)
                except Exception as e:  # noqa: BLE001
                    torch.cuda.synchronize()
                    row["error"] = repr(e)[:400]
                print(json.dumps(row), flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
            xs = do = dht = None
            torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    (OUT / "cuda_chunk_bwd_mem.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
