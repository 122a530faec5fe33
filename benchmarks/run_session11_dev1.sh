#!/bin/bash
# Session 11, first call (2x H200): what session 10 owed and what this session's helpers start from.
#   build (sm_90) -> GPU 1: every CUDA test file at main (includes the owed checks: the KDA prep v3 removal,
#   test_cuda_chunk_fwd.py -k "retired or prep"; the shared gdn_gate_prefix, test_cuda_gdn_prep2.py and
#   test_cuda_chunk_bwd.py -k gdn), then ours' and fla's fwd+bwd in one process at B1 T8192 / T32768
#   | GPU 0: per-kernel times, GDN/KDA varlen forward beside fla, Nsight Compute of the fp32 / bf16 decode kernels
#   at B=256 and of the forward scan (GDN) for the helpers.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-420}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-200} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
mkdir -p "$OUT/g0" "$OUT/g1"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s" >> "$OUT/tests.log"
  OUT="$OUT/g1" BENCH_SHAPES=B1_T8192,B1_T32768 BENCH_PHASES=fla_0.6.0,ours BENCH_SKIP_RECURRENT=1 \
    timeout $(( $(left) - 5 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $? at ${SECONDS}s" >> "$OUT/bench_bwd.log" ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  timeout 80 python3 benchmarks/cuda/profile_chunk.py > "$OUT/kernel_times.json"
  echo "profile exit $? at ${SECONDS}s"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  for op in kda_serve_fp32 gdn_serve_fp32 kda_serve_bf16; do
    timeout 60 ncu --set full -k regex:delta_decode -s 1 -c 1 python3 benchmarks/cuda/profile_decode.py --op $op \
      > "$OUT/ncu_dec_${op}.txt" 2>&1
    echo "ncu $op exit $?"; grep -E "^    Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput" \
      "$OUT/ncu_dec_${op}.txt" | head -6
  done
  timeout 60 ncu --set full -k regex:scan5 -c 1 python3 benchmarks/cuda/profile_chunk.py --once gdn_fwd \
    > "$OUT/ncu_gdn_fwd_scan5.txt" 2>&1
  echo "ncu gdn scan5 exit $?"
  echo "== varlen forward beside fla"
  OUT="$OUT/g0" BENCH_SHAPES=varlen BENCH_BUDGET_S=$(( $(left) - 40 )) timeout $(( $(left) - 12 )) \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s"
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
grep -E "sum |exit|took" "$LOG" | cut -c1-420
grep '^{' "$OUT/bench_fwd.log" | cut -c1-260
grep '^{' "$OUT/bench_bwd.log" | cut -c1-300
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
