#!/bin/bash
# One device call for the chunked backward: build (sm_90), tests/test_cuda_chunk_bwd.py, the chunk tests of
# tests/test_cuda_backend.py, benchmarks/cuda/bench_chunk_bwd.py; logs and JSON under $OUT.
source "$(dirname "$0")/device_env.sh"
build_cuda 16
timeout ${DIAG_TIMEOUT:-60} python3 benchmarks/cuda/diag_chunk_bwd.py 2>&1 | tee "$OUT/diag.log" | tail -12
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 8 tests/test_cuda_chunk_bwd.py ${EXTRA_TESTS} -p no:cacheprovider \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | grep -v "^\s*$" | tail -25
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/cuda/bench_chunk_bwd.py 2>&1 | tee "$OUT/bench.log" | tail -20
fi
