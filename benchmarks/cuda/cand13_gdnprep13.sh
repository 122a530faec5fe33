#!/bin/bash
# Session 13, branch gdnprep13 (candidate): the GDN prep v3 (KDA_CUDA_GDN_PREP=3, gdn_chunk_prep3.cuh; off by
# default): one block per pair of value heads of a GVA group, q / k staged and S1's raw Q K^T / K K^T computed once
# per pair; claimed bit-identical to v2 (the per-head gate factors are applied after the product exactly as v2 does).
# Checked without a GPU: nvcc 13.0 sm_90a (80 registers, 8 B spill stores / 12 B spill loads, 72.4 KB shared memory:
# three blocks per SM), main's 27 kernels of gdn_chunk_fwd.cu with the same SASS, CPU emulation of the new index maps
# (tests/test_cuda_gdn_prep3_emu.py).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/gdnprep13. About 90-140 s in all.
#  (1) tests/test_cuda_gdn_prep3.py (+ the unknown-value test of test_cuda_chunk_fwd.py, whose GDN_PREP entry moved
#      from 3 to 9), ~60-90 s with -n 14: all must pass. What to expect: =3 gives =2's bits (torch.equal on o, final
#      state and the raw workspace words of every real chunk and head) for HV = 2H, H, 3H, 4H, T 1000, varlen with
#      empty sequences, h0, gates near 0 and -20 / -1e4, bf16 / fp16; the float64 reference within DESIGN.md
#      section 6 (the same errors as v2). A failure of the bit tests with tiny differences would mean a changed
#      rounding path (report the max |do|, printed); O(1) differences an indexing bug in the head pairing / parking.
#  (2) per-kernel times of the GDN forward with =2 and =3 in one process (rows fwd_gdn_prep2 / fwd_gdn_prep3),
#      B1 T8192 H16 HV32 K=V=128 bf16, ~20 s. Expected: gdn_chunk_prep2 ~0.217 ms; gdn_chunk_prep3 0.20-0.22
#      (0-8 %: per head it saves q / k staging and half of S1's ldmatrix / mma -- ~1/8 of the shared-memory
#      wavefronts, ~3-5 % of the instructions -- but runs half as many blocks, each twice as long, so the last
#      wave's tail doubles; a slower v3 is a plausible outcome and means: keep v2, retire 3). scan7 unchanged.
#      A second shape, B4 T4096 H16 HV32 (more blocks), and HV = H (B1 T8192 H32 HV32: groups of one, v3 ~ v2 plus
#      the relocation overheads: expected equal or up to ~2 % slower).
D="$OUT/gdnprep13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_gdn_prep3.py \
  "tests/test_cuda_chunk_fwd.py::test_unknown_fwd_knob_values_are_refused" > "$D/tests.log" 2>&1
echo "gdnprep13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
for shape in 1,8192,16,32,128,128 4,4096,16,32,128,128 1,8192,32,32,128,128; do
  tag=${shape//,/_}
  timeout -k 5 60 python3 benchmarks/cuda/profile_chunk.py --families gdn --phases fwd --shape "$shape" \
    --gdn-prep 2,3 > "$D/kernel_times_$tag.json" 2> "$D/kernel_times_$tag.err"
  echo "gdnprep13 profile $shape exit $?"
  python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times_$tag.json" prep,scan
done
