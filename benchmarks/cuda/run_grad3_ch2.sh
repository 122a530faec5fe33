#!/bin/bash
# Session 7, one device call for grad3_ch2 (issue #7; kernels_src/cuda/delta_chunk_bwd_grad3_ch2.cuh): build (sm_90),
# a smoke test of the new kernel, per-kernel times of the KDA backward with the new default
# (KDA_CUDA_CHUNK_BWD_CH=2), grad3_ch_kernel (=1) and the 128-register instance (=3), an agreement check at the
# benchmark shape, then tests/test_cuda_chunk_bwd.py + tests/test_cuda_stages.py. Everything under $OUT; each step
# timed out (the data first, the long test run last).
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-140} build_cuda 16
grep -A2 "grad3_ch" "$OUT/build.log" | grep -E "Compiling|registers|spill" > "$OUT/ptxas_ch.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${SMOKE_TIMEOUT:-40} python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda_chunk_bwd.py \
  -k "ch2_matches_ch1 and (varlen_empty or T200_gates_50_rows) and fp32" 2>&1 | tail -15 > "$OUT/smoke.log"
tail -3 "$OUT/smoke.log"
timeout ${PROF_TIMEOUT:-40} python3 benchmarks/cuda/profile_chunk.py --families kda --phases bwd --bwd-ch 1,3 \
  > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for name in ("bwd", "bwd_ch1", "bwd_ch3"):
    x = r.get("kda", {}).get(name, {})
    print("kda", name, "total %.4f ms" % sum(x.values()), {k: v for k, v in x.items() if "grad3" in k or v > 0.3})
PY
timeout ${CHECK_TIMEOUT:-30} python3 - <<'PY' 2>&1 | tee "$OUT/agree.txt"
# B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape): relative RMS difference of every output between modes
import sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs
ops = load_cuda_variant("kda_cuda_profile").ops
q, k, v, g, beta, do, dht = inputs("kda", 1, 8192, 16, 32, 128, 128)
run = lambda: ops.kda_chunk_bwd(q, k, v, g, beta, 128 ** -0.5, None, None, do, dht)
res = {}
for m in ("2", "3", "1"):
    with knobs_set({"KDA_CUDA_CHUNK_BWD_CH": m}):
        res[m] = [x.double() for x in run()]
    torch.cuda.synchronize()
for m in ("2", "3"):
    d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
         for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), res[m], res["1"])}
    print("kda", f"CH={m} vs 1 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
          "finite:", all(bool(torch.isfinite(x).all()) for x in res[m]))
print("CH=2 vs CH=3 identical:", all(bool(torch.equal(a, b)) for a, b in zip(res["2"], res["3"])))
PY
TT=$(( ${CALL_LIMIT:-268} - SECONDS )); echo "tests get ${TT}s"
timeout ${TEST_TIMEOUT:-$TT} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py \
  tests/test_cuda_stages.py 2>&1 | tail -40 > "$OUT/tests.log"
tail -4 "$OUT/tests.log"
