#!/bin/bash
# One device call for the chunked backward: build (sm_90), tests/test_cuda_chunk_bwd.py, the chunk tests of
# tests/test_cuda_backend.py, benchmarks/cuda/bench_chunk_bwd.py; logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
WHL=${WHL:-.whl}
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    && export PYTHONPATH=/tmp/site
fi
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 KDA_CUDA_PTXAS_VERBOSE=1 python3 scripts/build.py --backends cuda --jobs 16 \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
echo "build took $(( $(date +%s) - t0 ))s"
timeout ${DIAG_TIMEOUT:-60} python3 benchmarks/cuda/diag_chunk_bwd.py 2>&1 | tee "$OUT/diag.log" | tail -12
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 8 tests/test_cuda_chunk_bwd.py ${EXTRA_TESTS} -p no:cacheprovider \
    --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | grep -v "^\s*$" | tail -25
fi
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/cuda/bench_chunk_bwd.py 2>&1 | tee "$OUT/bench.log" | tail -20
fi
