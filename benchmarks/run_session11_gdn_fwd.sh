#!/bin/bash
# Session 11, last call (one H200, the session's remaining ~250 s of device time): GDN's chunked forward at B1 T8192
# H16 HV32 beside fla 0.6.0 in one process, with scan6 the default (the verification call ran out of time before it).
source "$(dirname "$0")/cuda/device_env.sh"
log_machine "$OUT/all.log"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-120} build_cuda 16
OUT="$OUT" BENCH_FAMILIES=gdn BENCH_SHAPES=B1_T8192 timeout ${BENCH_TIMEOUT:-75} python3 benchmarks/cuda/bench_chunk_fwd.py \
  > "$OUT/bench_fwd_gdn.log" 2>&1
echo "fwd exit $? at ${SECONDS}s" | tee -a "$OUT/all.log"; grep '^{' "$OUT/bench_fwd_gdn.log" | cut -c1-300
