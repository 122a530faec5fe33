#!/bin/bash
# Session 6, one device call for the backward's tensor-core prep v3 (kernels_src/cuda/delta_chunk_bwd_prep.cuh):
# build (sm_90), per-kernel times of the KDA and GDN backward with the new default prep and the fp32 SIMT prep
# (KDA_CUDA_CHUNK_BWD_PREP=2) in one process, tests/test_cuda_chunk_bwd.py (+ the prep's CPU emulation), then
# Nsight Compute sections of prep v3 if the call's time allows. Everything under $OUT, packed into
# $OUT/results.tgz with $OUT/build.log beside it; each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -A3 -E "prep3_|prep_kernel" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" > "$OUT/ptxas_prep.txt"
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-prep2 \
  > "$OUT/kernel_times_bwd_prep.json" 2> "$OUT/kernel_times_bwd_prep.err"
python3 - "$OUT/kernel_times_bwd_prep.json" <<'PY' 2>&1 | tee "$OUT/kernel_times_summary.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for fam in ("kda", "gdn"):
    for ph in ("bwd", "bwd_prep2"):
        t = d[fam][ph]
        print(fam, ph, "total %.4f ms" % sum(t.values()), {k[:60]: v for k, v in list(t.items())[:6]})
PY
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q $XD tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_bwd_prep_emu.py \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -30 "$OUT/tests.log" | grep -vE "^\.|^s" | tail -25
timeout ${TEST2_TIMEOUT:-40} python3 -m pytest -q $XD tests/test_cuda_backend.py -k "test_bwd or autograd" \
  -p no:cacheprovider > "$OUT/tests_backend.log" 2>&1
echo "tests_backend rc=$?"; tail -3 "$OUT/tests_backend.log"
if [ $SECONDS -lt ${NCU_BEFORE_S:-270} ] && command -v ncu >/dev/null; then
  timeout $(( ${CALL_S:-320} - SECONDS )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats -k regex:prep3_kda -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_bwd > "$OUT/ncu_prep3_kda.txt" 2>&1
  grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers|No Eligible|Block Limit" \
    "$OUT/ncu_prep3_kda.txt" | head -12
fi
echo "total ${SECONDS}s"
(cd "$OUT" && tar czf /tmp/bwd_prep_results.tgz --exclude=build.log . && find . -type f ! -name build.log -delete \
  && mv /tmp/bwd_prep_results.tgz results.tgz)
