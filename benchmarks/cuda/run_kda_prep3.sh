#!/bin/bash
# Session 10: the steps a device call runs for the KDA prep kernel v3 (kernels_src/cuda/kda_chunk_prep3.cuh,
# KDA_CUDA_KDA_PREP=4, and =5 with P1's channel loop unrolled; opt-in, the default stays 3): build (sm_90; skipped
# with SKIP_BUILD=1 when the call already built this tree), its GPU tests, per-kernel times of the KDA forward for
# 3 / 4 / 5 in one process, agreement with the default at the benchmark shape (plain and adversarial gates), the
# forward under CUDA graphs (no fla), then Nsight Compute of v3 while the call's time allows. Everything under
# $OUT; each step timed out. Expected on one H200 after the build: tests ~60 s, times ~20 s, agreement ~15 s,
# graphs ~30 s, ncu ~60 s.
source "$(dirname "$0")/device_env.sh"
T_START=$SECONDS
[ "${SKIP_BUILD:-0}" = 1 ] || { BUILD_TIMEOUT=${BUILD_TIMEOUT:-250} build_cuda 16; }
[ -f "$OUT/build.log" ] && grep -A3 "kda_chunk_prep[23]" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" \
  > "$OUT/ptxas_kda_prep3.txt"

echo "== tests"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_fwd.py -k prep3 \
  > "$OUT/tests_kda_prep3.log" 2>&1
tail -4 "$OUT/tests_kda_prep3.log"

echo "== kernel times"
timeout ${PROF_TIMEOUT:-60} python3 benchmarks/cuda/profile_chunk.py --families kda --phases fwd --kda-prep 3,4,5 \
  > "$OUT/kda_prep3_kernel_times.json" 2> "$OUT/profile_kda_prep3.err"
python3 - "$OUT/kda_prep3_kernel_times.json" <<'PY' 2>&1 | tee "$OUT/kda_prep3_summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))["kda"]
for name, x in r.items():
    print(name, "total %.4f ms" % sum(x.values()), {k[:60]: v for k, v in x.items()})
PY

echo "== agreement at the benchmark shape"
timeout ${CHECK_TIMEOUT:-40} python3 - <<'PY' 2>&1 | tee "$OUT/kda_prep3_agree.txt"
import sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
from profile_chunk import inputs
ops = load_cuda_variant("kda_cuda_profile").ops
q, k, v, g, beta, _, _ = inputs("kda", 1, 8192, 16, 32, 128, 128)
for gates in ("bench", "extreme"):
    if gates == "extreme":
        r = torch.rand_like(g)
        g = torch.where(r < 0.3, torch.full_like(g, -20.0), torch.where(r > 0.97, torch.full_like(g, -1e4), g))
    res = {}
    for m in ("3", "4", "5"):
        with knobs_set({"KDA_CUDA_KDA_PREP": m}):
            res[m] = [x.double() for x in ops.kda_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, None, None)]
        torch.cuda.synchronize()
    for m in ("4", "5"):
        d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
             for n, a, b in zip(("o", "ht"), res[m], res["3"])}
        print(gates, f"PREP={m} vs 3 rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
              "finite:", all(bool(torch.isfinite(x).all()) for x in res[m]))
PY

if [ $(( SECONDS - T_START )) -lt ${BENCH_BEFORE_S:-400} ]; then
  echo "== KDA forward under CUDA graphs (no fla)"
  BENCH_FAMILIES=kda BENCH_KDA_PREP=3,4,5 BENCH_NO_FLA=1 BENCH_SHAPES=B1_T8192 BENCH_BUDGET_S=40 \
    timeout ${BENCH_TIMEOUT:-60} python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/kda_prep3_bench.log" 2>&1
  grep -E "^B|kda" "$OUT/kda_prep3_bench.log" | tail -8
fi
if command -v ncu >/dev/null && [ $(( SECONDS - T_START )) -lt ${NCU_BEFORE_S:-460} ]; then
  echo "== ncu v3"
  KDA_CUDA_KDA_PREP=4 timeout ${NCU_TIMEOUT:-90} ncu --set full -k regex:kda_chunk_prep3 -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_fwd > "$OUT/ncu_kda_fwd_kda_chunk_prep3.txt" 2>&1
  grep -E "Duration|Registers Per|No Eligible|Issue Slots Busy|L1/TEX Cache Th|Executed Instructions  " \
    "$OUT/ncu_kda_fwd_kda_chunk_prep3.txt" | head -8
fi
echo "total $(( SECONDS - T_START ))s"
