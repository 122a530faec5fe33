#!/bin/bash
# Session 4, one device call for the GDN-specific prep kernel (kernels_src/cuda/gdn_chunk_prep.cuh): build (sm_90),
# tests/test_cuda_chunk_fwd.py + the chunked-forward cases of tests/test_cuda_backend.py, per-kernel times of the GDN
# forward with the generic (KDA_CUDA_GDN_PREP=0) and the GDN prep (=1), then bench_chunk_fwd.py for GDN only, both
# preps in one process, without fla (its Triton compile costs minutes). Everything under $OUT (at the end packed into
# $OUT/results.tgz, with $OUT/build.log beside it); each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -A3 "prep_kernel" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" > "$OUT/ptxas_prep.txt"
timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -n 14 tests/test_cuda_chunk_fwd.py tests/test_cuda_backend.py \
  -k "chunk and fwd" -p no:cacheprovider --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
tail -15 "$OUT/tests.log"
for sel in 0 1; do
  KDA_CUDA_GDN_PREP=$sel timeout 40 python3 benchmarks/cuda/profile_chunk.py --families gdn --phases fwd \
    > "$OUT/kernel_times_gdn_prep$sel.json" 2> "$OUT/kernel_times_gdn_prep$sel.err"
  cat "$OUT/kernel_times_gdn_prep$sel.json"
done
BENCH_FAMILIES=gdn BENCH_GDN_PREP=0,1 BENCH_NO_FLA=1 timeout ${BENCH_TIMEOUT:-80} \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
tail -12 "$OUT/bench.log"
# the scan's 32-column tile (KDA_CUDA_CHUNK_BV=32; default at this shape: 16), GDN prep: one more data point
KDA_CUDA_CHUNK_BV=32 timeout 30 python3 benchmarks/cuda/profile_chunk.py --families gdn --phases fwd \
  > "$OUT/kernel_times_gdn_prep1_bv32.json" 2>&1
# Nsight Compute of the new prep kernel (a few sections), only if the call's time allows
if [ $SECONDS -lt ${NCU_BEFORE_S:-215} ] && command -v ncu >/dev/null; then
  timeout $(( ${CALL_S:-285} - SECONDS )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:gdn_chunk_prep -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once gdn_fwd > "$OUT/ncu_gdn_chunk_prep_details.txt" 2>&1
fi
echo "total ${SECONDS}s"
# The run tool brings back only the first 8 files under $OUT (session 4: tests.xml, the second kernel-time JSON and
# the ncu text were left out): everything but build.log goes into one archive.
(cd "$OUT" && tar czf results.tgz --exclude=build.log --exclude=results.tgz . && find . -type f ! -name build.log \
  ! -name results.tgz -delete)
