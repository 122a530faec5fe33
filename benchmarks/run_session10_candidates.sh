#!/bin/bash
# Session 10, the candidate call on the two-GPU H200 machine (kind nvidia-h200-x2): main with four branches merged,
# each new path behind a knob OFF by default (bwd10: grad3_ch2g, KDA_CUDA_CHUNK_BWD_CH=4; gdnprep10: GDN prep v2,
# KDA_CUDA_GDN_PREP=2; dec10: lean decode kernels, KDA_CUDA_DEC_LEAN=1|2; state10: narrow state_fwd3,
# KDA_CUDA_CHUNK_BWD_STATE_FWD=7), and the capture diagnosis (benchmarks/cuda/diag_capture.py):
#   build (sm_90) -> GPU 1: every CUDA test file, the capture diagnosis, the backward's accuracy per new knob, ours'
#   fwd+bwd per variant | GPU 0: the decode benchmark with session 10's A/B rows beside fla, per-kernel times of every
#   new knob, GDN's forward per prep at four shapes. Logs in results.tgz.
export NCCL_NVLS_ENABLE=0
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-520}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-220} build_cuda 32
echo "== build took ${BUILD_S}s" >> "$LOG"
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"
mkdir -p "$OUT/g0" "$OUT/g1"
( export CUDA_VISIBLE_DEVICES=1
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -n 14 -p no:cacheprovider -rfE tests/test_cuda_*.py \
    > "$OUT/tests.log" 2>&1
  echo "pytest exit $? at ${SECONDS}s" >> "$OUT/tests.log"
  timeout 100 python3 benchmarks/cuda/diag_capture.py > "$OUT/diag_capture.log" 2>&1
  echo "diag exit $? at ${SECONDS}s" >> "$OUT/diag_capture.log"
  timeout 60 python3 benchmarks/cuda/bwd_accuracy.py "KDA_CUDA_CHUNK_BWD_CH=4" "KDA_CUDA_CHUNK_BWD_STATE_FWD=7" \
    > "$OUT/bwd_accuracy.jsonl" 2>&1
  OUT="$OUT/g1" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 \
    BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_CH=4;KDA_CUDA_CHUNK_BWD_STATE_FWD=7;KDA_CUDA_CHUNK_BWD_CH=4,KDA_CUDA_CHUNK_BWD_STATE_FWD=7,KDA_CUDA_GDN_PREP=2" \
    timeout $(( $(left) - 10 )) python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench_bwd.log" 2>&1
  echo "bwd exit $? at ${SECONDS}s" >> "$OUT/bench_bwd.log" ) &
gpu1=$!
( export CUDA_VISIBLE_DEVICES=0
  echo "== decode beside fla, session 10 A/B rows"
  OUT="$OUT/g0" timeout 170 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session10 --decode-only \
    --sweep10 --rep 100 --sweep-rep 40 --batches 256,64 > "$OUT/bench_dec10.log" 2>&1
  echo "decode exit $? at ${SECONDS}s"
  echo "== profile (defaults and every new knob)"
  timeout 120 python3 benchmarks/cuda/profile_chunk.py --gdn-prep 2 --bwd-ch 4 --bwd-state-fwd 7 \
    > "$OUT/kernel_times.json"
  echo "profile exit $? at ${SECONDS}s"
  python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/kernel_times.json"
  echo "== GDN forward per prep, four shapes"
  OUT="$OUT/g0" BENCH_FAMILIES=gdn BENCH_GDN_PREP=1,2 BENCH_NO_FLA=1 BENCH_BUDGET_S=80 timeout 100 \
    python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench_fwd_gdn.log" 2>&1
  echo "fwd exit $? at ${SECONDS}s"
  L=$(left); if [ "$L" -gt 70 ]; then KDA_CUDA_GDN_PREP=2 timeout 60 ncu --set full -k regex:gdn_chunk_prep2 -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once gdn_fwd > "$OUT/ncu_gdn_prep2.txt" 2>&1; echo "ncu exit $?"; fi
) >> "$LOG" 2>&1
wait $gpu1
tail -3 "$OUT/tests.log"; grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
cat "$OUT/diag_capture.log" | cut -c1-300 | head -40
grep -E "within_design_6|worst" "$OUT/bwd_accuracy.jsonl" | cut -c1-300
grep -E "sum |exit|took" "$LOG" | cut -c1-420
grep -E "sweep|TBps" "$OUT/bench_dec10.log" | grep -E "B.: 256|\"B\": 256" | cut -c1-200 | head -60
grep '^{' "$OUT/bench_fwd_gdn.log" | cut -c1-220
grep '^{' "$OUT/bench_bwd.log" | cut -c1-260
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
