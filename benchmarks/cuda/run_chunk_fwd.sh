#!/bin/bash
# One device call for the chunked forward: build (sm_90), tests/test_cuda_chunk_fwd.py, the chunk cases of
# tests/test_cuda_backend.py, benchmarks/cuda/bench_chunk_fwd.py; logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
WHL=${WHL:-.whl}
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$OUT/env.txt" 2>&1
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST=9.0 KDA_CUDA_PTXAS_VERBOSE=1 timeout ${BUILD_TIMEOUT:-200} python3 scripts/build.py --backends cuda \
  --jobs 16 > "$OUT/build.log" 2>&1 || { echo BUILD FAILED; tail -30 "$OUT/build.log"; exit 1; }
echo "build took $(( $(date +%s) - t0 ))s"
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
