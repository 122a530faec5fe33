#!/bin/bash
# Session 8 (branch dec8), for the lead's candidate call (H200): build the CUDA variant (sm_90; SKIP_BUILD=1 when the
# call built it already), the decode tests of the new variants (the compiled-in hints = every plain cfgX_stageY row,
# the run-time hint kernels _h*, KDA_CUDA_DEC_FUSE _f1), then the decode benchmark beside fla 0.6.0 at B=256 with
# session 8's A/B rows (bench_cuda.py --sweep8: s1 compiled-in vs s1_h0 / s1_h2 run-time flag tests, s1_f1 FUSE,
# s1_h1), then the other decode tests while time is left. Everything under $OUT; ~180-250 s after the build.
#   OUT=/tmp/o bash benchmarks/cuda/run_decode8.sh
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
left() { echo $(( ${TOTAL_S:-280} - ($(date +%s) - T0) )); }
[ "${SKIP_BUILD:-0}" = 1 ] || { BUILD_TIMEOUT=200 build_cuda 16;
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | grep -A2 "delta_decode_kernel" \
    > "$OUT/ptxas_decode.txt"; }
echo "== tests (new variants) at $(( $(date +%s) - T0 ))s"
timeout 90 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "decode and (_h or _f1 or stage1)" > "$OUT/tests_dec8.log" 2>&1; tail -3 "$OUT/tests_dec8.log"
echo "== bench at $(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 40 )) python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session8 --decode-only \
  --sweep8 --rep 100 --sweep-rep 40 --batches 256 > "$OUT/bench_dec8.log" 2>&1
tail -5 "$OUT/bench_dec8.log"
echo "== remaining decode tests at $(( $(date +%s) - T0 ))s"
L=$(left); [ "$L" -gt 8 ] && timeout $L python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "(decode or serve) and not _h and not _f1 and not stage1" > "$OUT/tests_dec8_rest.log" 2>&1
tail -3 "$OUT/tests_dec8_rest.log" 2>/dev/null
cd "$OUT" && tar czf results.tgz *.log *.txt cuda_decode_session8.* 2>/dev/null && rm -f build.log ptxas_decode.txt
ls -la "$OUT"; echo "== done at $(( $(date +%s) - T0 ))s"
