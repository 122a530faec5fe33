#!/bin/bash
# Session 8, first call (one H200): build, then forward+backward beside fla 0.6.0 at the three shapes with fla's side
# FIRST (two sessions lost its rows to the call's time limit behind ours), then ours; then both forwards at
# B1 T8192 beside fla. Logs go straight to files (never through a pipe under timeout).
source "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)';
  python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=150 build_cuda 16
OUT="$OUT" BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 timeout ${BWD_TIMEOUT:-330} \
  python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $?"
OUT="$OUT" BENCH_SHAPES=B1_T8192 BENCH_BUDGET_S=60 timeout ${FWD_TIMEOUT:-100} \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $?"
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
grep '^{' "$OUT/bench_fwd.log" | cut -c1-300
