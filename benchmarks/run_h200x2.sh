#!/bin/bash
# One call on the two-GPU H200 machine (device kind nvidia-h200-x2), everything under $OUT (at most 8 files):
#   build the CUDA variant (sm_90) -> CUDA tests on GPU 1 while GPU 0 runs the per-kernel profile and (FLA=1) the
#   chunked fwd / bwd benchmarks beside fla -> the context-parallel benchmark on both GPUs (NCCL, NVLink multicast
#   off), with its CP == one-rank check for every schedule.
# Carries flash-linear-attention 0.6.0 as wheels in .whl/ (carry=[".whl"]). Phase time limits are env vars;
# TEST_FILES, FLA_STEPS (fwd,bwd), CP_T, CP_MODES (fwd,fwdbwd), CP_SCHEDULES (relay,affine), CP_RELAY_SHARES
# (even,0.45), CP_SHARES (affine: even,auto); CP=0 skips the context-parallel phase.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
{ date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } >> "$LOG" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
# GPU 1: the CUDA test files (junit names each test)
( CUDA_VISIBLE_DEVICES=1 timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -n 12 -p no:cacheprovider \
    ${TEST_FILES:-tests/test_cuda_stages.py tests/test_cuda_backend.py tests/test_cuda_chunk_fwd.py \
    tests/test_cuda_chunk_bwd.py} --junitxml="$OUT/tests.xml" > /tmp/tests.log 2>&1
  echo "pytest exit $?" >> /tmp/tests.log ) &
tests_pid=$!
# GPU 0: per-kernel times; with FLA=1 also the chunked forward and forward+backward beside fla 0.6.0
( export CUDA_VISIBLE_DEVICES=0
  echo "== profile_chunk"; timeout 60 python3 benchmarks/cuda/profile_chunk.py > "$OUT/kernel_times.json"
  if [ "${FLA:-0}" = 1 ]; then
    for step in ${FLA_STEPS:-fwd bwd}; do
      if [ "$step" = fwd ]; then
        echo "== bench_chunk_fwd"; BENCH_BUDGET_S=${FWD_BUDGET:-70} timeout ${FWD_TIMEOUT:-100} python3 benchmarks/cuda/bench_chunk_fwd.py
      else
        echo "== bench_chunk_bwd"; BENCH_NSHAPES=${BWD_NSHAPES:-1} timeout ${BWD_TIMEOUT:-90} python3 benchmarks/cuda/bench_chunk_bwd.py
      fi
    done
  fi
) >> "$LOG" 2>&1
wait $tests_pid
{ echo "== tests (GPU 1)"; grep -v "^\s*$" /tmp/tests.log | tail -40; } >> "$LOG"
tail -3 /tmp/tests.log
[ "${CP:-1}" = 1 ] || exit 0
echo "== context parallel (2 GPUs)" >> "$LOG"
timeout ${CP_TIMEOUT:-300} python3 benchmarks/cp/benchmark_cp.py --check --T ${CP_T:-131072,524288} --modes ${CP_MODES:-fwd,fwdbwd} \
  --schedules ${CP_SCHEDULES:-relay,affine} --relay-shares ${CP_RELAY_SHARES:-even,0.45} --shares ${CP_SHARES:-even,auto} \
  --warmup 1 --iters ${CP_ITERS:-3} --out "$OUT" >> "$LOG" 2>&1
echo "cp exit $?" >> "$LOG"
grep -E "speedup|CHECK|check|cp exit|one device" "$LOG" | tail -30
