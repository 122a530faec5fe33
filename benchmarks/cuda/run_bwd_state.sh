#!/bin/bash
# One device call for the chunked backward's v2 state kernels (session 4): build (sm_90), tests/test_cuda_chunk_bwd.py,
# per-kernel times with the v2 (default) and v1 (KDA_CUDA_CHUNK_BWD_STATE=1) state kernels in one process, the
# backward benchmark at B1 T8192 H16 HV32 without fla (no wheels: fla's Triton compile costs minutes), and Nsight
# Compute details of the two v2 state kernels if time is left. Everything under $OUT; `timeout` around each step.
WHL=${WHL:-/nonexistent}  # no fla
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
el() { echo "== $1 at $(( $(date +%s) - T0 ))s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -A2 "state_fwd2\|state_bwd2\|prep_kernel\|grad_kernel" "$OUT/build.log" | grep -i "registers\|spill" | head -12
el build
timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py -p no:cacheprovider \
  --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
tail -15 "$OUT/tests.log"
el tests
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --bwd-state-v1 > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no kernel times:", e); sys.exit()
for fam in ("kda", "gdn"):
    for ph in ("bwd", "bwd_state_v1"):
        d = r[fam].get(ph, {})
        print(fam, ph, "total %.3f ms" % sum(d.values()), {k.split("::")[-1][:24]: v for k, v in d.items() if v > 0.01})
PY
el profile
BENCH_NSHAPES=1 timeout ${BENCH_TIMEOUT:-80} python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench.log" 2>&1
grep -v "^$" "$OUT/bench.log" | tail -8
el bench
for k in state_bwd2 state_fwd2; do
  left=$(( ${TOTAL_S:-290} - ($(date +%s) - T0) ))
  [ $left -lt 40 ] && { echo "no time for ncu $k"; break; }
  timeout $(( left - 5 )) ncu --set full -k regex:$k -c 1 python3 benchmarks/cuda/profile_chunk.py --once kda_bwd \
    > "$OUT/ncu_kda_bwd_${k}_details.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible" "$OUT/ncu_kda_bwd_${k}_details.txt" | head -6
  el "ncu $k"
done
