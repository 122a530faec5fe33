#!/bin/bash
# Session 8, the candidate call on the two-GPU H200 machine (kind nvidia-h200-x2): main with four kernel branches
# merged, each new path behind a knob (mem8: backward memory -- early frees, GDN dg per head, token windows on by
# default; bprep8: KDA backward prep v4, KDA_CUDA_CHUNK_BWD_PREP=4/5; scan8: split forward, KDA_CUDA_CHUNK_SCAN=5/6;
# dec8: decode hints compiled in, KDA_CUDA_DEC_FUSE=1):
#   build (sm_90) -> GPU 1: every CUDA test file, then the backward's accuracy per precision knob against the float64
#   reference (bwd_accuracy.py) and the memory per variant (mem_chunk_bwd.py) | GPU 0: per-kernel times of every
#   new knob, decode beside fla 0.6.0 with session 8's A/B rows, the forward per scan beside fla (B1 T8192), ours'
#   fwd+bwd at the three shapes with and without windows. Each step has its own time limit; results.tgz.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)';
  python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1; } >> "$LOG" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log"
  timeout ${ACC_TIMEOUT:-100} python3 benchmarks/cuda/bwd_accuracy.py "KDA_CUDA_CHUNK_BWD_STATE_BWD=4" \
    "KDA_CUDA_CHUNK_BWD_STATE_BWD=4,KDA_CUDA_CHUNK_BWD_VC=3" "KDA_CUDA_CHUNK_BWD_PREP=4" "KDA_CUDA_CHUNK_BWD_PREP=5" \
    "KDA_CUDA_CHUNK_BWD_WINDOW=0" > "$OUT/bwd_accuracy.jsonl" 2>&1
  OUT="$OUT" timeout ${MEM_TIMEOUT:-100} python3 benchmarks/cuda/mem_chunk_bwd.py > "$OUT/mem.jsonl" 2>&1 ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults and every new knob)"
  timeout ${PROF_TIMEOUT:-110} python3 benchmarks/cuda/profile_chunk.py --scans 5,6 --bwd-prep 4,5 --bwd-state-bwd 4 \
    --bwd-vc 3 --bwd-window 0 --bwd-free 0 --peak > "$OUT/kernel_times.json"
  echo "profile exit $?"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== decode beside fla (session 8 A/B rows)"
  OUT="$OUT" timeout ${DEC_TIMEOUT:-130} python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session8 \
    --decode-only --sweep8 --rep 100 --sweep-rep 40 > "$OUT/bench_decode.log" 2>&1
  echo "decode exit $?"
  echo "== forward per scan beside fla (B1 T8192)"
  OUT="$OUT" BENCH_SHAPES=B1_T8192 BENCH_CHUNK_SCAN=4,5,6 BENCH_BUDGET_S=80 timeout ${FWD_TIMEOUT:-110} \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $?"
  echo "== ours fwd+bwd, three shapes, windows on (default) and off"
  OUT="$OUT" BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_WINDOW=0" \
    timeout ${BWD_TIMEOUT:-120} python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $?"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "within_design_6" "$OUT/bwd_accuracy.jsonl"
grep -E "sum |exit" "$LOG" | tail -40
grep '^{' "$OUT/bench_fwd.log" | cut -c1-260
grep '^{' "$OUT/bench_bwd.log" | cut -c1-260
tail -4 "$OUT/bench_decode.log" | cut -c1-300
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
