#!/bin/bash
# One device call: build the CUDA variant for sm_90, run the CUDA tests, run the benchmarks; everything under $OUT.
#   bash benchmarks/cuda/run_all.sh            (OUT defaults to /tmp/kda_out)
# Carries flash-linear-attention 0.6.0 as wheels in .whl/ (pure Python) when present.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=${KDA_ARCHS:-9.0} KDA_CUDA_PTXAS_VERBOSE=1 python3 scripts/build.py --backends cuda \
  --jobs 16 2>&1 | tee "$OUT/build.log" || { echo BUILD FAILED; exit 1; }
echo "build took $(( $(date +%s) - t0 ))s"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q ${PYTEST_ARGS:---maxfail=20 -n 8} tests/test_cuda_backend.py -p no:cacheprovider --junitxml="$OUT/tests.xml" \
    2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/cuda/bench_cuda.py 2>&1 | tee "$OUT/bench.log" | tail -60
fi
