#!/bin/bash
# Session 11, branch retire11 (retirement round: GDN forward prep v1 KDA_CUDA_GDN_PREP=1, KDA prep2 without the 8x8
# split KDA_CUDA_KDA_PREP=2, KDA backward prep v4 without the split KDA_CUDA_CHUNK_BWD_PREP=5, the 32-column tf32
# state_fwd3 KDA_CUDA_CHUNK_BWD_STATE_FWD=4, grad3_ch2's 128-register instance KDA_CUDA_CHUNK_BWD_CH=3, grad3_wy2 with
# plain tf32 KDA_CUDA_CHUNK_BWD_WY=3; docs/cuda.md, "Retired kernels (sessions 9 to 11)").
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under $OUT.
#  (1) the changed CUDA tests, ~80 s with -n 14 (expected: all pass; the refusal tests raise for every retired value,
#      the defaults' tests against the float64 reference unchanged in what they run);
#  (2) per-kernel times of the defaults, ~30 s: nothing may move against session 11's first call
#      (h200x2_session11_dev1_kernel_times.json: KDA fwd 0.913 / bwd 4.418 ms, GDN 0.573 / 3.588), since the
#      surviving kernels' SASS is unchanged (checked on the development machine).
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE \
  tests/test_cuda_gdn_prep2.py tests/test_cuda_chunk_bwd_state_fwd_narrow.py tests/test_cuda_chunk_fwd.py \
  tests/test_cuda_chunk_bwd.py tests/test_cuda_stages.py tests/test_cuda_chunk_bwd_mem.py \
  -k "retired or prep or narrow or ch2 or free or grad_v1" > "$OUT/retire11_tests.log" 2>&1
echo "retire11 tests exit $?: $(tail -1 "$OUT/retire11_tests.log")"
grep -E "^FAILED|^ERROR" "$OUT/retire11_tests.log" | head -20
timeout 60 python3 benchmarks/cuda/profile_chunk.py > "$OUT/retire11_kernel_times.json"
echo "retire11 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/retire11_kernel_times.json"
