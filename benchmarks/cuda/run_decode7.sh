#!/bin/bash
# Session 7, one device call (H200): build the CUDA variant (sm_90), the decode-kernel tests of the hint variants,
# the decode benchmark beside fla 0.6.0 with the session-7 sweep (bench_cuda.py --sweep7), then the other decode
# tests while time is left. Everything under $OUT; the steps' time limits keep the whole under ~270 s.
# (The session-7 run of this script also had a stage-3 kernel, "stage3" tests and s3_* sweep rows; removed since.)
#   OUT=/tmp/o bash benchmarks/cuda/run_decode7.sh
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
left() { echo $(( ${TOTAL_S:-268} - ($(date +%s) - T0) )); }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } 2>&1 | tee "$OUT/env.txt"
BUILD_TIMEOUT=150 build_cuda 16
grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | grep -A2 "delta_decode_kernel" > "$OUT/ptxas_decode.txt"
echo "== tests (new variants) at $(( $(date +%s) - T0 ))s"
timeout 35 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "decode and (h0 or h11)" 2>&1 | tail -15 | tee "$OUT/tests_new.log"
echo "== bench at $(( $(date +%s) - T0 ))s"
timeout $(( $(left) - 25 )) python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session7 --decode-only --sweep7 \
  --rep 30 --sweep-rep 15 --batches 256,64,1 > "$OUT/bench.log" 2>&1
tail -5 "$OUT/bench.log"
echo "== remaining decode tests at $(( $(date +%s) - T0 ))s"
L=$(left); [ "$L" -gt 8 ] && timeout $L python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "(decode or serve) and not h0 and not h11" 2>&1 | tail -15 | tee "$OUT/tests_rest.log"
cd "$OUT" && tar czf results.tgz *.log *.txt cuda_decode_session7.* 2>/dev/null && rm -f build.log ptxas_decode.txt
ls -la "$OUT"; echo "== done at $(( $(date +%s) - T0 ))s"
