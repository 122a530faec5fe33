#!/bin/bash
# One device call for the split grad kernels of the chunked backward (KDA_CUDA_CHUNK_BWD_GRAD=3: grad3_vc,
# grad3_wy, grad3_ch; issue #7, session 5): build (sm_90, ptxas lines of the grad kernels), the host checks and
# tests/test_cuda_chunk_bwd.py (incl. grad3 vs grad2 on varlen / odd dims / V=200 blocks / GVA / gates at -1e4 /
# bf16), the float64-reference tests with grad3 forced, per-kernel times of default / grad3 / v1 in one process,
# Nsight Compute details of the five grad3 launches, the backward benchmark with grad3 if time is left.
# Everything goes to $W (outside $OUT) and is packed into one archive, $OUT/grad3_results.tgz, plus
# $OUT/summary.txt (the console lines); `timeout` around each step. TOTAL_S: the time the call is allowed.
# Usage (device call, copy of the worktree in .dev/cuda-bwd-grad3, no fla needed):
#   cd .dev/cuda-bwd-grad3 && TOTAL_S=280 bash benchmarks/cuda/run_bwd_grad3.sh
WHL=${WHL:-/nonexistent}  # no fla
source "$(dirname "$0")/device_env.sh"
W=/tmp/grad3_run; rm -rf "$W"; mkdir -p "$W"
FINAL_OUT=$OUT
T0=$(date +%s)
el() { echo "== $1 at $(( $(date +%s) - T0 ))s"; }
pack() { tar czf /tmp/grad3_results.tgz -C "$W" . && cp /tmp/grad3_results.tgz "$FINAL_OUT/grad3_results.tgz"; }
trap pack EXIT
exec > >(tee "$FINAL_OUT/summary.txt") 2>&1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; git log -1 --oneline 2>/dev/null; } > "$W/env.txt" 2>&1
OUT=$W BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
# ptxas: "Function properties for NAME", then the spill line, then "Used N registers"
awk '/Function properties for/ { n = ($0 ~ /grad3_|grad2_kernel/) ? $NF : ""; k = 0; next }
     n != "" && k < 2 { print n ": " $0; k++ }' "$W/build.log" | sed 's/  */ /g' > "$W/ptxas_grad.txt"
cat "$W/ptxas_grad.txt"
el build
timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_bwd_host.py \
  -p no:cacheprovider -rfE > "$W/tests.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$W/tests.log" | tail -30
el tests
KDA_CUDA_CHUNK_BWD_GRAD=3 timeout ${TEST3_TIMEOUT:-60} python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py \
  -k "not matches_v2" -p no:cacheprovider -rfE > "$W/tests_grad3_forced.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$W/tests_grad3_forced.log" | tail -20
el "tests with grad3 forced"
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-grad3 --bwd-grad-v1 \
  > "$W/kernel_times.json" 2> "$W/profile.err"
tail -3 "$W/profile.err"
python3 - "$W/kernel_times.json" <<'PY'
import json, re, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no kernel times:", e); sys.exit()
for fam in ("kda", "gdn"):
    for ph in ("bwd", "bwd_grad3", "bwd_grad_v1"):
        d = r[fam].get(ph, {})
        short = {}
        for k, v in d.items():
            m = re.search(r"(\w+_kernel)<", k)
            key = m.group(1) if m else k[:20]
            short[key] = short.get(key, 0.0) + v  # (grad3_vc_kernel<PC, 0..2>: summed)
        print(fam, ph, "total %.3f ms" % sum(d.values()), {k: round(v, 3) for k, v in short.items() if v > 0.01})
PY
el profile
left=$(( ${TOTAL_S:-270} - ($(date +%s) - T0) ))
if [ $left -lt 45 ]; then echo "no time for ncu"; else
  KDA_CUDA_CHUNK_BWD_GRAD=3 timeout $(( left > 100 ? 70 : left - 30 )) ncu --set full -k regex:grad3 -c 5 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_bwd > "$W/ncu_kda_bwd_grad3_details.txt" 2>&1
  grep -E "grad3_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Executed Ipc A|No Eligible|Block Limit" \
    "$W/ncu_kda_bwd_grad3_details.txt" | head -40
  el "ncu grad3"
fi
left=$(( ${TOTAL_S:-270} - ($(date +%s) - T0) ))
if [ $left -lt 40 ]; then echo "no time for the benchmark"; else
  KDA_CUDA_CHUNK_BWD_GRAD=3 BENCH_NSHAPES=1 timeout $(( left - 10 )) python3 benchmarks/cuda/bench_chunk_bwd.py \
    > "$W/bench_grad3.log" 2>&1
  grep -v "^$" "$W/bench_grad3.log" | tail -8
  el bench
fi
