#!/bin/bash
# Session 12, first device call (one H200), main at the session's start (scan6 the default): the GPU runs owed since
# session 8 / 11 --
#   build (sm_90) -> fwd+bwd of fla 0.6.0 and ours in one process at B1 T8192 (fla's first compiles alone need
#   ~200 s) -> per-kernel times of fla's chunked forward beside ours (profile_fla.py; where fla's 0.48 / 0.96 ms go)
#   -> both forwards beside fla at B1 T32768 and B4 T4096 with scan6.
# Triton's cache (with autotuning results) is kept in $OUT/triton_cache.tgz so a later call can skip fla's compiles.
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-540}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
if [ -f .triton_cache.tgz ]; then mkdir -p $TRITON_CACHE_DIR && tar xzf .triton_cache.tgz -C $TRITON_CACHE_DIR; fi
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 16
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
mkdir -p "$OUT/bwd" "$OUT/fwd"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 \
  timeout 270 python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
PROFILE_FLA_BWD=1 timeout 90 python3 benchmarks/cuda/profile_fla.py > "$OUT/profile_fla.log" 2>&1
echo "profile_fla exit $? at ${SECONDS}s" | tee -a "$LOG"; grep -E "sum|^  " "$OUT/profile_fla.log" | head -80
OUT="$OUT/fwd" BENCH_SHAPES=B1_T32768,B4 BENCH_BUDGET_S=$(( $(left) - 40 )) timeout $(( $(left) - 20 )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
tar czf "$OUT/triton_cache.tgz" -C /tmp/triton_cache . 2>/dev/null; ls -la "$OUT/triton_cache.tgz"
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log --exclude=triton_cache.tgz . \
  && find "$OUT" -type f ! -name build.log ! -name triton_cache.tgz ! -name '*.tgz' -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
