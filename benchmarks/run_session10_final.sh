#!/bin/bash
# Session 10, the verification call of main on the two-GPU H200 machine (kind nvidia-h200-x2) after the candidate
# call's decisions (GDN prep v2, the narrow state_fwd3 and the lean decode kernels as defaults; grad3_ch2g removed;
# the capture test's eager results detached) with KDA prep v3 merged behind KDA_CUDA_KDA_PREP=4 / 5 (first GPU run):
#   build (sm_90) -> GPU 1: every CUDA test file, the backward's accuracy at the defaults, ours' fwd+bwd at three
#   shapes | GPU 0: per-kernel times at the defaults and KDA prep 4 / 5, the decode benchmark at the defaults beside
#   fla, then both chunked forwards beside fla 0.6.0 with the time left. Each step has its own time limit.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-470}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
mkdir -p "$OUT/g0" "$OUT/g1"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-250} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s" >> "$OUT/tests.log"
  timeout 45 python3 benchmarks/cuda/bwd_accuracy.py > "$OUT/bwd_accuracy.jsonl" 2>&1
  OUT="$OUT/g1" BENCH_SHAPES=B1_T8192,B4,B1_T32768 BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 \
    timeout $(( $(left) - 5 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $? at ${SECONDS}s" >> "$OUT/bench_bwd.log" ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults, KDA prep v3: 4, 5)"
  timeout 80 python3 benchmarks/cuda/profile_chunk.py --kda-prep 4,5 > "$OUT/kernel_times.json"
  echo "profile exit $? at ${SECONDS}s"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== decode at the defaults beside fla"
  OUT="$OUT/g0" timeout 90 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session10_final --decode-only \
    --rep 100 > "$OUT/bench_dec.log" 2>&1
  echo "decode exit $? at ${SECONDS}s"
  echo "== both forwards beside fla"
  OUT="$OUT/g0" BENCH_SHAPES=B1_T8192,B4,B1_T32768 BENCH_BUDGET_S=$(( $(left) - 40 )) timeout $(( $(left) - 12 )) \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "within_design_6" "$OUT/bwd_accuracy.jsonl" | cut -c1-300
grep -E "sum |exit|took" "$LOG" | cut -c1-420
grep '^{' "$OUT/bench_dec.log" | grep -v sweep | cut -c1-230
grep '^{' "$OUT/bench_fwd.log" | cut -c1-260
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
