#!/bin/bash
# Session 7, one device call for grad3_wy2 (issue #7; kernels_src/cuda/delta_chunk_bwd_grad3_wy2.cuh, the WY backward
# on tensor cores, KDA_CUDA_CHUNK_BWD_WY=2 default, =1 the SIMT grad3_wy, =3 grad3_wy2 with plain tf32 for bf16): build
# (sm_90), the new tests first (smoke), per-kernel times of the KDA and GDN backward with WY=2, 1, 3 and the agreement
# of every output at the benchmark shape (WY=2 and 3 against 1), then tests/test_cuda_chunk_bwd.py +
# tests/test_cuda_stages.py with the time left. Everything under $OUT; each step timed out.
# Run: copy the branch to .dev/grad3-wy2, run(command="cd .dev/grad3-wy2 && bash benchmarks/cuda/run_grad3_wy2.sh",
# carry=[".dev/grad3-wy2", ".whl"], timeout_s=280); the full tests get what is left of BUDGET_S (272) seconds.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-140} build_cuda 16
grep -A2 "grad3_wy" "$OUT/build.log" | grep -E "Compiling|registers|spill" > "$OUT/ptxas_wy.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${NEW_TIMEOUT:-45} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py -k "grad3_wy2" \
  2>&1 | tail -40 > "$OUT/tests_new.log"
tail -3 "$OUT/tests_new.log"
timeout ${CHECK_TIMEOUT:-45} python3 - "$OUT/kernel_times.json" <<'PY' 2>&1 | tee "$OUT/summary.txt"
# B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape): per-kernel times (torch.profiler, profile_chunk.kernel_times)
# and the relative RMS difference of every output, WY=2 (default) and WY=3 against WY=1
import json, sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs, kernel_times
ops = load_cuda_variant("kda_cuda_profile").ops
res = {"gpu": torch.cuda.get_device_name(), "shape": dict(B=1, T=8192, H=16, HV=32, K=128, V=128)}
for fam in ("kda", "gdn"):
    q, k, v, g, beta, do, dht = inputs(fam, 1, 8192, 16, 32, 128, 128)
    run = lambda: getattr(ops, f"{fam}_chunk_bwd")(q, k, v, g, beta, 128 ** -0.5, None, None, do, dht)
    out = {}
    for m in ("2", "1", "3"):
        with knobs_set({"KDA_CUDA_CHUNK_BWD_WY": m}):
            t = kernel_times(run)
            res[f"{fam}_bwd_WY{m}"] = t
            wy = {kk: x for kk, x in t.items() if "grad3_wy" in kk}
            print(fam, f"WY={m}", "kernel sum %.4f ms" % sum(t.values()), wy, flush=True)
            out[m] = [x.double() for x in run()]
        torch.cuda.synchronize()
    for m in ("2", "3"):
        d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
             for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out[m], out["1"])}
        res[f"{fam}_WY{m}_vs_WY1_rel_rms"] = d
        print(fam, f"WY={m} vs 1 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
              "finite:", all(bool(torch.isfinite(x).all()) for x in out[m]), flush=True)
    del out
json.dump(res, open(sys.argv[1], "w"), indent=1)
PY
# the two whole test files last, with the time left (written as they run)
LEFT=$(( ${BUDGET_S:-272} - SECONDS )); echo "time left for the full tests: ${LEFT}s"
if [ "$LEFT" -gt 15 ]; then
  timeout "$LEFT" python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py tests/test_cuda_stages.py \
    -k "not grad3_wy2" > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log"
fi
