#!/bin/bash
# Session 13 second round, branch sf13: the backward's forward-state recompute on the narrow (=7) warp tiles with
# shared, prefetched operand tiles. KDA_CUDA_CHUNK_BWD_STATE_FWD=11: state_fwd3s_kernel (two narrow column groups of
# 8 warps per 32-column block, each with its own named barriers; w / K Eend / Gam_last loaded once per block by
# cp.async pieces, double-buffered, a step ahead: the second group to release a buffer fills it, readers wait on
# mbarriers fed by cp.async.mbarrier.arrive.noinc; h / U stored tf32-rounded).
# =12: state_fwd3w_kernel (=7's warp tiles on 16 warps of one 32-column block, =3's cp.async double buffers). Both
# keep =7's mma chains on the same tf32 operands: hs and U must be bit for bit =7's. =7 stays the default.
# Checked without a GPU (nvcc 13.0 sm_90a): kda_chunk_bwd.cu / gdn_chunk_bwd.cu compile; every pre-existing kernel's
# SASS is main's (all 42 functions of each, encodings included; gdn's grad3_gdn varies build to build, main's too);
# =11 80 registers, 3 barriers, =12 84, no spills; the hand-off emulated on the CPU (tests/test_cuda_state_fwd11_emu.py:
# random interleavings, catches 4 deliberately broken hand-offs).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT. About 100-140 s in all.
#  (1) GPU tests, ~60-90 s with -n 14: tests/test_cuda_state_fwd11.py (stage 1's U and hs torch.equal between 11 /
#      12 and 7 over 15 cases x KDA/GDN x bf16/fp16; V > 128 gradients equal; =11 against the float64 reference;
#      kernel names) plus the knob-refusal tests. A hang would mean an mbarrier hand-off bug in =11 (the script's
#      timeout stops it); a mismatch in U or hs means the groups' tiles / rounding differ from =7 (the message gives
#      the largest difference).
#  (2) per-kernel times of the backward in one process, ~30 s: rows bwd (default =7), bwd_state_fwd7 (a second
#      sample), bwd_state_fwd11, bwd_state_fwd12. Expected at B1 T8192 H16 HV32 K=V=128 bf16 (=7 0.58 ms): =11
#      ~0.35-0.45 ms (half the L2 -> SM bytes of =7, operands a step ahead so the per-chunk chain is barrier ->
#      16 + 8 dependent mma -> barrier, groups decoupled as =7's two blocks per SM); =12 ~0.45-0.6 (same, but one
#      barrier domain of 16 warps). Keep =11 as the default only if it beats 7 by > 5 % for KDA and GDN.
D="$OUT/sf13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_state_fwd11.py \
  "tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_bwd.py::test_unknown_bwd_knob_values_are_refused" > "$D/tests.log" 2>&1
echo "sf13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 100 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-fwd 7,11,12 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "sf13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" state_fwd
