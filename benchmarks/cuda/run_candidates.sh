#!/bin/bash
# One device call for candidate kernels not yet run on a GPU (session 5: the bulk-prefetch scan
# KDA_CUDA_CHUNK_SCAN=4 and the split grad kernels KDA_CUDA_CHUNK_BWD_GRAD=3), then flash-linear-attention's fwd+bwd
# side by side:
#   1. build (sm_90), ptxas lines;
#   2. every CUDA test file (the defaults, old-vs-new and candidate-vs-default tests), then the float64-reference
#      backward tests with grad3 forced;
#   3. per-kernel times in one process: forward with scans 1 / 4 (32- and 64-column blocks), backward with
#      grad2 / grad3 (B1 T8192 H16 HV32 K=V=128 bf16);
#   4. bench_chunk_bwd.py at B1 T8192 (ours, ours with grad3, fla 0.6.0: its Triton compile takes minutes) as far
#      as CALL_S allows (one JSON line per row: a cut-short run keeps its rows).
# Everything but build.log is packed into $OUT/results.tgz at the end (written outside $OUT first).
#   cd .dev/NAME && CALL_S=560 bash benchmarks/cuda/run_candidates.sh
# (Run once in session 5 before grad3 and scan 4 became the defaults, with --bwd-grad3 where it now says
# --bwd-grad2, and with the cluster scan removed in session 6 (its smoke test, scans 3 / 4); fla was missing from
# that run: the copy under .dev did not find the root's .whl, now it does.)
source "$(dirname "$0")/device_env.sh"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - 15 - SECONDS )); }
T="timeout -k 5"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -E "Compiling entry|registers|spill" "$OUT/build.log" > "$OUT/ptxas.txt"

$T ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 14 tests/test_cuda_backend.py tests/test_cuda_chunk_fwd.py \
  tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_bwd_host.py -p no:cacheprovider -rfE > "$OUT/tests.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -25
KDA_CUDA_CHUNK_BWD_GRAD=3 $T 60 python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py -k "not matches_v2" \
  -p no:cacheprovider -rfE > "$OUT/tests_grad3_forced.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests_grad3_forced.log" | tail -10
echo "tests done at ${SECONDS}s"

$T 60 python3 benchmarks/cuda/profile_chunk.py --phases fwd,bwd --scans 1,4 --bwd-grad2 \
  > "$OUT/kernel_times.json" 2> "$OUT/kernel_times.err"
KDA_CUDA_SCAN3_BV=64 $T 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 4 \
  > "$OUT/kernel_times_bv64.json" 2> "$OUT/kernel_times_bv64.err"
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
