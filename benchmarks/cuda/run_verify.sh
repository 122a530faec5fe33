#!/bin/bash
# One device call that verifies main on a GPU: build (sm_90), then the STEPS in the order given (default
# "tests,profile,fwd,bwd"):
#   tests    every CUDA test file (or TEST_FILES)
#   profile  per-kernel times of the chunked kernels (and the single scan / the GVA reduce kernel in the same process)
#   fwd      the chunked forward side by side with flash-linear-attention 0.6.0 (default scan and
#            KDA_CUDA_CHUNK_SCAN=1: FWD_SCANS; shapes: FWD_SHAPES name prefixes, default all four)
#   bwd      forward+backward side by side with fla (BWD_NSHAPES, default all three shapes)
# fla's Triton compilation and autotuning take minutes, so the benchmarks come last and each step has its own time
# limit; they print one JSON line per measurement, so a step cut short keeps its rows.
# The run tool returns at most ~8 files: everything except build.log is packed into $OUT/results.tgz.
#   CALL_S=560 bash benchmarks/cuda/run_verify.sh
#   STEPS=bwd,fwd FWD_SHAPES=B4,varlen CALL_S=560 bash benchmarks/cuda/run_verify.sh
source "$(dirname "$0")/device_env.sh"
CALL_S=${CALL_S:-560}
STEPS=${STEPS:-tests,profile,fwd,bwd}
left() { echo $(( CALL_S - SECONDS )); }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"

step_tests() {
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -n 14 ${TEST_FILES:-tests/test_cuda_backend.py \
    tests/test_cuda_chunk_fwd.py tests/test_cuda_chunk_bwd.py} -p no:cacheprovider -rfE --junitxml="$OUT/tests.xml" \
    > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -25
}
step_profile() {
  timeout 60 python3 benchmarks/cuda/profile_chunk.py --scans 1,11 --bwd-gva 1 > "$OUT/kernel_times.json" \
    2> "$OUT/kernel_times.err"
}
step_fwd() {
  [ "$(left)" -gt 60 ] || return
  BENCH_CHUNK_SCAN=${FWD_SCANS:-0,1} ${FWD_SHAPES:+BENCH_SHAPES=$FWD_SHAPES} BENCH_BUDGET_S=$(( $(left) - 60 )) \
    timeout $(( $(left) - 20 )) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  tail -20 "$OUT/bench_fwd.log"
}
step_bwd() {
  [ "$(left)" -gt 40 ] || return
  BENCH_NSHAPES=${BWD_NSHAPES:-3} timeout $(( $(left) - 25 )) python3 benchmarks/cuda/bench_chunk_bwd.py \
    > "$OUT/bench_bwd.log" 2>&1
  grep -v '^{' "$OUT/bench_bwd.log" | tail -12
  grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
}
for st in ${STEPS//,/ }; do
  "step_$st"
  echo "$st done at ${SECONDS}s"
done
# (the archive is written outside $OUT first: tar reading the folder it writes into fails)
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
