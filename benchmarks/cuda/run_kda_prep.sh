#!/bin/bash
# Session 4, one device call for the KDA-specific prep kernel (kernels_src/cuda/kda_chunk_prep.cuh): build (sm_90),
# tests/test_cuda_chunk_fwd.py + the chunked-forward cases of tests/test_cuda_backend.py, per-kernel times of the KDA
# forward with the generic (KDA_CUDA_KDA_PREP=0) and the KDA prep (=1), then bench_chunk_fwd.py for KDA only, both
# preps in one process, without fla (its Triton compile costs minutes). Everything under $OUT, packed at the end into
# $OUT/results.tgz (the run tool returns at most 8 files), with $OUT/build.log beside it; each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-120} build_cuda 16
grep -A3 "prep_kernel" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" > "$OUT/ptxas_prep.txt"
timeout ${TEST_TIMEOUT:-60} python3 -m pytest -q -n 14 tests/test_cuda_chunk_fwd.py tests/test_cuda_backend.py \
  -k "chunk and fwd" -p no:cacheprovider > "$OUT/tests.log" 2>&1
tail -25 "$OUT/tests.log" | grep -vE "^\.|^s" | tail -20
for sel in 0 1; do
  KDA_CUDA_KDA_PREP=$sel timeout 25 python3 benchmarks/cuda/profile_chunk.py --families kda --phases fwd \
    > "$OUT/kernel_times_kda_prep$sel.json" 2> "$OUT/kernel_times_kda_prep$sel.err"
  python3 -c "import json,sys;d=json.load(open(sys.argv[1]));print('prep=$sel', d['kda']['fwd'])" \
    "$OUT/kernel_times_kda_prep$sel.json" 2>&1 | tail -1
done
BENCH_FAMILIES=kda BENCH_KDA_PREP=0,1 BENCH_NO_FLA=1 timeout ${BENCH_TIMEOUT:-60} \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
tail -10 "$OUT/bench.log"
# Nsight Compute of the new prep kernel (a few sections), only if the call's time allows
if [ $SECONDS -lt ${NCU_BEFORE_S:-175} ] && command -v ncu >/dev/null; then
  timeout $(( ${CALL_S:-225} - SECONDS )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats -k regex:kda_chunk_prep -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_fwd > "$OUT/ncu_kda_chunk_prep_details.txt" 2>&1
  grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers|No Eligible|Block Limit" \
    "$OUT/ncu_kda_chunk_prep_details.txt" | head -12
fi
echo "total ${SECONDS}s"
# The archive is written outside $OUT first (session 4: writing it inside made tar fail with "file changed as we
# read it", so nothing was deleted and the tool returned only the first 8 loose files).
(cd "$OUT" && tar czf /tmp/kda_prep_results.tgz --exclude=build.log . && find . -type f ! -name build.log -delete \
  && mv /tmp/kda_prep_results.tgz results.tgz)
