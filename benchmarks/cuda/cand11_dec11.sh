#!/bin/bash
# Session 11, branch dec11 (issue #5, decode at the bandwidth limit): KDA_CUDA_DEC_LEAN=3, the LEAN decode kernels with
# the state tile brought into shared memory by Hopper bulk copies (cp.async.bulk + an mbarrier per warp) for K-first
# fp32 cfg 2, K-first 2-byte cfg 1 and V-first fp32 cfg 0 (other cfgs / V-first 2-byte pools run LEAN=1's kernels).
# Assumes the CUDA variant is built from this branch and `source benchmarks/cuda/device_env.sh` was done; writes under
# $OUT. One H200.
#   1. the new tests (LEAN=3 bit-identical to LEAN=1 and against the float64 reference; the _l3 decode variants; the
#      knob's bad values): ~30-60 s
#   2. the A/B in one process: bench_cuda.py decode at B=256 and 64, fla 0.6.0 + our core op + every pool kind at the
#      defaults (LEAN=1), then per batch/family the sweep rows s1_l1, s1_l3, s1_l1_again, s1_l3_again (core op and
#      every pool kind, CUDA graphs), the 4 GB copy at start and end and the same-size elementwise copies: ~70-90 s
# Decides: at B=256 the rows core_fwd:s1_l3 vs core_fwd:s1_l1 (fp32 target 4.1 TB/s: <= 0.2619 ms) and
# serve_fp32_pool / serve_bf16_pool / serve_fp32_pool_vfirst :s1_l3 vs :s1_l1, both families; the _again rows give the
# drift (the bf16_pool_vfirst rows run the same kernel in l1 and l3: a noise floor). LEAN=3 becomes the default for a
# pool kind if it is faster there by more than the drift at B=256 and not slower at B=64.
mkdir -p "$OUT"
T0=$(date +%s)
echo "== tests (LEAN=3) at $(( $(date +%s) - T0 ))s"
timeout 90 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "lean_bulk or lean_bad_value or _l3" > "$OUT/tests_dec11.log" 2>&1; tail -3 "$OUT/tests_dec11.log"
echo "== bench at $(( $(date +%s) - T0 ))s"
timeout 110 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session11_dec11 --decode-only --sweep11 \
  --rep 50 --sweep-rep 20 --batches 256,64 > "$OUT/bench_dec11.log" 2>&1
grep -E '"d2d_copy|ew_copy|ew_inplace|s1_l|default_again' "$OUT/bench_dec11.log" | cut -c1-200
echo "== done at $(( $(date +%s) - T0 ))s"
