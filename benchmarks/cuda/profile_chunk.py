#!/usr/bin/env python3
"""Per-kernel times of the chunked forward and backward core ops (torch.profiler), and a single-call mode for
Nsight Compute. B=1 T=8192 H=16 HV=32 K=V=128 bf16 unless told otherwise.

    python benchmarks/cuda/profile_chunk.py                 # prints {family: {phase: {kernel: ms}}} as JSON
    python benchmarks/cuda/profile_chunk.py --summarize A.json [B.json ...]   # one line per (family, phase)
    ncu -k regex:prep -c 1 --set full -o prep python benchmarks/cuda/profile_chunk.py --once kda_fwd
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_chunk_fwd import mk  # noqa: E402
from cuda_variant import knobs_set, load_cuda_variant  # noqa: E402


def inputs(family, B, T, H, HV, K, V):
    """The chunked benchmarks' inputs (bench_chunk_fwd.mk), plus grad_o and grad_final_state for the backward."""
    q, k, v, g, beta = mk(B, T, H, HV, K, V, family == "kda")
    return q, k, v, g, beta, torch.randn_like(v), torch.randn(B, HV, K, V, device=v.device)


def calls(ops, family, xs, K):
    q, k, v, g, beta, do, dht = xs
    fwd = getattr(ops, f"{family}_chunk_fwd")
    bwd = getattr(ops, f"{family}_chunk_bwd")
    return {"fwd": lambda: fwd(q, k, v, g, beta, K ** -0.5, None, None),
            "bwd": lambda: bwd(q, k, v, g, beta, K ** -0.5, None, None, do, dht)}


