#!/bin/bash
# Session 13, the verification call (one H200), part A, of main after the candidate call's decisions (KDA's forward
# prep FAST and backward prep v6 the defaults, GDN's forward prep v3 where HV / H is even, sfwd13 reverted, the
# backward's knobs on env_choice) with the second round's four backward candidates merged behind knobs --
#   fla 0.6.0's compiles in the background (fla_warm.py, Triton's cache in .dev/tcache so part B, the next call on
#   the still-warm machine, finds it) while the CUDA variant builds -> every CUDA test file -> per-kernel times of
#   the backward with each candidate knob beside the defaults, and of the forward.
# Part B (run_session13_final_b.sh) runs the benchmarks beside fla. Two calls because one command may run 600 s.
source "$(dirname "$0")/cuda/device_env.sh"
BWD_SWEEPS=${BWD_SWEEPS:-"--bwd-ch 2,5 --bwd-wy 2,4 --bwd-state-bwd 4,11,12 --bwd-state-fwd 7,11,12"}
LOG="$OUT/all.log"
log_machine "$LOG"
export TRITON_CACHE_DIR=$PWD/.dev/tcache
mkdir -p $TRITON_CACHE_DIR
if ls .dev/tc/tc.tgz.* >/dev/null 2>&1; then cat .dev/tc/tc.tgz.* | tar xz -C $TRITON_CACHE_DIR; fi
(cd benchmarks/cuda && timeout 400 python3 fla_warm.py B1_T8192) > "$OUT/warm.log" 2>&1 &
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 15
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
timeout -k 5 ${TEST_TIMEOUT:-330} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
  > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests.log")" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -40
timeout 100 python3 benchmarks/cuda/profile_chunk.py --phases bwd $BWD_SWEEPS > "$OUT/bwd_times.json" 2> "$OUT/bwd_times.err"
echo "profile bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/bwd_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$OUT/bwd_times.json" grad3_ch,grad3_wy,state_bwd,state_fwd
timeout 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd > "$OUT/fwd_times.json" 2> "$OUT/fwd_times.err"
echo "profile fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/fwd_times.json"
wait; echo "fla warm-up done at ${SECONDS}s" | tee -a "$LOG"; grep "fla warm" "$OUT/warm.log"
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
