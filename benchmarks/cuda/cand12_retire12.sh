#!/bin/bash
# Session 12, branch retire12: the knob-only forward scans retired (scan3 KDA_CUDA_CHUNK_SCAN=4, the split forward
# scan4 + out =5 / =6, scan5 =7: refused), unknown values of the forward's knobs refused (env_choice), scan6's pieces
# moved into delta_chunk_scan6.cuh (its SASS unchanged), and (last commit, separable) one copy of the GDN gate's
# double prefix scan (gate_prefix_warp) for the GDN preps and grad3_gdn (SASS rescheduled: needs this check).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT. About 120-150 s in all.
#  (1) the touched forward test files, ~60 s with -n 14: all must pass (retired values and unknown values raise
#      RuntimeError naming the knob; scan6 against the float64 reference, the single kernel and a repeat call;
#      stages with the knob changed between them);
#  (2) the GDN tests for gate_prefix_warp (forward prep v2, backward incl. prep3_gdn / grad3_gdn), ~40 s: all must
#      pass, else revert the commit "GDN: one copy of the per-head gate's double prefix scan ..." alone;
#  (3) per-kernel times of the defaults in one process, ~30 s. Expected unchanged against session 11/12's calls
#      (B1 T8192 H16 HV32 K=V=128 bf16): scan6 0.300 ms (KDA and GDN), kda_chunk_prep2 0.57, gdn_chunk_prep2 0.228;
#      GDN backward prep3_gdn 0.426, grad3_gdn 0.441 (h200_session11_candidates_retire11_kernel_times.json). A
#      move of more than ~2 % in gdn_chunk_prep2 / prep3_gdn / grad3_gdn would speak against the last commit; scan6
#      cannot move (same SASS).
D="$OUT/retire12"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 100 python3 -m pytest -q $XD -p no:cacheprovider -rfE \
  tests/test_cuda_chunk_fwd.py tests/test_cuda_stages.py tests/test_cuda_scan6.py > "$D/tests_fwd.log" 2>&1
echo "retire12 fwd tests exit $?: $(tail -1 "$D/tests_fwd.log")"
grep -E "^FAILED|^ERROR" "$D/tests_fwd.log" | head -20
timeout -k 5 90 python3 -m pytest -q $XD -p no:cacheprovider -rfE \
  tests/test_cuda_gdn_prep2.py tests/test_cuda_chunk_bwd.py -k "gdn" > "$D/tests_gdn.log" 2>&1
echo "retire12 gdn tests exit $?: $(tail -1 "$D/tests_gdn.log")"
grep -E "^FAILED|^ERROR" "$D/tests_gdn.log" | head -20
timeout -k 5 60 python3 benchmarks/cuda/profile_chunk.py > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "retire12 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
