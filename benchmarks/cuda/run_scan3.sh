#!/bin/bash
# One device call for the cluster scan of the chunked forward (delta_chunk_scan3_kernel in
# kernels_src/cuda/delta_chunk_fwd.cuh; KDA_CUDA_CHUNK_SCAN=3 selects it, 4 the same kernel without the cluster; the
# default stays the single scan kernel): build (sm_90), a 45-second smoke test of scan3 first (a hang in the
# mbarrier / cluster protocol would otherwise eat the call: on a timeout the rest is skipped), then the scan3
# cases of tests/test_cuda_chunk_fwd.py (float64 reference, against the single kernel, 3 vs 4 bit for bit, CUDA
# graphs), in this order: per-kernel times of the forward with scans 1 / 3 / 4 in one process (B1 T8192 H16 HV32,
# 32- and 64-column blocks), the tests, then as far as CALL_S (default 290 s) allows: B4 T4096 kernel times,
# bench_chunk_fwd.py for scans 1, 3, 4 without fla, Nsight Compute of the scan3 kernel (launch stats). Everything
# under $OUT, packed at the end into $OUT/results.tgz ($OUT/build.log beside it); each step timed out.
#   cd .dev/cuda-scan3 && bash benchmarks/cuda/run_scan3.sh
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -E "Compiling entry.*chunk_scan3?_kernel" -A3 "$OUT/build.log" | grep -E "Compiling entry|registers|spill" \
  > "$OUT/ptxas_scan.txt"
T="timeout -k 5"
CALL_S=${CALL_S:-290}   # the device call's limit; later steps shrink or drop to fit
left() { echo $(( CALL_S - 10 - SECONDS )); }
# smoke: one small case per family on the cluster scan
$T 45 python3 -m pytest -q -x tests/test_cuda_chunk_fwd.py -p no:cacheprovider \
  -k "test_chunk_fwd_scan3 and T200 and bf16 and cluster and not nocluster and bv32" > "$OUT/smoke.log" 2>&1
rc=$?
tail -3 "$OUT/smoke.log"
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "SCAN3 SMOKE TIMED OUT (hang?): skipping the rest" | tee -a "$OUT/smoke.log"
else
  # per-kernel times (torch profiler), B1 T8192 H16 HV32 K=V=128 bf16: the default scan (fwd) and scans 3 / 4
  # (fwd_scan3, fwd_scan4), 32- and 64-column blocks; the debug line gives the clusters that fit at once
  KDA_CUDA_SCAN3_DEBUG=1 $T 45 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 3,4 \
    > "$OUT/kernel_times.json" 2> "$OUT/kernel_times.err"
  cat "$OUT/kernel_times.json"; grep "\[scan3\]" "$OUT/kernel_times.err"
  KDA_CUDA_SCAN3_BV=64 KDA_CUDA_SCAN3_DEBUG=1 $T 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd \
    --scans 3,4 > "$OUT/kernel_times_bv64.json" 2> "$OUT/kernel_times_bv64.err"
  cat "$OUT/kernel_times_bv64.json"; grep "\[scan3\]" "$OUT/kernel_times_bv64.err"
  # tests: the scan3 cases, the CUDA graphs, a few default cases
  $T $(( $(left) < ${TEST_TIMEOUT:-100} ? $(left) : ${TEST_TIMEOUT:-100} )) python3 -m pytest -q -n 14 \
    tests/test_cuda_chunk_fwd.py -p no:cacheprovider \
    -k "scan3 or test_chunk_fwd_cuda_graph or (test_chunk_fwd and T200)" > "$OUT/tests.log" 2>&1
  tail -15 "$OUT/tests.log"
  if [ $(left) -gt 35 ]; then
    $T 30 python3 benchmarks/cuda/profile_chunk.py --phases fwd --families gdn --shape 4,4096,32,32,128,128 \
      --scans 3,4 > "$OUT/kernel_times_b4.json" 2>&1
  fi
  # whole forward, eager and graphs, scans 1 / 3 / 4 in one process, no fla (its Triton compile costs minutes)
  if [ $(left) -gt 40 ]; then
    BENCH_CHUNK_SCAN=1,3,4 BENCH_NO_FLA=1 BENCH_SHAPES=B1_T8192,B4,varlen BENCH_BUDGET_S=$(( $(left) - 25 )) \
      $T $(left) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
    tail -20 "$OUT/bench.log"
  fi
  # Nsight Compute of the cluster scan kernel, only if the call's time allows
  if [ $(left) -gt 40 ] && command -v ncu >/dev/null; then
    KDA_CUDA_CHUNK_SCAN=3 $T $(left) ncu --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      -k regex:"delta_chunk_scan3?_kernel" -c 1 python3 benchmarks/cuda/profile_chunk.py --once gdn_fwd \
      > "$OUT/ncu_scan3_details.txt" 2>&1
  fi
fi
echo "total ${SECONDS}s"
# the run tool brings back at most ~8 files: everything but build.log goes into one archive, written outside $OUT
# first (tar reading the folder it writes into fails)
tar czf /tmp/scan3_results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/scan3_results.tgz "$OUT/results.tgz"
