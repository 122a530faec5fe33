#!/bin/bash
# Session 9, the verification call of main on the two-GPU H200 machine (kind nvidia-h200-x2) after the candidate
# call's decisions (the warp-specialized scan5 and the GVA reduce kernel as defaults; the bulk-copy state scans
# removed; training windows opt-in):
#   build (sm_90) -> GPU 1: every CUDA test file, the backward's accuracy against float64 at the defaults, ours'
#   fwd+bwd at the four shapes (defaults and KDA_TRAIN_WINDOW=-1), then both forwards beside fla 0.6.0 with the time
#   left | GPU 0: per-kernel times at the defaults, then fla's fwd+bwd on the varlen mix beside ours (fla first;
#   owed since session 8: its Triton compile did not fit in call 1). Each step has its own time limit.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-515}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
mkdir -p "$OUT/g0" "$OUT/g1"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log"
  timeout ${ACC_TIMEOUT:-60} python3 benchmarks/cuda/bwd_accuracy.py > "$OUT/bwd_accuracy.jsonl" 2>&1
  OUT="$OUT/g1" BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 BENCH_OURS_VARIANTS="KDA_TRAIN_WINDOW=-1" \
    timeout ${BWD_TIMEOUT:-130} python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $?" >> "$OUT/bench_bwd.log"
  OUT="$OUT/g1" BENCH_SHAPES=B1_T8192,B1_T32768,B4 BENCH_BUDGET_S=$(( $(left) - 40 )) timeout $(( $(left) - 15 )) \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $?" >> "$OUT/bench_fwd.log" ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults)"
  timeout ${PROF_TIMEOUT:-70} python3 benchmarks/cuda/profile_chunk.py --peak > "$OUT/kernel_times.json"
  echo "profile exit $?"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== fla fwd+bwd on the varlen mix beside ours (fla first)"
  OUT="$OUT/g0" BENCH_SHAPES=varlen BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 timeout $(( $(left) - 15 )) \
    python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd_varlen_fla.log" 2>&1
  echo "varlen fla exit $?"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "within_design_6" "$OUT/bwd_accuracy.jsonl" | cut -c1-300
grep -E "sum |exit|took" "$LOG" | cut -c1-420
grep '^{' "$OUT/bench_bwd.log" | cut -c1-260
grep '^{' "$OUT/bench_bwd_varlen_fla.log" | cut -c1-260
grep '^{' "$OUT/bench_fwd.log" | cut -c1-260
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
