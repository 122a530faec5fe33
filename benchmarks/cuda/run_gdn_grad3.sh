#!/bin/bash
# Session 7, one device call for grad3_gdn (issue #7; kernels_src/cuda/delta_chunk_bwd_grad3_gdn.cuh, GDN's last grad
# kernel, KDA_CUDA_CHUNK_BWD_CH=2 default, =1 the per-channel grad3_ch): build (sm_90), the new tests first, per-kernel
# times of the GDN backward with the new default
# and with KDA_CUDA_CHUNK_BWD_CH=1, then an agreement check of every output at the benchmark shape, then
# tests/test_cuda_chunk_bwd.py + tests/test_cuda_stages.py. Everything under $OUT; each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-130} build_cuda 16
grep -A2 "grad3_gdn\|grad3_ch" "$OUT/build.log" | grep -E "Compiling|registers|spill" > "$OUT/ptxas_gdn.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${NEW_TIMEOUT:-40} python3 -m pytest -q -x $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py -k "gdn_grad3" \
  2>&1 | tail -25 > "$OUT/tests_new.log"
tail -3 "$OUT/tests_new.log"
# profile_chunk.py has no --bwd-ch flag: time the default, then the old kernel through the environment
timeout ${PROF_TIMEOUT:-22} python3 benchmarks/cuda/profile_chunk.py --families gdn --phases bwd \
  > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
KDA_CUDA_CHUNK_BWD_CH=1 timeout ${PROF_TIMEOUT:-22} python3 benchmarks/cuda/profile_chunk.py --families gdn --phases bwd \
  > "$OUT/kernel_times_ch1.json" 2>> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" "$OUT/kernel_times_ch1.json" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys
for name, f in zip(("CH=2 (grad3_gdn, default)", "CH=1 (grad3_ch)"), sys.argv[1:]):
    x = json.load(open(f)).get("gdn", {}).get("bwd", {})
    print("gdn bwd", name, "kernel sum %.4f ms" % sum(x.values()), x)
PY
timeout ${CHECK_TIMEOUT:-25} python3 - <<'PY' 2>&1 | tee "$OUT/agree.txt"
# B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape): relative RMS difference of every output, CH=2 vs CH=1
import sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs
ops = load_cuda_variant("kda_cuda_profile").ops
q, k, v, g, beta, do, dht = inputs("gdn", 1, 8192, 16, 32, 128, 128)
run = lambda: ops.gdn_chunk_bwd(q, k, v, g, beta, 128 ** -0.5, None, None, do, dht)
res = {}
for m in ("2", "1"):
    with knobs_set({"KDA_CUDA_CHUNK_BWD_CH": m}):
        res[m] = [x.double() for x in run()]
    torch.cuda.synchronize()
d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
     for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), res["2"], res["1"])}
print("gdn CH=2 vs 1 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
      "finite:", all(bool(torch.isfinite(x).all()) for x in res["2"]))
PY
# the two whole test files last (written as they run, so a cut-short run still shows how far it got)
timeout ${TEST_TIMEOUT:-70} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py \
  tests/test_cuda_stages.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
