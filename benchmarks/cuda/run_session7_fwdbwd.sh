#!/bin/bash
# Session 7, the last call (one H200): build, then forward+backward at B1 T8192 beside fla 0.6.0 (ours, then fla).
source "$(dirname "$0")/device_env.sh"
BUILD_TIMEOUT=150 build_cuda 16
python3 -c 'import fla; print("fla", fla.__version__)'
# (straight into the log: session 7's call piped this through grep, whose buffer the timeout killed with every row)
OUT="$OUT" BENCH_NSHAPES=1 BENCH_SKIP_RECURRENT=1 timeout ${BWD_TIMEOUT:-200} python3 benchmarks/cuda/bench_chunk_bwd.py \
  > "$OUT/bench_bwd.log" 2>&1
grep '^{' "$OUT/bench_bwd.log" | cut -c1-330
