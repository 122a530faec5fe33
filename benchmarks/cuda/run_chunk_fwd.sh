#!/bin/bash
# One device call for the chunked forward: build (sm_90), tests/test_cuda_chunk_fwd.py, the chunk cases of
# tests/test_cuda_backend.py, benchmarks/cuda/bench_chunk_fwd.py; logs under $OUT.
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 16
grep -i "chunk" "$OUT/build.log" | grep -i "spill\|registers" | head -30
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -n 8 tests/test_cuda_chunk_fwd.py -p no:cacheprovider \
    --junitxml="$OUT/tests_chunk_fwd.xml" > "$OUT/tests.log" 2>&1
  tail -25 "$OUT/tests.log"
  timeout ${TEST2_TIMEOUT:-45} python3 -m pytest -q -n 8 tests/test_cuda_backend.py -k "chunk or native" -p no:cacheprovider \
    >> "$OUT/tests.log" 2>&1
  tail -4 "$OUT/tests.log"
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
  tail -14 "$OUT/bench.log"
fi
