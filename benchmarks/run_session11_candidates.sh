#!/bin/bash
# Session 11, the candidate call on one H200 (kind nvidia-h200; the two-GPU kind was not lent): main with four
# branches merged, each new path behind a knob OFF by default, plus the retirement round (retire11):
#   build (sm_90) -> scan11 (scan6, KDA_CUDA_CHUNK_SCAN=8/9) -> sbwd11 (narrow state_bwd3,
#   KDA_CUDA_CHUNK_BWD_STATE_BWD=7/8) -> dec11 (bulk-copy decode KDA_CUDA_DEC_LEAN=3, KDA_CUDA_DEC_IDX=1) -> retire11's
#   changed tests if time is left. Each step's commands and decision rules: benchmarks/cuda/cand11_*.sh.
# (A record of the call: sbwd11 and dec11 lost and were reverted, their cand11_*.sh with them -- `git show
# 8a67f1c:benchmarks/cuda/cand11_sbwd11.sh` / `cand11_dec11.sh`; scan6's mode 9 was retired, so re-running this script
# as it is fails at those steps.)
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-540}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 16
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
for c in scan11 sbwd11 dec11; do
  echo "== $c at ${SECONDS}s (left $(left))"
  bash benchmarks/cuda/cand11_$c.sh 2>&1 | tee "$OUT/cand_$c.log" | tail -40
done
if [ "$(left)" -gt 120 ]; then echo "== retire11 at ${SECONDS}s"; bash benchmarks/cuda/cand11_retire11.sh 2>&1 \
  | grep -v "^{" | head -30; fi
echo "== end at ${SECONDS}s"
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
