#!/bin/bash
# Session 7, one device call for the KDA prep kernel v2 (kernels_src/cuda/kda_chunk_prep2.cuh, KDA_CUDA_KDA_PREP=2,
# the new default): build (sm_90), a smoke test of v2 against v1 first, tests/test_cuda_chunk_fwd.py + the forward
# stage tests, per-kernel times of the KDA forward with every knob value (2, 1, 0) in one process, agreement of v2
# with v1 at the benchmark shape (plain and adversarial gates), then Nsight Compute of v2 (full set), the KDA
# forward at B1 T8192 under CUDA graphs for v1 and v2 (no fla) and Nsight Compute of v1 (a few sections), the last
# three only while the call's time allows. Since the session-7 call (commit d90e9dd) it also covers
# KDA_CUDA_KDA_PREP=3 (v2 with the 8x8 split of the diagonal blocks, added afterwards, not yet run on a GPU) in the
# smoke test, the kernel times, the agreement check and the graph benchmark. Everything under $OUT, packed into
# $OUT/results.tgz (build.log beside it); each step timed out.
source "$(dirname "$0")/device_env.sh"
T_START=$SECONDS
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvcc --version | tail -1;
  python3 -c 'import torch;print(torch.__version__, torch.version.cuda)'; } > "$OUT/env.txt" 2>&1
BUILD_TIMEOUT=${BUILD_TIMEOUT:-140} build_cuda 16
grep -A3 "kda_chunk_prep" "$OUT/build.log" | grep -E "Compiling entry|registers|spill" > "$OUT/ptxas_prep.txt"
cat "$OUT/ptxas_prep.txt" | grep -A2 prep2 | head -6

echo "== smoke"
timeout ${SMOKE_TIMEOUT:-40} python3 - <<'PY' 2>&1 | tee "$OUT/smoke.txt"
import sys, torch
sys.path.insert(0, "benchmarks/cuda")
from cuda_variant import knobs_set, load_cuda_variant
ops = load_cuda_variant("kda_cuda_profile").ops
torch.manual_seed(0)
B, T, H, HV, K, V = 1, 300, 2, 4, 128, 128
q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
v = torch.randn(B, T, HV, V, device="cuda").bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device="cuda"))
g[..., ::7] = -1e4
beta = torch.rand(B, T, HV, device="cuda")
res = {}
for m in ("1", "2", "3"):
    with knobs_set({"KDA_CUDA_KDA_PREP": m}):
        res[m] = ops.kda_chunk_fwd(q, k, v, g, beta, K ** -0.5, None, None)
    torch.cuda.synchronize()
for m in ("2", "3"):
    for n, a, b in zip(("o", "ht"), res[m], res["1"]):
        a, b = a.double(), b.double()
        print(f"PREP={m}", n, "finite", bool(torch.isfinite(a).all()),
              "rel RMS vs v1 %.3e" % float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()))
PY

echo "== tests"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout ${TEST_TIMEOUT:-75} python3 -m pytest -q $XD -p no:cacheprovider tests/test_cuda_chunk_fwd.py \
  tests/test_cuda_stages.py -k "not bwd" 2>&1 | tail -40 > "$OUT/tests.log"
tail -4 "$OUT/tests.log"

echo "== kernel times"
timeout ${PROF_TIMEOUT:-40} python3 benchmarks/cuda/profile_chunk.py --families kda --phases fwd --kda-prep 1,0,2,3 \
  > "$OUT/kernel_times.json" 2> "$OUT/profile.err"
tail -3 "$OUT/profile.err"
python3 - "$OUT/kernel_times.json" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))["kda"]
for name, x in r.items():
    print(name, "total %.4f ms" % sum(x.values()), {k[:60]: v for k, v in x.items()})
PY

echo "== agreement at the benchmark shape"
timeout ${CHECK_TIMEOUT:-30} python3 - <<'PY' 2>&1 | tee "$OUT/agree.txt"
# B1 T8192 H16 HV32 K=V=128 bf16: relative RMS difference of o and the final state, v2 vs v1 (and generic)
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
    for m in ("2", "3", "1", "0"):
        with knobs_set({"KDA_CUDA_KDA_PREP": m}):
            res[m] = [x.double() for x in ops.kda_chunk_fwd(q, k, v, g, beta, 128 ** -0.5, None, None)]
        torch.cuda.synchronize()
    for m, ref in (("2", "1"), ("3", "1"), ("3", "2"), ("2", "0"), ("1", "0")):
        d = {n: float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))
             for n, a, b in zip(("o", "ht"), res[m], res[ref])}
        print(gates, f"PREP={m} vs {ref} rel RMS:", {n: f"{x:.2e}" for n, x in d.items()},
              "finite:", all(bool(torch.isfinite(x).all()) for x in res[m]))
PY

# Nsight Compute of v2 (full set), then v1 (a few sections), only while the call's time allows
if command -v ncu >/dev/null && [ $(( SECONDS - T_START )) -lt ${NCU_BEFORE_S:-200} ]; then
  echo "== ncu v2"
  KDA_CUDA_KDA_PREP=2 timeout $(( ${CALL_S:-272} - (SECONDS - T_START) )) ncu --set full -k regex:kda_chunk_prep2 -c 1 \
    python3 benchmarks/cuda/profile_chunk.py --once kda_fwd > "$OUT/ncu_kda_prep2_details.txt" 2>&1
  grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|No Eligible|Issue Slots Busy|Compute \(SM\) Th|Memory Throughput|Local Memory Spilling Req" \
    "$OUT/ncu_kda_prep2_details.txt" | head -14
fi
if [ $(( SECONDS - T_START )) -lt ${BENCH_BEFORE_S:-225} ]; then
  echo "== KDA forward under CUDA graphs (no fla)"
  BENCH_FAMILIES=kda BENCH_KDA_PREP=1,2,3 BENCH_NO_FLA=1 BENCH_SHAPES=B1_T8192 BENCH_BUDGET_S=30 timeout $(( ${CALL_S:-272} - (SECONDS - T_START) )) \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/bench.log" 2>&1
  grep -E "^B|^varlen|kda" "$OUT/bench.log" | tail -12
fi
if command -v ncu >/dev/null && [ $(( SECONDS - T_START )) -lt ${NCU1_BEFORE_S:-240} ]; then
  echo "== ncu v1"
  KDA_CUDA_KDA_PREP=1 timeout $(( ${CALL_S:-272} - (SECONDS - T_START) )) ncu --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats --section Occupancy \
    -k regex:kda_chunk_prep_kernel -c 1 python3 benchmarks/cuda/profile_chunk.py --once kda_fwd \
    > "$OUT/ncu_kda_prep1_details.txt" 2>&1
  grep -E "Duration|Issue Slots Busy|No Eligible" "$OUT/ncu_kda_prep1_details.txt" | head -4
fi
echo "total $(( SECONDS - T_START ))s"
(cd "$OUT" && tar czf /tmp/kda_prep2_results.tgz --exclude=build.log . && find . -type f ! -name build.log -delete \
  && mv /tmp/kda_prep2_results.tgz results.tgz)
