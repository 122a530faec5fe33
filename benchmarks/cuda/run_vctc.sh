#!/bin/bash
# Session 6, one device call for grad3_vc_tc (issue #7; kernels_src/cuda/delta_chunk_bwd_grad3_vc_tc.cuh): build
# (sm_90), tests/test_cuda_chunk_bwd.py + tests/test_cuda_stages.py, per-kernel times of the KDA and GDN backward
# with the new default (KDA_CUDA_CHUNK_BWD_VC=2, 3xTF32), plain tf32 (=3) and the SIMT grad3_vc (=1), then a
# large-shape agreement check of =2 and =3 against =1. Everything under $OUT; each step timed out.
source "$(dirname "$0")/device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-140} build_cuda 16
grep -A2 "grad3_vc" "$OUT/build.log" | grep -E "Compiling|registers|spill" > "$OUT/ptxas_vc.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${TEST_TIMEOUT:-65} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_bwd.py \
  tests/test_cuda_stages.py 2>&1 | tail -40 > "$OUT/tests.log"
tail -4 "$OUT/tests.log"
timeout ${PROF_TIMEOUT:-45} python3 benchmarks/cuda/profile_chunk.py --families kda,gdn --phases bwd --bwd-vc 1,3 \
  > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
for fam in ("kda", "gdn"):
    for name in ("bwd", "bwd_vc1", "bwd_vc3"):
        x = r.get(fam, {}).get(name, {})
        print(fam, name, "total %.4f ms" % sum(x.values()), {k: v for k, v in x.items() if "grad3" in k or v > 0.3})
PY
timeout ${CHECK_TIMEOUT:-25} python3 - <<'PY' 2>&1 | tee "$OUT/agree.txt"
# B1 T8192 H16 HV32 K=V=128 bf16 (the benchmark shape): relative RMS difference of every output between modes
import sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs
ops = load_cuda_variant("kda_cuda_profile").ops
for fam in ("kda", "gdn"):
    q, k, v, g, beta, do, dht = inputs(fam, 1, 8192, 16, 32, 128, 128)
    run = lambda: getattr(ops, f"{fam}_chunk_bwd")(q, k, v, g, beta, 128 ** -0.5, None, None, do, dht)
    res = {}
    for m in ("2", "3", "1"):
        with knobs_set({"KDA_CUDA_CHUNK_BWD_VC": m}):
            res[m] = [x.double() for x in run()]
        torch.cuda.synchronize()
    for m in ("2", "3"):
        d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
             for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), res[m], res["1"])}
        print(fam, f"VC={m} vs 1 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
              "finite:", all(bool(torch.isfinite(x).all()) for x in res[m]))
PY
