#!/bin/bash
# One device call for grad3_vc_tc (issue #7): build, the chunked-backward and stage tests, per-kernel times of the
# backward with the new default (KDA_CUDA_CHUNK_BWD_VC=2), the SIMT grad3_vc (=1) and plain tf32 (=3); under $OUT.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
grep -A2 "grad3_vc" "$OUT/build.log" | grep -E "Compiling|registers|spill" > "$OUT/ptxas_vc.txt"
timeout ${TEST_TIMEOUT:-75} python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_cuda_chunk_bwd.py \
  tests/test_cuda_stages.py 2>&1 | tail -30 > "$OUT/tests.log"
tail -5 "$OUT/tests.log"
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --families kda,gdn --phases bwd --bwd-vc 1,3 \
  > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY' | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for fam in ("kda", "gdn"):
    for name in ("bwd", "bwd_vc1", "bwd_vc3"):
        x = r.get(fam, {}).get(name)
        print(fam, name, json.dumps(x)[:1500])
PY
