#!/bin/bash
# Session 9, last call (one H200): the public API under CUDA graph capture (varlen chunked fwd+bwd and serving
# decode; their host-side value checks are skipped while a graph is captured) and the rest of the CUDA backend's
# public-API tests, after that change.
source "$(dirname "$0")/device_env.sh"
BUILD_TIMEOUT=250 build_cuda 16
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_backend.py \
  tests/test_cuda_train_windows.py > "$OUT/tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
# ours' varlen fwd+bwd again, now capturable (fla's row: the verification call, h200x2_session9_final.log)
OUT="$OUT" BENCH_SHAPES=varlen BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 timeout ${BWD_TIMEOUT:-70} \
  python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd_varlen.log" 2>&1
echo "bwd exit $?"
grep '^{' "$OUT/bench_bwd_varlen.log" | cut -c1-300
