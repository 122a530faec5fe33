#!/bin/bash
# Session 12 second round, branch retire13 (for a later session's candidate call): scan6 (KDA_CUDA_CHUNK_SCAN=8) and
# state_bwd3_bf16 with 4-byte reads (KDA_CUDA_CHUNK_BWD_STATE_BWD=9) retired: both values now raise RuntimeError
# ("retired in session 12"); what scan7 used of delta_chunk_scan6.cuh moved into delta_chunk_scan7.cuh /
# delta_chunk_fwd.cuh; state_bwd3_bf16_kernel lost its VEC template parameter (the =10 form is the only one).
# Checked without a GPU (nvcc 13.0, sm_90a, cuobjdump -sass per kernel, before / after): every surviving kernel of
# kda_chunk_fwd.cu, gdn_chunk_fwd.cu and kda_chunk_bwd.cu has the same SASS (encodings included), and
# state_bwd3_bf16_kernel<PC> that of the former <PC, true>; gdn_chunk_bwd.cu's PTX is main's (up to the TU hash in
# internal names), its SASS main's but for grad3_gdn_kernel, whose SASS varies between builds of the same source
# (main's too). So the default paths cannot have moved.
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT. About 90-120 s in all.
#  (1) the touched GPU test files, ~60-90 s with -n 14: all must pass. What to expect: 8 and STATE_BWD=9 refused
#      (test_retired_fwd_knob_values_are_refused, test_state_bwd_9_is_retired, test_retired_bwd_knob_values_are_
#      refused); scan7 (10 / 11) against the float64 reference as in session 12 (worst o error / tolerance 0.642 for
#      11, 0.819 for 10) plus the new test_scan7_many_blocks (B1 T8192 H16 HV32 and B3 T1000 V96, reference on the
#      GPU in float64: ~5-10 s each; o / state ratios ~0.5 expected, printed as SCAN7_ERR lines in $D/scan7_errs.txt);
#      the stages with 11 / 1; state_bwd =10 against =4 and the float64 reference (worst 0.358 in session 12) and
#      the kernel name state_bwd3_bf16_kernel<true> / <false> (no VEC argument any more).
#  (2) per-kernel times of the forward defaults in one process, ~20 s. Expected unchanged against session 12's
#      candidate call (h200_session12_candidates_fwd_kernel_times.json, B1 T8192 H16 HV32 K=V=128 bf16): scan7
#      <128, true> ~0.240 ms (KDA and GDN), kda_chunk_prep2 ~0.56, gdn_chunk_prep2 ~0.22 (same SASS: any move is
#      noise).
D="$OUT/retire13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
SCAN7_ERRS="$D/scan7_errs.txt" timeout -k 5 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE \
  tests/test_cuda_chunk_fwd.py tests/test_cuda_stages.py tests/test_cuda_scan7.py tests/test_cuda_state_bwd_bf16.py \
  tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused > "$D/tests.log" 2>&1
echo "retire13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
grep "many_blocks" "$D/scan7_errs.txt" 2>/dev/null
timeout -k 5 60 python3 benchmarks/cuda/profile_chunk.py --phases fwd > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "retire13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
