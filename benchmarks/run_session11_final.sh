#!/bin/bash
# Session 11, the verification call of main on one H200 after the candidate call's decisions (scan6 the default,
# its pair variant retired; the narrow state_bwd3 and dec11's decode variants reverted; retire11's round merged):
#   build (sm_90) -> every CUDA test file -> both chunked forwards beside fla 0.6.0 (B1 T8192, varlen mix) -> fwd+bwd
#   of fla 0.6.0 and ours in one process (B1 T8192, then B1 T32768 with the time left; owed since session 8).
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 16
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
timeout ${TEST_TIMEOUT:-250} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s" >> "$OUT/tests.log"
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
mkdir -p "$OUT/fwd" "$OUT/bwd"
OUT="$OUT/fwd" BENCH_SHAPES=B1_T8192,varlen BENCH_BUDGET_S=80 timeout 100 python3 benchmarks/cuda/bench_chunk_fwd.py \
  > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $? at ${SECONDS}s"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-260
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192,B1_T32768 BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 \
  timeout $(( $(left) - 5 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
