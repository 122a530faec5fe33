#!/bin/bash
# Session 7, the verification call of main on the two-GPU H200 machine (kind nvidia-h200-x2) after merging four
# kernels (grad3_gdn, grad3_ch2, grad3_wy2, kda_chunk_prep2) and the decode store hint:
#   build (sm_90) -> GPU 1: every CUDA test file | GPU 0: per-kernel times (new defaults and the old kernels by
#   knob), decode beside fla 0.6.0 (its GDN called with keywords), fwd+bwd at B1 T8192 beside fla, the forward at
#   B1 T8192 beside fla. Each step has its own time limit; logs packed into $OUT/results.tgz.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)';
  python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1; } >> "$LOG" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
( CUDA_VISIBLE_DEVICES=1 timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE \
    tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_fwd.py tests/test_cuda_stages.py tests/test_cuda_backend.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.log" ) &
tests_pid=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile (defaults; old kernels by knob)"
  timeout 60 python3 benchmarks/cuda/profile_chunk.py --bwd-ch 1 --kda-prep 1,3 > "$OUT/kernel_times.json"
  KDA_CUDA_CHUNK_BWD_WY=1 timeout 40 python3 benchmarks/cuda/profile_chunk.py --phases bwd > "$OUT/kernel_times_wy1.json"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json" "$OUT/kernel_times_wy1.json"
  echo "== decode beside fla"
  OUT="$OUT" timeout ${DEC_TIMEOUT:-120} python3 benchmarks/cuda/bench_cuda.py --decode-only --prefix cuda_decode_session7_final
  echo "== fwd+bwd beside fla (B1 T8192)"
  OUT="$OUT" BENCH_NSHAPES=1 timeout ${BWD_TIMEOUT:-200} python3 benchmarks/cuda/bench_chunk_bwd.py
  echo "== fwd beside fla (B1 T8192)"
  OUT="$OUT" BENCH_SHAPES=B1_T8192 BENCH_BUDGET_S=70 timeout ${FWD_TIMEOUT:-110} python3 benchmarks/cuda/bench_chunk_fwd.py
) >> "$LOG" 2>&1
wait $tests_pid
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "sum |ratio|TB/s|ms" "$LOG" | grep -v "^{" | tail -40
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
