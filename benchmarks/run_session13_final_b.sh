#!/bin/bash
# Session 13, the verification call, part B: right after part A on the same warm machine (its build/ and Triton's
# cache in .dev/tcache are still there; a fresh machine builds first) -- fwd+bwd of ours (defaults, and with the
# second round's backward candidates on) and fla 0.6.0 in one process at B1 T8192, then both forwards beside fla in
# one process at the four shapes of issue #6.
source "$(dirname "$0")/cuda/device_env.sh"
BWD_VARIANT=${BWD_VARIANT:-"KDA_CUDA_CHUNK_BWD_CH=5,KDA_CUDA_CHUNK_BWD_WY=4,KDA_CUDA_CHUNK_BWD_STATE_BWD=11,KDA_CUDA_CHUNK_BWD_STATE_FWD=11"}
LOG="$OUT/all.log"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=$PWD/.dev/tcache
ls -d build/torch*cu1* >/dev/null 2>&1 || { BUILD_TIMEOUT=200 build_cuda 15; echo "== build took ${BUILD_S}s" | tee -a "$LOG"; }
mkdir -p "$OUT/bwd" "$OUT/fwd"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours,fla_0.6.0 BENCH_SKIP_RECURRENT=1 BENCH_OURS_VARIANTS="$BWD_VARIANT" \
  timeout $(( $(left) > 200 ? 200 : $(left) - 10 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-330
if [ "$(left)" -gt 40 ]; then
  OUT="$OUT/fwd" BENCH_SHAPES=B1_T8192,B4,varlen,B1_T32768 BENCH_BUDGET_S=$(( $(left) - 35 )) \
    timeout $(( $(left) - 8 )) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
fi
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
