#!/bin/bash
# One device call for candidate kernels not yet run on a GPU (session 5: the cluster scan KDA_CUDA_CHUNK_SCAN=3/4
# and the split grad kernels KDA_CUDA_CHUNK_BWD_GRAD=3), then flash-linear-attention's fwd+bwd side by side:
#   1. build (sm_90), ptxas lines;
#   2. a 45 s smoke test of the cluster scan (a mistake in its mbarrier / cluster protocol would hang: on a
#      timeout the scan3 steps are skipped, the rest still runs);
#   3. every CUDA test file (the defaults, old-vs-new and candidate-vs-default tests), then the float64-reference
#      backward tests with grad3 forced;
#   4. per-kernel times in one process: forward with scans 1 / 3 / 4 (32- and 64-column blocks), backward with
#      grad2 / grad3 (B1 T8192 H16 HV32 K=V=128 bf16);
#   5. bench_chunk_bwd.py at B1 T8192 (ours, ours with grad3, fla 0.6.0: its Triton compile takes minutes) as far
#      as CALL_S allows (one JSON line per row: a cut-short run keeps its rows).
# Everything but build.log is packed into $OUT/results.tgz at the end (written outside $OUT first).
#   cd .dev/NAME && CALL_S=560 bash benchmarks/cuda/run_candidates.sh
# (Run once in session 5 before grad3 and scan 4 became the defaults, with --bwd-grad3 where it now says
# --bwd-grad2; fla was missing from that run: the copy under .dev did not find the root's .whl, now it does.)
source "$(dirname "$0")/device_env.sh"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - 15 - SECONDS )); }
T="timeout -k 5"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"

$T 45 python3 -m pytest -q -x tests/test_cuda_chunk_fwd.py -p no:cacheprovider \
  -k "test_chunk_fwd_scan3 and T200 and bf16 and cluster and not nocluster and bv32" > "$OUT/smoke_scan3.log" 2>&1
rc=$?
tail -2 "$OUT/smoke_scan3.log"
SCAN3_OK=1
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then SCAN3_OK=0; echo "SCAN3 SMOKE TIMED OUT (hang?)" | tee -a "$OUT/smoke_scan3.log"; fi
echo "smoke done at ${SECONDS}s"

DESEL=""; [ $SCAN3_OK = 1 ] || DESEL="-k not scan3"
$T ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 14 tests/test_cuda_backend.py tests/test_cuda_chunk_fwd.py \
  tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_bwd_host.py -p no:cacheprovider -rfE ${DESEL:+"$DESEL"} \
  > "$OUT/tests.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -25
KDA_CUDA_CHUNK_BWD_GRAD=3 $T 60 python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py -k "not matches_v2" \
  -p no:cacheprovider -rfE > "$OUT/tests_grad3_forced.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests_grad3_forced.log" | tail -10
echo "tests done at ${SECONDS}s"

if [ $SCAN3_OK = 1 ]; then SC="--scans 3,4"; else SC=""; fi
KDA_CUDA_SCAN3_DEBUG=1 $T 60 python3 benchmarks/cuda/profile_chunk.py --phases fwd,bwd $SC --bwd-grad2 \
  > "$OUT/kernel_times.json" 2> "$OUT/kernel_times.err"
grep "\[scan3\]" "$OUT/kernel_times.err"
if [ $SCAN3_OK = 1 ]; then
  KDA_CUDA_SCAN3_BV=64 $T 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 3,4 \
    > "$OUT/kernel_times_bv64.json" 2> "$OUT/kernel_times_bv64.err"
fi
python3 - "$OUT"/kernel_times*.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        r = json.load(open(f))
    except Exception as e:  # noqa: BLE001
        print(f, "unreadable:", e); continue
    for fam, phases in r.items():
        if isinstance(phases, dict):
            print(f.rsplit("/", 1)[-1], fam, {ph: round(sum(d.values()), 3) for ph, d in phases.items() if isinstance(d, dict)})
PY
echo "profile done at ${SECONDS}s"

if [ "$(left)" -gt 60 ]; then
  BENCH_NSHAPES=1 BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_GRAD=3" $T $(left) python3 benchmarks/cuda/bench_chunk_bwd.py \
    > "$OUT/bench_bwd.log" 2>&1
  grep -v '^{' "$OUT/bench_bwd.log" | tail -5
  grep '^{' "$OUT/bench_bwd.log" | cut -c1-260
fi
echo "total ${SECONDS}s"
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
