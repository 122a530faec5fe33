#!/bin/bash
# Device call for branch win9 (the public API's training windows, KDA_TRAIN_WINDOW; docs/ops.md): build (unless
# SKIP_BUILD=1), the CUDA tests of the windows (tests/test_cuda_train_windows.py: windowed == unwindowed, float64
# reference, measured peak vs tests/cuda_mem_model.py and <= 900 MiB at B1 T8192 H16 HV32) and the C++ windows'
# tests, then benchmarks/cuda/mem_chunk_bwd.py: peak and fwd+bwd time of no windows / C++ windows / autograd
# windows side by side at B1 T8192 H16 HV32, B4 T4096 H=HV=32, B1 T32768 H16 HV32. Everything under $OUT.
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
[ "${SKIP_BUILD:-0}" = 1 ] || build_cuda 16
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x -n ${XDIST:-8} -p no:cacheprovider \
  tests/test_cuda_train_windows.py tests/test_cuda_chunk_bwd_mem.py -k "windows or peak" > "$OUT/tests_win9.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests_win9.log"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/cuda/mem_chunk_bwd.py > "$OUT/mem_win9.jsonl" 2> "$OUT/mem_win9.err"
echo "bench rc=$?"; cat "$OUT/mem_win9.jsonl" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r['family'], r['B'], r['T'], r['H'], r['HV'], r['variant'], 'peak', r.get('peak_fwdbwd_mib'), 'model',
          r.get('model_fwdbwd_mib'), 'ms', r.get('fwdbwd_ms'), 'windows', r.get('train_windows'), r.get('error', ''))"
