#!/bin/bash
# Session 12, the verification call (one H200) of main after the candidate call's decisions: scan7 with U as bf16
# hi + lo (KDA_CUDA_CHUNK_SCAN=11) the forward's default, retire12 merged, state_bwd3 bf16 (9 / 10) opt-in, dec12
# reverted --
#   build (sm_90) -> every CUDA test file -> ours' fwd+bwd at B1 T8192 -> both forwards beside fla 0.6.0 in one
#   process at B1 T8192, then B1 T32768 / B4 T4096 with the time left.
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-585}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
timeout ${TEST_TIMEOUT:-290} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests.log")" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
mkdir -p "$OUT/fwd" "$OUT/bwd" "$OUT/fwd2"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 timeout 45 \
  python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
OUT="$OUT/fwd" BENCH_SHAPES=B1_T8192 timeout $(( $(left) > 100 ? 100 : $(left) - 5 )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
if [ "$(left)" -gt 40 ]; then
  OUT="$OUT/fwd2" BENCH_SHAPES=B1_T32768,B4,varlen BENCH_BUDGET_S=$(( $(left) - 30 )) timeout $(( $(left) - 8 )) \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd2.log" 2>&1
  echo "fwd2 exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd2.log" | cut -c1-300
fi
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
