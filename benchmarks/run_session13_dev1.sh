#!/bin/bash
# Session 13, first device call (one H200), main at the session's start (scan7 = 11 the forward's default):
#   fla 0.6.0's first compiles + autotuning (fwd+bwd at B1 T8192, its own process, recorded as such) run in the
#   background while the CUDA variant builds -> fwd+bwd of ours and fla in ONE process at B1 T8192 (fla now from
#   Triton's disk cache) -> both forwards beside fla at B4 T4096, the varlen mix and B1 T32768 with the time left ->
#   retire13's owed GPU tests (cand13_retire13.sh) only if >= 200 s are left -> Triton's cache, split into 15 MB pieces
#   ($OUT/tc.tgz.*), so later calls can carry it (cat .dev/tc/tc.tgz.* | tar xz) and skip fla's compiles.
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=/tmp/triton_cache TRITON_CACHE_AUTOTUNING=1
mkdir -p "$OUT/warm" "$OUT/bwd"
# fla alone, while nvcc builds ours (the build uses the CPUs, not the GPU; fla's autotuning times on an idle GPU)
OUT="$OUT/warm" BENCH_SHAPES=B1_T8192 BENCH_PHASES=fla_0.6.0 BENCH_SKIP_RECURRENT=1 \
  timeout 330 python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/warm.log" 2>&1 &
WARM=$!
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 15
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
wait $WARM; echo "fla warm-up exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/warm.log" | cut -c1-300
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours,fla_0.6.0 BENCH_SKIP_RECURRENT=1 \
  timeout $(( $(left) > 150 ? 150 : $(left) - 20 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
mkdir -p "$OUT/fwd"
OUT="$OUT/fwd" BENCH_SHAPES=B4,varlen,B1_T32768 BENCH_BUDGET_S=$(( $(left) - 45 )) timeout $(( $(left) - 25 )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
if [ "$(left)" -gt 200 ]; then
  timeout $(( $(left) - 25 )) bash benchmarks/cuda/cand13_retire13.sh 2>&1 | tee -a "$LOG"
fi
tar czf /tmp/tc.tgz -C /tmp/triton_cache . 2>/dev/null && split -b 15M /tmp/tc.tgz "$OUT/tc.tgz." && ls -la "$OUT"/tc.tgz.*
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log --exclude='tc.tgz.*' . \
  && find "$OUT" -type f ! -name build.log ! -name 'tc.tgz.*' -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
