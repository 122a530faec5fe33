#!/bin/bash
# Session 6, one device call for state_bwd3 (kernels_src/cuda/delta_chunk_bwd_state_bwd3.cuh, tensor cores):
# build (sm_90), a large-shape agreement check of state_bwd3 (3xTF32, default), its plain-tf32 mode (=4) and the
# fp32 SIMT state_bwd2 (=2), per-kernel times of the KDA and GDN backward with each, tests/test_cuda_chunk_bwd.py +
# tests/test_cuda_stages.py, the reference tests in bf16 with the plain-tf32 mode, then Nsight Compute sections
# of state_bwd3 if the call's time allows. Everything under $OUT (results.tgz + build.log); each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -A3 -E "state_bwd3|state_bwd2" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" \
  > "$OUT/ptxas_state_bwd.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${CHECK_TIMEOUT:-40} python3 - <<'PY' 2>&1 | tee "$OUT/agree.txt"
# B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape): relative RMS difference of every output between modes
import os, sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs
ops = load_cuda_variant("kda_cuda_profile").ops
for fam in ("kda", "gdn"):
    q, k, v, g, beta, do, dht = inputs(fam, 1, 8192, 16, 32, 128, 128)
    run = lambda: getattr(ops, f"{fam}_chunk_bwd")(q, k, v, g, beta, 128 ** -0.5, None, None, do, dht)
    res = {}
    for m in ("3", "4", "2"):
        with knobs_set({"KDA_CUDA_CHUNK_BWD_STATE_BWD": m}):
            res[m] = [x.double() for x in run()]
        torch.cuda.synchronize()
    for m in ("3", "4"):
        d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
             for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), res[m], res["2"])}
        print(fam, f"STATE_BWD={m} vs 2 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
              "finite:", all(bool(torch.isfinite(x).all()) for x in res[m]))
PY
timeout ${PROF_TIMEOUT:-70} python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-bwd 2,4 \
  > "$OUT/kernel_times_state_bwd3.json" 2> "$OUT/kernel_times_state_bwd3.err"
python3 - "$OUT/kernel_times_state_bwd3.json" <<'PY' 2>&1 | tee "$OUT/kernel_times_summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for fam in ("kda", "gdn"):
    for ph in ("bwd", "bwd_state_bwd2", "bwd_state_bwd4"):
        t = d[fam][ph]
        st = {k[k.find("state_bwd"):k.find("state_bwd") + 22]: v for k, v in t.items() if "state_bwd" in k}
        print(fam, ph, "total %.4f ms" % sum(t.values()), st)
PY
timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q $XD tests/test_cuda_chunk_bwd.py tests/test_cuda_stages.py \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -30 "$OUT/tests.log" | grep -vE "^\.|^s" | tail -25
KDA_CUDA_CHUNK_BWD_STATE_BWD=4 timeout ${TEST4_TIMEOUT:-40} \
  python3 -m pytest -q $XD tests/test_cuda_chunk_bwd.py \
  -k "test_chunk_bwd and (bf16 or fp16) and not matches" -p no:cacheprovider > "$OUT/tests_mode4.log" 2>&1
echo "tests_mode4 rc=$?"; grep -E "passed|failed" "$OUT/tests_mode4.log" | tail -3
grep -E "^FAILED|Error:" "$OUT/tests_mode4.log" | head -8
if [ $SECONDS -lt ${NCU_BEFORE_S:-250} ] && command -v ncu >/dev/null; then
  timeout $(( ${CALL_S:-285} - SECONDS )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats -k regex:state_bwd3 -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_bwd > "$OUT/ncu_state_bwd3_kda.txt" 2>&1
  grep -E "Duration|Achieved Occupancy|Registers|No Eligible|Issued Warp|Stall" "$OUT/ncu_state_bwd3_kda.txt" | head -12
fi
echo "total ${SECONDS}s"
(cd "$OUT" && tar czf /tmp/sb3_results.tgz --exclude=build.log . && find . -type f ! -name build.log -delete \
  && mv /tmp/sb3_results.tgz results.tgz)
