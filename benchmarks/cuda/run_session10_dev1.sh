#!/bin/bash
# Session 10, first call (one H200): the public API under CUDA graph capture (the rewritten test, owed since
# session 9), every CUDA test file at main, per-kernel times at the defaults, and Nsight Compute (--set full) of the
# kernels the session's helpers work on: GDN's and KDA's forward preps, KDA's backward prep v4 and grad3_ch2.
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/all.log"
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-250} build_cuda 16
echo "== build took ${BUILD_S}s" >> "$LOG"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cuda_backend.py -k captures > "$OUT/captures.log" 2>&1
echo "captures exit $?" >> "$OUT/captures.log"; tail -4 "$OUT/captures.log"
timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py > "$OUT/tests.log" 2>&1
echo "pytest exit $?" >> "$OUT/tests.log"; tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
timeout 70 python3 benchmarks/cuda/profile_chunk.py > "$OUT/kernel_times.json" 2>> "$LOG"
echo "profile exit $?"; python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
# Nsight Compute: one call of each kernel after profile_chunk's warm-up (-c 1 takes the first launch that matches)
for kv in "gdn_fwd:gdn_chunk_prep" "kda_fwd:kda_chunk_prep2" "kda_bwd:prep4" "kda_bwd:grad3_ch2" "kda_fwd:scan5" \
          "kda_bwd:state_bwd3"; do
  once=${kv%%:*}; k=${kv#*:}
  timeout 60 ncu --set full -k regex:$k -c 1 python3 benchmarks/cuda/profile_chunk.py --once $once \
    > "$OUT/ncu_${once}_${k}.txt" 2>&1
  echo "ncu $k exit $?"; grep -E "^    Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput" \
    "$OUT/ncu_${once}_${k}.txt" | head -6
done
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
