#!/bin/bash
# Session 13, branch sfwd13 (for a candidate call): state_fwd on bf16 tensor-core operands, the backward's recompute of
# the chunk-start states with scan7's m16n8k16 bf16 products on state_fwd3 narrow's schedule (16 value columns per
# block, 256 threads, two blocks per SM): KDA_CUDA_CHUNK_BWD_STATE_FWD=8 (U plain bf16), 9 (U as bf16 hi + lo, as
# scan7's 11), 10 (U and K Eend as hi + lo); off by default (7, tf32 narrow). Unknown values of the knob are now
# refused (before: anything but 3 / 7 ran state_fwd2).
# Checked without a GPU (nvcc 13.0 sm_90a): 120 / 115 / 113 registers (8 / 9 / 10), 0 spills, 83,456 / 88,576 bytes
# of dynamic shared memory (two blocks per SM); kda_chunk_bwd.cu, gdn_chunk_bwd.cu and kda_chunk_fwd.cu SASS identical
# to main's (the kernel lives in its own TU, delta_chunk_bwd_state_fwd_bf16.cu), so the default paths cannot move.
# CPU emulation (tests/test_cuda_state_fwd_bf16_emu.py): hs error against float64 ~8x / ~5.6x / ~0.02x tf32's for
# 8 / 9 / 10 (K Eend's bf16 rounding dominates hs), U ~2-9x tf32's for all three (h and w stay bf16).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/sfwd13. About 150 s in all.
#  (1) tests/test_cuda_state_fwd_bf16.py (+ the CPU emulation), ~90-120 s with -n 14: all must pass. Expect 8 / 9 /
#      10 within DESIGN.md section 6 for every gradient; the worst err / tol per gradient and value is summarised
#      below from $D/errs.txt. Expected (emulation): dq / dk / dv near the default's (their error is the bf16 output
#      rounding, ~0.2 of the bound), dg / dbeta up to several x the default's for 8 / 9 (as state_bwd bf16 =10 did),
#      10 close to the default. dh0 comes from state_bwd and should not move.
#  (2) per-kernel times of the backward with 8, 9, 10 beside the default in one process, ~30 s. Expected at B1 T8192
#      H16 HV32 K=V=128 bf16: state_fwd 0.58 ms (7) -> ~0.30-0.45 (8, 9), ~0.35-0.5 (10): half the mma and ~55 % of
#      the shared-memory read instructions per chunk (66 LDS.64 + 24-32 LDS.32 against 180 LDS.32), the same
#      hs / U stores, cp.async tiles and barriers; the floor is the ~0.8 GB of DRAM traffic (~0.17 ms). Rows
#      bwd_state_fwd8 / 9 / 10 (kernel state_fwd_bf16_kernel); every other backward kernel unchanged.
D="$OUT/sfwd13"
mkdir -p "$D"
rm -f "$D/errs.txt"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
STATE_FWD_BF16_ERRS="$D/errs.txt" timeout -k 5 170 python3 -m pytest -q $XD -p no:cacheprovider -rfE \
  tests/test_cuda_state_fwd_bf16.py tests/test_cuda_state_fwd_bf16_emu.py > "$D/tests.log" 2>&1
echo "sfwd13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
python3 benchmarks/cuda/worst_errs.py "$D/errs.txt"
timeout -k 5 90 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-fwd 8,9,10 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "sfwd13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" state_fwd
