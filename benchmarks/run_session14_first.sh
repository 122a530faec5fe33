#!/bin/bash
# For the next session's first device call (one H200), the GPU runs session 13 left owed (docs/cuda.md, "State at
# the end of session 13") -- fla 0.6.0's compiles in the background while the CUDA variant builds (Triton's cache in
# /tmp, in this same call: session 13's part B lost a cache kept under .dev/) -> every CUDA test file with session
# 13's final defaults (the second round's backward kernels as defaults for the first time; test_scan7_runs_scan7's
# fixed expectation) -> fwd+bwd of ours and fla in one process at B1 T8192 -> both forwards beside fla in one process
# at B4 T4096 and the varlen mix (GDN with prep v3 / v2 by group), then B1 T8192 / T32768 with the time left.
# About 560 s; every step after the tests is cut by the call's budget, not lost (JSON lines in the logs:
# bench_chunk_{fwd,bwd}.py --from-log rebuild their JSON and plots).
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-570}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
(cd benchmarks/cuda && timeout 330 python3 fla_warm.py B1_T8192) > "$OUT/warm.log" 2>&1 &
WARM=$!
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 15
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
timeout -k 5 ${TEST_TIMEOUT:-300} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests.log")" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
wait $WARM; echo "fla warm-up exit $? at ${SECONDS}s" | tee -a "$LOG"; grep "fla warm" "$OUT/warm.log"
mkdir -p "$OUT/bwd" "$OUT/fwd"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours,fla_0.6.0 BENCH_SKIP_RECURRENT=1 \
  timeout $(( $(left) > 100 ? 100 : $(left) - 10 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-330
if [ "$(left)" -gt 40 ]; then
  OUT="$OUT/fwd" BENCH_SHAPES=B4,varlen,B1_T8192,B1_T32768 BENCH_BUDGET_S=$(( $(left) - 35 )) \
    timeout $(( $(left) - 8 )) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
fi
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
