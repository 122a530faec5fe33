#!/bin/bash
# One device call that verifies main on a GPU: build (sm_90), every CUDA test file, per-kernel times of the
# chunked kernels, then the chunked forward and forward+backward side by side with flash-linear-attention 0.6.0
# (its Triton compilation and autotuning take minutes, so it comes last and each step has its own time limit;
# the benchmarks print one JSON line per measurement, so a step cut short still leaves its rows in the log).
# The run tool returns at most ~8 files: everything except build.log is packed into $OUT/results.tgz.
#   CALL_S=560 bash benchmarks/cuda/run_verify.sh
source "$(dirname "$0")/device_env.sh"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - SECONDS )); }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 14 tests/test_cuda_backend.py tests/test_cuda_chunk_fwd.py \
  tests/test_cuda_chunk_bwd.py -p no:cacheprovider --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
grep -E "passed|failed|error" "$OUT/tests.log" | tail -5
echo "tests done at ${SECONDS}s"
timeout 60 python3 benchmarks/cuda/profile_chunk.py --scan-split > "$OUT/kernel_times.json" 2> "$OUT/kernel_times.err"
echo "profile done at ${SECONDS}s"
[ "$(left)" -gt 60 ] && timeout $(( $(left) > ${FWD_TIMEOUT:-150} ? ${FWD_TIMEOUT:-150} : $(left) - 30 )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
tail -14 "$OUT/bench_fwd.log"
echo "fwd bench done at ${SECONDS}s"
[ "$(left)" -gt 40 ] && timeout $(( $(left) - 25 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
grep -v '^{' "$OUT/bench_bwd.log" | tail -12
echo "total ${SECONDS}s"
# (the archive is written outside $OUT first: tar reading the folder it writes into fails)
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
