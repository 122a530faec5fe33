#!/bin/bash
# Session 9, first call (one H200): the fla 0.6.0 rows owed since session 8 -- forward+backward at B4 T4096 and
# the varlen mix beside ours in one process (fla's side FIRST: its Triton compile and autotune take > 150 s per
# shape on a fresh machine), then both forwards at every shape beside fla with what time is left. Logs go
# straight to files (never through a pipe under timeout). The Triton cache comes back as triton_cache.tgz (when
# small enough) so that a later call can carry it and skip fla's compiles.
source "$(dirname "$0")/device_env.sh"
export TRITON_CACHE_DIR=/tmp/triton_cache
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)';
  python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=250 build_cuda 16
left() { echo $(( ${CALL_S:-570} - SECONDS )); }
OUT="$OUT" BENCH_SHAPES=B4,varlen BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 \
  timeout $(( $(left) - 150 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
echo "bwd exit $? at ${SECONDS}s"
OUT="$OUT" BENCH_BUDGET_S=$(( $(left) - 60 )) timeout $(( $(left) - 25 )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
echo "fwd exit $? at ${SECONDS}s"
tar czf /tmp/tc.tgz -C /tmp triton_cache 2>/dev/null && ls -la /tmp/tc.tgz && \
  [ "$(stat -c %s /tmp/tc.tgz)" -lt 60000000 ] && cp /tmp/tc.tgz "$OUT/triton_cache.tgz"
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
grep '^{' "$OUT/bench_fwd.log" | cut -c1-240
