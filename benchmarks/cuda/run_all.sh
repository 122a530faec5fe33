#!/bin/bash
# One device call: build the CUDA variant for sm_90, run the CUDA tests, run the benchmarks; everything under $OUT.
#   bash benchmarks/cuda/run_all.sh            (OUT defaults to /tmp/kda_out)
# Carries flash-linear-attention 0.6.0 as wheels in .whl/ (pure Python) when present.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
build_cuda 16
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q ${PYTEST_ARGS:---maxfail=20 -n 8} tests/test_cuda_backend.py -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/cuda/bench_cuda.py 2>&1 | tee "$OUT/bench.log" | tail -60
fi
