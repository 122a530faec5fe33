#!/bin/bash
# Session 13, the verification call (one H200) of main after the candidate call's decisions: KDA's forward prep FAST
# (KDA_CUDA_KDA_PREP=6) and backward prep v6 (KDA_CUDA_CHUNK_BWD_PREP=6) the defaults, GDN's forward prep v3 where
# HV / H is even, sfwd13 reverted, the backward's knobs on env_choice --
#   fla 0.6.0's compiles in the background (fla_warm.py) while the CUDA variant builds -> every CUDA test file (the
#   second round's four backward candidates, behind knobs, included) -> per-kernel times of the backward with each
#   candidate knob beside the defaults, and of the forward ->
#   fwd+bwd of ours and fla in one process at B1 T8192 -> both forwards beside fla in one process at the four
#   shapes of issue #6 with the time left.
source "$(dirname "$0")/cuda/device_env.sh"
BWD_SWEEPS=${BWD_SWEEPS:-"--bwd-ch 2,5 --bwd-wy 2,4 --bwd-state-bwd 4,11 --bwd-state-fwd 7,11,12"}
BWD_VARIANT=${BWD_VARIANT:-"KDA_CUDA_CHUNK_BWD_CH=5,KDA_CUDA_CHUNK_BWD_WY=4,KDA_CUDA_CHUNK_BWD_STATE_BWD=11,KDA_CUDA_CHUNK_BWD_STATE_FWD=11"}
LOG="$OUT/all.log"
CALL_S=${CALL_S:-575}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
if ls .dev/tc/tc.tgz.* >/dev/null 2>&1; then cat .dev/tc/tc.tgz.* | tar xz -C $TRITON_CACHE_DIR; fi
(cd benchmarks/cuda && timeout 300 python3 fla_warm.py B1_T8192) > "$OUT/warm.log" 2>&1 &
WARM=$!
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 15
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
timeout -k 5 ${TEST_TIMEOUT:-280} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests.log")" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
# the second round's backward candidates (bit-identical by construction, off by default) beside the defaults
timeout 100 python3 benchmarks/cuda/profile_chunk.py --phases bwd $BWD_SWEEPS > "$OUT/bwd_times.json" 2> "$OUT/bwd_times.err"
echo "profile bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/bwd_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$OUT/bwd_times.json" grad3_ch,grad3_wy,state_bwd,state_fwd
timeout 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd > "$OUT/fwd_times.json" 2> "$OUT/fwd_times.err"
echo "profile fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/fwd_times.json"
wait $WARM; echo "fla warm-up exit $? at ${SECONDS}s" | tee -a "$LOG"; grep "fla warm" "$OUT/warm.log"
mkdir -p "$OUT/bwd" "$OUT/fwd"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours,fla_0.6.0 BENCH_SKIP_RECURRENT=1 \
  BENCH_OURS_VARIANTS="$BWD_VARIANT" \
  timeout $(( $(left) > 90 ? 90 : $(left) - 10 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-330
if [ "$(left)" -gt 40 ]; then
  OUT="$OUT/fwd" BENCH_SHAPES=B1_T8192,B4,varlen,B1_T32768 BENCH_BUDGET_S=$(( $(left) - 35 )) \
    timeout $(( $(left) - 8 )) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
fi
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
