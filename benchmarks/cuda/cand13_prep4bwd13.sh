#!/bin/bash
# Session 13, branch prep4bwd13 (for a later session's candidate call): the KDA backward's prep v6,
# KDA_CUDA_CHUNK_BWD_PREP=6 (prep4_kda_kernel<T16, true>, delta_chunk_bwd_prep4.cuh; opt-in, 4 stays the default):
# prep v4 with each 3xTF32 hi / lo split formed once per fragment and reused (P2 tiles regrouped by row block, T's
# fragments pre-split in S4 for S5, two S5 jobs per sweep, hoisted store addresses, the 8x8 quarter tiles on
# warps 4-7). Claimed bit-identical to =4.
# Checked without a GPU (nvcc 13.0, sm_90a): 125 registers, no spills; prep4_kda_kernel<*, false> and every other
# kernel of kda_chunk_bwd.o have main's SASS; per warp ~13 700 -> ~9 000 issued instructions by SASS path lengths
# (-34 %, averaged over the 8 warps; the same HMMAs).
# Unknown KDA_CUDA_CHUNK_BWD_PREP values (0, 7, text) are now refused (env_choice), 2-6 accepted as before.
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/prep4bwd13. About 90-130 s in all.
#  (1) tests, ~60-90 s with -n 14; all must pass:
#      tests/test_cuda_bwd_prep6.py: every gradient (dq, dk, dv, dg, dbeta, dh0) torch.equal between =6 and =4
#      (bf16 / fp16, T 1 / 63 / 65 / 1000, varlen with empty sequences, GVA, with and without state, gates at -20
#      and -1e4, odd K / V, V 64 and > 128), every prep output buffer torch.equal (stage 0), =6 against the float64
#      reference, GDN and fp32 unaffected, unknown values refused. A failure of *_is_prep4 / *_outputs_are_prep4s
#      means v6 is NOT bit-identical: the buffer named in the message localizes it (aqk / akk: P2's remap; wc / u:
#      the pre-split T or the paired S5 jobs; qgc / kendc: the build's row pointers).
#      The existing prep / refusal tests (tests/test_cuda_chunk_bwd.py -k "prep or retired", tests/test_cuda_stages.py
#      -k prep4) must still pass with the knob now read by env_choice.
#  (2) per-kernel times of the KDA backward in one process, ~20 s: rows bwd (default, =4), bwd_prep6, bwd_prep4 (a
#      second sample of the default, for the noise). Expected prep4_kda_kernel<__nv_bfloat16, true> ~0.60-0.68 ms
#      against <__nv_bfloat16, false> ~0.77 (B1 T8192 H16 HV32 K=V=128 bf16); the other kernels unchanged. If v6 is
#      not at least ~5 % faster than both v4 rows, it is not worth keeping.
D="$OUT/prep4bwd13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 170 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_bwd_prep6.py \
  "tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_bwd.py::test_kda_bwd_prep4_matches_prep2" \
  "tests/test_cuda_chunk_bwd.py::test_gdn_bwd_prep4_is_prep3" \
  "tests/test_cuda_stages.py::test_kda_bwd_prep4_matches_prep2" > "$D/tests.log" 2>&1
echo "prep4bwd13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 90 python3 benchmarks/cuda/profile_chunk.py --phases bwd --families kda --bwd-prep 6,4 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "prep4bwd13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" prep
