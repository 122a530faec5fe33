#!/bin/bash
# Session 10 (branch dec10), for the lead's candidate call (H200): build the CUDA variant (sm_90; SKIP_BUILD=1 when the
# call built it already), the decode tests of KDA_CUDA_DEC_LEAN (test_decode_lean_vs_default: LEAN=1/2 against the
# default kernel and the float64 reference; the _l1 / _l2 variants of the decode tests), then the decode benchmark
# beside fla 0.6.0 at B=256 and 64 with session 10's A/B rows in one process (bench_cuda.py --sweep10: s1 default vs
# s1_l1 / s1_l2, LEAN with other cfgs, drift rows), then the other decode tests while time is left. Everything under
# $OUT; ~150-220 s after the build.
#   OUT=/tmp/o bash benchmarks/cuda/run_decode10.sh
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
left() { echo $(( ${TOTAL_S:-280} - ($(date +%s) - T0) )); }
[ "${SKIP_BUILD:-0}" = 1 ] || { BUILD_TIMEOUT=250 build_cuda 16;
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | grep -A2 "delta_decode_kernel" \
    > "$OUT/ptxas_decode.txt"; }
echo "== tests (LEAN) at $(( $(date +%s) - T0 ))s"
timeout 90 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "decode and (lean or _l1 or _l2)" > "$OUT/tests_dec10.log" 2>&1; tail -3 "$OUT/tests_dec10.log"
echo "== bench at $(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 40 )) python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session10 --decode-only \
  --sweep10 --rep 100 --sweep-rep 40 --batches 256,64 > "$OUT/bench_dec10.log" 2>&1
tail -5 "$OUT/bench_dec10.log"
echo "== remaining decode tests at $(( $(date +%s) - T0 ))s"
L=$(left); [ "$L" -gt 8 ] && timeout $L python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "(decode or serve) and not lean and not _l1 and not _l2" > "$OUT/tests_dec10_rest.log" 2>&1
tail -3 "$OUT/tests_dec10_rest.log" 2>/dev/null
cd "$OUT" && tar czf results.tgz *.log *.txt cuda_decode_session10.* 2>/dev/null && rm -f build.log ptxas_decode.txt
ls -la "$OUT"; echo "== done at $(( $(date +%s) - T0 ))s"
