#!/bin/bash
# One device call for the decode kernels (issue #5, session 4): build the sm_90 variant, run the decode/serve tests
# (the bulk-copy kernel forced, the per-column-slice kernel's stage-1 variants, the general kernel's serve tests),
# then benchmarks/cuda/bench_decode_v2.py (old vs new kernel vs fla 0.6.0, copy ceiling); everything under $OUT.
#   OUT=/tmp/out bash benchmarks/cuda/run_decode.sh
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-100} build_cuda 16
grep -A2 "decode_bulk" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | head -20
timeout ${TEST_TIMEOUT:-70} python3 -m pytest -q --maxfail=10 -n 12 tests/test_cuda_backend.py -p no:cacheprovider \
  -k "${PYTEST_K:-bulk or stage1 or serve_decode or speculative or serve_varlen or public}" \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -15
timeout ${BENCH_TIMEOUT:-125} python3 benchmarks/cuda/bench_decode_v2.py --prefix ${PREFIX:-cuda_decode_session4} \
  2>&1 | tee "$OUT/bench.log" | tail -90
