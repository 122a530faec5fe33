#!/bin/bash
# One device call for the split scan of the chunked forward (delta_chunk_state_kernel + delta_chunk_out_kernel in
# kernels_src/cuda/delta_chunk_fwd.cuh; KDA_CUDA_CHUNK_SCAN=2 selects it; the default is the single scan kernel since the session-4 measurement): build (sm_90),
# tests/test_cuda_chunk_fwd.py (float64-reference cases on the split scan, old-scan cases, split-vs-single in one
# process, 32-column state kernel, CUDA graphs), per-kernel times of both forwards (split and single scan in one
# process; 16- and 32-column state kernel), then bench_chunk_fwd.py for both scans in one process without fla.
# Everything under $OUT, packed at the end into $OUT/results.tgz ($OUT/build.log beside it); each step timed out.
#   cd .dev/cuda-scan-split && bash benchmarks/cuda/run_scan_split.sh
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -E "Compiling entry.*chunk_(state|out|scan)_kernel" -A3 "$OUT/build.log" | grep -E "Compiling entry|registers|spill" \
  > "$OUT/ptxas_scan.txt"
timeout ${TEST_TIMEOUT:-110} python3 -m pytest -q -n 14 tests/test_cuda_chunk_fwd.py -p no:cacheprovider \
  --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
tail -15 "$OUT/tests.log"
# per-kernel times (torch profiler), B1 T8192 H16 HV32 K=V=128 bf16: split (fwd) and single (fwd_scan_single)
timeout 60 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scan-split \
  > "$OUT/kernel_times.json" 2> "$OUT/kernel_times.err"
cat "$OUT/kernel_times.json"
KDA_CUDA_CHUNK_BV=32 timeout 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --families gdn \
  > "$OUT/kernel_times_bv32.json" 2>&1
cat "$OUT/kernel_times_bv32.json"
timeout 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --families gdn --shape 4,4096,32,32,128,128 \
  --scan-split > "$OUT/kernel_times_b4.json" 2>&1
# whole forward, eager and graphs, both scans in one process, no fla (its Triton compile costs minutes)
BENCH_CHUNK_SCAN=1,2 BENCH_NO_FLA=1 BENCH_SHAPES=B1_T8192,B4,varlen,B1_T32768 BENCH_BUDGET_S=${BENCH_BUDGET_S:-70} \
  timeout ${BENCH_TIMEOUT:-90} python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
tail -20 "$OUT/bench.log"
# Nsight Compute of the new kernels (a few sections), only if the call's time allows
if [ $SECONDS -lt ${NCU_BEFORE_S:-230} ] && command -v ncu >/dev/null; then
  timeout $(( ${CALL_S:-290} - SECONDS )) ncu --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    -k regex:"delta_chunk_(state|out)_kernel" -c 2 python3 benchmarks/cuda/profile_chunk.py --once gdn_fwd \
    > "$OUT/ncu_scan_split_details.txt" 2>&1
fi
echo "total ${SECONDS}s"
# the run tool brings back at most ~8 files: everything but build.log goes into one archive, written outside $OUT
# first (tar reading the folder it writes into fails)
tar czf /tmp/scan_split_results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/scan_split_results.tgz "$OUT/results.tgz"
