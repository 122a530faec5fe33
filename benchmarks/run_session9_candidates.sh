#!/bin/bash
# Session 9, the candidate call on the two-GPU H200 machine (kind nvidia-h200-x2): main with five branches merged,
# each new path behind a knob (scan5: warp-specialized forward scan, KDA_CUDA_CHUNK_SCAN=7; bscan9: backward state
# scans v4 with bulk copies, KDA_CUDA_CHUNK_BWD_STATE_FWD=5, _STATE_BWD=5/6; win9: training windows in the public
# API, KDA_TRAIN_WINDOW=-1; clean9: retired kernels and the GVA reduce kernel, KDA_CUDA_CHUNK_BWD_GVA=1; cpu9: CPU
# only):
#   build (sm_90) -> GPU 1: every CUDA test file, the backward's accuracy with the v4 state scans against the float64
#   reference, ours' fwd+bwd under graphs per variant | GPU 0: per-kernel times of every new knob, the forward per
#   scan at the four shapes, peak memory and time of the window variants (mem_chunk_bwd.py). Logs in results.tgz.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-230} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log"
  timeout ${ACC_TIMEOUT:-70} python3 benchmarks/cuda/bwd_accuracy.py \
    "KDA_CUDA_CHUNK_BWD_STATE_FWD=5,KDA_CUDA_CHUNK_BWD_STATE_BWD=5" "KDA_CUDA_CHUNK_BWD_GVA=1" \
    > "$OUT/bwd_accuracy.jsonl" 2>&1
  OUT="$OUT/bwd" BENCH_SHAPES=B1_T8192,B4 BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 \
    BENCH_OURS_VARIANTS="KDA_TRAIN_WINDOW=-1;KDA_CUDA_CHUNK_BWD_STATE_FWD=5,KDA_CUDA_CHUNK_BWD_STATE_BWD=5,KDA_CUDA_CHUNK_BWD_GVA=1;KDA_CUDA_CHUNK_SCAN=7,KDA_CUDA_CHUNK_BWD_STATE_FWD=5,KDA_CUDA_CHUNK_BWD_STATE_BWD=5,KDA_CUDA_CHUNK_BWD_GVA=1,KDA_TRAIN_WINDOW=-1" \
    timeout ${BWD_TIMEOUT:-140} python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $?" >> "$OUT/bench_bwd.log" ) &
gpu1=$!
mkdir -p "$OUT/bwd"
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults and every new knob)"
  timeout ${PROF_TIMEOUT:-110} python3 benchmarks/cuda/profile_chunk.py --scans 6,7 --bwd-state-fwd 5 \
    --bwd-state-bwd 5,6 --bwd-gva 1 --peak > "$OUT/kernel_times.json"
  echo "profile exit $?"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== forward per scan (default, scan5), four shapes"
  OUT="$OUT" BENCH_CHUNK_SCAN=0,7 BENCH_NO_FLA=1 BENCH_BUDGET_S=90 timeout ${FWD_TIMEOUT:-110} \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $?"
  echo "== memory and time of the window variants"
  OUT="$OUT" timeout ${MEM_TIMEOUT:-150} python3 benchmarks/cuda/mem_chunk_bwd.py > "$OUT/mem.jsonl" 2> "$OUT/mem.err"
  echo "mem exit $?"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "within_design_6" "$OUT/bwd_accuracy.jsonl" | cut -c1-300
grep -E "sum |exit" "$LOG" | cut -c1-420
grep '^{' "$OUT/bench_fwd.log" | cut -c1-200
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
cut -c1-300 "$OUT/mem.jsonl"
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
