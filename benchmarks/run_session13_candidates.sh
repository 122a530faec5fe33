#!/bin/bash
# Session 13, the candidate call (one H200): main with this session's four kernel branches merged behind knobs
# (default paths unchanged) --
#   fla 0.6.0's compiles in the background (fla_warm.py; Triton's cache from the first call carried in .dev/tc)
#   while the CUDA variant builds -> one pytest of every test file the branches and retire13 touched -> per-kernel
#   times in one process: forward with KDA_CUDA_KDA_PREP=6 and KDA_CUDA_GDN_PREP=3 beside the defaults, backward with
#   KDA_CUDA_CHUNK_BWD_STATE_FWD=8,9 and KDA_CUDA_CHUNK_BWD_PREP=6 beside the defaults -> fwd+bwd of ours (defaults,
#   and with every candidate knob on) and fla 0.6.0 in ONE process at B1 T8192.
# Each cand13_*.sh beside this script describes what to expect of its branch. After this call sfwd13 was reverted
# (no gain), with cand13_sfwd13.sh, its tests and benchmarks/cuda/worst_errs.py, which this script called.
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-570}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p $TRITON_CACHE_DIR
if ls .dev/tc/tc.tgz.* >/dev/null 2>&1; then cat .dev/tc/tc.tgz.* | tar xz -C $TRITON_CACHE_DIR; fi
(cd benchmarks/cuda && timeout 300 python3 fla_warm.py B1_T8192) > "$OUT/warm.log" 2>&1 &
WARM=$!
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 15
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
TESTS="tests/test_cuda_chunk_fwd.py tests/test_cuda_stages.py tests/test_cuda_scan7.py tests/test_cuda_state_bwd_bf16.py
  tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused tests/test_cuda_kda_prep_fast.py
  tests/test_cuda_gdn_prep3.py tests/test_cuda_state_fwd_bf16.py tests/test_cuda_bwd_prep6.py
  tests/test_cuda_chunk_bwd.py::test_kda_bwd_prep4_matches_prep2 tests/test_cuda_chunk_bwd.py::test_gdn_bwd_prep4_is_prep3"
SCAN7_ERRS="$OUT/scan7_errs.txt" STATE_FWD_BF16_ERRS="$OUT/sfwd_errs.txt" timeout -k 5 ${TEST_TIMEOUT:-230} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE -s \
  $TESTS > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(tail -1 "$OUT/tests.log")" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
python3 benchmarks/cuda/worst_errs.py "$OUT/sfwd_errs.txt"
grep -h many_blocks "$OUT/scan7_errs.txt"
timeout 60 python3 benchmarks/cuda/profile_chunk.py --phases fwd --kda-prep 3,6 --gdn-prep 2,3 \
  > "$OUT/fwd_times.json" 2> "$OUT/fwd_times.err"
echo "profile fwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/fwd_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$OUT/fwd_times.json" prep,scan
for shape in 4,4096,16,32,128,128 1,8192,32,32,128,128; do  # GDN prep v3 where the GVA group is 2 and 1
  timeout 40 python3 benchmarks/cuda/profile_chunk.py --families gdn --phases fwd --shape $shape --gdn-prep 2,3 \
    > "$OUT/fwd_gdn_${shape//,/_}.json" 2>/dev/null
  echo "gdn $shape:"; python3 benchmarks/cuda/profile_chunk.py --kernels "$OUT/fwd_gdn_${shape//,/_}.json" prep,scan
done
timeout 90 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-fwd 8,9,10 --bwd-prep 4,6 \
  > "$OUT/bwd_times.json" 2> "$OUT/bwd_times.err"
echo "profile bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/bwd_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$OUT/bwd_times.json" state_fwd,prep
wait $WARM; echo "fla warm-up exit $? at ${SECONDS}s" | tee -a "$LOG"; cat "$OUT/warm.log" | grep "fla warm"
mkdir -p "$OUT/bwd"
OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours,fla_0.6.0 BENCH_SKIP_RECURRENT=1 \
  BENCH_OURS_VARIANTS="KDA_CUDA_KDA_PREP=6,KDA_CUDA_GDN_PREP=3,KDA_CUDA_CHUNK_BWD_STATE_FWD=10,KDA_CUDA_CHUNK_BWD_PREP=6" timeout $(( $(left) - 15 )) python3 benchmarks/cuda/bench_chunk_bwd.py \
  > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/bench_bwd.log" | cut -c1-330
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
