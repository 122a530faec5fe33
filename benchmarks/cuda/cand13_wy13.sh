#!/bin/bash
# Session 13 round 2, branch wy13 (for the candidate call): grad3_wy4, KDA_CUDA_CHUNK_BWD_WY=4 (grad3_wy4_kernel,
# delta_chunk_bwd_grad3_wy2.cuh; opt-in, 2 = grad3_wy2 stays the default, 3 stays refused as retired): grad3_wy2 with
# T^T's 3xTF32 splits formed once into shared memory (fragment order over tt + ms), T^T dX by column tiles (each dX
# fragment split once per k-step; dbeta's dR_u . v terms read back from shared memory in grad3_wy2's mapping), and
# dL += dR X^T over a per-warp tile table (3 / 2 tiles; grad3_wy2: 2, 4, 4, 4, 0, 0, 2, 4). Claimed bit-identical to =2.
# Checked without a GPU (nvcc 13.0, sm_90a): 128 registers, no spills, the same 108 KB / two blocks per SM; grad3_wy2's
# SASS unchanged; slice-loop body per warp (SASS with the warp index made compile-time, u and w branches both counted)
# max 1932 -> 1404 instructions, sum over the 8 warps 12 263 -> 10 623; HMMAs the same 960 per slice per block;
# FFMA / FMUL counts equal (no new contraction). tests/test_cuda_grad3_wy4_emu.py (CPU) checks the data movement.
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/wy13. About 80-130 s in all.
#  (1) tests, ~50-90 s with -n 14; all must pass: tests/test_cuda_grad3_wy4.py -- every gradient (dq, dk, dv, dg,
#      dbeta, dh0) torch.equal between WY=4 and WY=2 (both set explicitly; KDA and GDN; bf16 / fp16, fp32 on a
#      subset; T 1 / 63 / 65 / 1000, varlen with empty sequences, GVA HV = 2H / 4H / 8H, with and without state,
#      gates at -20 and -1e4, V 32 / 64 / 96, V 256 / 200 column blocks) and a repeat call of each equal too; =4
#      against the float64 reference (DESIGN.md section 6); the profiler sees grad3_wy4_kernel under =4 and
#      grad3_wy2_kernel under =2 (grad3_wy_kernel for V % 4 != 0 under both); 0 / 5 / text refused, 3 retired.
#      A failure of test_grad3_wy4_is_grad3_wy2 names the first gradient that differs: dv / dbeta only -> the dR
#      read-back or the P1 column tiles; dq / dk / dg (via dR_w, dA_kk) -> the dL table or the T^T fragments.
#      Also the CPU emulation and the existing WY / refusal tests (knob now accepts 4).
#  (2) per-kernel times of the backward in one process, ~25 s, KDA and GDN: rows bwd (default =2), bwd_wy2 (a second
#      sample of the default, for the noise), bwd_wy4. Expected grad3_wy4_kernel ~0.45-0.55 ms against grad3_wy2's
#      0.60 (B1 T8192 H16 HV32 K=V=128 bf16; the longest warp's issue count -27 %, the total -13 %; the barrier-bound
#      parts -- cp.async waits, the T inversion on two warps, the 24-HMMA dependency chains -- do not shrink); the other
#      kernels unchanged. If =4 is not at least ~5 % faster than both =2 rows, it is not worth keeping.
D="$OUT/wy13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 170 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_grad3_wy4.py \
  tests/test_cuda_grad3_wy4_emu.py \
  "tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_bwd.py::test_unknown_bwd_knob_values_are_refused" > "$D/tests.log" 2>&1
echo "wy13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 100 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-wy 2,4 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "wy13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" grad3_wy
