#!/bin/bash
# One device call for the decode kernels (issue #5, session 4): build the sm_90 variant, run the decode/serve tests
# (the bulk-copy kernel forced, the per-column-slice kernel's stage-1 variants, the general kernel's serve tests),
# then benchmarks/cuda/bench_decode_v2.py (old vs new kernel vs fla 0.6.0, copy ceiling); everything under $OUT.
#   OUT=/tmp/out bash benchmarks/cuda/run_decode.sh
# SKIP_TESTS=1 / SKIP_BENCH=1 skip those steps; PROFILE="bulk2 old" adds one Nsight Compute report per variant of
# the B=256 KDA bf16-pool serve call ($OUT/ncu_<variant>.txt; profile_decode.py; the PROFILE step has not run yet).
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-100} build_cuda 16
grep -A2 "decode_bulk" "$OUT/build.log" | grep -E "registers|spill" | sort | uniq -c | head -20
[ -z "$SKIP_TESTS" ] && timeout ${TEST_TIMEOUT:-70} python3 -m pytest -q --maxfail=10 -n 12 tests/test_cuda_backend.py -p no:cacheprovider \
  -k "${PYTEST_K:-bulk or stage1 or serve_decode or speculative or serve_varlen or public}" \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -15
[ -z "$SKIP_BENCH" ] && timeout ${BENCH_TIMEOUT:-125} python3 benchmarks/cuda/bench_decode_v2.py --prefix ${PREFIX:-cuda_decode_session4} \
  2>&1 | tee "$OUT/bench.log" | tail -90
for v in $PROFILE; do
  (cd benchmarks/cuda && timeout ${PROFILE_TIMEOUT:-90} ncu --set full -k regex:delta_decode -s 1 -c 1 \
    python3 profile_decode.py --variant "$v" --op ${PROFILE_OP:-kda_serve_bf16}) > "$OUT/ncu_$v.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per" "$OUT/ncu_$v.txt" | head -8
done
