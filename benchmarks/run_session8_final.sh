#!/bin/bash
# Session 8, the verification call of main on the two-GPU H200 machine (kind nvidia-h200-x2) after the candidate
# call's decisions (KDA backward prep v4, state_bwd3 / grad3_vc_tc in tf32, windows opt-in):
#   build (sm_90) -> GPU 1: every CUDA test file, then the backward's accuracy against float64 (defaults and the
#   3xTF32 modes) | GPU 0: per-kernel times (defaults; the split forward bf16 and windows by knob), ours' fwd+bwd at
#   the three shapes (fla 0.6.0's side: device call 1 of this session, run_session8_fla.sh). Logs in results.tgz.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } >> "$LOG" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log"
  timeout ${ACC_TIMEOUT:-90} python3 benchmarks/cuda/bwd_accuracy.py \
    "KDA_CUDA_CHUNK_BWD_STATE_BWD=3,KDA_CUDA_CHUNK_BWD_VC=2" > "$OUT/bwd_accuracy.jsonl" 2>&1 ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults; split forward and windows by knob)"
  timeout ${PROF_TIMEOUT:-90} python3 benchmarks/cuda/profile_chunk.py --scans 6 --bwd-window=-1 --peak \
    > "$OUT/kernel_times.json"
  echo "profile exit $?"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== ours fwd+bwd, three shapes"
  OUT="$OUT" BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 timeout ${BWD_TIMEOUT:-120} \
    python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $?"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "within_design_6" "$OUT/bwd_accuracy.jsonl"
grep -E "sum |exit" "$LOG" | cut -c1-400
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
