#!/bin/bash
# One device call for the chunked backward's grad2 / prep (FS2) kernels (session 4): build (sm_90),
# tests/test_cuda_chunk_bwd.py (summary and failures only: the JUnit file did not come back last time), per-kernel
# times with the new (default) and v1 (KDA_CUDA_CHUNK_BWD_GRAD=1 KDA_CUDA_CHUNK_BWD_PREP=1) grad/prep in one
# process, the backward benchmark at B1 T8192 H16 HV32 without fla, and Nsight Compute details of grad2 if time
# is left. Everything under $OUT; `timeout` around each step.
WHL=${WHL:-/nonexistent}  # no fla
source "$(dirname "$0")/device_env.sh"
T0=$(date +%s)
el() { echo "== $1 at $(( $(date +%s) - T0 ))s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-170} build_cuda 16
grep -A2 "grad2_kernel\|grad_kernel\|prep_kernel" "$OUT/build.log" | grep -i "registers\|spill" | head -16 > "$OUT/ptxas_grad_prep.txt"
cat "$OUT/ptxas_grad_prep.txt"
el build
timeout ${TEST_TIMEOUT:-90} python3 -m pytest -q -n 14 tests/test_cuda_chunk_bwd.py tests/test_cuda_chunk_bwd_host.py \
  -p no:cacheprovider -rfE > "$OUT/tests.log" 2>&1
grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -30
el tests
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --bwd-grad-v1 > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY'
import json, re, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no kernel times:", e); sys.exit()
for fam in ("kda", "gdn"):
    for ph in ("bwd", "bwd_grad_v1"):
        d = r[fam].get(ph, {})
        short = {}
        for k, v in d.items():
            m = re.search(r"(\w+_kernel)<", k)
            short[m.group(1) if m else k[:20]] = v
        print(fam, ph, "total %.3f ms" % sum(d.values()), {k: v for k, v in short.items() if v > 0.01})
PY
el profile
BENCH_NSHAPES=1 timeout ${BENCH_TIMEOUT:-60} python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/bench.log" 2>&1
grep -v "^$" "$OUT/bench.log" | tail -8
el bench
left=$(( ${TOTAL_S:-225} - ($(date +%s) - T0) ))
if [ $left -lt 35 ]; then echo "no time for ncu"; else
  timeout $(( left - 5 )) ncu --set full -k regex:grad2 -c 1 python3 benchmarks/cuda/profile_chunk.py --once kda_bwd \
    > "$OUT/ncu_kda_bwd_grad2_details.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible|Executed Instructions  " "$OUT/ncu_kda_bwd_grad2_details.txt" | head -8
  el "ncu grad2"
fi
