#!/bin/bash
# Session 11 candidate steps for branch sbwd11: the narrow state_bwd3 (state_bwd3n_kernel,
# KDA_CUDA_CHUNK_BWD_STATE_BWD=7 tf32 / 8 3xTF32; off by default). Assumes the CUDA variant is built and
# `source benchmarks/cuda/device_env.sh` was done (the working directory is the repository root, $OUT is set).
# About 100 s on one H200:
#   1. its tests (~45 s): bit-identical gradients (torch.equal) against STATE_BWD=4 / 3, float64-reference
#      tolerances (extreme gates at -20, varlen with empty sequences, initial state, GVA), staged op, kernel
#      selection, refused values; plus the CPU index emulation;
#   2. per-kernel times of the backward with STATE_BWD = 4 (the default), 7, 3, 8 in one process (~20 s): the
#      decisive numbers are the state_bwd3_kernel row under bwd_state_bwd4 (0.835 ms KDA / 0.830 GDN in session
#      11's first call) against the state_bwd3n_kernel row under bwd_state_bwd7, KDA and GDN;
#   3. fwd+bwd at B1_T8192 (ours only), default against STATE_BWD=7 in one process (~35 s).
# 7 becomes the default if (1) passes (bit-identical, so no accuracy question) and (2) shows it faster for both
# families (then the fwd+bwd rows of (3) should drop by about the same amount).
mkdir -p "$OUT/sbwd11"
timeout -k 5 75 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/test_cuda_chunk_bwd_state_bwd_narrow.py \
  tests/test_cuda_state_bwd3n_emu.py > "$OUT/sbwd11/tests.log" 2>&1
echo "sbwd11 pytest exit $? at ${SECONDS}s"; tail -3 "$OUT/sbwd11/tests.log"
grep -E "^FAILED|^ERROR" "$OUT/sbwd11/tests.log" | head -20
timeout -k 5 45 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-bwd 4,7,3,8 \
  > "$OUT/sbwd11/kernel_times.json" 2> "$OUT/sbwd11/kernel_times.err"
echo "sbwd11 profile exit $? at ${SECONDS}s"
python3 - "$OUT/sbwd11/kernel_times.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for fam in ("kda", "gdn"):
    for row, ks in r.get(fam, {}).items():
        if isinstance(ks, dict):
            st = {k.split("(")[0].split("::")[-1]: v for k, v in ks.items() if "state_bwd" in k}
            print(fam, row, f"sum {sum(ks.values()):.3f} ms", st)
PY
OUT="$OUT/sbwd11" BENCH_SHAPES=B1_T8192 BENCH_PHASES=ours BENCH_SKIP_RECURRENT=1 \
  BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_STATE_BWD=7" \
  timeout -k 5 60 python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/sbwd11/bench_bwd.log" 2>&1
echo "sbwd11 bench exit $? at ${SECONDS}s"
grep '^{' "$OUT/sbwd11/bench_bwd.log" | cut -c1-260