def kernel_times(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            out[e.key[:90]] = round(e.device_time_total / 1e3 / reps, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# Knobs whose values are timed in turn, in the same process (the host code reads them on every call):
# (option, environment variable, phase, row name prefix, KDA only (True; "gdn": GDN only), what the values select)
KNOB_SWEEPS = [
    ("--scans", "KDA_CUDA_CHUNK_SCAN", "fwd", "fwd_scan", False,
     "1 single kernel, 11 scan7 with U as bf16 hi + lo (the default since session 12: warp-specialized, recurrence "
     "and output warps in one block, bf16 m16n8k16 operands), 10 scan7 with U plain bf16 (4 the bulk-prefetch "
     "scan3, 5 / 6 the split forward, 7 scan5, 8 scan6, 9 scan6 with warp pairs: retired in sessions 11 and 12, "
     "refused)"),
    ("--kda-prep", "KDA_CUDA_KDA_PREP", "fwd", "fwd_kda_prep", True,
     "6 kda_chunk_prep2's FAST instance, the default since session 13 (the same outputs bit for bit from fewer "
     "instructions), 3 kda_chunk_prep2 with the 8x8 split, the default until then (0, 1, 2, 4, 5: retired, refused)"),
    ("--gdn-prep", "KDA_CUDA_GDN_PREP", "fwd", "fwd_gdn_prep", "gdn",
     "2 gdn_chunk_prep2, 3 gdn_chunk_prep3: one block per pair of GVA value heads sharing the q / k loads and the "
     "raw products of S1, bit for bit v2's (session 13); unset: 3 where HV / H is even, else 2 (0 and 1: retired, "
     "refused)"),
    ("--bwd-state-fwd", "KDA_CUDA_CHUNK_BWD_STATE_FWD", "bwd", "bwd_state_fwd", False,
     "11 state_fwd3 shared-operand, the default for bf16/fp16 inputs since session 13 (two narrow column groups per "
     "block sharing double-buffered operand tiles; bit for bit 7's; sm_90+, else 7), 7 state_fwd3 tf32 narrow (16 "
     "value columns per block, the default from session 10 to 13), 12 state_fwd3 wide-block (7's warp tiles on 16 "
     "warps of a 32-column block; bit for bit 7's), 3 state_fwd3 3xTF32, 2 the fp32 SIMT state_fwd2 (4, 5, and 8 / "
     "9 / 10, state_fwd on bf16 operands: retired, refused)"),
    ("--bwd-state-bwd", "KDA_CUDA_CHUNK_BWD_STATE_BWD", "bwd", "bwd_state_bwd", False,
     "12 state_bwd3f, the default for bf16/fp16 inputs since session 13 (4 with its operands rounded to tf32 once "
     "where written and 3 barriers per chunk; bit for bit 4's outputs), 11 it with 8-byte A reads (dS rows "
     "permuted), 4 state_bwd3 with plain tf32 (the default from session 8 to 13), 3 it with 3xTF32, 10 it with bf16 "
     "operands (session 12, opt-in), 2 the fp32 SIMT state_bwd2 (9, 5, 6: retired, refused)"),
    ("--bwd-vc", "KDA_CUDA_CHUNK_BWD_VC", "bwd", "bwd_vc", False,
     "1 the fp32 SIMT grad3_vc, 2 grad3_vc_tc on tensor cores with 3xTF32, 3 it with plain tf32, the default for "
     "bf16/fp16 inputs"),
    ("--bwd-prep", "KDA_CUDA_CHUNK_BWD_PREP", "bwd", "bwd_prep", False,
     "6 the KDA prep v6 (v4 with each 3xTF32 split formed once, bit for bit v4's), the default for bf16/fp16 inputs "
     "since session 13, 4 the KDA prep v4 with the 8x8 split (the default until then), 2 the fp32 SIMT prep (GDN: "
     "every value but 2 runs its prep v3; 1, 3, 5: retired, refused for KDA)"),
    ("--bwd-ch", "KDA_CUDA_CHUNK_BWD_CH", "bwd", "bwd_ch", True,
     "5 grad3_ch2's F5 instance, the default since session 13 (the same gradients bit for bit from fewer integer / "
     "shuffle instructions), 2 grad3_ch2 without it (1, 3, 4: retired, refused)"),
    ("--bwd-wy", "KDA_CUDA_CHUNK_BWD_WY", "bwd", "bwd_wy", False,
     "4 grad3_wy4, the default since session 13 (grad3_wy2 with the splits formed once and rebalanced warps, bit "
     "for bit its outputs), 2 grad3_wy2, 1 the SIMT grad3_wy (the only one where V %% 4 != 0) (3: retired, refused)"),
    ("--bwd-gva", "KDA_CUDA_CHUNK_BWD_GVA", "bwd", "bwd_gva", False,
     "1 gva_reduce_kernel (the GVA reduce of dq, dk in one launch), the default since session 9, 0 the reduce in "
     "torch"),
    ("--bwd-window", "KDA_CUDA_CHUNK_BWD_WINDOW", "bwd", "bwd_window", False,
     "0 no windows, the default (one call over the whole sequence), N tokens per window, -1 about 65536 / (B * HV), "
     "2048 at B1 HV32 (the windowed backward also runs the chunked forward over all windows but the last)"),
    ("--bwd-free", "KDA_CUDA_CHUNK_BWD_FREE", "bwd", "bwd_free", False,
     "0 every output allocated before the first stage and no work freed early (session 7), 1 the default"),
]


def peak_mib(fn):
    """Peak of torch.cuda.max_memory_allocated above what was allocated before one call of fn (MiB; the inputs
    do not count, the outputs do): bench_chunk_bwd.py's peak_above."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


def summarize(paths):
    """One line per (family, phase) of this script's JSON output: the sum (ms; MiB for peak_mib) and every kernel
    above 0.1, short names; each line starts with the file name when several files are given."""
    for path in paths:
        r = json.load(open(path))
        for fam in ("kda", "gdn"):
            for ph, x in r.get(fam, {}).items():
                xs = {k: v for k, v in x.items() if isinstance(v, (int, float))}
                unit = "MiB" if ph == "peak_mib" else "ms"
                print(*([path.rsplit("/", 1)[-1]] if len(paths) > 1 else []), fam, ph,
                      f"sum {sum(xs.values()):.3f} {unit}",
                      {k.split("(")[0].split("::")[-1]: v for k, v in xs.items() if v > 0.1})


def kernels_matching(path, words):
    """Per family and timed row of this script's JSON output, the kernels whose names contain one of the
    comma-separated `words` (e.g. "prep" or "state_fwd"), short names: how the candidate scripts show the kernels a
    knob swaps."""
    r = json.load(open(path))
    for fam in ("kda", "gdn"):
        for row, x in r.get(fam, {}).items():
            if row == "peak_mib":
                continue
            ks = {k.split("(")[0].split("::")[-1][:60]: v for k, v in x.items()
                  if any(w in k for w in words.split(","))}
            if ks:
                print(fam, row, " ".join(f"{k} {v:.3f}" for k, v in ks.items()))


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":  # no GPU needed
        return summarize(sys.argv[2:])
    if len(sys.argv) == 4 and sys.argv[1] == "--kernels":  # --kernels FILE WORDS; no GPU needed
        return kernels_matching(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8192,16,32,128,128", help="B,T,H,HV,K,V")
    ap.add_argument("--families", default="kda,gdn", help="comma-separated: kda, gdn")
    ap.add_argument("--phases", default="fwd,bwd", help="comma-separated: fwd, bwd")
    ap.add_argument("--peak", action="store_true",
                    help="also record each timed row's peak memory above the inputs (MiB) under FAMILY.peak_mib")
    ap.add_argument("--once", default=None, help="one call of FAMILY_PHASE (kda_fwd, gdn_bwd, ...) after a warm-up")
    ap.add_argument("--bwd-prep2", action="store_true",
                    help="also time the backward with the fp32 SIMT prep (KDA_CUDA_CHUNK_BWD_PREP=2; the default for "
                         "bf16/fp16 inputs is a tensor-core prep, v4 for KDA, v3 for GDN) as bwd_prep2")
    for opt, env, phase, row, kda_only, values in KNOB_SWEEPS:
        ap.add_argument(opt, default="", help=f"comma-separated {env} values ({values}) to also time the {phase} "
                                              f"with, each as {row}N" + (" (GDN only)" if kda_only == "gdn" else
                                                                         " (KDA only)" if kda_only else ""))
    args = ap.parse_args()
    B, T, H, HV, K, V = (int(x) for x in args.shape.split(","))
    ops = load_cuda_variant("kda_cuda_profile").ops
    if args.once:
        family, phase = args.once.split("_")
        fn = calls(ops, family, inputs(family, B, T, H, HV, K, V), K)[phase]
        fn()
        torch.cuda.synchronize()
        return
    res = {"gpu": torch.cuda.get_device_name(), "shape": dict(B=B, T=T, H=H, HV=HV, K=K, V=V),
           "env": {k: v for k, v in os.environ.items() if k.startswith("KDA_CUDA_")}}
    phases = args.phases.split(",")
    for family in args.families.split(","):
        fns = calls(ops, family, inputs(family, B, T, H, HV, K, V), K)
        res[family] = {phase: kernel_times(fn) for phase, fn in fns.items() if phase in phases}
        if args.peak:
            res[family]["peak_mib"] = {phase: peak_mib(fn) for phase, fn in fns.items() if phase in phases}
        # the older kernels, selected by knobs the host code reads on every call, timed in the same process
        # the fifth field: True KDA only, "gdn" GDN only, False both families
        extra = [((family == "gdn") if kda_only == "gdn" else (family == "kda" or not kda_only), phase, f"{row}{x}",
                  {env: x})
                 for opt, env, phase, row, kda_only, _ in KNOB_SWEEPS
                 for x in getattr(args, opt[2:].replace("-", "_")).split(",") if x]
        # (--bwd-state-v1, --bwd-grad-v1, --bwd-grad2: their kernels were retired in session 9)
        extra += [(args.bwd_prep2, "bwd", "bwd_prep2", {"KDA_CUDA_CHUNK_BWD_PREP": "2"})]
        for flag, phase, name, knobs in extra:
            if flag and phase in phases:
                with knobs_set(knobs):
                    res[family][name] = kernel_times(fns[phase])
                    if args.peak:
                        res[family]["peak_mib"][name] = peak_mib(fns[phase])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
