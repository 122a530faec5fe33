#!/bin/bash
# Session 13, branch kdaprep13 (for a later session's candidate call): the FAST instance of the KDA forward prep,
# kda_chunk_prep2_kernel<KP, T16, WB, FAST = true>, behind KDA_CUDA_KDA_PREP=6 (opt-in; 3 stays the default, the
# only other accepted value). Same outputs bit for bit (inputs without NaN) from fewer instructions: tf32
# conversions by to_tf32_fast (1 SASS instruction before an mma instead of cvt.rna's 2), P2's tiles regrouped so a
# warp's three tiles share their A operand (formed once per k-step), S5 as gdn_chunk_prep2's (T rounded to tf32 once
# in shared memory, A fragments by ldmatrix.x4, jobs in pairs, u0 as float2).
# Checked without a GPU (nvcc 13.0, sm_90a): FAST instances 128 registers, 0 spills, 113.4 KB shared memory (two
# blocks per SM as the default); the default instances' SASS identical to main's (encodings included), as is every
# kernel of gdn_chunk_fwd.o (prep2_w_u0 became a wrapper of prep2_w_u0_x). CPU emulation
# tests/test_cuda_kda_prep_fast_emu.py: to_tf32_fast = cvt.rna for every mantissa of 18 exponents x 2 signs and 4 M
# random patterns; FAST's S5 issues the default's mma operand sequence bit for bit per output tile; the P2 tile map
# is a permutation of the default's.
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/kdaprep13. About 90-120 s in all.
#  (1) tests, ~60-90 s with -n 14; all must pass. tests/test_cuda_kda_prep_fast.py: =6 against =3 torch.equal on o,
#      the final state and every workspace word the prep writes (19 cases x bf16/fp16 x {bf16 workspace + scan7 (w
#      bf16), bf16 workspace + single scan, fp32 workspace}: varlen with empty sequences, GVA, h0, extreme gates,
#      T = 1 / 65 / 200 / 1000, K = V = 64, odd K/V, odd V, V = 200 / 256), the benchmark shape bit for bit, =6
#      against the float64 reference, unknown values refused ("takes 3, 6"); plus test_cuda_chunk_fwd.py's knob
#      tests (KDA_CUDA_KDA_PREP=7 must still be refused). A failure of the bit-identity test is a real bug (the
#      claim is exact), not a tolerance question.
#  (2) per-kernel times, one process, B1 T8192 H16 HV32 K=V=128 bf16: kda fwd (default, i.e. 3), fwd_kda_prep3
#      (the same kernel again: the noise), fwd_kda_prep6. Expected: kda_chunk_prep2_kernel<128, bf16, true, false>
#      ~0.56-0.57 ms for the default and for 3; <..., true, true> (=6) 0.46-0.54 ms by the instruction counts (about
#      -20 % warp instructions per block, estimated from the SASS), but session 10's prep v3, which also cut S5's
#      conversions and P2's work, measured 0.570 against 0.569 with ~20 % fewer instructions estimated: anything
#      from no gain to ~15 % is plausible. Adopt 6 as the default only if it is faster by more than the 3-vs-default
#      spread.
D="$OUT/kdaprep13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_kda_prep_fast.py \
  "tests/test_cuda_chunk_fwd.py::test_unknown_fwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_fwd.py::test_retired_fwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_fwd.py::test_accepted_fwd_knob_values_run" > "$D/tests.log" 2>&1
echo "kdaprep13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 90 python3 benchmarks/cuda/profile_chunk.py --phases fwd --families kda --kda-prep 3,6 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "kdaprep13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" prep
